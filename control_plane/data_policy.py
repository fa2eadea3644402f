"""Which files a job's data may name: only those under the server's data roots (``--data-root``).

A data source names files (``ArrayFileSource``'s ``.npy`` paths, ``TokenFileSource``'s token file); the
workers would read whatever they name, ``/etc/passwd`` included. :class:`DataPolicy` refuses, at
Submit (``validation.compile_submit``) and again before a run starts (a job re-queued after a restart
was validated under the roots of its day), every path that does not resolve under a root: paths are
resolved as the server sees them, symlinks followed and ``..`` collapsed, so neither leads out.
Refusals are :class:`DataAccessDenied` (PERMISSION_DENIED), naming the roots and never a file's bytes.

    DataPolicy.under(["/data"])   # `sbpflow server --data-root /data`
    DataPolicy.under([])          # no --data-root: no file data at all (synthetic or inline only)
    DataPolicy.embedded()         # `sbpflow run`: the working directory and sf.corpus's cache
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sbpflow.data import ArrayFileSource, DataSource, TokenFileSource
from sbpflow.errors import SbpflowError
from sbpflow.job import Job

MAX_SHOWN = 200  # characters of a refused path shown in the message


class DataAccessDenied(SbpflowError, PermissionError):
    """A job's data names a file outside the server's data roots."""


def data_paths(source: DataSource | None) -> list[tuple[str, str]]:
    """``(what, path)`` of every file ``source`` would read."""
    if isinstance(source, ArrayFileSource):
        return [(f"data field {k!r}", p) for k, p in source.paths.items()]
    if isinstance(source, TokenFileSource):
        return [("token file", source.path)]
    return []


def _resolved(path: str | Path) -> Path | None:
    """``path`` with symlinks and ``..`` resolved (relative to the server's directory); None if it
    cannot name a file (a NUL byte, say)."""
    try:
        return Path(os.path.realpath(path))
    except (ValueError, OSError):
        return None


@dataclass(frozen=True)
class DataPolicy:
    roots: tuple[Path, ...]  # resolved

    @classmethod
    def under(cls, roots: Iterable[str | Path]) -> DataPolicy:
        resolved = []
        for r in roots:
            p = _resolved(r)
            if p is None:  # a root that does not exist yet is fine: nothing resolves under it until it does
                raise SbpflowError(f"--data-root {str(r)[:MAX_SHOWN]!r} cannot name a folder; give a path")
            resolved.append(p)
        return cls(tuple(resolved))

    @classmethod
    def embedded(cls) -> DataPolicy:
        """The embedded run's: the working directory and the corpus cache (``sbpflow.corpus``)."""
        from sbpflow.corpus import cache_dir

        return cls(tuple(p for p in (_resolved(Path.cwd()), _resolved(cache_dir())) if p is not None))

    def allows(self, path: str) -> bool:
        p = _resolved(path)
        return p is not None and any(p == r or p.is_relative_to(r) for r in self.roots)

    def check(self, job: Job) -> None:
        """Refuse ``job`` (DataAccessDenied) if its data (or its held-out split) names a file outside
        the roots."""
        held_out = [(f"held-out {what}", path) for what, path in data_paths(job.eval_data)]
        for what, path in [*data_paths(job.data), *held_out]:
            if not self.allows(path):
                where = (
                    f"under the data roots {[str(r) for r in self.roots]}"
                    if self.roots
                    else "anywhere: the server has no --data-root"
                )
                raise DataAccessDenied(
                    f"job {job.name[:MAX_SHOWN]!r}: {what} {path[:MAX_SHOWN]!r} is outside what the server "
                    f"may read ({where}); put the file under a data root, or start the server with "
                    "--data-root DIR (repeatable) for its folder"
                )
