"""The command line's strings, checked before any command runs: every string a command was given
(positional, flag, a repeated flag's items, a default read from the environment) is at most
``MAX_ARG_CHARS`` characters, holds no NUL and is valid UTF-8. A value that is not stops the command
with one line naming the argument and the limit (a :class:`UsageError`, exit 2), before it reaches a file
system call, a gRPC request or a print that would fail on it with a traceback.

Unix hands a program its arguments as bytes; Python decodes the ones that are not UTF-8 with
``surrogateescape``, which leaves lone surrogates no encoder accepts: that is how non-UTF-8 shows here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from sbpflow.client.cli.exit_codes import UsageError

MAX_ARG_CHARS = 4096  # Linux's PATH_MAX: no path, id, address or value a command takes is longer
POSITIONAL = frozenset({"command", "id", "example"})  # the arguments given without a flag


def _not_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# (what is wrong with a value, how to say it) in the order they are checked; the length first, so that
# a long value is never scanned or quoted in full
CHECKS: tuple[tuple[Callable[[str], bool], Callable[[str], str]], ...] = (
    (
        lambda v: len(v) > MAX_ARG_CHARS,
        lambda v: f"is {len(v)} characters, over the limit of {MAX_ARG_CHARS}",
    ),
    (lambda v: "\x00" in v, lambda v: f"holds a NUL byte at position {v.index(chr(0))}"),
    (_not_utf8, lambda v: "is not valid UTF-8"),
)


def argument_name(dest: str) -> str:
    """How the user wrote the argument stored in ``dest``: ``--out``, ``--checkpoint-root``, ``id``."""
    return dest if dest in POSITIONAL else "--" + dest.replace("_", "-")


def check_value(name: str, value: str) -> None:
    """Raise UsageError if ``value`` (the argument ``name``'s) fails one of :data:`CHECKS`."""
    for wrong, says in CHECKS:
        if wrong(value):
            quoted = ascii(value[:60]) + ("..." if len(value) > 60 else "")  # ascii: a surrogate prints too
            raise UsageError(
                f"{name} {says(value)} ({quoted}); give at most {MAX_ARG_CHARS} characters of UTF-8 text "
                "without NUL bytes"
            )


def check_arguments(args: argparse.Namespace) -> None:
    """Check every string in ``args`` (see the module's docstring)."""
    for dest, value in vars(args).items():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, str):
                check_value(argument_name(dest), item)
