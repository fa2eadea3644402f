"""``tensor[...]`` with basic indexing: step-1 slices, ints, ``...`` and ``None``.

Worked out here as plain data (:class:`Box`) from the tensor's name and metadata; ``Tensor.__getitem__``
lowers it to at most one ``slice`` op (the box of kept elements) and one ``reshape`` (dropping the axes an
int indexed, inserting the ``None`` axes). Strided and advanced (tensor) indexing are refused with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from sbpflow.errors import ShapeError
from sbpflow.tensor_meta import Shape, TensorMeta


class Indexed(Protocol):
    """What basic indexing reads of a tensor: its name (for messages), metadata and shape."""

    @property
    def name(self) -> str: ...
    @property
    def meta(self) -> TensorMeta: ...
    @property
    def shape(self) -> Shape: ...
    @property
    def ndim(self) -> int: ...


@dataclass(frozen=True)
class Box:
    """``t[index]`` as a box of kept elements ``[starts, stops)`` and the result's shape."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]
    shape: Shape

    def whole(self, shape: Shape) -> bool:
        """Whether the box keeps every element of a tensor of ``shape`` (no slice op needed)."""
        return (self.starts, self.stops) == ((0,) * len(shape), shape)


def _expand(t: Indexed, index: Any) -> list[Any]:
    """The index as one entry per axis (plus the ``None`` entries), ``...`` expanded to full slices."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1:
        raise ShapeError(f"index {index!r} of tensor {t.name!r} has more than one '...'")
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    if used > t.ndim:
        raise ShapeError(
            f"index {index!r} has {used} entries but tensor {t.name!r} {t.meta} has only {t.ndim} axes"
        )
    fill = [slice(None)] * (t.ndim - used)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        return items[:at] + fill + items[at + 1 :]
    return items + fill


def box(t: Indexed, index: Any) -> Box:
    """The box ``t[index]`` keeps, or a :class:`ShapeError` naming the index and the fix."""
    starts, stops, out_shape = [], [], []
    axis = 0
    for item in _expand(t, index):
        if item is None:
            out_shape.append(1)
            continue
        n = t.shape[axis]
        if isinstance(item, slice):
            lo, hi, step = item.indices(n)
            if step != 1:
                raise ShapeError(
                    f"index {item} of tensor {t.name!r} axis {axis} has step {step}; only step-1 slices are "
                    "supported (reshape and slice, or transpose, instead)"
                )
            hi = max(lo, hi)
            out_shape.append(hi - lo)
        elif isinstance(item, int) and not isinstance(item, bool):
            if not -n <= item < n:
                raise ShapeError(
                    f"index {item} is out of range for axis {axis} of tensor {t.name!r} {t.meta}"
                )
            lo = item % n
            hi = lo + 1
        else:
            raise ShapeError(
                f"index {item!r} of tensor {t.name!r}: only ints, step-1 slices, '...' and None are supported; "
                "gather with sf.nn.functional.embedding for tensor indices"
            )
        starts.append(lo)
        stops.append(hi)
        axis += 1
    return Box(tuple(starts), tuple(stops), tuple(out_shape))
