"""bench/models/gpu_step.py on a machine without a GPU: it refuses, saying what it needs and naming
--cpu-smoke, and --cpu-smoke runs the whole code path (sbpflow and PyTorch eager, bf16 and fp32, the GEMM
peak, the verdicts, the JSON) on a tiny GPT. The figures themselves come from the GPU machine
(bench/README.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sbpflow.device import gpu_available

BENCH = Path(__file__).resolve().parents[1] / "bench" / "models" / "gpu_step.py"


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU: the bench would run for real")
def test_without_a_gpu_it_refuses_and_names_the_smoke_run() -> None:
    out = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "needs a CUDA GPU that cupy and PyTorch both see" in out.stderr and "--cpu-smoke" in out.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch (the bench extra) is absent")
def test_the_cpu_smoke_run_measures_every_side_and_writes_the_verdicts(tmp_path: Path) -> None:
    figures = tmp_path / "gpu_step.json"
    args = [
        sys.executable,
        str(BENCH),
        "--cpu-smoke",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--json",
        str(figures),
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(figures.read_text())
    sides = {(s["name"], s["precision"]): s for s in result["sides"]}
    assert set(sides) == {(n, p) for n in ("sbpflow", "torch eager") for p in ("bf16", "fp32")}
    for s in sides.values():
        assert not s["error"] and s["step_s"] > 0 and s["tflops"] > 0 and len(s["losses"]) == 2
    assert result["peak_tflops"] > 0
    assert set(result["verdicts"]) == {
        "bf16 sbpflow / eager",
        "fp32 sbpflow / eager",
        "bf16 sbpflow / GEMM peak",
    }
    assert sides[("sbpflow", "bf16")]["losses"] != sides[("sbpflow", "fp32")]["losses"]  # bf16 is bf16
