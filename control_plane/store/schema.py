"""What the job store holds: the lifecycle, the records it returns, and the SQLite schema with its migrations.

The store (``store.py``) does the transactions; this module only says what the rows are. Schema
version 2 added, per job, the submitter (``client_id``, ``idempotency_key`` — a retried Submit with the
same pair returns the first job), ``total_steps`` and ``slots`` (devices it needs), and the tables
``workers`` (one row per rank), ``logs`` and ``results`` (the JobResult protobuf of a finished job).
Version 3 added ``resumed_from`` (the job whose checkpoint a resumed job started from) and
``resume_checkpoint`` (that checkpoint's path). Version 4 keeps non-finite losses: SQLite stores an
infinity in a REAL column but turns NaN into NULL, so ``losses.loss`` may be NULL, which there means NaN
(every row of ``losses`` has a loss), and ``jobs.loss_nan`` says that the job's last loss is NaN (its
``loss`` NULL then, which otherwise means no step yet). Version 5 keeps the latest evaluation on the
held-out split (``eval_step``, 0 before the first, and ``eval_loss``; NaN as NULL with ``eval_step``
set). Version 6 keeps the run options a client set for its job at Submit (``options``, a serialized
``sbpflow.v1.RunOptions``; empty: the server's), so a job re-queued after a restart runs under them
again. Version 7 makes Cancel durable and Resume single: ``cancel_requested`` holds a Cancel's message
from the moment it is asked ('' = none), so a restarted control plane ends the job CANCELLED instead
of resuming it, and the unique index ``jobs_live_resume`` lets at most one job in flight (or PENDING)
hold a given ``resumed_from``, so two Resumes of one job racing cannot both start from its checkpoint
(a version-6 file that already holds two is migrated keeping the first: the others end FAILED,
``DUPLICATE_RESUME``).
A file of an older version is migrated in place on open by ``MIGRATIONS[v]`` for each version
``v`` it is behind. The table ``loss_scaling`` (a dynamically loss-scaled job's scale after its last
step and its steps skipped so far) is created on open in a file of any version that lacks it, and read
through a LEFT JOIN, so an older file needs no migration and an older sbpflow ignores it; so is
``worker_usage`` (each worker process's CPU seconds and RSS as of its last report, kept after the job).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sbpflow.runs.states import IN_FLIGHT, JobState, WorkerState

SCHEMA_VERSION = 7


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    state: JobState
    reason: str
    message: str
    attempt: int
    step: int
    loss: float | None
    samples_per_second: float | None
    created: float
    updated: float
    started: float | None
    finished: float | None
    job_proto: bytes
    client_id: str = ""
    total_steps: int = 0
    slots: int = 0
    resumed_from: str = ""  # the job whose checkpoint this one started from ('' = a fresh job)
    resume_checkpoint: str = ""  # that checkpoint's path
    eval_step: int = 0  # the step of the latest evaluation on the held-out split (0: none yet)
    eval_loss: float | None = None  # its loss
    options: bytes = b""  # the sbpflow.v1.RunOptions the client set at Submit (b"": the server's)
    loss_scale: float | None = None  # dynamic loss scaling: the scale after the last step (None: none)
    skipped_steps: int = 0  # its steps skipped so far (a gradient held an inf or NaN)
    cancel_requested: str = ""  # a Cancel's message, stored before it is acknowledged ('' = none asked)


@dataclass(frozen=True)
class JobEvent:
    job_id: str
    seq: int
    time: float
    # "created", "state" (data: "from"; "attempt" and "step" when a new attempt began), "reason", "step",
    # "eval" (data: "step", "loss": a held-out evaluation)
    kind: str
    state: JobState
    reason: str
    message: str
    data: dict[str, object]


@dataclass(frozen=True)
class LossPoint:
    step: int
    loss: float
    samples_per_second: float
    time: float


@dataclass(frozen=True)
class WorkerRecord:
    job_id: str
    rank: int
    worker_id: str
    state: WorkerState
    host: str
    step: int
    last_heartbeat: float
    # its process's usage as of its latest step report or heartbeat (the worker_usage table; 0: none)
    cpu_seconds: float = 0.0
    rss_bytes: int = 0


@dataclass(frozen=True)
class LogRecord:
    job_id: str
    seq: int  # position in the job's log, 1-based
    rank: int  # -1: the control plane
    time: float
    level: str
    text: str


_JOBS = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    attempt INTEGER NOT NULL DEFAULT 1,
    step INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    samples_per_second REAL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    started REAL,
    finished REAL,
    job_proto BLOB NOT NULL,
    last_seq INTEGER NOT NULL DEFAULT 0,
    client_id TEXT NOT NULL DEFAULT '',
    idempotency_key TEXT NOT NULL DEFAULT '',
    total_steps INTEGER NOT NULL DEFAULT 0,
    slots INTEGER NOT NULL DEFAULT 0,
    resumed_from TEXT NOT NULL DEFAULT '',
    resume_checkpoint TEXT NOT NULL DEFAULT '',
    loss_nan INTEGER NOT NULL DEFAULT 0,
    eval_step INTEGER NOT NULL DEFAULT 0,
    eval_loss REAL,
    options BLOB NOT NULL DEFAULT x'',
    cancel_requested TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    seq INTEGER NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    data TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS losses (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    step INTEGER NOT NULL,
    loss REAL,  -- NULL: NaN (SQLite cannot hold a NaN REAL)
    samples_per_second REAL NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (job_id, step)
);
"""
_LOSSES_V4 = """
CREATE TABLE losses_v4 (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    step INTEGER NOT NULL,
    loss REAL,
    samples_per_second REAL NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (job_id, step)
)"""

