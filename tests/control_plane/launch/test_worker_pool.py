"""The warm worker pool on a real local Ray: a job on warm workers trains exactly as a cold run, on the
same worker processes; a warm worker that died is replaced in its bundle; the pool keeps at most its
bound of idle workers and gives an idle group's CPUs up to a job of another shape; idle workers expire;
a cancelled attempt's workers are not kept; through the control plane, the second job runs on the first
job's worker actors."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import sbpflow as sf
from sbpflow.client.client import Client
from sbpflow.control_plane.launch.launcher import RunCancelled
from sbpflow.control_plane.launch.worker_pool import PoolConfig, WorkerPool, install, installed, uninstall
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.service.test_server import LONG, start, until
from tests.examples.test_examples import load

pytestmark = pytest.mark.usefixtures("ray_local")
MLP = load("mlp")


@contextmanager
def pooled(**kw: Any) -> Iterator[WorkerPool]:
    pool = WorkerPool(PoolConfig(**kw))
    install(pool)
    try:
        yield pool
    finally:
        uninstall(pool)
        pool.close()


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    with pooled(max_workers=4, idle_seconds=300) as p:
        yield p


def pids(pool: WorkerPool) -> list[list[int]]:
    return [[i["pid"] for i in g.info] for g in pool.idle_groups()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run(ranks: int = 2, steps: int = 3, **kw: Any) -> list[float]:
    return sf.run(MLP.make_job(steps=steps, ranks=ranks), backend="ray", timeout=120, **kw).losses


def test_warm_workers_train_as_a_cold_run_and_a_dead_one_is_replaced(pool: WorkerPool) -> None:
    uninstall(pool)
    cold = run()  # no pool: workers of its own, gone after
    assert pool.idle_workers == 0
    install(pool)
    assert run() == cold and pool.idle_workers == 2
    first = pids(pool)
    assert run() == cold  # on the same processes
    assert pids(pool) == first and pool.idle_groups()[0].jobs == 1
    victim = first[0][1]
    os.kill(victim, signal.SIGKILL)
    until(lambda: not alive(victim), "the warm worker to die")
    assert run() == cold  # its bundle got a new worker
    (group,) = pool.idle_groups()
    assert group.respawned == 1 and pids(pool)[0][0] == first[0][0] and pids(pool)[0][1] != victim
    with pytest.raises(SbpflowError, match="already installed"):
        install(WorkerPool())


def test_the_pool_is_bounded_makes_room_and_expires() -> None:
    with pooled(max_workers=3, idle_seconds=300) as pool:
        run(ranks=2)
        run(ranks=1)  # another shape: 3 idle workers, at the bound
        assert sorted(len(g.workers) for g in pool.idle_groups()) == [1, 2]
        run(ranks=2)  # reuses the 2-rank group
        assert pool.idle_workers == 3
        held = [p for g in pids(pool) for p in g]
        run(ranks=4)  # the session's Ray has 4 CPUs: the idle groups must give theirs up
        assert pool.idle_workers == 0, "a 4-rank group is over the bound of 3: not kept"
        until(lambda: not any(alive(p) for p in held), "the evicted workers to exit")
    with pooled(max_workers=4, idle_seconds=0.5) as pool:
        run()
        held = [p for g in pids(pool) for p in g]
        until(lambda: pool.idle_workers == 0, "the idle group to expire", 15)
        until(lambda: not any(alive(p) for p in held), "the expired workers to exit")
    with pytest.raises(SbpflowError, match="idle_seconds=0"):
        PoolConfig(idle_seconds=0)


def test_a_cancelled_attempt_gives_no_workers_back(pool: WorkerPool) -> None:
    cancel = threading.Event()
    threading.Timer(8.0, cancel.set).start()
    with pytest.raises(RunCancelled):
        run(steps=LONG, cancel=cancel)
    assert pool.idle_workers == 0


def test_through_the_control_plane_the_next_job_runs_on_the_same_worker_actors(tmp_path: Path) -> None:
    assert installed() is None
    plane = start(tmp_path, run=MANAGER_DEFAULTS, slots=2, warm_workers=2)
    try:
        assert installed() is plane.pool
        with Client(plane.address) as c:
            ids = []
            for _ in range(2):
                final = c.submit(MLP.make_job(steps=3, ranks=2)).wait(timeout=120)
                assert sp.JobState.Name(final.state) == "JOB_STATE_SUCCEEDED", final.message
                ids.append([w.worker_id for w in final.workers])
        assert ids[0] == ids[1] and all(ids[0])
        t = time.monotonic()
    finally:
        plane.stop()
    assert installed() is None and time.monotonic() - t < 30
