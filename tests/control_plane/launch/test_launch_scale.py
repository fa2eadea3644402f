"""bench/compiler/launch_scale.py at a quick size: a 64-rank pipeline of the GPT-175B-shaped job, lowered on
demand and launched on fake workers that each get, parse and check their own rank's serialised Plan.
Correctness only; the timings are the benchmark's."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import pytest

from sbpflow.codec import wire
from sbpflow.control_plane.compiler import pipeline
from sbpflow.v1 import plan_pb2 as pp

BENCH = Path(__file__).resolve().parents[3] / "bench" / "compiler"


def bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    return bench("launch_scale")


def quick_job(scale: ModuleType, **shape: int) -> tuple[int, object]:
    cs = scale.compile_scale
    s = cs.Shape(
        **{**asdict(cs.Shape()), "layers": 4, "tp": 2, "pp": 4, "dp": 8, "micro_batches": 4, **shape}
    )
    return s.devices, cs.make_job(s)


def test_every_fake_worker_gets_and_checks_its_own_lazily_lowered_plan(scale: ModuleType) -> None:
    devices, job = quick_job(scale)
    compiled = pipeline.finish(pipeline.compile(job, lower="none", cluster_size=devices), "lazy")
    assert compiled.plan is None and compiled.lazy is not None
    built = set(compiled._devices)  # the representatives of the memory classes, no more
    assert len(built) < devices

    result = scale.launch(compiled, batch=24)  # batches that do not divide the ranks

    assert sorted(result.workers) == list(range(devices))
    assert all(w.tasks > 0 and w.digest for w in result.workers.values())
    assert sum(w.tasks for w in result.workers.values()) == compiled.lazy.tasks
    assert set(compiled._devices) == built  # shipped, not kept
    scale.verify(compiled, result, list(range(devices)))  # each equals the rank lowered alone
    assert len(result.verified) == devices


def test_rank_plans_of_a_lazy_compile_are_the_whole_plans_parts(scale: ModuleType) -> None:
    devices, job = quick_job(scale, layers=2, pp=2, dp=2, micro_batches=2)
    whole = pipeline.compile(job, lower="eager")
    lazy = pipeline.compile(job, lower="lazy")
    assert whole.plan is not None and lazy.plan is None
    assert lazy.device_types() == whole.device_types()
    comms = {c.id: list(c.ranks) for c in whole.plan.communicators}
    for rank, data in lazy.rank_plans(list(range(devices)), batch=3):
        plan = pp.Plan.FromString(data)
        assert plan == whole.rank_plan(rank) == pp.Plan.FromString(dict(whole.rank_plans([rank]))[rank])
        assert plan.devices[0] == whole.device_plan(rank)
        assert not plan.HasField("job") and plan.format_version == whole.plan.format_version
        mine = [t for t in whole.plan.tensors if rank in set(wire.placement_from_proto(t.placement).ranks)]
        assert list(plan.tensors) == mine and 0 < len(mine) < len(whole.plan.tensors)
        assert {c.id: list(c.ranks) for c in plan.communicators} == {
            c: comms[c] for c in {t.communicator for t in plan.devices[0].tasks if t.communicator}
        }


def test_a_plan_that_is_not_the_ranks_own_is_refused(scale: ModuleType) -> None:
    devices, job = quick_job(scale, layers=2, pp=2, dp=2, micro_batches=2)
    compiled = pipeline.compile(job, lower="lazy")
    world = frozenset(range(devices))
    plan = compiled.rank_plan(1)
    scale.check_rank_plan(plan, 1, world)
    with pytest.raises(scale.PlanCheckError, match="got DevicePlans of ranks"):
        scale.check_rank_plan(plan, 0, world)
    plan.devices[0].registers.pop()
    with pytest.raises(scale.PlanCheckError, match="does not hold"):
        scale.check_rank_plan(plan, 1, world)
