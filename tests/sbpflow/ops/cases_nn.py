"""Cases for sbpflow/ops/nn.py.

References take the inputs positionally and the attributes by keyword and use plain numpy: explicit
Jacobians for the backward ops, loops over positions for cross entropy (never the kernels).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _rows_last(axis: int, *xs: np.ndarray) -> list[np.ndarray]:
    """Each array with ``axis`` moved last and the rest flattened: one row per softmax."""
    return [np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis]) for x in xs]


def _rows_back(rows: np.ndarray, like: np.ndarray, axis: int) -> np.ndarray:
    return np.moveaxis(rows.reshape(np.moveaxis(like, axis, -1).shape), -1, axis)


# ---- softmax and log_softmax ---------------------------------------------------------------------


@st.composite
def _along_axis(draw: st.DrawFn, backward: str = "") -> Example:
    shape = draw(shapes())
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    x = arrays(shape, draw, -3.0, 3.0)
    if not backward:
        return Example((x,), {"axis": axis})
    y = _softmax(x, axis)
    y = np.log(y) if backward == "log_softmax" else y
    return Example((y, arrays(shape, draw)), {"axis": axis})


def _softmax_ref(x: np.ndarray, axis: int = -1) -> list[np.ndarray]:
    (rows,) = _rows_last(axis, x)
    out = np.array([np.exp(r) / np.exp(r).sum() for r in rows - rows.max(axis=1, keepdims=True)])
    return [_rows_back(out, x, axis)]


def _log_softmax_ref(x: np.ndarray, axis: int = -1) -> list[np.ndarray]:
    (rows,) = _rows_last(axis, x)
    m = rows.max(axis=1, keepdims=True)
    return [_rows_back(rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True)), x, axis)]


def _softmax_grad_ref(y: np.ndarray, dy: np.ndarray, axis: int = -1) -> list[np.ndarray]:
    ys, dys = _rows_last(axis, y, dy)
    # Jacobian of softmax: diag(s) - s s^T (symmetric)
    dx = np.array([(np.diag(s) - np.outer(s, s)) @ g for s, g in zip(ys, dys, strict=True)])
    return [_rows_back(dx, y, axis)]


def _log_softmax_grad_ref(y: np.ndarray, dy: np.ndarray, axis: int = -1) -> list[np.ndarray]:
    ys, dys = _rows_last(axis, y, dy)
    # Jacobian of log_softmax: J[i, j] = delta_ij - s_j; dx = J^T dy
    dx = np.array([(np.eye(len(s)) - np.exp(s)[None, :]).T @ g for s, g in zip(ys, dys, strict=True)])
    return [_rows_back(dx, y, axis)]


case(OpCase("softmax", _along_axis(), _softmax_ref))
case(OpCase("log_softmax", _along_axis(), _log_softmax_ref))
case(OpCase("softmax_grad", _along_axis("softmax"), _softmax_grad_ref, differentiable=()))
case(OpCase("log_softmax_grad", _along_axis("log_softmax"), _log_softmax_grad_ref, differentiable=()))


# ---- layer_norm ----------------------------------------------------------------------------------


@st.composite
def _layer_norm(draw: st.DrawFn, backward: bool = False) -> Example:
    shape = draw(shapes(max_dims=3))
    d = shape[-1]
    x = arrays(shape, draw)
    weight, bias = arrays((d,), draw, 0.5, 1.5), arrays((d,), draw)
    eps = draw(st.sampled_from([1e-5, 0.1]))
    inputs = (arrays(shape, draw), x, weight) if backward else (x, weight, bias)
    return Example(inputs, {"eps": eps})


def _layer_norm_ref(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> list:
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        mu = row.sum() / len(row)
        var = ((row - mu) ** 2).sum() / len(row)
        out[r] = (row - mu) / np.sqrt(var + eps) * weight + bias
    return [out.reshape(x.shape)]


def _layer_norm_grad_ref(dy: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float = 1e-5) -> list:
    d = x.shape[-1]
    dx = np.empty((0, d))
    dweight, dbias = np.zeros(d), np.zeros(d)
    for row, g in zip(x.reshape(-1, d), dy.reshape(-1, d), strict=True):
        rstd = 1.0 / np.sqrt(row.var() + eps)
        xhat = (row - row.mean()) * rstd
        # d xhat / d x = rstd (I - 1/d - xhat xhat^T / d), a symmetric matrix
        jac = rstd * (np.eye(d) - 1.0 / d - np.outer(xhat, xhat) / d)
        dx = np.vstack([dx, jac @ (g * weight)])
        dweight += g * xhat
        dbias += g
    return [dx.reshape(x.shape), dweight, dbias]


case(OpCase("layer_norm", _layer_norm(), _layer_norm_ref, differentiable=(0, 1, 2), grad_rtol=1e-4))
case(OpCase("layer_norm_grad", _layer_norm(backward=True), _layer_norm_grad_ref, differentiable=()))


# ---- cross_entropy -------------------------------------------------------------------------------


@st.composite
def _cross_entropy(draw: st.DrawFn, backward: bool = False) -> Example:
    shape = draw(shapes(min_dims=2, max_dims=3))  # [..., V]: labels keep at least one axis
    vocab = shape[-1]
    logits = arrays(shape, draw, -3.0, 3.0)
    ignore = draw(st.sampled_from([-100, 0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, vocab, size=shape[:-1])
    labels[rng.random(shape[:-1]) < 0.25] = ignore  # some positions do not count
    labels = labels.astype(draw(st.sampled_from([np.int32, np.int64])))
    inputs: tuple[np.ndarray, ...] = (logits, labels)
    if backward:
        inputs += (arrays(shape[:-1], draw),)
    return Example(inputs, {"ignore_index": ignore})


def _ce_positions(logits: np.ndarray, labels: np.ndarray, ignore_index: int) -> Any:
    for pos in np.ndindex(*labels.shape):
        if labels[pos] != ignore_index:
            row = logits[pos]
            yield pos, row, int(labels[pos]), np.exp(row - row.max()) / np.exp(row - row.max()).sum()


def _cross_entropy_ref(logits: np.ndarray, labels: np.ndarray, ignore_index: int = -100) -> list:
    loss = np.zeros(labels.shape)
    for pos, _, label, p in _ce_positions(logits, labels, ignore_index):
        loss[pos] = -np.log(p[label])
    return [loss]


def _cross_entropy_grad_ref(
    logits: np.ndarray, labels: np.ndarray, dy: np.ndarray, ignore_index: int = -100
) -> list:
    dlogits = np.zeros_like(logits)
    for pos, _, label, p in _ce_positions(logits, labels, ignore_index):
        dlogits[pos] = (p - np.eye(len(p))[label]) * dy[pos]
    return [dlogits]


case(OpCase("cross_entropy", _cross_entropy(), _cross_entropy_ref, differentiable=(0,)))
case(OpCase("cross_entropy_grad", _cross_entropy(True), _cross_entropy_grad_ref, differentiable=()))
