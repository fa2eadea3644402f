"""Golden plan dumps: three reference configurations compiled and diffed against committed text.

Each file under ``golden/`` is ``pipeline.dump`` of the compiled job: the SBP chosen for every op and why,
every boxing with its bytes, the plan's size and the memory estimate of every device. A compiler change
that alters any of them fails here with a unified diff; when the change is intended, rewrite the files
with ``SBPFLOW_UPDATE_GOLDEN=1 python -m pytest tests/control_plane/compiler/test_golden.py`` and commit
the diff beside the change, so the review shows what the compiler now does differently.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import pytest

from sbpflow.control_plane.compiler import pipeline
from tests.examples.test_examples import load

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SBPFLOW_UPDATE_GOLDEN") == "1"
HOW = "SBPFLOW_UPDATE_GOLDEN=1 python -m pytest tests/control_plane/compiler/test_golden.py"

# one layer each: small enough to read, large enough to show every kind of op and boxing
REFERENCES: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp_dp4": ("mlp", {"ranks": 4}),
    "gpt_tp4": (
        "gpt",
        {"ranks": 4, "tp": True, "layers": 1, "heads": 4, "width": 64, "batch_size": 2, "seq_len": 8},
    ),
    "gpt_dp2xtp2": (
        "gpt",
        {
            "ranks": 4,
            "tp": True,
            "dp": 2,
            "layers": 1,
            "heads": 4,
            "width": 64,
            "batch_size": 2,
            "seq_len": 8,
        },
    ),
}


def render(name: str) -> str:
    model, kwargs = REFERENCES[name]
    c = pipeline.compile(load(model).make_job(**kwargs))
    return f"# golden plan dump of {model} {kwargs}\n# regenerate: {HOW}\n" + pipeline.dump(c)


@pytest.mark.parametrize("name", list(REFERENCES))
def test_plan_dump_matches_golden(name: str) -> None:
    path = GOLDEN / f"{name}.txt"
    got = render(name)
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got)
        return
    if not path.exists():
        pytest.fail(f"{path} is missing; create it with {HOW}")
    want = path.read_text()
    if got != want:
        diff = "".join(
            difflib.unified_diff(
                want.splitlines(keepends=True),
                got.splitlines(keepends=True),
                f"golden/{name}.txt",
                "compiled",
            )
        )
        pytest.fail(
            f"the compiled plan of {name} differs from golden/{name}.txt:\n{diff}\n"
            f"If the change is intended, rewrite the golden files with {HOW} and commit them with the change.",
            pytrace=False,
        )


def test_dump_is_deterministic_and_free_of_timings() -> None:
    a, b = render("mlp_dp4"), render("mlp_dp4")
    assert a == b
    assert " ms" not in a and "SBP per op:" in a and "boxing:" in a and "rank 3:" in a
