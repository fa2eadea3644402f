"""The worker: one process per device, a Ray actor that runs its rank's part of a plan.

The scheduler (:mod:`sbpflow.control_plane.launch.ray_backend`) creates one :class:`Worker` per rank inside a
placement group, then drives it in three calls:

1. ``endpoint()`` — where this rank's data plane listens (the scheduler gathers every rank's);
2. ``setup(plan, steps, endpoints, ranks=...)`` — connect the data plane to every peer (``endpoints[i]``
   is rank ``ranks[i]``'s) and build the rank's actors from the plan: the rank's own part of it (its
   DevicePlan, its communicators and the compiled job, as protobuf data, never code);
3. ``run(timeout)`` — run the actor engine to the end and return a :class:`WorkerOutcome`: this rank's
   fetched losses, or the failure (rank, actor, op, cause) — failures are values, not Ray exceptions, so
   the driver can name them exactly.

``abort(reason)`` may come at any time from another thread of the actor (it has several), and stops the
engine and the transport; so does a ``ReportAck`` with ``cancel`` set. While it runs, the worker sends
``WorkerReport`` protobufs to the control plane's WorkerService — each step, a heartbeat when idle, its
error, done — from a background thread, so a slow control plane never stalls a step.

The class is plain Python; :func:`remote_class` wraps it for Ray, so this module imports without Ray.
"""

from __future__ import annotations

import functools
import os
import resource
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sbpflow.actor_workers import step_reports as progress
from sbpflow.actor_workers.report_sender import Reporter
from sbpflow.actor_workers.runtime import heap, threads
from sbpflow.device import asnumpy
from sbpflow.runs.numerics import non_finite_parameters
from sbpflow.v1 import plan_pb2 as pp
from sbpflow.v1 import service_pb2 as sp

if TYPE_CHECKING:
    from sbpflow.actor_workers.execution.segments import Evaluation


@dataclass(frozen=True)
class WorkerFailure:
    """Why a worker's run stopped: the parts of a RuntimeFailure, as plain data."""

    rank: int
    actor: str | None
    op: str | None
    cause_type: str
    cause: str
    traceback: str = ""
    iteration: int | None = None


@dataclass(frozen=True)
class WorkerOutcome:
    """What ``run`` returns: this rank's losses per step (when it holds the loss), timings, or the failure."""

    rank: int
    losses: dict[int, Any] = field(default_factory=dict)  # step -> this rank's share of the loss
    seconds: float = 0.0
    acts: int = 0
    peak_rss_bytes: int = 0
    trace: list[Any] = field(default_factory=list)
    failure: WorkerFailure | None = None
    non_finite: list[str] = field(default_factory=list)  # parameters whose shard holds NaN or inf
    # (fetch, micro-batch) -> step -> this rank's share: the job's fetches but the loss
    fetched: dict[tuple[str, int], dict[int, Any]] = field(default_factory=dict)


