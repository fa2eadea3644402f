"""A warm pool of Ray workers: the placement group and worker actors of one job attempt, kept after it
succeeds for the next job of the same shape, so that job starts without a new placement group and new
worker processes (their start-up, imports and data planes).

    pool = WorkerPool(PoolConfig(max_workers=8, idle_seconds=300))
    install(pool)                           # the scheduler takes from it; one pool per process (Ray's)
    group = pool.acquire(key, respawn)      # an idle group of that shape, dead actors replaced; or None
    pool.release(group)                     # after a clean run: idle again, for at most idle_seconds
    uninstall(pool); pool.close()           # every idle actor killed, every placement group removed

Rules:
- a group's **key** is its bundles' device types in rank order (``(cpu, cpu)``): a job of that shape
  reuses the whole group, so its ranks keep the packing the placement group gave them;
- only a group whose attempt ran to the end cleanly comes back (a failed, cancelled or timed-out attempt
  kills its workers, as without a pool); each worker is :meth:`Worker.release`d first, which drops the
  job's actors and connections and opens a fresh data plane for the same rank;
- at acquire every worker is pinged; one that died is replaced in its bundle by ``respawn`` (the bundle
  stays reserved), one that does not answer makes the group go;
- at most ``max_workers`` idle workers are kept (the oldest groups go first), and an idle group goes after
  ``idle_seconds`` (a timer looks at least every :data:`SWEEP_SECONDS`);
- an idle group holds its CPUs or GPUs in Ray: before a job of another shape places a new group,
  :meth:`WorkerPool.make_room` removes idle groups (oldest first) until the cluster has what it needs.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sbpflow.errors import SbpflowError

SWEEP_SECONDS = 5.0  # the expiry timer's period (at most)
PING_SECONDS = 10.0  # an idle worker that does not answer a ping within this is dropped with its group
RELEASE_SECONDS = 10.0

Key = tuple[int, ...]  # the device type (jp.DeviceType) of each bundle, in rank order
Respawn = Callable[["WarmGroup", int], Any]  # (group, bundle index) -> a new worker actor in that bundle


@dataclass(frozen=True)
class PoolConfig:
    """How many idle workers a pool keeps, and for how long."""

    max_workers: int = 8
    idle_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.max_workers < 0:
            raise SbpflowError(f"max_workers={self.max_workers}: give 0 (no pool) or more idle workers")
        if not self.idle_seconds > 0:
            raise SbpflowError(
                f"idle_seconds={self.idle_seconds}: give how long an idle worker is kept (> 0)"
            )


@dataclass
class WarmGroup:
    """A placement group and its worker actors (by bundle index); ``resources`` what it holds in Ray."""

    key: Key
    pg: Any
    workers: list[Any]
    resources: dict[str, float]
    idle_since: float = 0.0
    jobs: int = 0  # attempts it has served
    respawned: int = 0  # dead workers replaced in it
    info: list[dict[str, Any]] = field(default_factory=list)  # each worker's last ``info()``


class WorkerPool:
    """Idle warm groups by key (see the module's rules)."""

    def __init__(self, config: PoolConfig = PoolConfig()) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._idle: list[WarmGroup] = []  # oldest first
        self._closed = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="sbpflow-worker-pool", daemon=True)
        self._sweeper.start()

    @property
    def idle_workers(self) -> int:
        with self._lock:
            return sum(len(g.workers) for g in self._idle)

    def idle_groups(self) -> list[WarmGroup]:
        with self._lock:
            return list(self._idle)

    def acquire(self, key: Key, respawn: Respawn) -> WarmGroup | None:
        """An idle group of shape ``key`` with every worker alive (dead ones replaced), or None."""
        while True:
            with self._lock:
                group = next((g for g in self._idle if g.key == key), None)
                if group is None:
                    return None
                self._idle.remove(group)
            if _revive(group, respawn):
                group.jobs += 1
                return group
            destroy(group)

    def release(self, group: WarmGroup) -> None:
        """Keep ``group`` idle after a clean run (its workers released first), within the bounds."""
        import ray

        if self._closed.is_set() or len(group.workers) > self.config.max_workers:
            destroy(group)
            return
        try:
            group.info = ray.get([w.release.remote() for w in group.workers], timeout=RELEASE_SECONDS)
        except Exception:  # noqa: BLE001 - a worker that cannot be released is not kept
            destroy(group)
            return
        group.idle_since = time.monotonic()
        with self._lock:
            self._idle.append(group)
            evicted = self._over_bound()
        for g in evicted:
            destroy(g)

    def make_room(self, needed: dict[str, float], available: Callable[[], dict[str, float]]) -> None:
        """Remove idle groups, oldest first, until ``available()`` holds ``needed`` (or none is left)."""
        while not all(available().get(k, 0.0) >= v for k, v in needed.items()):
            with self._lock:
                if not self._idle:
                    return
                oldest = self._idle.pop(0)
            destroy(oldest)
            _wait_freed(oldest.resources, needed, available)

    def expire(self, now: float | None = None) -> int:
        """Remove the groups idle for longer than ``idle_seconds``; returns how many went."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [g for g in self._idle if now - g.idle_since >= self.config.idle_seconds]
            self._idle = [g for g in self._idle if g not in old]
        for g in old:
            destroy(g)
        return len(old)

    def close(self) -> None:
        """Kill every idle worker and remove its placement group; later releases destroy their group."""
        self._closed.set()
        with self._lock:
            idle, self._idle = self._idle, []
        for g in idle:
            destroy(g)

    def _over_bound(self) -> list[WarmGroup]:
        out = []
        while self._idle and sum(len(g.workers) for g in self._idle) > self.config.max_workers:
            out.append(self._idle.pop(0))
        return out

    def _sweep(self) -> None:
        period = min(SWEEP_SECONDS, self.config.idle_seconds / 2)
        while not self._closed.wait(period):
            self.expire()


def _revive(group: WarmGroup, respawn: Respawn) -> bool:
    """Ping every worker; replace the dead ones in their bundles. False: the group cannot be used."""
    import ray

    refs = [w.info.remote() for w in group.workers]
    for i, ref in enumerate(refs):
        try:
            group.info[i:i + 1] = [ray.get(ref, timeout=PING_SECONDS)]  # fmt: skip
        except ray.exceptions.RayActorError:
            try:
                ray.kill(group.workers[i], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            group.workers[i] = respawn(group, i)
            group.respawned += 1
        except Exception:  # noqa: BLE001 - hung or unreachable: not worth keeping
            return False
    return True


def destroy(group: WarmGroup) -> None:
    """Kill a group's workers and remove its placement group (what is already gone is skipped)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for w in group.workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    group.workers = []
    if group.pg is not None:
        try:
            remove_placement_group(group.pg)
        except Exception:  # noqa: BLE001 - already removed
            pass
        group.pg = None


