"""The running_stats pass: a running_stat op's result is its variable's next value, and only for an
untrained parameter, once per step."""

from __future__ import annotations

from typing import Any

import pytest

import sbpflow as sf
from sbpflow.control_plane.compiler.pipeline import compile as compile_job
from sbpflow.errors import GraphError
from sbpflow.job import Job
from tests.client.nn.test_batch_norm import C, data, fit_job

F = sf.nn.functional


def test_each_running_statistic_is_written_back_with_its_variables_sbp() -> None:
    state = compile_job(fit_job(2), lower=False).state
    for var in ("bn.running_mean", "bn.running_var"):
        new = state.updates[var]
        assert state.graph.tensors[new].sbp == state.graph.tensors[var].sbp, var
    assert {"bn.weight", "bn.bias"} <= set(state.updates), "beside the optimizer's updates"


class Misused(sf.Graph):
    """A running statistic kept in a trained parameter, or updated twice in a step."""

    def __init__(self, trained: bool) -> None:
        super().__init__()
        self.bn = sf.nn.BatchNorm2d(C)
        self.trained = trained
        if trained:
            self.bn.running_mean.requires_grad_(True)
        self.add_optimizer(sf.optim.SGD(self.bn.parameters(), lr=0.1))

    def build(self, images: sf.Tensor, target: sf.Tensor) -> Any:
        loss = F.mse_loss(self.bn(images), target)
        if self.trained:  # so that the running mean has a gradient
            loss = loss + self.bn.running_mean.sum()
        else:
            loss = loss + F.mse_loss(self.bn(images), target)
        loss.backward()
        return loss


def misused(trained: bool) -> Job:
    return Misused(trained).trace(
        data(), placement=sf.placement("cpu", ranks=[0, 1]), input_sbp=sf.sbp.split(0)
    )


@pytest.mark.parametrize(
    "trained, message",
    [
        (True, "that is trained; its first input must be a parameter made with requires_grad=False"),
        (False, "already updates; give each running statistic one update per step"),
    ],
    ids=["trained", "twice"],
)
def test_misuse_is_refused_naming_the_op_and_the_fix(trained: bool, message: str) -> None:
    with pytest.raises(GraphError, match=message):
        compile_job(misused(trained), lower=False)
