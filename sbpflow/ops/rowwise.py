"""Reductions along the last axis for the kernels of nn.py: per-row sums, dot products and maxima.

numpy's ``sum`` along a short contiguous axis (a softmax row of 64) pays the setup of its pairwise
summation once per row, ~5x the time of ``einsum``'s sum of products, which runs one loop down each row
and makes no temporary for a dot product. It adds in another order, so the last bit may differ from
``xp.sum``; a row's result depends on that row alone, so a shard's rows match the whole tensor's. numpy's
``max`` along a short row is not vectorised; halving the row with elementwise maxima is, and gives the
same values (a maximum is exact), so numpy takes that path for rows up to ``_TREE_MAX`` long.
"""

from __future__ import annotations

from typing import Any

_TREE_MAX = 128  # longer rows: numpy's max is as fast as the halving (measured on 2048 x 768)


def row_sum(xp: Any, x: Any) -> Any:
    """``sum(x, axis=-1, keepdims=True)``."""
    return xp.einsum("...i->...", x)[..., None]


def row_dot(xp: Any, a: Any, b: Any) -> Any:
    """``sum(a * b, axis=-1, keepdims=True)`` without the product's temporary."""
    return xp.einsum("...i,...i->...", a, b)[..., None]


def row_mean(xp: Any, x: Any) -> Any:
    s = row_sum(xp, x)
    return xp.divide(s, x.shape[-1], out=s)  # a Python int: the division stays in x's dtype


def row_max(xp: Any, x: Any) -> Any:
    """``max(x, axis=-1, keepdims=True)`` (nan where a row has one, as numpy's max)."""
    n = x.shape[-1]
    if xp.__name__ != "numpy" or not 1 < n <= _TREE_MAX:
        return xp.max(x, axis=-1, keepdims=True)
    while n > 1:  # the two halves overlap by one element when n is odd; max(a, a) == a
        half = (n + 1) // 2
        x = xp.maximum(x[..., :half], x[..., n - half : n])
        n = half
    return x
