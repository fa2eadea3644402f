"""Which files a job's data may name: only those under the server's data roots (``--data-root``).

A data source names files (every ``FileSource``'s ``file_paths()``: ``.npy`` arrays, token files, text,
tables, images); the
workers would read whatever they name, ``/etc/passwd`` included. :class:`DataPolicy` refuses, at
Submit (``validation.compile_submit``) and again before a run starts (a job re-queued after a restart
was validated under the roots of its day), every path that does not resolve under a root: paths are
resolved as the server sees them, symlinks followed and ``..`` collapsed, so neither leads out.
Refusals are :class:`~sbpflow.data.access.DataAccessDenied` (PERMISSION_DENIED), naming the roots and
never a file's bytes.

A path checked is still only a name until it is read. So the policy also travels with the job: ``bind``
stamps its roots on the job's file sources (``allowed_roots``, for what the control plane itself reads
while it compiles), and the job manager runs every job with ``RunOptions.data_roots`` (``run_roots``),
which the workers set on the sources they decode from the plan; each file is then checked as opened
(:mod:`sbpflow.data.access`), so a symlink swapped after Submit leads nowhere.

    DataPolicy.under(["/data"])   # `sbpflow server --data-root /data`
    DataPolicy.under([])          # no --data-root: no file data at all (synthetic or inline only)
    DataPolicy.embedded()         # `sbpflow run`: the working directory and sf.corpus's cache
    DataPolicy.embedded(["/d/x"]) # `sbpflow run --data /d/x`: and the folder of what --data names

A failed run's reason comes from its cause's type (:data:`FAILURE_REASONS`, :func:`reason_of`):
``PERMISSION_DENIED`` for a refused file, ``CHECKPOINT_STORAGE_FULL``/``_READ_ONLY``/``_ERROR`` for a
checkpoint that its disk would not take (:mod:`sbpflow.checkpoint.write`), ``COMPILE_LIMIT`` for a
compile over the server's limits (:class:`sbpflow.limits.CompileLimitError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sbpflow.checkpoint.write import STORAGE_ERRORS, CheckpointStorageError
from sbpflow.data.access import DENIED, MAX_SHOWN, DataAccessDenied, refusal, resolved, within
from sbpflow.data.sources import DataSource, FileSource, with_roots
from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.limits import CompileLimitError


def data_paths(source: DataSource | None) -> list[tuple[str, str]]:
    """``(what, path)`` of every file ``source`` would read."""
    return source.file_paths() if isinstance(source, FileSource) else []


# `sbpflow run` has no --data-root: what to do there instead
EMBEDDED_FIX = (
    "give it with --data PATH (its folder may then be read), or run `sbpflow run` from a folder that holds it"
)


@dataclass(frozen=True)
class DataPolicy:
    roots: tuple[Path, ...]  # resolved
    embedded_run: bool = False  # `sbpflow run`'s: a refusal says what to do there (no --data-root)

    @classmethod
    def under(cls, roots: Iterable[str | Path]) -> DataPolicy:
        out = []
        for r in roots:
            p = resolved(r)
            if p is None:  # a root that does not exist yet is fine: nothing resolves under it until it does
                raise SbpflowError(f"--data-root {str(r)[:MAX_SHOWN]!r} cannot name a folder; give a path")
            out.append(p)
        return cls(tuple(out))

    @classmethod
    def embedded(cls, also: Iterable[str] = ()) -> DataPolicy:
        """The embedded run's: the working directory, the corpus cache (``sbpflow.data.corpus``) and the
        folder of each path in ``also`` (``--data``: a folder itself, a file's or a glob's folder)."""
        from sbpflow.data.corpus import cache_dir

        found = (resolved(p) for p in (Path.cwd(), cache_dir(), *map(folder_of, also)))
        return cls(tuple(p for p in found if p is not None), embedded_run=True)

    @property
    def run_roots(self) -> tuple[str, ...]:
        """The roots as ``RunOptions.data_roots``: what the workers check each opened file against."""
        return tuple(str(r) for r in self.roots)

    def allows(self, path: str) -> bool:
        p = resolved(path)
        return p is not None and within(p, self.roots)

    def check(self, job: Job) -> None:
        """Refuse ``job`` (DataAccessDenied) if its data (or its held-out split) names a file outside
        the roots."""
        held_out = [(f"held-out {what}", path) for what, path in data_paths(job.eval_data)]
        for what, path in [*data_paths(job.data), *held_out]:
            if not self.allows(path) and self.embedded_run:
                shown = [str(r) for r in self.roots]
                raise DataAccessDenied(
                    f"job {job.name[:MAX_SHOWN]!r}: {what} {path[:MAX_SHOWN]!r} is outside the folders `sbpflow "
                    f"run` reads ({shown}: the working directory, the corpus cache, --data's); {EMBEDDED_FIX}"
                )
            if not self.allows(path):
                raise refusal(what, path, self.roots, job.name)

    def bind(self, job: Job) -> Job:
        """``job`` checked (``check``), its file sources carrying the roots, so that what the control plane
        reads of them (shapes, sample counts) is checked as opened too."""
        self.check(job)
        roots = self.run_roots
        return dataclasses.replace(
            job, data=with_roots(job.data, roots), eval_data=with_roots(job.eval_data, roots)
        )


def folder_of(path: str) -> Path:
    """The folder ``path`` names: itself, a file's, or a glob's (the part before its first ``*?[``)."""
    if Path(path).is_dir():
        return Path(path)
    fixed = path[: min((i for i in map(path.find, "*?[") if i >= 0), default=len(path))]
    return Path(fixed) if fixed.endswith("/") else Path(fixed or ".").parent


# A failed run's cause (its type, or a base of it) -> the job's reason. A Ray worker's cause arrives as its
# type's name only (``cause_type``), so the table is keyed by names.
_STORAGE: tuple[type[CheckpointStorageError], ...] = (CheckpointStorageError, *STORAGE_ERRORS.values())
FAILURE_REASONS: dict[str, str] = {
    DataAccessDenied.__name__: DENIED,  # a file refused: by the check before the run, or as a worker opened it
    **{c.__name__: c.reason for c in _STORAGE},  # its disk
    CompileLimitError.__name__: CompileLimitError.reason,  # its compile over the server's limits
}


def reason_of(error: BaseException, otherwise: str) -> str:
    """A failed run's reason by its cause (in process the cause itself, the error when it has none; from a
    Ray worker its type's name) in :data:`FAILURE_REASONS`, else ``otherwise``."""
    cause = getattr(error, "cause", error)
    names = [getattr(cause, "cause_type", "")] + [t.__name__ for t in type(cause).__mro__]
    return next((FAILURE_REASONS[n] for n in names if n in FAILURE_REASONS), otherwise)
