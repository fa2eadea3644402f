"""Parameter buffers recycled by their update: the value two steps back is dead, so the new one goes there.

Exactness is the equivalence suite's (every layout trains as one device does, with recycling on); here:
the rule itself (the first value is never recycled, a view made by a reader turns recycling off), that a
plain data-parallel job does recycle, and that a job whose reader keeps a view of the parameter across
the update still trains exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import sbpflow as sf
from sbpflow.actor_workers.execution import executor_analysis
from sbpflow.actor_workers.execution.tasks import Recycler, guard_aliases
from sbpflow.control_plane.compiler import pipeline
from sbpflow.data.sources import ArraySource
from sbpflow.oracle import reference
from sbpflow.random import Normal
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load


def test_the_update_gets_the_value_two_steps_back_never_the_first_nor_the_current() -> None:
    r = Recycler(input=0)
    v0, v1, v2 = np.zeros(3), np.ones(3), np.full(3, 2.0)
    assert r.take([v0]) is None  # the store's initial value: not ours
    assert r.take([v1]) is None  # v0 is never handed back
    assert r.take([v2]) is v1  # v1's readers are all done once v2 is being updated
    assert r.take([v2]) is None  # never the value being read


def test_a_reader_that_passes_on_a_view_turns_recycling_off() -> None:
    r = Recycler(input=0)
    fresh = guard_aliases(lambda step, values: [values[0] * 2], r, 0, np)
    viewing = guard_aliases(lambda step, values: [values[0].reshape(-1)], r, 0, np)
    w = np.ones((2, 3))
    fresh(0, [w])
    assert r.ok
    viewing(0, [w])
    assert not r.ok
    r.take([w]), r.take([w + 1])
    assert r.take([w + 2]) is None


def test_a_data_parallel_mlp_recycles_every_parameter() -> None:
    job = load("mlp").make_job(ranks=2, steps=4)
    compiled = pipeline.compile(job)
    assert compiled.plan is not None
    recyclers, _ = executor_analysis.recyclers(compiled.plan.devices[0])
    updates = [t for t in compiled.plan.devices[0].tasks if t.id in recyclers]
    assert {t.op_name for t in updates} and len(updates) == len(job.parameters)


class _ViewOfWeight(sf.nn.Module):
    """loss = mse(x @ w.T, y): the transpose of the parameter is a view of its array."""

    def __init__(self) -> None:
        super().__init__()
        self.w = sf.nn.Parameter((3, 4), Normal(0.0, 0.5))

    def forward(self, x: Any, y: Any) -> Any:
        return sf.nn.functional.mse_loss(x @ self.w.T, y)


class _Train(sf.Graph):
    def __init__(self, model: _ViewOfWeight) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.SGD(model.parameters(), lr=0.1))
        self.config.steps = 5

    def build(self, x: Any, y: Any) -> Any:
        loss = self.model(x, y)
        loss.backward()
        return loss


def test_a_job_whose_reader_views_the_parameter_is_watched_and_trains_exactly() -> None:
    rng = np.random.default_rng(0)
    data = ArraySource(
        batch_size=4,
        arrays={
            "x": rng.standard_normal((16, 4), dtype=np.float32),
            "y": rng.standard_normal((16, 3), dtype=np.float32),
        },
    )
    job = as_float64(
        _Train(_ViewOfWeight()).trace(data, placement=sf.placement("cpu", ranks=[0]), input_sbp=None)
    )
    compiled = pipeline.compile(job)
    assert compiled.plan is not None
    _, guards = executor_analysis.recyclers(compiled.plan.devices[0])
    assert guards, "the transpose reads the parameter: it is watched"
    want = reference.train(job, steps=5)
    got = sf.run(job, backend="inprocess", steps=5, return_parameters=True)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-12)
    assert got.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got.parameters[name], value, rtol=1e-12, err_msg=name)
