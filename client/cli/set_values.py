"""``--set KEY=VALUE``: the value typed by what the example's ``make_job`` says KEY takes.

The text is read as a Python literal (``64``, ``0.5``, ``True``, ``(0, 1)``; a bare word is a string),
then checked against ``make_job``'s annotation of KEY, or its default's type where KEY has no
annotation: ``--set steps=abc`` is a usage error naming the key, the type and the value, an int given
for a float becomes a float, and a string parameter takes the text as written (``--set name=007``)::

    parse_set("steps=50", param_types(make_job))   # ("steps", 50)
"""

from __future__ import annotations

import ast
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

from sbpflow.client.cli.exit_codes import UsageError

_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")


def param_types(make_job: Callable[..., Any]) -> dict[str, Any]:
    """KEY -> the type ``make_job`` declares for it: its annotation, else its default's type."""
    try:
        hints = typing.get_type_hints(make_job)
    except Exception:  # an annotation naming what the example does not import: fall back to defaults
        hints = {}
    out: dict[str, Any] = {}
    for name, p in inspect.signature(make_job).parameters.items():
        if p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            continue
        if name in hints:
            out[name] = hints[name]
        elif p.default is not inspect.Parameter.empty and p.default is not None:
            out[name] = type(p.default)
    return out


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text  # a bare word is a string


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


_NO = object()  # "this type does not take the value"


def _as(hint: Any, value: Any, text: str) -> Any:
    """``value`` (read from ``text``) as a ``hint``, or ``_NO``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return value
    if hint is type(None):
        return None if value is None else _NO
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        for arm in args:
            if (got := _as(arm, value, text)) is not _NO:
                return got
        return _NO
    if origin is typing.Literal:
        return value if value in args else (text if text in args else _NO)
    if hint is bool:
        if isinstance(value, bool):
            return value
        low = text.strip().lower()
        return True if low in _TRUE else (False if low in _FALSE else _NO)
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if hint is float:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else _NO
    if hint is str:
        return text
    if origin in (tuple, list) or hint in (tuple, list):
        seq = value if isinstance(value, tuple | list) else _NO
        return _NO if seq is _NO else (origin or hint)(seq)
    if isinstance(hint, type):
        return value if isinstance(value, hint) else _NO
    return value  # a hint this reader does not know: the literal as it is


def parse_set(item: str, types_: dict[str, Any]) -> tuple[str, Any]:
    """``KEY=VALUE`` as (key, typed value); a UsageError naming what is wrong and the fix."""
    key, sep, text = item.partition("=")
    if not sep or not key.isidentifier():
        raise UsageError(f"--set {item!r}: write KEY=VALUE, e.g. --set hidden=64")
    value = _literal(text)
    if key not in types_:
        return key, value
    got = _as(types_[key], value, text)
    if got is _NO:
        raise UsageError(
            f"--set {key}={text}: make_job's {key} takes {_name(types_[key])}, not {text!r}; "
            f"e.g. --set {key}={_example(types_[key])}"
        )
    return key, got


def _example(hint: Any) -> str:
    for arm in typing.get_args(hint) or (hint,):
        if arm is int:
            return "8"
        if arm is float:
            return "0.5"
        if arm is bool:
            return "true"
        if typing.get_origin(arm) in (tuple, list) or arm in (tuple, list):
            return "0,1"
    args = typing.get_args(hint)
    return str(args[0]) if typing.get_origin(hint) is typing.Literal else "..."
