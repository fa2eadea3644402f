"""``sbpflow run`` of a job with ``eval_every``: the held-out losses after the run's summary."""

from __future__ import annotations

import pytest

from sbpflow.client.cli.main import main


def test_sbpflow_run_prints_each_held_out_loss(capsys: pytest.CaptureFixture[str]) -> None:
    sets = ["eval_every=2", "width=16", "seq_len=16", "layers=1", "batch_size=4"]
    args = ["run", "examples/charlm.py", "--ranks", "1", "--steps", "4", "--backend", "inprocess"]
    assert main([*args, *(f"--set={s}" for s in sets)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "held-out loss" in line]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    assert all(3.0 < float(line.rsplit(" ", 1)[1]) < 6.0 for line in lines)
