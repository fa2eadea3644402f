"""BatchNorm2d's running statistics: updated in training as PyTorch's are, synchronised under data
parallelism, read in eval mode, kept in checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint.read import latest_intact, read_logical
from sbpflow.data.sources import DataField, SyntheticSource
from sbpflow.dtype import DType
from sbpflow.errors import GraphError, SbpflowError
from sbpflow.job import Job
from sbpflow.oracle import reference
from tests.control_plane.compiler.passes.test_autodiff import as_float64

F = sf.nn.functional
N, C, H, W = 8, 3, 4, 5
STEPS, LR, MOMENTUM = 5, 0.1, 0.3


class Fit(sf.Graph):
    """Batch norm fitted to a target: its weight and bias train, its running statistics follow."""

    def __init__(self, bn: sf.nn.BatchNorm2d, train: bool = True) -> None:
        super().__init__()
        self.bn = bn.train(train)
        if train:
            self.add_optimizer(sf.optim.SGD(bn.parameters(), lr=LR))
        self.config.steps = STEPS

    def build(self, images: sf.Tensor, target: sf.Tensor) -> Any:
        y = self.bn(images)  # y: [N, C, H, W]  S(0)
        loss = F.mse_loss(y, target)
        if self.bn.training:
            loss.backward()
        return loss, y


def data(seed: int = 0) -> SyntheticSource:
    fields = (DataField("images", (C, H, W), DType.float32), DataField("target", (C, H, W), DType.float32))
    return SyntheticSource(batch_size=N, sample_fields=fields, seed=seed)


def fit_job(ranks: int, bn: sf.nn.BatchNorm2d | None = None, train: bool = True) -> Job:
    where = sf.placement("cpu", ranks=list(range(ranks)))
    graph = Fit(bn or sf.nn.BatchNorm2d(C, momentum=MOMENTUM), train)
    return graph.trace(data(), placement=where, input_sbp=sf.sbp.split(0))


def test_running_statistics_follow_pytorch_under_data_parallelism() -> None:
    torch = pytest.importorskip("torch")
    job = as_float64(fit_job(2), batches=STEPS)
    got = sf.run(job, steps=STEPS, return_parameters=True, backend="inprocess", timeout=60)
    bn = torch.nn.BatchNorm2d(C, momentum=MOMENTUM).double()
    opt = torch.optim.SGD(bn.parameters(), lr=LR)
    want = []
    for step in range(STEPS):
        batch = {k: torch.from_numpy(v) for k, v in job.data.read(step).items()}  # type: ignore[union-attr]
        loss = torch.nn.functional.mse_loss(bn(batch["images"]), batch["target"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    np.testing.assert_allclose(got.losses, want, rtol=1e-12)
    assert got.parameters is not None
    for name in ("running_mean", "running_var", "weight", "bias"):
        have, torch_value = got.parameters[f"bn.{name}"], getattr(bn, name).detach().numpy()
        np.testing.assert_allclose(have, torch_value, rtol=1e-12, atol=1e-14, err_msg=name)
    assert not np.allclose(got.parameters["bn.running_var"], 1.0), "the statistics moved"


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_every_layout_updates_the_statistics_as_one_device(ranks: int) -> None:
    job = as_float64(fit_job(ranks), batches=STEPS)
    want = reference.train(job, steps=STEPS).parameters
    got = sf.run(job, steps=STEPS, return_parameters=True, backend="inprocess", timeout=60).parameters
    assert got is not None
    for name in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, err_msg=name)


def test_eval_mode_normalises_by_the_trained_running_statistics() -> None:
    bn = sf.nn.BatchNorm2d(C, momentum=MOMENTUM)
    sf.run(fit_job(2, bn), backend="inprocess", timeout=60)  # the module gets the trained values back
    mean, var = (np.asarray(p.value, np.float64) for p in (bn.running_mean, bn.running_var))
    assert not np.allclose(var, 1.0)
    job = fit_job(2, bn, train=False)
    assert "running_stat" not in {o.op_type for o in job.graph.ops}, "eval updates nothing"
    out = sf.run(job, steps=1, backend="inprocess", timeout=60).outputs
    (y,) = out[job.fetches[1]]  # build returns (loss, y); one step
    x = job.data.read(0)["images"].astype(np.float64)  # type: ignore[union-attr]
    w, b = (np.asarray(p.value, np.float64)[None, :, None, None] for p in (bn.weight, bn.bias))
    want = (x - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + bn.eps) * w + b
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_checkpoints_keep_the_running_statistics(tmp_path: Path) -> None:
    job = fit_job(2)
    job = dataclasses.replace(job, config=dataclasses.replace(job.config, checkpoint_every=STEPS))
    got = sf.run(job, return_parameters=True, backend="inprocess", timeout=60, checkpoint_dir=str(tmp_path))
    assert got.parameters is not None
    ckpt = latest_intact(tmp_path)
    assert ckpt is not None
    saved = read_logical(ckpt.path)
    for name in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_array_equal(saved[name], got.parameters[name])


def test_a_running_statistic_in_micro_batches_is_refused_with_the_fix() -> None:
    job = fit_job(2)
    job = dataclasses.replace(job, config=dataclasses.replace(job.config, gradient_accumulation_steps=2))
    with pytest.raises((GraphError, SbpflowError), match="one forward per step|one micro-batch"):
        sf.run(job, backend="inprocess", timeout=60)


def test_momentum_out_of_range_is_refused() -> None:
    with pytest.raises(SbpflowError, match=r"momentum in \[0, 1\]"):
        sf.nn.BatchNorm2d(4, momentum=1.5)


@pytest.mark.parametrize(
    "config",
    [
        {"zero_stage": 3},
        {"activation_checkpointing": True},
        {"zero_stage": 1, "activation_checkpointing": True},
    ],
    ids=["zero3", "recompute", "zero1-recompute"],
)
def test_the_statistics_follow_zero_and_recomputation_as_one_device(config: dict[str, Any]) -> None:
    """ZeRO shards the trained parameters only; recomputation re-runs the forward for the backward, not
    the statistics' update (it is read by no backward op)."""
    job = fit_job(2)
    job = as_float64(
        dataclasses.replace(job, config=dataclasses.replace(job.config, **config)), batches=STEPS
    )
    want = reference.train(job, steps=STEPS).parameters
    got = sf.run(job, steps=STEPS, return_parameters=True, backend="inprocess", timeout=60).parameters
    assert got is not None
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=1e-14, err_msg=name)
