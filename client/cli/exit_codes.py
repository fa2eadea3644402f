"""How an ``sbpflow`` command ends: its exit code and its last words.

    0    success
    1    a job that did not succeed, a call the control plane refused or could not answer, a job the
         compiler refused: anything but the command line itself
    2    a usage error: a flag or argument that is wrong (argparse's own, and :class:`UsageError`)
    130  interrupted (Ctrl-C), without a traceback
    141  the reader of stdout went away (``sbpflow status | head``): quiet, as other Unix tools end on
         SIGPIPE

Errors print one line on stderr, ``sbpflow: error: ...``; an ``OSError`` no command turned into words
(a file name too long for the file system, say) prints its reason and file name, exit 1, never a
traceback. An example's own failure (an exception raised in its make_job, its model code, or a module
of its own they call) prints that line and then the traceback's frames of the user's files only, not
sbpflow's or Python's, exit 1 (``SBPFLOW_TRACEBACK=1``: the whole traceback); any other exception is a
bug of sbpflow's and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from sbpflow.errors import SbpflowError

OK, FAILED, USAGE, INTERRUPTED, BROKEN_PIPE = 0, 1, 2, 130, 141


class UsageError(SbpflowError):
    """The command line is wrong (a bad flag value, an example file that is not one): exit 2."""


def shown(value: object) -> str:
    """A value (a path, an id) as an error message quotes it: repr'd, so that odd characters show, and
    cut to about 100 characters with its length said."""
    text = repr(str(value))
    return text if len(text) <= 120 else f"{text[:100]}...' ({len(str(value))} characters)"


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout without a descriptor (a test's capture)
        pass
    finally:
        os.close(devnull)


def _not_users() -> tuple[Path, ...]:
    """The folders whose files are not a user's: sbpflow's packages and Python's own (stdlib, site-packages)."""
    import sbpflow
    import sbpflow.actor_workers
    import sbpflow.client
    import sbpflow.control_plane

    packages = (sbpflow, sbpflow.actor_workers, sbpflow.client, sbpflow.control_plane)
    found = {Path(str(m.__file__)).resolve().parent for m in packages}
    return (*found, *{Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})


def users_frames(tb: TracebackType | None) -> traceback.StackSummary:
    """The frames of ``tb`` in a user's own files (an example, a module of its own), outermost first."""
    skip = _not_users()
    own = [
        f
        for f in traceback.extract_tb(tb)
        if not f.filename.startswith("<")
        and not any(Path(f.filename).resolve().is_relative_to(d) for d in skip)
    ]
    return traceback.StackSummary.from_list(own)


def _users_failure(e: Exception) -> bool:
    """Print ``e`` as one line and the user's own frames if any frame of it is theirs; whether it was."""
    own = users_frames(e.__traceback__)
    if not own or os.environ.get("SBPFLOW_TRACEBACK"):
        return False
    print(f"sbpflow: error: {type(e).__name__}: {e}", file=sys.stderr)
    print("".join(own.format()), end="", file=sys.stderr)
    return True


def run_command(fn: Callable[[], int]) -> int:
    """``fn()``'s exit code, with each way a command can fail mapped to its code above."""
    try:
        code = fn()
        sys.stdout.flush()  # here, not at exit: a reader that went away is then a BrokenPipeError below
        return code
    except UsageError as e:
        print(f"sbpflow: error: {e}", file=sys.stderr)
        return USAGE
    except (SbpflowError, NotImplementedError) as e:
        print(f"sbpflow: error: {e}", file=sys.stderr)
        return FAILED
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE
    except OSError as e:  # after BrokenPipeError, one of its kind
        where = f": {shown(e.filename)}" if e.filename is not None else ""
        print(f"sbpflow: error: {e.strerror or e}{where}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        print("sbpflow: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:  # last: raised in the user's code, or a bug of sbpflow's (its traceback kept)
        if _users_failure(e):
            return FAILED
        raise
