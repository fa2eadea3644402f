"""A name -> value registry that refuses a second registration under a taken name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from sbpflow.errors import RegistryError, UnknownOpError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, what: str) -> None:
        self._what = what
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise RegistryError(
                f"{self._what} {name!r} is already registered; pick another name or remove the first one"
            )
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            import difflib

            close = difflib.get_close_matches(name, self._items, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UnknownOpError(f"unknown {self._what} {name!r}{hint} (known: {len(self._items)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())
