"""The repository's own documents stay true: the design page is inside the repository and linked from
the README, the contributor guide names files that exist, and the pre-commit hooks run what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_links_the_design_page_inside_the_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docs/ARCHITECTURE.md" in readme
    assert (ROOT / "docs" / "ARCHITECTURE.md").is_file()
    assert "../shared" not in readme  # nothing a user reads points outside the repository


def test_every_path_the_design_page_and_the_contributor_guide_name_exists() -> None:
    missing = []
    for doc in ("docs/ARCHITECTURE.md", "CONTRIBUTING.md"):
        text = (ROOT / doc).read_text()
        for path in re.findall(
            r"`((?:sbpflow|actor_workers|control_plane|client|tests|bench|protos)/[\w/.]+)`", text
        ):
            candidate = ROOT / path.rstrip("/")
            if not candidate.exists():
                missing.append(f"{doc}: {path}")
    assert not missing, "\n".join(missing)


def test_pre_commit_runs_the_checks_ci_runs() -> None:
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    entries = {h["id"]: h["entry"] for h in hooks}
    ci = (ROOT / ".ci" / "run").read_text()
    assert entries["mypy"] in ci
    assert "ruff check" in entries["ruff"] and "ruff check ." in ci
    assert entries["ruff-format"] == "ruff format" and "ruff format --check ." in ci
