"""A live plan: a forward job compiled once, its actors up between calls, each call a step whose output
is the oracle's forward on that call's inputs, on one rank and under tensor parallelism."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.control_plane.generation.live_plan import LivePlan, LivePlanError
from sbpflow.oracle import reference
from tests.control_plane.launch.test_run_outputs import Logits

CFG = sf.nn.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, n_embd=16)


def _job(ranks: int, tp: bool, model: sf.nn.GPT | None = None) -> sf.Job:
    model = (model or sf.nn.GPT(CFG)).eval()
    where = sf.placement("cpu", ranks=list(range(ranks)))
    if tp:
        sf.nn.parallel.megatron(model, where, tp_axis=-1)
    data = sf.data.ArraySource(batch_size=2, arrays={"tokens": np.zeros((2, 8), np.int64)})
    return Logits(model).trace(data, placement=where, input_sbp=sf.sbp.broadcast)


@pytest.mark.parametrize(("ranks", "tp"), [(1, False), (2, True)])
def test_each_call_is_a_step_of_the_same_actors_and_gives_the_oracles_forward(ranks: int, tp: bool) -> None:
    job = _job(ranks, tp)
    assert job.bound is not None
    values = job.bound.held()
    (name,) = job.fetches
    before = threading.active_count()
    with LivePlan(job) as plan:
        engines = 0
        for seed in range(3):
            tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (2, 8))
            logits = plan({"tokens": tokens})
            want = reference.forward(_with(job, tokens), fetches=[name], parameters=values)[name]
            np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)
            engines = engines or threading.active_count()  # the first call finds every stream up
            assert threading.active_count() == engines  # no new actors, no new job
        assert plan.program.ranks.keys() == set(range(ranks))
        assert all(not rec for rp in plan.program.ranks.values() for rec in rp.context.fetched.values())
    assert threading.active_count() <= before  # closed: every stream thread ended


def _with(job: sf.Job, tokens: np.ndarray) -> sf.Job:
    import dataclasses

    return dataclasses.replace(job, data=sf.data.ArraySource(batch_size=2, arrays={"tokens": tokens}))


def test_a_batch_of_another_shape_or_without_the_input_is_refused_with_the_shape_it_needs() -> None:
    with LivePlan(_job(1, False)) as plan:
        with pytest.raises(LivePlanError, match=r"\[2, 8\] int64: pad the batch"):
            plan({"tokens": np.zeros((2, 5), np.int64)})
        with pytest.raises(LivePlanError, match="no field 'tokens'"):
            plan({"ids": np.zeros((2, 8), np.int64)})
        assert plan({"tokens": np.ones((2, 8), np.int64)}).shape == (2, 8, CFG.vocab_size)


def test_a_failing_step_stops_the_plan_and_names_the_step_and_a_closed_plan_takes_no_call() -> None:
    with LivePlan(_job(2, True)) as plan:
        assert plan({"tokens": np.ones((2, 8), np.int64)}).shape == (2, 8, CFG.vocab_size)

        def broken(name: str, micro_batch: int, step: int, value: object) -> None:
            if step == 1:
                raise OSError("the disk went away")

        plan.program.ranks[1].context.fetch_hooks.insert(0, broken)  # rank 1's output of step 1 fails
        with pytest.raises(LivePlanError, match="failed at step 1") as failed:
            plan({"tokens": np.ones((2, 8), np.int64)})
        assert "the disk went away" in str(failed.value.__cause__)
        with pytest.raises(LivePlanError, match="stopped"):
            plan({"tokens": np.zeros((2, 8), np.int64)})
    with pytest.raises(LivePlanError, match="stopped"):
        plan({"tokens": np.zeros((2, 8), np.int64)})


def test_a_training_job_is_refused() -> None:
    job = sf.nn.GPT(CFG)

    class Loss(sf.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = job
            self.add_optimizer(sf.optim.SGD(job.parameters(), lr=0.1))

        def build(self, tokens: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
            loss = self.model(tokens, targets)
            loss.backward()
            return loss

    data = sf.data.SyntheticSource(kind="tokens", batch_size=2, params={"seq_len": 8, "vocab": 32})
    with pytest.raises(LivePlanError, match="forward-only"):
        LivePlan(Loss().trace(data))
