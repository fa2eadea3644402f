"""sbpflow.limits: each bound refuses with the field, the value, the limit and the fix; the examples pass."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest

from sbpflow.control_plane.compiler.passes.micro_batching import PipelineError, check_stages
from sbpflow.job import SGD, JobConfig, OptimizerSpec, check_job
from sbpflow.limits import (
    LIMITS,
    CompileBudget,
    CompileCancelled,
    CompileLimitError,
    LimitError,
    check_float,
    check_name,
    check_shape,
)
from tests.examples.test_examples import load


@pytest.fixture(scope="module")
def job():
    return load("mlp").make_job(steps=2)


def test_the_examples_are_within_the_limits(job) -> None:
    check_job(job)
    check_job(load("gpt").make_job(tp=True))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e300])
def test_floats_must_be_finite_and_bounded(value: float) -> None:
    with pytest.raises(LimitError) as e:
        check_float("job.optimizer.sgd.lr", value, 0.0, LIMITS.magnitude)
    assert str(e.value).startswith("job.optimizer.sgd.lr=") and e.value.field == "job.optimizer.sgd.lr"


def test_names_are_short_and_printable() -> None:
    with pytest.raises(LimitError, match=r"10000000 characters, over the limit of 256; use a shorter name"):
        check_name("job.name", "x" * 10_000_000)
    with pytest.raises(LimitError, match="unprintable character"):
        check_name("job.name", "a\nb")


def test_shape_products_never_wrap() -> None:
    with pytest.raises(LimitError, match="elements, over the limit"):
        check_shape("t.shape", (1 << 32, 1 << 32))  # 2**64: an int64 product wraps to 0
    with pytest.raises(LimitError, match=r"t.shape\[0\]=-5"):
        check_shape("t.shape", (-5, 3))


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda j: dataclasses.replace(j, name="n" * 300), "job.name"),
        (lambda j: dataclasses.replace(j, config=JobConfig(steps=1 << 62)), "job.config.steps"),
        (
            lambda j: dataclasses.replace(j, config=JobConfig(micro_batches=1 << 31)),
            "job.config.micro_batches",
        ),
        (lambda j: dataclasses.replace(j, config=JobConfig(loss_scale=math.inf)), "job.config.loss_scale"),
        (
            lambda j: dataclasses.replace(
                j, optimizer=OptimizerSpec(SGD(lr=math.nan), j.optimizer.parameters)
            ),
            "job.optimizer.sgd.lr",
        ),
        (
            lambda j: dataclasses.replace(
                j, optimizer=OptimizerSpec(SGD(momentum=2.0), j.optimizer.parameters)
            ),
            "job.optimizer.sgd.momentum",
        ),
    ],
)
def test_job_fields_out_of_range_name_the_field(job, change, field: str) -> None:
    with pytest.raises(LimitError) as e:
        change(job).verify()  # Job.verify applies the limits first: sf.run and Submit alike
    assert e.value.field == field and "; " in str(e.value)


def test_a_huge_or_negative_stage_is_refused_without_enumerating_it(job) -> None:
    g = job.graph.copy()
    g.ops[-1] = dataclasses.replace(g.ops[-1], stage=(1 << 31) - 1)
    t = time.perf_counter()
    with pytest.raises(PipelineError, match="no op is in stage 1"):
        check_stages(g)
    assert time.perf_counter() - t < 10.0  # enumerating 2^31 stages would take minutes and gigabytes
    g.ops[-1] = dataclasses.replace(g.ops[-1], stage=-1)
    with pytest.raises(PipelineError, match="numbered from 0"):
        check_stages(g)


# ---- the compile's budget -------------------------------------------------------------------------------


def test_a_budget_refuses_the_task_past_its_limit_naming_it() -> None:
    budget = CompileBudget.start(dataclasses.replace(LIMITS, built_tasks=10))
    budget.made(tasks=10)
    with pytest.raises(CompileLimitError) as e:
        budget.made(tasks=1)
    assert e.value.reason == "COMPILE_LIMIT" and e.value.field == "built_tasks"
    assert "built 11 tasks, over the limit of 10 (Limits.built_tasks); use fewer micro-batches" in str(
        e.value
    )
    budget.walk()  # a new walk counts from zero
    budget.made(tasks=10)


def test_a_budget_sees_a_cancel_within_its_check_interval() -> None:
    cancel = threading.Event()
    budget = CompileBudget.start(LIMITS, cancel)
    budget.made(steps=5000)
    cancel.set()
    with pytest.raises(CompileCancelled):
        for _ in range(CompileBudget.EVERY + 1):
            budget.made(steps=1)


def test_a_budget_stops_at_its_deadline() -> None:
    budget = CompileBudget.start(dataclasses.replace(LIMITS, compile_seconds=0.05))
    time.sleep(0.1)
    with pytest.raises(CompileLimitError) as e:
        budget.check()
    assert e.value.field == "compile_seconds" and "ran past its time limit" in str(e.value)
