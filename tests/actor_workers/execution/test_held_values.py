"""The engine drops a value once its readers have acted (it no longer holds every register's newest value
into the next step), and the runtime's reuse of dead buffers counts references without that hold
(tasks.UNHELD). A wrong count would let a kernel overwrite a live value; these runs would then differ.

Training with the hold removed (the executor's engine) equals training the old way (every register
held, and counted among a dead buffer's references) bit for bit, on 1 rank, on a 2 x 2 mesh (data and
tensor parallel) and in a pipeline of 2 stages x 4 micro-batches; kernels write into lent buffers in both
(on one rank only in the dropped run: the hold keeps views of every candidate).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.execution import executor, memory_plan, tasks
from sbpflow.actor_workers.execution.executor_analysis import ExecutorError
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.control_plane.compiler import pipeline
from sbpflow.job import Job
from tests.actor_workers.test_equivalence import gpt_job
from tests.examples.test_examples import load

STEPS = 4

JOBS = {
    "main-job": lambda: load("charlm").make_job(
        ranks=1, layers=2, heads=4, width=64, seq_len=64, steps=STEPS
    ),
    "gpt-dp2xtp2": lambda: gpt_job(ranks=4, tp=True, dp=2, steps=STEPS),
    "gpt-pp2x4mb": lambda: gpt_job(ranks=2, pp=2, micro_batches=4, steps=STEPS),
}


def holding(rp: executor.RankProgram, trace: bool = False, data_on_compute: bool = False) -> Engine:
    """The executor's engine as it was: every register keeps its newest value into the next step."""
    return Engine(
        rp.actors,
        rp.registers,
        trace,
        rank=rp.rank,
        ordered_streams=executor.ORDERED_STREAMS,
        busy=rp.context.busy,
        keep_last=[r.id for r in rp.registers],
    )


def train(job: Job) -> tuple[list[Any], dict[str, Any]]:
    c = pipeline.compile(job)
    assert c.plan is not None, c.notes
    ranks = [d.rank for d in c.plan.devices]
    with InProcessWorld(ranks, timeout=60.0) as world:
        transports = {r: world.transport(r) for r in ranks}
        program = executor.build(c.plan, STEPS, transports)
        results = executor.execute(program, 60.0, abort_hooks=[world.abort])
    names = [p.tensor for p in job.parameters]
    assert all(r.last == {} for r in results.values()) or executor.engine is holding
    return executor.fetched(program, job.loss, STEPS), executor.variables(program, names)


def counting(lent: list[int], cls: Any = tasks.OutputReuse) -> Any:
    """``cls.take`` (OutputReuse's, or the memory plan's Lender's), counting the buffers it lends."""
    take = cls.take

    def counted(self: Any) -> tuple[Any, ...]:
        out = take(self)
        lent.append(sum(b is not None for b in out))
        return out

    return counted


@pytest.mark.parametrize("name", list(JOBS))
def test_training_without_the_hold_is_bit_identical(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lent: list[int] = []
    monkeypatch.setattr(tasks.OutputReuse, "take", counting(lent))
    monkeypatch.setattr(memory_plan.Lender, "take", counting(lent, memory_plan.Lender))
    dropped = train(JOBS[name]())
    # kernels wrote into their own dead previous outputs, or into the plan's slabs (on one rank the plan
    # takes every value a kernel writes, those its readers view included, and OutputReuse lends nothing)
    assert sum(lent) > 0
    lent.clear()
    monkeypatch.setattr(executor, "engine", holding)
    monkeypatch.setattr(tasks, "UNHELD", 4)  # the old count: the hold was one of the references
    held = train(JOBS[name]())
    # On one rank each value a kernel would write into again is also the base of a view its reader made
    # (a reshape, a transpose) and the hold keeps that view: the held run lends nothing, and the dropped
    # run is compared against no reuse at all. The pack buffers gave the held run its lending before one
    # rank stopped bucketing gradients (grad_buckets).
    assert sum(lent) > 0 or name == "main-job"
    for x, y in zip(dropped[0], held[0], strict=True):
        np.testing.assert_array_equal(x, y, err_msg="losses")
    assert held[1].keys() == dropped[1].keys()
    for k in held[1]:
        np.testing.assert_array_equal(dropped[1][k], held[1][k], err_msg=k)


def test_the_variables_first_values_die_once_read_and_a_program_runs_once() -> None:
    # nothing but the loop edges' initial values held a parameter's first value after the first update
    job = JOBS["main-job"]()
    c = pipeline.compile(job)
    assert c.plan is not None
    program = executor.build(c.plan, 2)
    store = program.ranks[0].context.store
    first = {p.tensor: weakref.ref(store[p.tensor]) for p in job.parameters}
    executor.execute(program, 60.0)
    gc.collect()
    assert first and all(ref() is None for ref in first.values())
    with pytest.raises(ExecutorError, match="runs once"):
        executor.engine(program.ranks[0])
