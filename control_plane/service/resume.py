"""Resuming jobs on the control plane: which checkpoint a job goes on from, and whether a job — perhaps
re-traced under another layout — can start from it.

A job's checkpoints live in ``<checkpoint_root>/<job id>/`` (``ManagerConfig.checkpoint_root``). Rules:

- A job goes on from its own latest complete checkpoint; one that wrote none yet passes on the
  checkpoint it was started from (``JobRecord.resume_checkpoint``, set by a Resume call), so a chain of
  resumed jobs never loses the last checkpoint of the chain (:func:`start_checkpoint`). Where a run is
  about to start from it, every byte is checked first (``on_corrupt``): a corrupt or truncated latest
  checkpoint is passed over for the previous intact one, and ``on_corrupt`` is told.
- A Resume makes a *new job* linked to the old one (``resumed_from``): the old job keeps its state,
  history and checkpoints; the new one has its own id, events, attempts and checkpoint folder.
- The new job must hold exactly the checkpoint's model: every variable of the job after the compiler's
  graph passes (parameters and the optimizer state they make) is in the checkpoint with the same logical
  shape and dtype, and every parameter of the checkpoint is in the job. Only placement and SBP may
  change: a checkpoint is read slice by slice under any layout (:mod:`sbpflow.checkpoint`). A mismatch
  is a ``ValidationError`` (INVALID_ARGUMENT) naming each tensor (:func:`check_compatible`).
- A job that is not over yet, or that has no checkpoint, cannot be resumed: ``NotResumable``
  (FAILED_PRECONDITION), whose message says what to do instead; nor can one that another job, not yet
  ended, already resumes (the store's unique index decides between Resumes that race). A retried Resume
  (the same client id and idempotency key) returns the job the first one made (``JobManager.resume``).
"""

from __future__ import annotations

from pathlib import Path

from sbpflow.checkpoint.format import CheckpointError
from sbpflow.checkpoint.read import (
    CheckpointInfo,
    CheckpointReader,
    CorruptCheckpoint,
    OnCorrupt,
    latest,
    latest_intact,
    verify,
)
from sbpflow.control_plane.service.validation import ValidationError
from sbpflow.control_plane.store.schema import JobRecord
from sbpflow.errors import SbpflowError
from sbpflow.graph import TensorKind
from sbpflow.job import Job

VARIABLES = (TensorKind.parameter, TensorKind.optimizer_state, TensorKind.constant)
SHOWN = 8  # mismatches named in one message; the rest are counted


class NotResumable(SbpflowError):
    """A job that cannot be resumed now: it still runs, it has no checkpoint, or none are kept."""


def job_dir(root: str | Path, job_id: str) -> Path:
    """Where job ``job_id`` writes its checkpoints."""
    return Path(root) / job_id


def start_checkpoint(
    root: str | Path, rec: JobRecord, on_corrupt: OnCorrupt | None = None, at_most: int | None = None
) -> CheckpointInfo | None:
    """The checkpoint ``rec``'s job goes on from: its own latest complete one (of a step no later than
    ``at_most`` when given), else the one it started from; None when there is neither (or that one is
    gone or damaged). With ``on_corrupt``, each is verified (every byte read) and a corrupt one passed
    over and reported; without, only listed (cheap: for status)."""
    mine = job_dir(root, rec.id)
    own = latest(mine) if on_corrupt is None else latest_intact(mine, on_corrupt, at_most)
    if own is not None or not rec.resume_checkpoint:
        return own
    try:
        if on_corrupt is not None:
            verify(rec.resume_checkpoint)
        reader = CheckpointReader(rec.resume_checkpoint)
    except CheckpointError as exc:
        if on_corrupt is not None:
            on_corrupt(CorruptCheckpoint(CheckpointInfo(-1, Path(rec.resume_checkpoint), 0), exc))
        return None
    except (OSError, ValueError):
        return None
    return CheckpointInfo(reader.step, reader.path, sum(reader.manifest.files.values()))


def checkpoint_to_resume(
    root: str | None, rec: JobRecord, on_corrupt: OnCorrupt | None = None
) -> CheckpointInfo:
    """The checkpoint a Resume of ``rec``'s job starts from, or ``NotResumable`` saying why there is none."""
    if not rec.state.terminal:
        raise NotResumable(
            f"job {rec.id} is {rec.state.name}; only a job that has ended can be resumed: cancel it first "
            f"(`sbpflow cancel {rec.id}`) or wait for it to end"
        )
    if root is None:
        raise NotResumable(
            "this control plane keeps no checkpoints; start it with --checkpoint-root DIR (and submit jobs "
            "with checkpoint_every > 0) to resume jobs"
        )
    found = start_checkpoint(root, rec, on_corrupt)
    if found is None:
        raise NotResumable(
            f"job {rec.id} has no complete checkpoint in {job_dir(root, rec.id)}: it stopped before its "
            "first checkpoint, or it does not checkpoint (set the job's checkpoint_every > 0); submit it "
            "again instead"
        )
    return found


def check_compatible(job: Job, reader: CheckpointReader) -> None:
    """Refuse (``ValidationError``) a job that cannot start from ``reader``'s checkpoint: another model
    (variables missing, extra parameters, other shapes or dtypes), or no step left to train."""
    from sbpflow.control_plane.compiler import pipeline

    graph = pipeline.compile(job, lower=False).state.graph
    variables = {d.name: d for d in graph.tensors.values() if d.kind in VARIABLES}
    stored = {t.name: t for t in reader.manifest.tensors}
    problems: list[str] = []
    for name, d in sorted(variables.items()):
        t = stored.get(name)
        if t is None:
            if d.kind is not TensorKind.constant:
                problems.append(f"the job's {d.kind.value} {name!r} {d.meta} is not in the checkpoint")
            continue
        if tuple(d.meta.shape) != tuple(t.shape) or d.meta.dtype.value != t.dtype:
            problems.append(
                f"{name!r} is {d.meta} in the job but [{', '.join(map(str, t.shape))}] {t.dtype} there"
            )
    for name, t in sorted(stored.items()):
        if t.kind == TensorKind.parameter.value and name not in variables:
            problems.append(f"the checkpoint's parameter {name!r} is not in the job")
    where = f"the checkpoint {reader.path} (step {reader.step})"
    if problems:
        more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise ValidationError(
            f"job {job.name!r} does not match {where}: {'; '.join(problems[:SHOWN])}{more}. Resume with "
            "the model that wrote it; only its layout (ranks, placement, tensor or data parallel) may change",
            kind="checkpoint",
            field="job.graph",
        )
    if job.config.steps <= reader.step:
        raise ValidationError(
            f"job {job.name!r} trains {job.config.steps} steps and {where} is past them: nothing is left to "
            f"train; give the job more steps (e.g. `sbpflow resume ID EXAMPLE --steps {reader.step * 2}`, or "
            f"`sbpflow run EXAMPLE --checkpoint-dir DIR --resume --steps {reader.step * 2}`)",
            kind="checkpoint",
            field="job.config.steps",
        )
