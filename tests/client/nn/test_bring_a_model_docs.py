"""docs/bring-a-model.md's snippets run as they are (each in a fresh namespace, in a temporary folder),
where torch and transformers are installed; skipped otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "bring-a-model.md"


def snippets() -> dict[str, str]:
    """Each section's runnable snippet (a ```python block that imports sbpflow), by its heading."""
    out = {}
    for section in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        for code in re.findall(r"```python\n(.*?)```", section, flags=re.S):
            if "import sbpflow" in code:
                out[title] = code
    return out


def test_every_family_has_a_snippet() -> None:
    assert set(snippets()) == {"GPT-2", "BERT", "ResNet-18"}


@pytest.mark.parametrize("title", sorted(snippets()))
def test_the_snippet_runs(title: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch", reason="torch comes with the bench extra")
    if "transformers" in snippets()[title]:
        pytest.importorskip("transformers", reason="transformers comes with the bench extra")
    monkeypatch.chdir(tmp_path)
    exec(compile(snippets()[title], f"{DOC.name}: {title}", "exec"), {"__name__": "snippet"})  # noqa: S102
