"""The checkpoints a job of the job manager goes on from: after a control-plane restart
(:func:`resumable`) and at the start of each run (:func:`run_checkpoints`).

A job's own latest intact checkpoint (an earlier attempt's) comes first, then the one a Resume started
it from (:func:`sbpflow.control_plane.service.resume.start_checkpoint`); a corrupt one is passed over, saying so.
Its own are taken no later than the job's last stored step (``rec.step``): a control plane that stopped
with reports in flight never stored the losses of the steps after it, so those steps train again and
the job's loss history stays whole.

A client reads a job's checkpoints through the server (:func:`listed`, :func:`chunks`: the
ListCheckpoints and ReadCheckpoint calls), so ``sbpflow export`` needs no disk shared with it.

Whether the checkpoint root takes writes at all is :class:`StorageProbe`'s: the manager is not ready
(``/readyz`` 503, saying why) from a run's failed checkpoint write (``CHECKPOINT_STORAGE_*``) or a
failed probe until a probe writes there again; it probes at start and at most every
:data:`PROBE_SECONDS` as it is asked.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sbpflow.checkpoint.read import CheckpointInfo, CorruptCheckpoint, corrupt_note, list_checkpoints
from sbpflow.checkpoint.write import CheckpointStorageError, make_dir, storage_error
from sbpflow.control_plane.service import resume as resuming
from sbpflow.control_plane.store.job_store import JobStore, Resumable
from sbpflow.control_plane.store.schema import JobRecord
from sbpflow.errors import SbpflowError
from sbpflow.v1 import service_pb2 as sp

CHECKPOINT_CORRUPT = "CHECKPOINT_CORRUPT"  # a corrupt checkpoint was passed over for an earlier one
PROBE_SECONDS = 5.0  # at most one probe write to the checkpoint root in this long
PROBE_BYTES = 64 * 1024  # what a probe writes (and fsyncs, then removes)
CHUNK_BYTES = 1 << 20  # of a checkpoint file, in one ReadCheckpoint message


def _found(root: str | None, job_id: str) -> list[CheckpointInfo]:
    if root is None:
        raise SbpflowError(
            "this server keeps no checkpoints (it runs without --checkpoint-root); read them where the job "
            "ran, with --checkpoint-root"
        )
    return list_checkpoints(Path(root) / job_id)


def listed(root: str | None, job_id: str) -> sp.ListCheckpointsResponse:
    """Job ``job_id``'s complete checkpoints under ``root``, oldest first."""
    return sp.ListCheckpointsResponse(
        checkpoints=[
            sp.CheckpointInfo(step=c.step, bytes=c.bytes, name=c.path.name) for c in _found(root, job_id)
        ]
    )


def chunks(root: str | None, job_id: str, step: int) -> Iterator[sp.CheckpointChunk]:
    """The files of job ``job_id``'s checkpoint at ``step`` (0: its latest complete one), in chunks of
    :data:`CHUNK_BYTES`, file after file. Only regular files inside the folder are sent: a symlink there
    is not followed."""
    found = _found(root, job_id)
    pick = [c for c in found if c.step == step] if step else found[-1:]
    if not pick:
        steps = ", ".join(str(c.step) for c in found) or "none yet"
        raise SbpflowError(f"job {job_id} has no complete checkpoint at step {step}; it has: {steps}")
    folder = pick[0].path
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        name = path.relative_to(folder).as_posix()
        with open(path, "rb") as f:
            offset = 0
            while True:
                data = f.read(CHUNK_BYTES)
                if not data and offset:
                    break
                yield sp.CheckpointChunk(checkpoint=folder.name, file=name, offset=offset, data=data)
                offset += len(data)
                if len(data) < CHUNK_BYTES:
                    break


def resumable(root: str | None, rec: JobRecord) -> Resumable | None:
    """How a job left in flight by a previous control plane goes on: from its checkpoint, if it has one
    with steps left after it."""
    passed: list[CorruptCheckpoint] = []
    found = resuming.start_checkpoint(root, rec, passed.append, rec.step) if root is not None else None
    if found is None or found.step >= rec.total_steps:
        return None
    return Resumable(
        found.step,
        f"the job was {rec.state.name} at step {rec.step} when the control plane stopped; attempt "
        f"{rec.attempt + 1} resumes from its checkpoint {found.path} (step {found.step})"
        + "".join(f"; {corrupt_note(c, found.step)}" for c in passed),
    )


@dataclass(frozen=True)
class RunCheckpoints:
    """Where a run checkpoints (``checkpoint_dir``), the checkpoint it goes on from (``resume_from``,
    None: none) and that checkpoint's step (``step``, 0: none)."""

    checkpoint_dir: str | None = None
    resume_from: str | None = None
    step: int = 0


def run_checkpoints(root: str | None, store: JobStore, rec: JobRecord) -> RunCheckpoints:
    """A job's checkpoints for its run: where it checkpoints, and the checkpoint it goes on from: its own
    latest (an earlier attempt's, before a control-plane restart re-queued it), else the one a Resume
    started it from. Each corrupt checkpoint passed over gets a log line and a "reason" event."""
    if root is None:
        return RunCheckpoints()
    passed: list[CorruptCheckpoint] = []
    found = resuming.start_checkpoint(root, rec, passed.append, rec.step)
    if found is not None and found.step >= rec.total_steps:
        found = None
    for c in passed:
        note = corrupt_note(c, 0 if found is None else found.step)
        store.append_log(rec.id, -1, "WARNING", note)
        store.set_reason(rec.id, CHECKPOINT_CORRUPT, note)
    if found is None:
        return RunCheckpoints(str(resuming.job_dir(root, rec.id)))
    return RunCheckpoints(str(resuming.job_dir(root, rec.id)), str(found.path), found.step)


def probe(root: str) -> str:
    """'' when ``root`` takes a small write now, else why not and what to do."""
    path = Path(root) / f".sbpflow-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        make_dir(root)
        try:
            with open(path, "wb", buffering=0) as f:
                f.write(bytes(PROBE_BYTES))
                os.fsync(f.fileno())
        finally:
            path.unlink(missing_ok=True)
    except CheckpointStorageError as e:
        return str(e)
    except OSError as e:
        return str(storage_error(e, root))
    return ""


class StorageProbe:
    """Why the checkpoint root cannot take checkpoints now ('' when it can, or when there is none)."""

    def __init__(
        self, root: str | None, every: float = PROBE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.root, self.every, self.clock = root, every, clock
        self._problem, self._next = "", 0.0
        self._lock = threading.Lock()

    def failed(self, message: str) -> None:
        """A run's checkpoint write failed (``message``): not ready until a probe, ``every`` s on, passes."""
        with self._lock:
            self._problem, self._next = message, self.clock() + self.every

    def problem(self) -> str:
        """The last finding, probed again when it is older than ``every`` seconds."""
        if self.root is None:
            return ""
        with self._lock:
            if self.clock() >= self._next:
                self._problem, self._next = probe(self.root), self.clock() + self.every
            return self._problem
