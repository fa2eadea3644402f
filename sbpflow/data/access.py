"""Which files a data source may open, checked on the file as opened: the read-time half of the server's
data policy (``control_plane/service/data_policy.py`` is the Submit-time half).

The control plane checks a job's paths at Submit and again before its run starts, but a path is only a
name: a symlink swapped after the check would lead a worker to ``/etc/passwd``. So a file-backed source
that carries ``allowed_roots`` (set by the control plane, never by the wire) opens its file once, asks
the kernel which file it opened (``/proc/self/fd/N``), refuses it unless that file lies under a root,
and then reads the opened file itself, never the name again:

    with opened(path, roots, "token file") as name:   # name: /proc/self/fd/N, the file as opened
        tokens = np.memmap(name, dtype, mode="r")

``roots=None``: no check (a user's own ``sf.run`` reads what its user can). Refusals are
:class:`DataAccessDenied` (PERMISSION_DENIED on the wire): they name the path and the roots, never the
file's bytes nor where a symlink led.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sbpflow.errors import SbpflowError

MAX_SHOWN = 200  # characters of a refused path shown in a message
DENIED = "PERMISSION_DENIED"  # the job's reason when its run was refused a file (JobStatus.reason)


class DataAccessDenied(SbpflowError, PermissionError):
    """A job's data names (or, by a symlink, opens) a file outside the server's data roots."""


def resolved(path: str | Path) -> Path | None:
    """``path`` with symlinks and ``..`` resolved (relative to this process's directory); None if it
    cannot name a file (a NUL byte, say)."""
    try:
        return Path(os.path.realpath(path))
    except (ValueError, OSError):
        return None


def within(path: Path, roots: Iterable[str | Path]) -> bool:
    """Whether the resolved ``path`` is one of ``roots`` (resolved already) or lies under one."""
    return any(path == Path(r) or path.is_relative_to(r) for r in roots)


def refusal(what: str, path: str, roots: Iterable[str | Path], job: str = "") -> DataAccessDenied:
    """The one message of a refused file, at Submit or at read time."""
    shown = [str(r) for r in roots]
    where = f"under the data roots {shown}" if shown else "anywhere: the server has no --data-root"
    who = f"job {job[:MAX_SHOWN]!r}: " if job else ""
    return DataAccessDenied(
        f"{who}{what} {path[:MAX_SHOWN]!r} is outside what the server may read ({where}); put the file "
        "under a data root, or start the server with --data-root DIR (repeatable) for its folder"
    )


def _opened_path(fd: int, path: str) -> Path | None:
    """The file ``fd`` is open on, as the kernel names it; where there is no ``/proc`` (not Linux), the
    resolved ``path`` if it is still that same file, else None."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
    real, st = resolved(path), os.fstat(fd)
    try:
        same = real is not None and os.path.samestat(os.stat(real), st)
    except OSError:
        same = False
    return real if same else None


@contextmanager
def opened(path: str, roots: tuple[str, ...] | None, what: str) -> Iterator[str]:
    """A name for ``path`` opened once (module docstring): ``/proc/self/fd/N`` while the block runs, the
    file's path itself with ``roots=None``. Raises ``DataAccessDenied`` for a file outside ``roots``, and
    the ``OSError`` of a file that cannot be opened (the caller words it)."""
    if roots is None:
        yield path
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block
    try:
        real = _opened_path(fd, path)
        if real is None or not within(real, roots):
            raise refusal(what, path, roots) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what} {path[:MAX_SHOWN]!r} is not a regular file")
        proc = f"/proc/self/fd/{fd}"
        yield proc if os.path.exists(proc) else str(real)
    finally:
        os.close(fd)
