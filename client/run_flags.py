"""The command-line flags of :class:`~sbpflow.run_options.RunOptions`, made from its fields: one flag per
field (``ray_address`` -> ``--ray-address``), typed by the field's hint, helped by its ``metadata["help"]``,
defaulting to the command's own defaults (``sbpflow server`` starts from the job manager's).

    add_run_flags(parser, MANAGER_DEFAULTS, exclude=("trace",))
    options = run_options_from_args(parser.parse_args(argv), MANAGER_DEFAULTS)
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection
from dataclasses import fields
from typing import Any

from sbpflow.client.cli_exit import UsageError
from sbpflow.errors import SbpflowError
from sbpflow.run_options import FIELD_NAMES, RunOptions, RunOptionsError

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


def add_run_flags(p: argparse.ArgumentParser, defaults: RunOptions, exclude: Collection[str] = ()) -> None:
    """Add a flag for every field of RunOptions but ``exclude`` to ``p``, defaulting to ``defaults``."""
    unknown = sorted(set(exclude) - set(FIELD_NAMES))
    if unknown:
        raise SbpflowError(f"exclude={unknown}: RunOptions has no such field(s); it has {list(FIELD_NAMES)}")
    hints = typing.get_type_hints(RunOptions)
    group = p.add_argument_group("how the job runs (sbpflow.run_options.RunOptions)")
    added = [f for f in fields(RunOptions) if f.name in FIELD_NAMES and f.name not in exclude]
    p.set_defaults(**{_ADDED: tuple(f.name for f in added)})
    for f in added:
        default = getattr(defaults, f.name)
        kind = _value_type(hints[f.name])
        help_text = f.metadata["help"] + ("" if default is None else " (default: %(default)s)")
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            for key in ("choices", "metavar"):
                if key in f.metadata:
                    kw[key] = f.metadata[key]
        group.add_argument(flag_of(f.name), **kw)


def run_options_from_args(args: argparse.Namespace, defaults: RunOptions, **overrides: Any) -> RunOptions:
    """``defaults`` with the run flags ``args`` holds and ``overrides`` on top; a value out of range is an
    error naming the flag."""
    given = {name: getattr(args, name) for name in getattr(args, _ADDED, ())}
    try:
        return defaults.replace(**(given | overrides))
    except RunOptionsError as e:
        raise UsageError(f"{flag_of(e.field)} {e.value}: {e.fix}") from None
