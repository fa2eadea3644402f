"""Elastic resume (issue 19 part 4): a job that loses a worker whose capacity is not back within its grace
period re-plans on a fallback rank count (``JobConfig.elastic``), resumes from its last intact checkpoint
and goes on; the attempt and the new layout show in status, events and metrics.

The Ray test is a DP 4 float64 job on the session's 4-CPU Ray: another tenant's task waits for 2 CPUs,
rank 3's worker is SIGKILLed after the checkpoint at step 8, the tenant gets its CPUs as the failed
attempt's group goes, so the job's 4 ranks are not back within its grace period and it goes on as DP 2. Its
losses equal, to 1e-12, those of an uninterrupted in-process run that switched layouts at the same step
(DP 4 up to the checkpoint, then the example's own DP 2 from it) — and, the global batch being the same,
those of an uninterrupted DP 4 run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint import read as ck_read
from sbpflow.checkpoint.format import step_dir
from sbpflow.codec import wire
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.launch.elastic import (
    ELASTIC_GROW,
    ELASTIC_RESUME,
    PLACE_SECONDS,
    ElasticError,
    replace_world,
    replan,
    world,
)
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.service.validation import ValidationError
from sbpflow.control_plane.status.metrics import Metrics
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.errors import SbpflowError
from sbpflow.job import Job, JobConfig
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from sbpflow.sbp import S
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.control_plane.service.test_server import until
from tests.examples.test_examples import load

STEPS, EVERY, KILL_AFTER = (
    1000,
    20,
    20,
)  # reports come a second apart: the job must run for seconds past KILL_AFTER (at 160 steps it could end before the kill)


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


def elastic(job: Job, **config: Any) -> Job:
    return dataclasses.replace(job, config=dataclasses.replace(job.config, **config))


def dp(mlp: ModuleType, ranks: int, **kw: Any) -> Job:
    """The MLP example in float64, data parallel over ``ranks``, checkpointing every EVERY steps."""
    job = mlp.make_job(ranks=ranks, n_in=64, hidden=256, batch_size=32, steps=STEPS, lr=0.02, **kw)
    return elastic(as_float64(job), checkpoint_every=EVERY)


def test_replace_world_scales_the_data_parallel_axis_and_keeps_the_sbp(mlp: ModuleType) -> None:
    job = dp(mlp, 4)
    two = replace_world(job, 2)
    assert world(two) == [0, 1]
    for name, t in job.graph.tensors.items():
        new = two.graph.tensors[name]
        assert new.sbp == t.sbp and new.meta == t.meta and new.kind == t.kind
        assert t.placement is None or new.placement == sf.placement("cpu", [0, 1])
    assert [o.placement for o in two.graph.ops] == [
        None if o.placement is None else sf.placement("cpu", [0, 1]) for o in job.graph.ops
    ]
    two.verify()
    # the same model: the re-placed job's one-step loss is the DP 4 job's (the same global batch)
    a = sf.run(elastic(job, steps=1), backend="inprocess").losses
    b = sf.run(elastic(two, steps=1), backend="inprocess").losses
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_a_mesh_shrinks_along_its_first_axis_only(mlp: ModuleType) -> None:
    job = mlp.make_job(ranks=4, tp=True)  # a 1-d TP placement over 4: it spans every rank
    assert world(replace_world(job, 2)) == [0, 1]
    grid = sf.placement("cpu", [[0, 1], [2, 3]])
    g = job.graph.copy()
    for name, t in g.tensors.items():
        if t.placement is not None:
            g.tensors[name] = dataclasses.replace(t, placement=grid, sbp=None)
    meshed = dataclasses.replace(job, graph=g)
    halved = replace_world(meshed, 2)
    assert {t.placement for t in halved.graph.tensors.values()} == {sf.placement("cpu", [[0, 1]])}
    with pytest.raises(SbpflowError, match=r"2x2 mesh .* cannot go on 1 ranks: only its first"):
        replace_world(meshed, 1)


def test_what_cannot_re_place_is_refused_naming_it(mlp: ModuleType) -> None:
    piped = mlp.make_job(ranks=2, pp=2, layers=2, micro_batches=2)
    with pytest.raises(SbpflowError, match=r"covers only ranks \[0\] of the job's \[0, 1\].*pipeline"):
        replace_world(piped, 1)
    job = mlp.make_job(ranks=4, batch_size=20)  # 20 over 4 divides; over 3 it does not
    with pytest.raises(SbpflowError, match=r"split S\(0\): its 20 over 4 ranks does not divide over 3"):
        replace_world(job, 3)
    assert S(0) in [t.sbp[0] for t in job.graph.tensors.values() if t.sbp]


def test_elastic_config_is_checked_and_crosses_the_wire(mlp: ModuleType) -> None:
    with pytest.raises(SbpflowError, match=r"elastic=\(2, 2\): give distinct rank counts"):
        JobConfig(elastic=(2, 2))
    with pytest.raises(SbpflowError, match=r"elastic_grace=-1"):
        JobConfig(elastic_grace=-1)
    job = elastic(mlp.make_job(ranks=4), elastic=(2, 1), elastic_grace=7.5)
    back = wire.job_from_proto(wire.job_to_proto(job))
    assert (back.config.elastic, back.config.elastic_grace) == ((2, 1), 7.5)
    plain = wire.job_from_proto(wire.job_to_proto(mlp.make_job()))
    assert (plain.config.elastic, plain.config.elastic_grace) == ((), 30.0)


def test_submit_refuses_a_fallback_the_job_cannot_go_on_with(mlp: ModuleType, tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        m = JobManager(store, ManagerConfig(MANAGER_DEFAULTS.replace(backend="inprocess"), slots=4))
        m.start()
        try:
            for fallbacks, why in [
                ((3,), r"to 3 ranks .*: tensor .* its 32 over 4 ranks does not divide over 3"),
                ((2, 4), r"to 4 ranks .*: the job is placed on 4 ranks: a fallback goes on with fewer"),
            ]:
                job = elastic(mlp.make_job(ranks=4, batch_size=32), elastic=fallbacks)
                with pytest.raises(ValidationError, match=why) as refused:
                    m.submit(wire.job_to_proto(job).SerializeToString())
                assert refused.value.field == "job.config.elastic"
            assert store.list() == []  # nothing stored
            ok = m.submit(
                wire.job_to_proto(elastic(mlp.make_job(ranks=4), elastic=(2, 1))).SerializeToString()
            )
            assert ok.job_proto  # admitted (it runs on, in process)
        finally:
            m.shutdown()


def test_replan_reserves_the_same_ranks_first_then_the_fallbacks(mlp: ModuleType) -> None:
    job = elastic(mlp.make_job(ranks=4, batch_size=24), elastic=(3, 2), elastic_grace=5)
    compiled: Compiled = pipeline.compile(job)
    asked: list[tuple[int, float]] = []

    def holds(n: int) -> Any:
        def reserve(key: tuple[int, ...], seconds: float) -> Any:
            asked.append((len(key), seconds))
            return f"group of {len(key)}" if len(key) <= n else None

        return reserve

    same = replan(compiled, holds(4))
    assert same is not None and same.compiled is compiled and same.change == "" and asked == [(4, 5)]
    asked.clear()
    three = replan(compiled, holds(3))
    assert three is not None and three.group == "group of 3" and asked == [(4, 5), (3, PLACE_SECONDS)]
    assert "re-planned from 4 ranks to 3 ([0, 1, 2, 3] -> [0, 1, 2]" in three.change
    assert list(three.compiled.device_types()) == [0, 1, 2]
    with pytest.raises(ElasticError, match=r"2 ranks: the cluster cannot hold them"):
        replan(compiled, holds(1))
    assert replan(pipeline.compile(mlp.make_job(ranks=4)), holds(0)) is None  # no fallbacks: as ever


def tenant() -> Any:
    """Another tenant of the cluster: a task that holds 2 CPUs until cancelled. Queued at the raylet, it
    gets them the moment a failed attempt's group gives them back, before any new placement group."""
    import ray

    return ray.remote(num_cpus=2)(lambda: time.sleep(3600)).remote()


