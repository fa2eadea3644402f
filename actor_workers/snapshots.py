"""The runtime side of checkpoints: each rank snapshots at step boundaries and writes in the background,
and a rank's store starts from a checkpoint (any layout) or from a file of logical parameters.

Snapshot: every SINK ``assign`` act calls the ``RankContext.assign_hooks`` right after it stores the
new value. At a checkpoint step (``(step + 1) % every == 0``) the checkpointer copies the value then, in
the act, before the next step's optimizer kernel may update that buffer in place; once every variable
this rank assigns has come in for the step, the copies go to the rank's writer thread, which writes the
rank's file and completes the checkpoint if it is the last (:mod:`sbpflow.checkpoint`). Training goes on
while the bytes go to disk; a writer at most ``MAX_PENDING`` snapshots behind makes the act wait (memory
stays bounded). Only the replica that :func:`sbpflow.checkpoint.write.writes` picks copies a ``B`` tensor.

Restore: :func:`store_source` gives :func:`~sbpflow.actor_workers.execution.variables.init_store` each rank's
slice of each variable under the *new* layout, read from whichever files hold it.
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.actor_workers.execution.executor import Program
from sbpflow.actor_workers.execution.tasks import RankContext
from sbpflow.actor_workers.execution.variables import VARIABLE_KINDS, StoreSource
from sbpflow.checkpoint import write as ck
from sbpflow.checkpoint.format import CheckpointError
from sbpflow.checkpoint.read import CheckpointReader, TensorFile, open_tensors, prune
from sbpflow.device import asnumpy, is_device_array
from sbpflow.errors import SbpflowError
from sbpflow.graph import TensorDecl, TensorKind
from sbpflow.job import Job
from sbpflow.sharding import Index
from sbpflow.v1 import plan_pb2 as pp

MAX_PENDING = 2


@dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often a run checkpoints; ``token`` names the attempt (see :mod:`sbpflow.checkpoint`)."""

    directory: str
    every: int
    token: str
    ranks: tuple[int, ...]  # every rank of the plan: a checkpoint is complete when all have written
    job: str = ""
    seed: int = 0

    def due(self, step: int) -> bool:
        """Whether (0-based) ``step`` ends with a checkpoint."""
        return (step + 1) % self.every == 0


@dataclass(frozen=True)
class Start:
    """How one attempt's ranks start: at ``first_step``, variables from ``resume_from`` (a checkpoint) or
    parameters from ``init_from`` (a tensor file), checkpointing as ``checkpoint`` says (None: never)."""

    first_step: int = 0
    resume_from: str | None = None
    init_from: str | None = None
    checkpoint: CheckpointOptions | None = None


class CheckpointWriteError(SbpflowError):
    """A rank could not write its part of a checkpoint (disk full, permissions)."""


