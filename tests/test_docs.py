"""The repository's own documents stay true: the design page is inside the repository and linked from
the README, the contributor guide names files that exist, and the pre-commit hooks run what CI runs."""

from __future__ import annotations

import re
import subprocess
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


# files that may name a path outside the checkout: the KubeRay CRD test data the environment provides
# beside it (or in $SBPFLOW_KUBERAY_CRDS), and this test's own patterns
OUTSIDE_OK = {"tests/deploy/test_manifests.py", "tests/test_docs.py"}


def test_nothing_points_outside_the_repository() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    found = []
    for name in tracked:
        path = ROOT / name
        if name in OUTSIDE_OK or not path.is_file() or path.suffix in {".png", ".pb", ".db", ".safetensors"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for bad in re.findall(r"(?<![\w.])/work/|\.\./shared\b|/home/(?!ray\b)\w+|/Users/\w+", text):
            found.append(f"{name}: {bad}")
    assert not found, "\n".join(found)


def test_the_license_is_the_apache_license_pyproject_names() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert (
        "Apache License" in text
        and "Version 2.0, January 2004" in text
        and "END OF TERMS AND CONDITIONS" in text
    )
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


def test_the_readme_links_the_pytorch_page() -> None:
    assert "docs/from-pytorch.md" in (ROOT / "README.md").read_text()
    assert (ROOT / "docs" / "from-pytorch.md").is_file()


def test_the_readme_server_block_sets_the_token_first_and_waits_until_ready() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## The control plane") :]
    block = block[block.index("```bash") : block.index("```", block.index("```bash") + 3)]
    export, server = block.index("export SBPFLOW_TOKEN="), block.index("sbpflow server")
    ready, submit = block.index("/readyz"), block.index("sbpflow submit")
    assert export < server < ready < submit, block


def test_the_own_data_page_runs_real_examples_with_options_they_take() -> None:
    import inspect

    from tests.examples.test_examples import load

    assert "docs/own-data.md" in (ROOT / "README.md").read_text()
    text = (ROOT / "docs" / "own-data.md").read_text()
    commands = re.findall(r"sbpflow run examples/(\w+)\.py (.*)", text)
    assert {name for name, _ in commands} >= {
        "gpt",
        "charlm",
        "bert",
        "resnet",
        "insightface",
        "wide_deep",
        "mlp",
    }
    for name, rest in commands:
        params = inspect.signature(load(name).make_job).parameters
        assert "data" in params, name
        for key in re.findall(r"--set \"?(\w+)=", rest):
            assert key in params, f"docs/own-data.md: examples/{name}.py's make_job takes no {key!r}"