def leave(ref: Any) -> None:
    import ray

    ray.cancel(ref, force=True)


def kill_after_checkpoint(
    store: JobStore, root: Path, job_id: str, rank: int, step: int, done: dict[str, Any]
) -> None:
    """Once ``job_id``'s checkpoint at ``step`` is complete and the control plane has the losses up to it
    (a restart goes on from no later checkpoint): another tenant asks for 2 of the session Ray's CPUs (it
    waits: the job holds all 4), then rank ``rank``'s worker is SIGKILLed."""
    import ray

    until(lambda: (c := ck_read.latest(root / job_id)) is not None and c.step >= step, "a checkpoint", 120)
    until(lambda: store.get(job_id).step >= step, f"step {step}'s loss", 120)
    done["tenant"] = tenant()
    info = ray.get(ray.get_actor(f"sbpflow-{job_id}-a1-r{rank}").info.remote())
    os.kill(info["pid"], signal.SIGKILL)
    done["pid"] = info["pid"]


def test_dp4_loses_a_worker_and_goes_on_dp2_from_its_checkpoint(
    ray_local: str, mlp: ModuleType, tmp_path: Path
) -> None:
    job = elastic(dp(mlp, 4), elastic=(2,), elastic_grace=3.0)
    root = tmp_path / "ckpt"
    done: dict[str, Any] = {}
    with JobStore(tmp_path / "jobs.db") as store:
        config = ManagerConfig(
            run=MANAGER_DEFAULTS.replace(ray_address=ray_local, max_restarts=1),
            slots=4,
            checkpoint_root=str(root),
            keep_run_results=True,
        )
        m = JobManager(store, config)
        m.metrics = Metrics(store, m.workers)
        m.start()
        try:
            rec = m.submit(wire.job_to_proto(job).SerializeToString())
            killer = threading.Thread(
                target=kill_after_checkpoint, args=(store, root, rec.id, 3, KILL_AFTER, done)
            )
            killer.start()
            until(lambda: store.get(rec.id).attempt == 2, "attempt 2", 180)
            until(lambda: m.used_slots <= 2, "the DP 2 attempt's 2 slots, not 4", 60)  # 2 for other jobs
            metrics = m.metrics.exposition().decode()  # while the job is in flight
            until(lambda: store.get(rec.id).state.terminal, "the job's end", 300)
            killer.join()
        finally:
            if "tenant" in done:
                leave(done["tenant"])
            m.shutdown()
        final = store.get(rec.id)
        events = store.events(rec.id)
        workers = store.workers(rec.id)
    assert final.state == JobState.SUCCEEDED, final.message
    (moved,) = [e for e in events if e.reason == ELASTIC_RESUME]
    assert moved.state == JobState.STARTING and moved.data["attempt"] == 2
    assert "rank 3" in moved.message and f"pid {done['pid']}" in moved.message
    assert "not back within 3 s: re-planned from 4 ranks to 2 ([0, 1, 2, 3] -> [0, 1]" in moved.message
    at = int(moved.message.split("resumes from step ")[1].split(";")[0].split()[0])
    assert at >= KILL_AFTER and at % EVERY == 0
    assert sorted(w.rank for w in workers) == [0, 1]  # the job's last attempt ran on 2 ranks
    assert f'sbpflow_job_attempt{{job_id="{rec.id}",name="{rec.name}"}} 2.0' in metrics
    got = m.run_results[rec.id].losses
    assert len(got) == STEPS and m.run_results[rec.id].attempts == 2

    ref = tmp_path / "ref"
    dp4 = sf.run(job, backend="inprocess", checkpoint_dir=str(ref)).losses
    switched = sf.run(dp(mlp, 2), backend="inprocess", resume_from=str(step_dir(ref, at))).losses
    np.testing.assert_allclose(got[:at], dp4[:at], rtol=1e-12, atol=0)
    np.testing.assert_allclose(got[at:], switched, rtol=1e-12, atol=0)
    # the same global batch: DP 4's losses too, to 1e-12 of the loss's scale (trained this long the loss
    # reaches ~1e-7, where the reduction order's last bits, 4 ranks then 2, show as 1e-11 relative)
    np.testing.assert_allclose(got, dp4, rtol=1e-12, atol=1e-12 * dp4[0])


