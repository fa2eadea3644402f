"""The command-line flags of :class:`~sbpflow.runs.options.RunOptions`, made from its fields: one flag per
field (``ray_address`` -> ``--ray-address``), typed by the field's hint, helped by its ``metadata["help"]``,
defaulting to the command's own defaults (``sbpflow server`` starts from the job manager's).

    add_run_flags(parser, MANAGER_DEFAULTS, exclude=("trace",))
    options = run_options_from_args(parser.parse_args(argv), MANAGER_DEFAULTS)

    add_run_flags(parser, None, only=CLIENT_FIELDS)   # `sbpflow submit`: a job's own, unset: the server's
    client.submit(job, **given_run_flags(parser.parse_args(argv)))
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection
from dataclasses import fields
from typing import Any

from sbpflow.client.cli.exit_codes import UsageError
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import FIELD_NAMES, RunOptions, RunOptionsError

_ADDED = "run_option_flags"  # the parser's default naming the fields it has flags for


def flag_of(name: str) -> str:
    """The command-line flag of a RunOptions field."""
    return "--" + name.replace("_", "-")


def _value_type(hint: Any) -> Any:
    """``str`` for ``str | None``; the hint itself otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner
    return hint


def add_run_flags(
    p: argparse.ArgumentParser,
    defaults: RunOptions | None,
    exclude: Collection[str] = (),
    only: Collection[str] = FIELD_NAMES,
) -> None:
    """Add a flag for every field of RunOptions in ``only`` but ``exclude`` to ``p``, defaulting to
    ``defaults`` (None: unset, the server's; ``given_run_flags`` has what was given)."""
    unknown = sorted((set(exclude) | set(only)) - set(FIELD_NAMES))
    if unknown:
        raise SbpflowError(
            f"{unknown}: RunOptions has no such field(s) to make flags of; it has {list(FIELD_NAMES)}"
        )
    hints = typing.get_type_hints(RunOptions)
    group = p.add_argument_group("how the job runs (sbpflow.runs.options.RunOptions)")
    added = [f for f in fields(RunOptions) if f.name in only and f.name not in exclude]
    p.set_defaults(**{_ADDED: tuple(f.name for f in added)})
    for f in added:
        default = None if defaults is None else getattr(defaults, f.name)
        kind = _value_type(hints[f.name])
        shown = " (default: the server's)" if defaults is None else " (default: %(default)s)"
        help_text = f.metadata["help"] + ("" if default is None and defaults is not None else shown)
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            for key in ("choices", "metavar"):
                if key in f.metadata:
                    kw[key] = f.metadata[key]
        group.add_argument(flag_of(f.name), **kw)


def given_run_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The run flags ``args`` was given (those added with ``defaults=None`` and left unset are not)."""
    return {n: v for n in getattr(args, _ADDED, ()) if (v := getattr(args, n)) is not None}


def run_options_from_args(args: argparse.Namespace, defaults: RunOptions, **overrides: Any) -> RunOptions:
    """``defaults`` with the run flags ``args`` holds and ``overrides`` on top; a value out of range is an
    error naming the flag."""
    given = {name: getattr(args, name) for name in getattr(args, _ADDED, ())}
    try:
        return defaults.replace(**(given | overrides))
    except RunOptionsError as e:
        raise UsageError(f"{flag_of(e.field)} {e.value}: {e.fix}") from None