class RankCheckpointer:
    """One rank's snapshots and its background writer."""

    def __init__(self, options: CheckpointOptions, rc: RankContext, assigned: Sequence[str]) -> None:
        self.options, self.rc = options, rc
        self.decls = [
            d
            for d in rc.tables.tensors.values()
            if d.kind in VARIABLE_KINDS and d.placement is not None and rc.rank in d.placement.ranks
        ]
        self.mine = {
            d.name
            for d in self.decls
            if d.placement is not None
            and d.sbp is not None
            and ck.writes(d.name, d.placement, d.sbp, rc.rank)
        }
        self.assigned = frozenset(assigned)
        self.written: list[int] = []  # steps whose rank file this rank wrote
        self.error: BaseException | None = None
        self._pending: dict[int, dict[str, np.ndarray]] = {}
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, dict[str, np.ndarray]] | None] = queue.Queue(MAX_PENDING)
        self._thread = threading.Thread(target=self._loop, name=f"sbpflow-ckpt-r{rc.rank}", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        return self.options.due(step)

    def on_assign(self, name: str, step: int) -> None:
        """Called in the assign act: copy the value now (later acts may overwrite its buffer)."""
        if isinstance(self.error, ck.CheckpointStorageError):  # a full or read-only disk: stop the run now,
            raise self.error  # not at its end; its type names the job's reason (CHECKPOINT_STORAGE_*)
        if not self.due(step):
            return
        copy = None
        if name in self.mine:
            value = self.rc.store[name]
            copy = asnumpy(value) if is_device_array(value) else np.array(value, copy=True)
        with self._lock:
            snap = self._pending.setdefault(step, {})
            if copy is not None:
                snap[name] = copy
            self._counts[step] = self._counts.get(step, 0) + 1
            if self._counts[step] < len(self.assigned):
                return
            del self._counts[step]
            snap = self._pending.pop(step)
        self._queue.put((step, snap))

    def steps_without_assigns(self, first: int, last: int) -> None:
        """A rank that assigns nothing (frozen or constant state only) never sees a step end: queue its
        checkpoints of steps ``[first, last)`` at once; its values do not change."""
        if self.assigned:
            return
        for step in range(first, last):
            if self.due(step):
                self._queue.put((step, {}))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue
            step, snap = item
            try:
                self._write(step + 1, snap)
            except BaseException as exc:  # noqa: BLE001 - reported by close(), the run goes on
                self.error = exc

    def _write(self, done: int, snap: dict[str, np.ndarray]) -> None:
        o, rc = self.options, self.rc
        shards = []
        for d in self.decls:
            if d.name not in self.mine:
                continue
            assert d.placement is not None and d.sbp is not None
            value = snap[d.name] if d.name in snap else asnumpy(rc.store[d.name])
            shards.append(ck.shard_of(d.name, d.kind.value, value, d.placement, d.sbp, rc.rank, d.meta.shape))
        ck.write_rank(o.directory, done, rc.rank, o.token, shards)
        self.written.append(done)
        ck.try_complete(o.directory, done, o.token, o.ranks, o.job, o.seed)

    def close(self, timeout: float = 600.0) -> None:
        """Wait for the queued snapshots to be written; raise what a write raised."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CheckpointWriteError(
                f"rank {self.rc.rank}: checkpoint writer still busy after {timeout:.0f} s"
            )
        if isinstance(self.error, ck.CheckpointStorageError):  # its type names the job's reason
            raise self.error
        if self.error is not None:
            raise CheckpointWriteError(
                f"rank {self.rc.rank} could not write its checkpoint shards to {self.options.directory}: "
                f"{type(self.error).__name__}: {self.error}; check the directory is writable and has room"
            ) from self.error


def assigned_variables(device: pp.DevicePlan) -> list[str]:
    """The variables this rank's SINK tasks assign each step."""
    from sbpflow.codec import wire

    return [
        str(wire.attr_from_proto(t.attrs["assign"]))
        for t in device.tasks
        if t.kind == pp.TASK_KIND_SINK and "assign" in t.attrs
    ]


def attach(options: CheckpointOptions, rc: RankContext, device: pp.DevicePlan) -> RankCheckpointer:
    """A checkpointer for the rank of ``rc``, hooked after the assign hooks it already has."""
    cp = RankCheckpointer(options, rc, assigned_variables(device))
    rc.assign_hooks.append(cp.on_assign)
    return cp


# ---- restore ----------------------------------------------------------------------------------------------


def store_source(reader: CheckpointReader | TensorFile, strict: bool) -> StoreSource:
    """Each variable's slice from ``reader``. ``strict`` (a resume): every variable must be there;
    otherwise (an import of parameters) what the file lacks starts as the job would start it."""

    def source(decl: TensorDecl, index: Index) -> Any:
        if decl.name not in reader:
            if strict and decl.kind is not TensorKind.constant:
                raise CheckpointError(
                    f"the checkpoint at {reader.path} has no {decl.kind.value} {decl.name!r} {decl.meta}; "
                    "it was written by a different model: resume the job that wrote it, or import only "
                    "its parameters (init_from=)"
                )
            return None
        value = reader.read(decl.name, index)
        want = tuple(s.stop - s.start for s in index)
        if value.shape != want:
            raise CheckpointError(
                f"{decl.name!r}: {reader.path} holds a slice of shape {list(value.shape)} where the job's "
                f"{decl.meta} needs {list(want)}; the file is from a different model"
            )
        return value.astype(decl.meta.dtype.to_numpy(), copy=False)

    return source


def source_for(resume_from: str | None, init_from: str | None) -> StoreSource | None:
    """Where a run's variables start: a checkpoint (strict), a file of parameters, or the initializers."""
    if resume_from is not None:
        return store_source(CheckpointReader(resume_from), strict=True)
    if init_from is not None:
        return store_source(open_tensors(init_from), strict=False)
    return None


def options_for(job: Job, directory: str | None, plan: pp.Plan, attempt: int) -> CheckpointOptions | None:
    """The checkpoint options of one attempt of ``job`` (None: it does not checkpoint). Files left by
    attempts that died are pruned first (no writer of this job runs now)."""
    if directory is None or job.config.checkpoint_every <= 0:
        return None
    ck.make_dir(directory)
    prune(directory)
    token = f"a{attempt}-{secrets.token_hex(4)}"
    ranks = tuple(d.rank for d in plan.devices)
    return CheckpointOptions(
        str(directory), job.config.checkpoint_every, token, ranks, job.name, job.config.seed
    )


def attach_all(
    options: CheckpointOptions | None, program: Program, plan: pp.Plan, steps: range = range(0)
) -> list[RankCheckpointer]:
    """A checkpointer on every rank ``program`` builds (none when ``options`` is None), for ``steps``."""
    if options is None:
        return []
    devices = {d.rank: d for d in plan.devices}
    out = [attach(options, rp.context, devices[rank]) for rank, rp in program.ranks.items()]
    for w in out:
        w.steps_without_assigns(steps.start, steps.stop)
    return out


def close_all(writers: Sequence[RankCheckpointer], raise_errors: bool = True) -> None:
    """Flush every writer; the first write error is raised (unless the run failed anyway)."""
    errors = []
    for w in writers:
        try:
            w.close()
        except (CheckpointWriteError, ck.CheckpointStorageError) as exc:
            errors.append(exc)
    if errors and raise_errors:
        raise errors[0]