def test_with_its_ranks_back_the_job_grows_again_at_the_next_checkpoint(
    ray_local: str, mlp: ModuleType, tmp_path: Path
) -> None:
    """DP 4 -> DP 2 as above (through ``sf.run``, the example's small MLP), then the tenant leaves as
    attempt 2 begins: the cluster has room for the job's own 4 ranks again, and the first checkpoint after
    that takes it back to DP 4 (attempt 3, ELASTIC_GROW), its losses still an uninterrupted run's."""
    import ray

    steps, every = 3000, 20  # ~3 ms a step: attempt 2 must outlast the reports' second of lag
    job = elastic(as_float64(mlp.make_job(ranks=4, steps=steps)), checkpoint_every=every)
    job = elastic(job, elastic=(2,), elastic_grace=3.0)
    root = tmp_path / "ckpt"
    attempts: list[tuple[int, int, str, str]] = []
    other: list[Any] = []

    def on_step(s: Any) -> None:
        if (
            s.step >= 2 * every
            and not other
            and (c := ck_read.latest(root)) is not None
            and c.step >= 2 * every
        ):
            other.append(tenant())
            info = ray.get(ray.get_actor("sbpflow-grow-a1-r3").info.remote())
            os.kill(info["pid"], signal.SIGKILL)

    def on_attempt(*a: Any) -> None:
        attempts.append(a)
        if a[0] == 2:  # the tenant leaves as the job goes on with 2 ranks
            threading.Timer(0.5, leave, (other[0],)).start()

    try:
        got = sf.run(
            job, job_id="grow", ray_address=ray_local, checkpoint_dir=str(root), max_restarts=1,
            on_step=on_step, on_attempt=on_attempt, timeout=600,
        )  # fmt: skip
    finally:
        for ref in other:  # gone already unless the job never reached attempt 2
            with contextlib.suppress(Exception):
                leave(ref)
    assert [(a, reason) for a, _, reason, _ in attempts] == [(2, ELASTIC_RESUME), (3, ELASTIC_GROW)], attempts
    assert attempts[1][3].startswith("its own ranks are back: [0, 1, 2, 3]; attempt 3 resumes from step")
    assert attempts[1][1] >= attempts[0][1] and attempts[1][1] % every == 0
    assert got.attempts == 3 and len(got.losses) == steps
    # the uninterrupted run on one device, the same global batch: 4 s where DP 4 on in-process ranks takes
    # ~30 s; to 1e-12 of the loss's scale, as above (DP 2 or 4 against one device: 6.3e-13 relative at
    # losses of ~4e-7, 1.5e-4 of this bound)
    want = sf.run(as_float64(mlp.make_job(ranks=1, steps=steps)), backend="inprocess").losses
    np.testing.assert_allclose(got.losses, want, rtol=1e-12, atol=1e-12 * want[0])