# Version 2's additions; also run (after MIGRATIONS[1]) on a version-1 file.
_V2 = """
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs(client_id, idempotency_key)
    WHERE idempotency_key != '';
CREATE TABLE IF NOT EXISTS workers (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    rank INTEGER NOT NULL,
    worker_id TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL,
    host TEXT NOT NULL DEFAULT '',
    step INTEGER NOT NULL DEFAULT 0,
    last_heartbeat REAL NOT NULL,
    PRIMARY KEY (job_id, rank)
);
CREATE TABLE IF NOT EXISTS logs (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    seq INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    time REAL NOT NULL,
    level TEXT NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS results (
    job_id TEXT PRIMARY KEY REFERENCES jobs(id),
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS loss_scaling (
    job_id TEXT PRIMARY KEY REFERENCES jobs(id),
    loss_scale REAL NOT NULL,
    skipped_steps INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS worker_usage (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    rank INTEGER NOT NULL,
    cpu_seconds REAL NOT NULL,
    rss_bytes INTEGER NOT NULL,
    PRIMARY KEY (job_id, rank)
);
"""
# Version 7's: one live job at most resumes a given job (terminal ones leave the index).
LIVE_STATES = "(" + ", ".join(f"'{s}'" for s in (JobState.PENDING, *IN_FLIGHT)) + ")"
_V7 = f"""
CREATE UNIQUE INDEX IF NOT EXISTS jobs_live_resume ON jobs(resumed_from)
    WHERE resumed_from != '' AND state IN {LIVE_STATES};
"""

SCHEMA = _JOBS + _V2 + _V7

_NOW = "((julianday('now') - 2440587.5) * 86400.0)"  # unix seconds, as the store writes times
# Version 6 did not stop two live jobs resuming one: before version 7's index, every live resume of a job
# but its first is failed (a retry's duplicate), so the index can hold and the file still opens.
_ONE_LIVE_RESUME = f"""
UPDATE jobs SET state = '{JobState.FAILED}', reason = 'DUPLICATE_RESUME', updated = {_NOW}, finished = {_NOW},
    message = 'another job was already resuming job ' || resumed_from || ' when this store was upgraded; '
        || 'resume it again if that one did not finish it'
WHERE resumed_from != '' AND state IN {LIVE_STATES} AND rowid NOT IN (
    SELECT MIN(rowid) FROM jobs WHERE resumed_from != '' AND state IN {LIVE_STATES} GROUP BY resumed_from
)"""

