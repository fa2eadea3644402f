"""bench/models/ops.py --quick: every op the examples' compiled graphs call (fused chains and folded
updates included) has a PyTorch peer and is timed; a graph that gains an op the script cannot time
(as the fused ``ne_scalar`` chain and ``clipped_adamw_update`` once did) fails here, not in a
benchmark run. The figures come from full runs (bench/README.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "models" / "ops.py"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch (the bench extra) is absent")
def test_the_quick_run_times_every_op_of_the_examples() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    cases = re.search(r"^(\d+) cases of (\d+) ops", out.stdout, re.MULTILINE)
    assert cases is not None and int(cases[2]) > 50, out.stdout[-2000:]
    for op in ("matmul", "fused_elementwise", "clipped_adamw_update", "layer_norm_grad"):
        assert re.search(rf"^{op}\*? +\d+ +[\d.]+ +[\d.]+ +\d+\.\d+", out.stdout, re.MULTILINE), op
