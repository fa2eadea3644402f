"""The registry of file formats' wire forms: how each :class:`~sbpflow.data.sources.FileSource` class
goes into a ``DataSource`` message and comes back out of one (a table, not an if/elif chain in the codec).

A :class:`FileFormat` is the name of its field in ``DataSource``'s ``kind`` oneof, its source class and
two functions: ``to_proto(source)`` gives the format's message, ``from_proto(message, common)`` the source,
``common`` being the batching every source takes (``batch_size``, ``shuffle``, ``seed``, ``drop_last``).
``from_proto`` runs on untrusted input at Submit: for a value it cannot take it raises
:class:`~sbpflow.codec.values.WireError` (or another :class:`~sbpflow.errors.SbpflowError`) naming the
field; the values' bounds are the source's own ``check_limits``. Each format's module registers it at
import (``data_wire`` imports them all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sbpflow.data.sources import FileSource
from sbpflow.errors import RegistryError
from sbpflow.registry import Registry


@dataclass(frozen=True)
class FileFormat:
    oneof: str  # the field of DataSource's ``kind`` oneof: "token_file", "text_files", ...
    source: type[FileSource]
    to_proto: Callable[[Any], Any]  # the source -> its message
    from_proto: Callable[[Any, dict[str, Any]], FileSource]  # (message, common) -> the source


FORMATS: Registry[FileFormat] = Registry("data source format")


def register(fmt: FileFormat) -> FileFormat:
    """Add ``fmt``; a second format under the same oneof field, or for the same class, is refused."""
    if any(FORMATS.get(k).source is fmt.source for k in FORMATS):
        raise RegistryError(
            f"{fmt.source.__name__} already has a wire format; register each source class once"
        )
    return FORMATS.register(fmt.oneof, fmt)


def format_of(source: FileSource) -> FileFormat:
    """The wire format of ``source``'s class (a class without one is a programming error, named)."""
    for k in FORMATS:
        if type(source) is FORMATS.get(k).source:
            return FORMATS.get(k)
    raise TypeError(f"{type(source).__name__} has no wire format; register one in sbpflow.codec.formats")