# from-version -> statements that bring a file of that version to the next one.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "ALTER TABLE jobs ADD COLUMN client_id TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN idempotency_key TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN total_steps INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN slots INTEGER NOT NULL DEFAULT 0",
    ),
    2: (
        "ALTER TABLE jobs ADD COLUMN resumed_from TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN resume_checkpoint TEXT NOT NULL DEFAULT ''",
    ),
    3: (  # SQLite cannot drop a NOT NULL: the losses table is rebuilt with a nullable loss
        "ALTER TABLE jobs ADD COLUMN loss_nan INTEGER NOT NULL DEFAULT 0",
        _LOSSES_V4.replace("losses_v4", "IF NOT EXISTS losses"),  # a file that never had one
        _LOSSES_V4,
        "INSERT INTO losses_v4 SELECT job_id, step, loss, samples_per_second, time FROM losses",
        "DROP TABLE losses",
        "ALTER TABLE losses_v4 RENAME TO losses",
    ),
    4: (
        "ALTER TABLE jobs ADD COLUMN eval_step INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN eval_loss REAL",
    ),
    5: ("ALTER TABLE jobs ADD COLUMN options BLOB NOT NULL DEFAULT x''",),
    6: ("ALTER TABLE jobs ADD COLUMN cancel_requested TEXT NOT NULL DEFAULT ''", _ONE_LIVE_RESUME),
}

COLUMNS = (
    "id, name, state, reason, message, attempt, step, loss, samples_per_second, created, updated, "
    "started, finished, job_proto, client_id, total_steps, slots, resumed_from, resume_checkpoint, loss_nan, "
    "eval_step, eval_loss, options, loss_scaling.loss_scale, loss_scaling.skipped_steps, cancel_requested"
)
JOBS = "jobs LEFT JOIN loss_scaling ON loss_scaling.job_id = jobs.id"  # what COLUMNS are selected from


def _opt(x: Any) -> float | None:
    return None if x is None else float(x)


def loss_column(loss: float) -> float | None:
    """A loss as the REAL column holds it: NaN as NULL (an infinity is kept as it is)."""
    return None if math.isnan(loss) else float(loss)


def loss_from_column(x: Any, nan: bool = True) -> float | None:
    """A stored loss back: NULL is NaN where ``nan`` (a losses row, or a job whose loss_nan is set)."""
    return (math.nan if nan else None) if x is None else float(x)


def record_from_row(row: Sequence[Any]) -> JobRecord:
    """A ``JobRecord`` from a row of ``SELECT {COLUMNS} FROM {JOBS}``."""
    (id_, name, state, reason, message, attempt, step, loss, sps, created, updated, started, finished,
     blob, client_id, total_steps, slots, resumed_from, resume_checkpoint, loss_nan, eval_step,
     eval_loss, options, loss_scale, skipped_steps, cancel_requested) = row  # fmt: skip
    return JobRecord(
        id=str(id_),
        name=str(name),
        state=JobState(str(state)),
        reason=str(reason),
        message=str(message),
        attempt=int(attempt),
        step=int(step),
        loss=loss_from_column(loss, bool(loss_nan)),
        samples_per_second=_opt(sps),
        created=float(created),
        updated=float(updated),
        started=_opt(started),
        finished=_opt(finished),
        job_proto=bytes(blob),
        client_id=str(client_id),
        total_steps=int(total_steps),
        slots=int(slots),
        resumed_from=str(resumed_from),
        resume_checkpoint=str(resume_checkpoint),
        eval_step=int(eval_step),
        eval_loss=loss_from_column(eval_loss, int(eval_step) > 0),
        options=bytes(options),
        loss_scale=_opt(loss_scale),
        skipped_steps=int(skipped_steps or 0),
        cancel_requested=str(cancel_requested),
    )
