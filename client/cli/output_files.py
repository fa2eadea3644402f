"""The files the CLI writes where its user says (``export --out``, ``trace --out``, ``plan --out``,
``--html``, ``--dot``, ``run --trace``): always a regular file, written whole or not at all.

- The target must be absent or a regular file. A symlink (never followed, even to a regular file), a
  directory, a device, a FIFO or a socket is refused with a :class:`UsageError` that names the flag,
  and nothing is replaced.
- The bytes go to a private temp folder beside the target (``mkdtemp``: mode 0700, the same file
  system, so nobody else can swap a name inside it), into a file opened ``O_EXCL | O_NOFOLLOW``; the file
  is fsynced, checked to be a regular file again, and renamed over the target, and the folder's rename
  fsynced. A failed write leaves the target as it was and removes the temp folder.
- Folders above the target are the user's to choose, symlinked or not (``/tmp`` and home folders often
  are): only the last component is the output's own.

:func:`write_output` writes bytes or text; :func:`output_path` hands a writer that wants a path (numpy,
the safetensors writer) the temp file's path.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sbpflow.client.cli.exit_codes import UsageError, shown
from sbpflow.errors import SbpflowError

# what a non-regular target is, in words (lstat's mode, so a symlink is itself, not what it points at)
KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def check_target(target: str | Path, flag: str) -> None:
    """Refuse a target that exists and is not a regular file (UsageError, naming ``flag``)."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as e:  # a name too long, a component that is a file, no permission to look
        raise UsageError(f"{flag} {shown(target)}: {e.strerror}; give a path sbpflow can write") from None
    if stat.S_ISREG(mode):
        return
    kind = next((what for test, what in KINDS if test(mode)), "not a regular file")
    raise UsageError(
        f"{flag} {shown(target)} is {kind}; sbpflow writes only regular files and replaces nothing else: "
        "give the path of a new or regular file"
    )


@contextmanager
def output_path(target: str | Path, flag: str, name: str = "output") -> Iterator[Path]:
    """A fresh path (``name`` in a private temp folder beside ``target``) to write the output to; when
    the block ends without an exception, that file replaces ``target`` (checked again first)."""
    target = Path(target)
    check_target(target, flag)
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".sbpflow-", dir=target.parent))
    except OSError as e:
        raise SbpflowError(
            f"{flag} {shown(target)}: cannot write in its folder ({e.strerror}); give a path in a folder "
            "that exists and that you may write to"
        ) from None
    try:
        yield scratch / name
        _commit(scratch / name, target, flag)
    except OSError as e:
        raise SbpflowError(f"{flag} {shown(target)}: {e.strerror or e}; nothing was written") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_output(target: str | Path, data: bytes | str, flag: str) -> int:
    """Write ``data`` (text as UTF-8) to ``target`` as above; the bytes written."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with output_path(target, flag) as tmp:
        fd = os.open(tmp, NEW_FILE, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
    return len(raw)


def _commit(tmp: Path, target: Path, flag: str) -> None:
    """Make the written temp file durable and move it onto ``target``."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a writer that made something else of its path
            raise SbpflowError(
                f"{flag} {shown(target)}: the output written is not a regular file; nothing was written"
            )
        os.fsync(fd)
    finally:
        os.close(fd)
    check_target(target, flag)  # again: it may have changed while the output was written
    os.replace(tmp, target)  # a rename: it replaces the name, it never follows one
    folder = os.open(target.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
