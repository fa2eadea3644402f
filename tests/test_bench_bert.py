"""bench/models/bert.py --quick: the whole code path (transformers' weights loaded into sbpflow's BERT
through the hf-bert layout, both sides trained side by side on the same batches, the first losses
checked to agree, the ratio printed) on a tiny BERT. The figures themselves come from the full run
(bench/README.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "models" / "bert.py"


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="PyTorch and transformers (the bench extra) are absent",
)
def test_the_quick_run_trains_both_sides_from_the_same_weights() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    first = dict(
        re.findall(
            r"^(sbpflow|sbpflow 1-d|pytorch) +[\d.]+ ms +[\d.]+ ms +[\d.]+  ([\d.]+),", out.stdout, re.M
        )
    )
    assert set(first) == {"sbpflow", "sbpflow 1-d", "pytorch"}, out.stdout
    for side in ("sbpflow", "sbpflow 1-d"):  # the same weights and batch: the first losses agree
        assert float(first[side]) == pytest.approx(float(first["pytorch"]), rel=1e-4)
    assert re.search(r"^ratio \d+\.\d+", out.stdout, re.MULTILINE), out.stdout
    assert re.search(r"^ratio 1-d \d+\.\d+", out.stdout, re.MULTILINE), out.stdout
