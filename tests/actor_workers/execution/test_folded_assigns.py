"""SINK assigns folded into the act that makes their value (executor_analysis.folded_assigns): one act
fewer per assigned variable and step, and the same run bit for bit — the loop edges carry each new value
into the next step, the store and the assign hooks see it (a checkpoint taken mid-run holds it), updates
still donate and recycle their variables' buffers."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.actor_workers.execution import executor, executor_analysis
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.checkpoint.format import step_dir
from sbpflow.checkpoint.read import read_logical
from sbpflow.control_plane.compiler import pipeline
from sbpflow.job import Job
from sbpflow.oracle import reference
from sbpflow.v1 import plan_pb2 as pp
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load

STEPS = 3
TIMEOUT = 120.0
RESNET = {"depth": 18, "width": 4, "image_size": 8, "classes": 5, "batch_size": 8}


def resnet() -> Job:  # SGD with momentum, and batch norm's running statistics (kernels that assign)
    return as_float64(load("resnet").make_job(ranks=1, steps=STEPS, **RESNET), batches=STEPS)


def mlp() -> Job:  # data parallel on 2 ranks
    job = load("mlp").make_job(ranks=2, n_in=8, hidden=16, n_out=4, batch_size=8, steps=STEPS)
    return as_float64(job, batches=STEPS)


def gpt_tp() -> Job:  # tensor parallel on a 1 x 1 mesh: no-op 2-d boxings between each update and its SINK
    job = load("gpt").make_job(
        layers=1, heads=2, width=16, vocab=32, seq_len=8, batch_size=8, steps=STEPS, ranks=1, tp=True, dp=1
    )
    return as_float64(job, batches=STEPS)


def folded(device: pp.DevicePlan) -> dict[int, executor_analysis.Folded]:
    return executor_analysis.folded_assigns(device, executor_analysis.no_op_boxings(device))


def run(job: Job, fold: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[executor.Program, dict[int, Any]]:
    monkeypatch.setattr(executor_analysis, "FOLD_ASSIGNS", fold)
    c = pipeline.compile(job)
    assert c.plan is not None
    ranks = [d.rank for d in c.plan.devices]
    with InProcessWorld(ranks, timeout=TIMEOUT) as world:
        program = executor.build(c.plan, STEPS, {r: world.transport(r) for r in ranks})
        results = executor.execute(program, TIMEOUT, abort_hooks=[world.abort])
    return program, results


@pytest.mark.parametrize("make", [resnet, mlp, gpt_tp], ids=["resnet", "mlp_dp2", "gpt_tp_1x1"])
def test_each_folded_assign_is_one_act_fewer_a_step_and_the_run_is_bit_for_bit_the_same(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make()
    c = pipeline.compile(job)
    assert c.plan is not None
    kinds: set[int] = set()
    for device in c.plan.devices:
        tasks = {t.id: t for t in device.tasks}
        found = folded(device)
        sinks = [t for t in device.tasks if t.kind == pp.TASK_KIND_SINK and "assign" in t.attrs]
        assert found and set(found) == {t.id for t in sinks}  # every assign here only stores an update
        kinds |= {tasks[f.producer].kind for f in found.values()}
        through = [f for f in found.values() if f.steps]
        if make is gpt_tp:  # most reach their SINK through no-op boxings: seen through, they fold too
            assert len(through) > len(found) // 2
            assert len(executor_analysis.folded_assigns(device)) == len(found) - len(through)
        for f in through:  # a chain of single-reader no-op steps from the update's output to the SINK
            assert all(tasks[t].kind == pp.TASK_KIND_BOXING for t in f.steps)
            assert list(tasks[f.steps[-1]].in_registers) == [f.register]  # the update's output
            assert list(tasks[f.sink].in_registers) == [f.passed[0]]
    if make is resnet:  # running statistics are kernels' outputs, the new parameters and momenta updates'
        assert kinds == {pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER}
    on, on_results = run(job, True, monkeypatch)
    off, off_results = run(job, False, monkeypatch)
    for device in c.plan.devices:
        monkeypatch.setattr(executor_analysis, "FOLD_ASSIGNS", True)
        found = folded(device)
        n = len(found)
        assert off_results[device.rank].acts - on_results[device.rank].acts == n * STEPS
        actors = {a.id for a in on.ranks[device.rank].actors}
        assert not actors & {t for f in found.values() for t in (f.sink, *f.steps)}
    losses = executor.fetched(on, job.loss, STEPS)
    np.testing.assert_array_equal(losses, executor.fetched(off, job.loss, STEPS))
    np.testing.assert_allclose(losses, reference.train(job, STEPS).losses, rtol=1e-12)
    for rank, rp in on.ranks.items():  # every variable: parameters, momenta, running statistics
        store, want = rp.context.store.values(), off.ranks[rank].context.store.values()
        assert set(store) == set(want)
        for name, value in want.items():
            np.testing.assert_array_equal(store[name], value, err_msg=name)


def test_a_checkpoint_taken_mid_run_holds_the_values_its_step_assigned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The assign hooks run in the update's act once the store holds the new value: a checkpoint of step
    ``k`` holds the parameters after ``k`` steps, as the reference and the unfolded run have them."""
    job = mlp()
    job = dataclasses.replace(job, config=dataclasses.replace(job.config, checkpoint_every=1))
    got = {}
    for fold in (True, False):
        monkeypatch.setattr(executor_analysis, "FOLD_ASSIGNS", fold)
        root = tmp_path / str(fold)
        sf.run(job, backend="inprocess", checkpoint_dir=str(root), timeout=TIMEOUT)
        got[fold] = {k: read_logical(step_dir(root, k), ("parameter", "optimizer_state")) for k in (1, 2)}
    for k in (1, 2):
        want = reference.train(job, steps=k).parameters
        assert set(want) < set(got[True][k])
        for name, value in want.items():
            np.testing.assert_allclose(got[True][k][name], value, rtol=1e-12, err_msg=f"{name} at step {k}")
        assert set(got[True][k]) == set(got[False][k])
        for name, value in got[False][k].items():
            np.testing.assert_array_equal(got[True][k][name], value, err_msg=f"{name} at step {k}")
