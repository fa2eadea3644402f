"""plan_size and the compile's budget: the estimate is the plan lowering builds; a walk over its budget
or cancelled stops at once, with the quantity named; random jobs are refused at Submit or compile
within the budget, never past it."""

from __future__ import annotations

import dataclasses
import threading
import time
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbpflow.codec import wire
from sbpflow.control_plane.compiler import pipeline, plan_size
from sbpflow.control_plane.launch.launcher import RunCancelled, launch
from sbpflow.control_plane.service.data_policy import reason_of
from sbpflow.control_plane.service.validation import ValidationError, compile_submit
from sbpflow.limits import LIMITS, CompileBudget, CompileCancelled, CompileLimitError
from tests.examples.test_examples import load


@pytest.fixture(scope="module")
def gpt() -> ModuleType:
    return load("gpt")


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


def pipelined(gpt: ModuleType, m: int) -> pipeline.Compiled:
    return pipeline.compile(gpt.make_job(ranks=2, pp=2, micro_batches=m, batch_size=m), lower="none")


@pytest.mark.parametrize(
    "example, kwargs",
    [
        ("gpt", {"ranks": 2, "pp": 2, "micro_batches": 4, "batch_size": 8}),
        ("gpt", {"ranks": 4, "tp": True}),
        ("mlp", {"ranks": 4, "pp": 2, "layers": 2, "micro_batches": 4, "grad_accum": 2}),
    ],
)
def test_the_estimate_is_the_plan_lowering_builds(example: str, kwargs: dict) -> None:
    c = pipeline.compile(load(example).make_job(**kwargs), lower="none")
    size = plan_size.estimate(c.state)
    plan = pipeline.finish(c, "eager").plan
    assert plan is not None
    per_rank = {d.rank: len(d.tasks) for d in plan.devices}
    total, most = sum(per_rank.values()), max(per_rank.values())
    assert 0.95 * total <= size.tasks <= 1.25 * total and 0.95 * most <= size.rank_tasks <= 1.25 * most


def test_a_plan_over_a_limit_is_refused_before_lowering(gpt: ModuleType) -> None:
    c = pipelined(gpt, 16)
    small = dataclasses.replace(LIMITS, rank_tasks=1000)
    with pytest.raises(CompileLimitError) as e:
        pipeline.finish(c, budget=CompileBudget.start(small))
    assert e.value.field == "rank_tasks" and "over the limit of 1,000 (Limits.rank_tasks)" in str(e.value)
    assert "16 micro-batches" in str(e.value) and "use fewer micro-batches" in str(e.value)
    assert c.plan is None and c.lazy is None  # nothing was lowered


def test_a_walk_past_its_budget_stops_there(gpt: ModuleType) -> None:
    c = pipelined(gpt, 16)  # ~8,000 tasks
    small = dataclasses.replace(LIMITS, built_tasks=500)
    with pytest.raises(CompileLimitError) as e:
        pipeline.lowering.lower(c.state, budget=CompileBudget.start(small))
    assert e.value.field == "built_tasks" and "built 501 tasks" in str(e.value)
    assert reason_of(e.value, "RUN_ERROR") == "COMPILE_LIMIT"


def test_a_cancel_stops_the_lowering_within_a_second(gpt: ModuleType) -> None:
    c = pipelined(gpt, 256)  # ~120,000 tasks: many seconds to lower
    cancel = threading.Event()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    t = time.monotonic()
    with pytest.raises(CompileCancelled):
        pipeline.finish(c, "eager", CompileBudget.start(LIMITS, cancel))
    assert time.monotonic() - t < 0.5 + 1.0


def test_a_launch_cancelled_while_compiling_is_run_cancelled(mlp: ModuleType) -> None:
    c = pipeline.compile(mlp.make_job(steps=2), lower="none")
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RunCancelled, match="cancelled while it was compiled"):
        launch(c, backend="inprocess", cancel=cancel)


FUZZ = dataclasses.replace(
    LIMITS, walk_steps=3_000, rank_tasks=1_500, rank_registers=3_000, plan_tasks=3_000, built_tasks=3_000
)


@settings(max_examples=8, deadline=None)
@given(
    stages=st.integers(1, 2),
    layers=st.integers(2, 4),
    m=st.sampled_from([1, 2, 8, 32, 128]),
    accumulate=st.integers(1, 3),
    rows=st.integers(1, 3),
)
def test_random_jobs_are_refused_or_compile_within_the_budget(
    mlp: ModuleType, stages: int, layers: int, m: int, accumulate: int, rows: int
) -> None:
    job = mlp.make_job(
        ranks=stages,
        pp=stages,
        layers=layers,
        micro_batches=m,
        grad_accum=accumulate,
        batch_size=m * accumulate * rows,
    )
    try:
        c = compile_submit(wire.job_to_proto(job).SerializeToString(), stages, limits=FUZZ)
    except ValidationError as e:
        assert e.kind == "limit" and "(Limits." in str(e)
        return
    plan = pipeline.finish(c, "eager", CompileBudget.start(FUZZ)).plan  # raises past the budget
    assert plan is not None and sum(len(d.tasks) for d in plan.devices) <= FUZZ.built_tasks
