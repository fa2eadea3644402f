"""Reductions along the last axis for the kernels of nn.py: per-row sums, dot products and maxima.

numpy's ``sum`` along a short contiguous axis (a softmax row of 64) pays the setup of its pairwise
summation once per row, ~5x the time of ``einsum``'s sum of products, which runs one loop down each row
and makes no temporary for a dot product. It adds in another order, so the last bit may differ from
``xp.sum``; a row's result depends on that row alone, so a shard's rows match the whole tensor's. numpy's
``max`` along a row is not vectorised (~1 ns an element); its ``argmax`` is, and the element it points at
is the same value, in a third of the time on every shape of the GPT examples.

``jit_rows`` says where a kernel may run rows_jit.py's one-pass numba loops instead (nn.py's softmax,
layer norm and cross entropy; reduction.py's, shape.py's and vocab.py's loops): numpy arrays,
C-contiguous, float32 or float64. It runs on every call of those kernels, so it is kept cheap.
``loop_into`` runs one of elementwise_jit's flat loops into a given output where that is safe.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np


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
    if xp.__name__ != "numpy" or x.shape[-1] == 0:
        return xp.max(x, axis=-1, keepdims=True)
    # numpy's argmax is vectorised along a row and returns the first nan where there is one
    return xp.take_along_axis(x, xp.argmax(x, axis=-1)[..., None], axis=-1)


# dtypes, not their names: numpy builds ``dtype.name`` afresh on each access, 1.5 us, which was most of
# the per-call cost of every kernel that asked jit_rows
_JIT_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


@cache
def jit_module(name: str) -> ModuleType | None:
    """``sbpflow.ops.<name>``, a module of numba loops (compiled at first call), or None on an install
    without numba, which keeps the numpy kernels."""
    try:
        return importlib.import_module(f"sbpflow.ops.kernels.{name}")
    except ImportError:
        return None


def jit_loops(name: str, xp: Any, *arrays: Any) -> ModuleType | None:
    """The numba loops of ``sbpflow.ops.<name>`` (conv_jit, pool_jit, elementwise_jit), where
    :func:`jit_rows` would take ``arrays``; None otherwise: the numpy kernel runs, the reference and
    cupy's path."""
    return jit_module(name) if jit_rows(xp, *arrays) is not None else None


def jit_rows(xp: Any, *arrays: Any) -> ModuleType | None:
    """rows_jit, where its one-pass row loops may run a kernel on ``arrays`` (the inputs, then any
    ``out=`` array): numpy, numba installed, every array C-contiguous with rows to work on, and one float
    dtype (float32 or float64; the others, and cupy, take the numpy kernel). None otherwise."""
    if xp is not np:
        return None
    dtype = getattr(arrays[0], "dtype", None)
    if dtype not in _JIT_DTYPES:
        return None
    for a in arrays:  # ~0.1 us an array: this runs on every call of every kernel that has a loop
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim == 0 or a.size == 0:
            return None
        if not a.flags.c_contiguous:
            return None
    return jit_module("rows_jit")


_ROW_LOOPS = frozenset({"add_rows"})  # the loops that take rows and a bias


def loop_into(xp: Any, loop: str, inputs: Sequence[Any], out: Any, lent: bool = False) -> Any:
    """elementwise_jit's one-pass ``loop`` on ``inputs``, written into ``out`` where it fits (C-contiguous,
    of the result's shape and dtype, no input's memory but the input itself of a loop that runs in place)
    or a new array; None where the loop does not take the inputs (rowwise.jit_rows: numpy, C-contiguous,
    float32 or float64). The inputs are of one shape, flattened for the loop, or (a row loop) x and a bias
    of x's trailing shape, x and the output as rows of the bias's size. ``lent``: out is the runtime's dead
    previous output, which no input can be, so the overlap check is skipped (it was ~2 of the ~10 us this
    took around a 2 us loop on 1,024 numbers)."""
    if (loops := jit_loops("elementwise_jit", xp, *inputs)) is None:
        return None
    x = inputs[0]
    shape = x.shape
    bias = False
    for a in inputs:
        bias = bias or a.shape != shape
    if bias and (
        loop not in _ROW_LOOPS or len(inputs) != 2 or inputs[1].shape != shape[len(shape) - inputs[1].ndim :]
    ):
        return None
    if (
        out is None
        or out.shape != shape
        or out.dtype != x.dtype
        or not out.flags.c_contiguous
        # over an input only where out is that very input of a loop that runs in place (elementwise_jit's
        # IN_PLACE); given another overlap, LLVM's run-time check runs the loop unvectorised
        or not lent
        and any(xp.may_share_memory(out, a) for a in inputs)
        and not (loop in loops.IN_PLACE and out is x and len(inputs) == 1)
    ):
        out = xp.empty(shape, dtype=x.dtype)
    if bias:
        n = inputs[1].size
        getattr(loops, loop)(x.reshape(-1, n), inputs[1].reshape(n), out.reshape(-1, n))
    elif len(inputs) == 1:
        getattr(loops, loop)(x.reshape(-1), out.reshape(-1))
    else:
        getattr(loops, loop)(*[a.reshape(-1) for a in inputs], out.reshape(-1))
    return out
