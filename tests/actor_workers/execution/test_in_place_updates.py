"""Updates that write the new parameter over the old (``tasks.Recycler`` lends the value itself once
nothing else holds it; ``OpDef.in_place``): one array a parameter, as PyTorch's optimizers keep.

Every update of SGD with momentum and batch norm (ResNet), of clipped AdamW (the main job) and of a data
parallel MLP goes in place from the second step on, and trains bit for bit as with the updates out of
place (``executor_analysis.IN_PLACE_UPDATES``): the count of in-place steps pins ``tasks.ALONE`` against
the engine's references. A value that something else still holds (here an assign hook keeping the newest
value) is never written over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.execution import executor, executor_analysis, tasks
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.control_plane.compiler import pipeline
from sbpflow.job import Job, LossScaling
from tests.control_plane.compiler.test_loss_scaling import fp16
from tests.examples.test_examples import load

STEPS = 4

JOBS: dict[str, Callable[[], Job]] = {
    "resnet-1": lambda: load("resnet").make_job(ranks=1, width=4, image_size=8, batch_size=4, steps=STEPS),
    "main-job": lambda: load("charlm").make_job(
        ranks=1, layers=1, heads=2, width=32, seq_len=16, steps=STEPS
    ),
    "mlp-dp2": lambda: load("mlp").make_job(ranks=2, steps=STEPS),
    # updates gated on a clean step: from a scale of 2**18, 2 of the 4 steps overflow and skip, 2 update
    "main-job-fp16": lambda: fp16(
        load("charlm").make_job(ranks=1, layers=1, heads=2, width=32, seq_len=16, steps=STEPS),
        LossScaling(2.0**18, growth_interval=1),
    ),
}


def train(
    job: Job, monkeypatch: pytest.MonkeyPatch, hook: Callable[[Any], Callable[[str, int], None]] | None = None
) -> tuple[list[Any], dict[str, Any], list[tasks.Recycler]]:
    """``job``'s losses and variables, and the recyclers its ranks' updates got; ``hook(rank context)``
    gives an assign hook added on every rank."""
    made: list[tasks.Recycler] = []
    recyclers = executor_analysis.recyclers

    def capturing(*args: Any) -> Any:
        out = recyclers(*args)
        made.extend(out[0].values())
        return out

    monkeypatch.setattr(executor_analysis, "recyclers", capturing)
    c = pipeline.compile(job)
    assert c.plan is not None, c.notes
    ranks = [d.rank for d in c.plan.devices]
    with InProcessWorld(ranks, timeout=60.0) as world:
        program = executor.build(c.plan, STEPS, {r: world.transport(r) for r in ranks})
        if hook is not None:
            for rp in program.ranks.values():
                rp.context.assign_hooks.append(hook(rp.context))
        executor.execute(program, 60.0, abort_hooks=[world.abort])
    names = [p.tensor for p in job.parameters]
    return executor.fetched(program, job.loss, STEPS), executor.variables(program, names), made


@pytest.mark.parametrize("name", list(JOBS))
def test_every_update_goes_in_place_from_its_second_step_bit_for_bit(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JOBS[name]()
    losses, variables, made = train(job, monkeypatch)
    assert made and all(r.in_place for r in made)
    assert [r.placed for r in made] == [STEPS - 1] * len(made)  # every update but the first step's
    monkeypatch.setattr(executor_analysis, "IN_PLACE_UPDATES", False)
    want_losses, want, off = train(job, monkeypatch)
    assert not any(r.placed for r in off)
    for x, y in zip(losses, want_losses, strict=True):
        np.testing.assert_array_equal(x, y, err_msg="losses")
    for k, v in want.items():
        np.testing.assert_array_equal(variables[k], v, err_msg=k)


@pytest.mark.parametrize("name", ["resnet-1", "main-job"])
def test_a_value_something_else_holds_is_not_written_over(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # parameter -> its newest value, as the hook got it, and a copy (an optimizer's state is donated to
    # its update, which no other act reads: updated in place whoever else holds it, as before)
    held: dict[str, tuple[Any, Any]] = {}
    changed: list[str] = []
    job = JOBS[name]()
    parameters = {p.tensor for p in job.parameters}

    def keeping(rc: tasks.RankContext) -> Callable[[str, int], None]:
        def hook(name: str, step: int) -> None:
            if name not in parameters:
                return
            before = held.get(name)
            if before is not None and not np.array_equal(before[0], before[1]):
                changed.append(f"{name} at step {step}")
            value = rc.store[name]
            held[name] = (value, np.array(value, copy=True))

        return hook

    losses, variables, made = train(job, monkeypatch, keeping)
    assert made and not any(r.placed for r in made), "a value the hook holds went in place"
    assert not changed
    monkeypatch.setattr(executor_analysis, "IN_PLACE_UPDATES", False)
    want_losses, want, _ = train(job, monkeypatch)
    for x, y in zip(losses, want_losses, strict=True):
        np.testing.assert_array_equal(x, y, err_msg="losses")
    for k, v in want.items():
        np.testing.assert_array_equal(variables[k], v, err_msg=k)