def _wait_freed(freed: dict[str, float], needed: dict[str, float], available: Callable[[], Any]) -> None:
    """Ray frees a removed group's resources asynchronously: wait (briefly) until they show."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        have = available()
        if all(have.get(k, 0.0) >= min(v, needed.get(k, v)) for k, v in freed.items()):
            return
        time.sleep(0.02)


def resources_of(bundles: Sequence[dict[str, float]]) -> dict[str, float]:
    """The total of a list of bundles (``{"CPU": 1.0}`` each, say)."""
    return dict(sum(map(Counter, bundles), Counter()))


# ---- the process's pool (Ray is one per process too) --------------------------------------------------

_INSTALLED: list[WorkerPool] = []


def install(pool: WorkerPool) -> None:
    """Make ``pool`` the one the scheduler uses; refuses a second while one is installed."""
    if _INSTALLED:
        raise SbpflowError(
            "a warm worker pool is already installed in this process (one per Ray session); uninstall it "
            "first, or run the second control plane in its own process"
        )
    _INSTALLED.append(pool)


def uninstall(pool: WorkerPool) -> None:
    if pool in _INSTALLED:
        _INSTALLED.remove(pool)


def installed() -> WorkerPool | None:
    """The pool the scheduler takes workers from, or None (every attempt starts its own)."""
    return _INSTALLED[0] if _INSTALLED else None
