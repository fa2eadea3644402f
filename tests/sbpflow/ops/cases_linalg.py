"""Cases for sbpflow/ops/linalg.py: references are np.einsum over explicitly transposed operands."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


def _t(x: np.ndarray, transpose: bool) -> np.ndarray:
    return np.swapaxes(x, -1, -2) if transpose else x


@st.composite
def _matmul(draw: st.DrawFn) -> Example:
    ta, tb = draw(st.booleans()), draw(st.booleans())
    batch = draw(shapes(0, 2, max_side=4))
    m, k, n = draw(shapes(3, 3))
    # a 1-d a (a single row) only without transpose_a
    a_shape = (*batch, k, m) if ta else (*batch, m, k)
    if not ta and not batch and draw(st.booleans()):
        a_shape = (k,)
    b_shape = (n, k) if tb else (k, n)
    return Example((arrays(a_shape, draw), arrays(b_shape, draw)), {"transpose_a": ta, "transpose_b": tb})


def _matmul_ref(a: np.ndarray, b: np.ndarray, transpose_a: bool, transpose_b: bool) -> list[np.ndarray]:
    if a.ndim == 1:
        return [np.einsum("k,kn->n", a, _t(b, transpose_b))]
    return [np.einsum("...mk,kn->...mn", _t(a, transpose_a), _t(b, transpose_b))]


@st.composite
def _batch_matmul(draw: st.DrawFn) -> Example:
    ta, tb = draw(st.booleans()), draw(st.booleans())
    batch = draw(shapes(0, 2, max_side=4))
    m, k, n = draw(shapes(3, 3))
    a_shape = (*batch, k, m) if ta else (*batch, m, k)
    b_shape = (*batch, n, k) if tb else (*batch, k, n)
    return Example((arrays(a_shape, draw), arrays(b_shape, draw)), {"transpose_a": ta, "transpose_b": tb})


def _batch_matmul_ref(a: np.ndarray, b: np.ndarray, transpose_a: bool, transpose_b: bool) -> list[np.ndarray]:
    return [np.einsum("...mk,...kn->...mn", _t(a, transpose_a), _t(b, transpose_b))]


case(OpCase("matmul", _matmul(), _matmul_ref, differentiable=(0, 1)))
case(OpCase("batch_matmul", _batch_matmul(), _batch_matmul_ref, differentiable=(0, 1)))


@st.composite
def _rows_matmul(draw: st.DrawFn) -> Example:
    lead = draw(shapes(1, 3, max_side=4))
    k, n = draw(shapes(2, 2))
    return Example((arrays((*lead, k), draw), arrays((*lead, n), draw)), {})


def _rows_matmul_ref(a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
    return [np.einsum("rk,rn->kn", a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))]


case(OpCase("rows_matmul", _rows_matmul(), _rows_matmul_ref, differentiable=(0, 1)))
