"""``init_from=``: strict by default (missing, unexpected, shape and dtype named), ``strict=False`` to
relax, another layout through the job's modules; a job from the wire (no modules) has no layouts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint.format import CheckpointError
from sbpflow.codec import wire
from tests.client.nn.test_state import trace


def params(tmp_path: Path) -> tuple[sf.Job, dict[str, np.ndarray]]:
    job = trace(sf.nn.MLP([8, 16, 4]), steps=1)
    start = sf.run(job, backend="inprocess", return_parameters=True).parameters
    assert start is not None
    return job, {k: np.asarray(v) for k, v in start.items()}


def test_init_from_refuses_a_file_that_does_not_fit_naming_every_problem(tmp_path: Path) -> None:
    job, start = params(tmp_path)
    bad = dict(start)
    bad.pop("model.2.bias")
    bad["model.0.weight"] = bad["model.0.weight"].astype(np.float64)
    bad["model.9.weight"] = np.zeros(2, np.float32)
    np.savez(tmp_path / "bad.npz", **bad)
    with pytest.raises(CheckpointError) as err:
        sf.run(job, backend="inprocess", init_from=str(tmp_path / "bad.npz"))
    text = str(err.value)
    assert "missing (1): model.2.bias" in text and "unexpected (1): model.9.weight" in text
    assert "model.0.weight: float64 given, float32 wanted" in text and "strict=False" in text
    relaxed = sf.run(job, backend="inprocess", init_from=str(tmp_path / "bad.npz"), strict=False)
    np.savez(tmp_path / "good.npz", **start)
    exact = sf.run(job, backend="inprocess", init_from=str(tmp_path / "good.npz"))
    assert relaxed.losses[0] != exact.losses[0]  # model.2.bias came from its initializer
    bad["model.2.bias"] = np.zeros(5, np.float32)
    np.savez(tmp_path / "shape.npz", **bad)
    with pytest.raises(CheckpointError, match=r"model.2.bias: \[5\] given, \[4\] wanted"):
        sf.run(job, backend="inprocess", init_from=str(tmp_path / "shape.npz"), strict=False)


def test_a_file_in_torch_layout_needs_the_jobs_modules(tmp_path: Path) -> None:
    job, start = params(tmp_path)
    np.savez(tmp_path / "p.npz", **start)
    remote = wire.job_from_proto(wire.job_to_proto(job))
    assert remote.bound is None
    with pytest.raises(CheckpointError, match="needs the job's modules"):
        sf.run(remote, backend="inprocess", init_from=str(tmp_path / "p.npz"), layout="torch")
    with pytest.raises(sf.SbpflowError, match="layout 'onnx' is unknown"):
        sf.run(job, backend="inprocess", init_from=str(tmp_path / "p.npz"), layout="onnx")
