"""Compile once, launch what was compiled: Submit's validation compile is the run's, and a job lowered on
demand runs on both backends from per-rank plans (each Ray worker gets only its own rank's)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.codec import wire
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.launch import launcher
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from tests.actor_workers.test_equivalence import LAYOUTS
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load

STEPS = 3


@pytest.fixture
def pass_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often each graph pass of ``pipeline.PASSES`` runs from now on."""
    calls: Counter[str] = Counter()

    def counting(name: str, run: Callable[[object], object]) -> Callable[[object], object]:
        def counted(state: object) -> object:
            calls[name] += 1
            return run(state)

        return counted

    for p in pipeline.PASSES:
        monkeypatch.setattr(p, "run", counting(pipeline.pass_name(p), p.run))
    return calls


def test_a_submit_through_the_manager_compiles_once_and_trains_as_sf_run(
    tmp_path: Path, pass_calls: Counter[str]
) -> None:
    mlp: ModuleType = load("mlp")
    job = mlp.make_job(ranks=2, steps=STEPS)
    want = sf.run(job, backend="inprocess")
    pass_calls.clear()
    with JobStore(tmp_path / "j.db") as store:
        config = ManagerConfig(MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2, keep_run_results=True)
        m = JobManager(store, config)
        m.start()
        rec = m.submit(wire.job_to_proto(job).SerializeToString())
        for _ in m.follow(rec.id):
            pass
        assert store.get(rec.id).state == JobState.SUCCEEDED
        m.shutdown()
    assert pass_calls == Counter({pipeline.pass_name(p): 1 for p in pipeline.PASSES})
    assert m.run_results[rec.id].losses == want.losses


def test_launch_lowers_a_validation_compile_without_running_a_pass_again(pass_calls: Counter[str]) -> None:
    job = as_float64(LAYOUTS["gpt-pp2xdp2"]())
    want = sf.run(job, backend="inprocess", steps=STEPS)
    compiled = pipeline.compile(job, lower="none")
    assert compiled.plan is None and compiled.lazy is None
    pass_calls.clear()
    got = launcher.launch(compiled, backend="inprocess", steps=STEPS)
    assert not pass_calls and compiled.plan is not None
    assert got.losses == want.losses


def test_finish_gives_the_plan_compile_gives() -> None:
    job = as_float64(LAYOUTS["gpt-pp2xdp2"]())
    whole = pipeline.compile(job)
    later = pipeline.finish(pipeline.compile(job, lower="none"))
    assert later.plan == whole.plan and later.memory == whole.memory
    assert list(later.timings)[-1] == "total" and "lowering" in later.timings
    assert pipeline.finish(later) is later  # lowered already: as it is


@pytest.mark.parametrize("layout", ["mlp-tp4", "gpt-pp2xdp2"])
def test_a_job_lowered_on_demand_runs_in_process_as_the_whole_plan(layout: str) -> None:
    job = as_float64(LAYOUTS[layout]())
    want = sf.run(job, backend="inprocess", steps=STEPS, return_parameters=True)
    lazy = pipeline.compile(job, lower="lazy")
    got = launcher.launch(lazy, backend="inprocess", steps=STEPS, return_parameters=True)
    assert lazy.plan is None
    np.testing.assert_array_equal(got.losses, want.losses)
    assert got.parameters is not None and want.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_array_equal(got.parameters[name], value, err_msg=name)


@pytest.mark.usefixtures("ray_local")
def test_ray_workers_of_a_job_lowered_on_demand_get_their_rank_plans_and_train_as_in_process() -> None:
    job = as_float64(LAYOUTS["gpt-pp2xdp2"]())
    want = sf.run(job, backend="inprocess", steps=STEPS)
    lazy = pipeline.compile(job, lower="lazy")
    built = dict(lazy._devices)
    got = launcher.launch(lazy, backend="ray", steps=STEPS, timeout=120)
    assert lazy.plan is None and lazy._devices.keys() == built.keys()  # shipped, not cached
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-12, atol=0)
