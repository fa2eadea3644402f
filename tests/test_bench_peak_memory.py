"""bench/models/peak_memory.py --quick: the whole code path (each side of each paper model in a fresh
process, a warm-up run, the peak-RSS mark reset, the measured run, the ratio printed) on tiny shapes. The
figures themselves come from the full run (bench/README.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "models" / "peak_memory.py"


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="PyTorch and transformers (the bench extra) are absent",
)
def test_the_quick_run_reports_a_ratio_per_model() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ratios = dict(re.findall(r"^ratio (\S+) (\d+\.\d+)$", out.stdout, re.MULTILINE))
    assert set(ratios) == {"gpt", "resnet18", "bert"}, out.stdout
    peaks = re.findall(
        r"^(?:gpt|resnet18|bert) +([\d.]+) +[-\d.]+ +([\d.]+) +[-\d.]+$", out.stdout, re.MULTILINE
    )
    assert len(peaks) == 3 and all(float(a) > 0 and float(b) > 0 for a, b in peaks), out.stdout