class Worker:
    """One rank of one job attempt; a warm pool's worker (``control_plane/launch/worker_pool.py``) serves one job
    attempt after another: ``release`` after a run, ``assign`` before the next."""

    def __init__(
        self,
        job_id: str,
        attempt: int,
        rank: int,
        report_address: str = "",
        credential: str = "",
        host: str | None = None,
        host_id: str | None = None,
        shared_memory: bool = True,
        device_type: str = "cpu",
    ) -> None:
        from sbpflow.actor_workers.planes import PLANES

        cpus = _assigned_cpus()
        if cpus is not None:  # a Ray worker: BLAS on its slots, so workers sharing a host don't oversubscribe
            threads.pin(threads.slot_threads(cpus))
        # one CPU: the data loads act on the compute thread, whose core a data thread would only share
        self.data_on_compute = device_type == "cpu" and cpus is not None and threads.slot_threads(cpus) == 1
        self.worker_id = _actor_id()
        node_ip, node_id = _node()
        self.host = host or node_ip
        if device_type not in PLANES:
            raise ValueError(f"device type {device_type!r} has no data plane; use one of {sorted(PLANES)}")
        self._make_plane = functools.partial(PLANES[device_type], host=self.host, host_id=host_id or node_id,
                                             shared_memory=shared_memory)  # fmt: skip
        self._lock = threading.Lock()
        self.plane: Any = None
        self.rank = rank
        self.assign(job_id, attempt, rank, report_address, credential)

    def assign(
        self, job_id: str, attempt: int, rank: int, report_address: str = "", credential: str = ""
    ) -> None:
        """Serve rank ``rank`` of ``(job_id, attempt)`` next: a data plane for that rank (a released
        worker's fresh one is kept when the rank is the same) and a reporter with the attempt's credential."""
        if self.plane is None or rank != self.rank:
            self._close_plane()
            self.plane = self._make_plane(rank)
        self.rank = rank
        old = getattr(self, "reporter", None)
        if old is not None:
            old.close(0.0)
        self.reporter = Reporter(
            report_address, job_id, attempt, rank, self.worker_id, credential, self.abort, self.host
        )
        self._engine: Any = None
        self._program: Any = None
        self._writers: list[Any] = []
        self._aborted: str | None = None

    def release(self) -> dict[str, Any]:
        """After a run, back to idle for a warm pool: the job's actors and connections go, and a fresh
        data plane listens for the same rank (the next job of the same shape reuses it); returns ``info``."""
        self._close_plane()
        with self._lock:
            self._engine = self._program = None
            self._writers = []
        self.plane = self._make_plane(self.rank)
        return self.info()

    def _close_plane(self) -> None:
        if self.plane is not None and self.plane.transport is not None:
            self.plane.transport.close()

    def endpoint(self) -> Any:
        """What this rank's peers need to reach its data plane (None where the plane needs nothing)."""
        return self.plane.address()

    def info(self) -> dict[str, Any]:
        """Who and where this worker is (for status and for tests that kill it)."""
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "worker_id": self.worker_id,
            "host": self.host,
        }

    def setup(
        self,
        plan_bytes: bytes,
        steps: int,
        endpoints: Sequence[Any],
        timeout: float = 60.0,
        trace: bool = False,
        uids: Any = None,
        start: Any = None,
        ranks: Sequence[int] | None = None,
        data_roots: tuple[str, ...] | None = None,
        evaluation: Evaluation | None = None,
    ) -> None:
        """Connect to every peer, then build this rank's actors from the plan (``data_roots``: the control
        plane's, checked on each data file as opened). ``evaluation``: this rank's eval plan, run on its
        live parameters after every ``evaluation.every`` steps (:mod:`.execution.segments`). ``start`` (a
        :class:`~sbpflow.actor_workers.snapshots.Start`): the first step, where the variables start
        from, and where to checkpoint. ``ranks``: the world's ranks, in the order of ``endpoints``
        (default: the plan's devices, for a plan that holds every rank's)."""
        from sbpflow.actor_workers import snapshots as checkpointing
        from sbpflow.actor_workers.execution import executor
        from sbpflow.actor_workers.execution.segments import first_steps

        start = start or checkpointing.Start()
        plan = pp.Plan.FromString(plan_bytes)
        world = [d.rank for d in plan.devices] if ranks is None else list(ranks)
        transport = self.plane.connect(endpoints, world, uids, timeout)
        self._program = executor.build(
            plan,
            first_steps(start.first_step, steps, evaluation),
            {self.rank: transport},
            ranks=(self.rank,),
            xp=self.plane.xp,
            first_step=start.first_step,
            source=checkpointing.source_for(start.resume_from, start.init_from),
            data_roots=data_roots,
        )
        rp = self._program.ranks[self.rank]
        loss = self._program.loss
        self._loss = loss

        progress.watch_steps(
            rp.context,
            _device(plan, self.rank),
            loss,
            lambda step, value, seconds, scaling: self.reporter.send(
                # a checkpoint step's report goes at once (report_sender.py): restarts reach the latest one
                start.checkpoint is not None and start.checkpoint.due(step),
                step=progress.step_report(step, value, seconds, scaling),
            ),
        )
        self._writers = checkpointing.attach_all(
            start.checkpoint, self._program, plan, range(start.first_step, start.first_step + steps)
        )
        self._run_as = (plan, steps, start.first_step, evaluation, trace, data_roots)

    def run(self, timeout: float) -> WorkerOutcome:
        """Run to the end; a failure comes back as ``WorkerOutcome.failure``, after the peers are told."""
        from sbpflow.actor_workers.runtime.errors import RuntimeFailure

        if self._program is None:
            raise RuntimeError(f"rank {self.rank}: call setup() before run()")
        self.reporter.send(log=sp.LogLine(rank=self.rank, level="INFO", text=f"rank {self.rank} running"))
        from sbpflow.actor_workers.snapshots import close_all

        try:
            try:
                with heap.frozen():  # the collector walks what the steps make (heap.py)
                    result = self._segments(timeout)
            except RuntimeFailure:
                close_all(self._writers, raise_errors=False)
                raise
            try:
                close_all(self._writers)  # the last checkpoint is on disk before the rank reports done
            except Exception as exc:  # noqa: BLE001 - a failed write fails the rank, named
                raise RuntimeFailure(self.rank, None, None, exc) from exc
        except RuntimeFailure as f:
            failure = WorkerFailure(
                self.rank if f.rank is None else f.rank,
                f.actor,
                f.op,
                type(f.cause).__name__,
                str(f.cause),
                "".join(traceback.format_exception(f.cause)),
                f.iteration,
            )
            self.reporter.send(
                error=sp.ErrorReport(
                    op_name=f.actor or "",
                    op_type=f.op or "",
                    cause=f"{failure.cause_type}: {failure.cause}",
                    traceback=failure.traceback,
                )
            )
            self.reporter.close()
            return WorkerOutcome(self.rank, failure=failure, peak_rss_bytes=_peak_rss())
        rc = self._program.ranks[self.rank].context
        losses = (
            {s: asnumpy(v) for s, v in rc.fetched.get((self._loss, -1), {}).items()} if self._loss else {}
        )
        bad = non_finite_parameters(rc.tables.tensors, rc.store)  # isfinite per shard: nothing gathered
        fetched = {
            key: {s: asnumpy(v) for s, v in values.items()}
            for key, values in rc.fetched.items()
            if key[0] != self._loss
        }
        self.reporter.send(memory=sp.MemoryReport(peak_bytes=_peak_rss()))
        self.reporter.send(done=sp.Done())
        self.reporter.close()
        return WorkerOutcome(
            self.rank,
            losses,
            result.seconds,
            result.acts,
            _peak_rss(),
            result.trace,
            non_finite=bad,
            fetched=fetched,
        )

    def _segments(self, timeout: float) -> Any:
        """Train (and evaluate between segments, :mod:`.execution.segments`) to the end; this rank's result."""
        from sbpflow.actor_workers.execution import executor, segments

        plan, steps, first_step, evaluation, trace, data_roots = self._run_as
        left = segments.Clock(timeout)

        def run_engines(ranks: Sequence[Any]) -> dict[int, Any]:
            (rp,) = ranks
            with self._lock:
                engine = self._engine = executor.engine(rp, trace=trace, data_on_compute=self.data_on_compute)
                if self._aborted is not None:
                    engine.abort(self._aborted)
            engine.add_abort_hook(self.plane.transport.abort)
            return {rp.rank: engine.run(left())}

        def on_eval(rank: int, step: int, shares: list[float]) -> None:
            self.reporter.send(eval=sp.EvalReport(step=step, losses=shares))

        program = self._program
        results = segments.run(program, plan, steps, first_step, evaluation, run_engines, on_eval, data_roots)
        return results[self.rank]

    def shards(self, names: Sequence[str]) -> dict[str, Any]:
        """This rank's shard of each variable in ``names`` that it holds."""
        store = self._program.ranks[self.rank].context.store
        return {n: asnumpy(store[n]) for n in names if n in store}

    def abort(self, reason: str) -> None:
        with self._lock:
            self._aborted = reason
            engine = self._engine
        if engine is not None:
            engine.abort(reason)
        if self.plane.transport is not None:
            self.plane.transport.abort(reason)

    def close(self) -> None:
        if self.plane.transport is not None:
            self.plane.transport.close()


def _device(plan: pp.Plan, rank: int) -> pp.DevicePlan:
    return next(d for d in plan.devices if d.rank == rank)


def _peak_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _node() -> tuple[str, str | None]:
    """This process's node address and id under Ray (loopback and None outside it)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address(), str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - not inside Ray
        pass
    return "127.0.0.1", None


def _assigned_cpus() -> float | None:
    """The CPUs Ray gave this actor (its bundle), or None outside a Ray actor."""
    try:
        import ray

        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is None:
            return None
        return float(ctx.get_assigned_resources().get("CPU", 0.0))
    except Exception:  # noqa: BLE001 - not inside Ray (a test builds a Worker directly)
        return None


def _actor_id() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_actor_id() or "")
    except Exception:  # noqa: BLE001 - not inside Ray (a test builds a Worker directly)
        return f"pid-{os.getpid()}"


@functools.cache
def remote_class() -> Any:
    """:class:`Worker` as a Ray actor class (several threads, so ``abort`` runs beside ``run``)."""
    import ray

    return ray.remote(max_concurrency=4)(Worker)  # type: ignore[call-overload]
