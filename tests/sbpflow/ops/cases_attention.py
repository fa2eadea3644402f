"""Cases for sbpflow/ops/attention.py: references loop over the leading index and each query row with plain
numpy (an explicit softmax Jacobian backward), never the kernels."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


@st.composite
def _attention(draw: st.DrawFn, backward: bool = False) -> Example:
    lead = draw(shapes(0, 2, max_side=3))
    tq, tk, dh, dv = draw(shapes(4, 4, max_side=5))
    q, k, v = (arrays((*lead, *s), draw) for s in ((tq, dh), (tk, dh), (tk, dv)))
    attrs = {"scale": draw(st.sampled_from([0.7, float(1 / np.sqrt(dh))])), "causal": draw(st.booleans())}
    if not backward:
        return Example((q, k, v), attrs)
    _, probs = _attention_ref(q, k, v, **attrs)
    return Example((q, k, v, probs, arrays((*lead, tq, dv), draw)), attrs)


def _rows(q: np.ndarray, tk: int, causal: bool) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """(leading index, query, how many keys it sees) for every query row."""
    for lead in np.ndindex(*q.shape[:-2]):
        for i in range(q.shape[-2]):
            yield lead, i, min(i + 1, tk) if causal else tk


def _attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool = False) -> list:
    probs = np.zeros((*q.shape[:-1], k.shape[-2]))
    for lead, i, seen in _rows(q, k.shape[-2], causal):
        keys = k[lead][:seen]
        s = np.array([np.dot(q[lead][i], key) * scale for key in keys])
        e = np.exp(s - s.max())
        probs[lead][i, : len(keys)] = e / e.sum()
    return [np.einsum("...qk,...kd->...qd", probs, v), probs]


def _attention_grad_ref(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, probs: np.ndarray, dy: np.ndarray, scale: float, causal: bool
) -> list:
    dprobs = np.einsum("...qd,...kd->...qk", dy, v)
    ds = np.zeros_like(probs)
    for lead, i, _ in _rows(q, k.shape[-2], causal):
        p = probs[lead][i]
        ds[lead][i] = (np.diag(p) - np.outer(p, p)) @ dprobs[lead][i] * scale  # softmax's Jacobian
    return [
        np.einsum("...qk,...kd->...qd", ds, k),
        np.einsum("...qk,...qd->...kd", ds, q),
        np.einsum("...qk,...qd->...kd", probs, dy),
    ]


case(OpCase("attention", _attention(), _attention_ref, differentiable=(0, 1, 2), grad_rtol=1e-4))
case(OpCase("attention_grad", _attention(backward=True), _attention_grad_ref, differentiable=()))


# ---- the attention core (sbpflow/ops/attention_core.py): qkv [B, T, H, 3, Dh] flat, y [B, T, H Dh] ----


@st.composite
def _qkv(draw: st.DrawFn, backward: bool = False) -> Example:
    b, t, h, d = draw(shapes(4, 4, max_side=4))
    qkv = arrays((b, t, 3 * h * d), draw)
    attrs = {
        "head_dim": d,
        "scale": draw(st.sampled_from([0.7, float(1 / np.sqrt(d))])),
        "causal": draw(st.booleans()),
    }
    if not backward:
        return Example((qkv,), attrs)
    _, probs = _qkv_ref(qkv, **attrs)
    return Example((qkv, probs, arrays((b, t, h * d), draw)), attrs)


def _heads(qkv: np.ndarray, d: int) -> list[np.ndarray]:
    b, t, w = qkv.shape
    per = qkv.reshape(b, t, w // (3 * d), 3, d)
    return [np.moveaxis(per[:, :, :, i, :], 2, 1) for i in range(3)]  # [B, H, T, Dh]


def _qkv_ref(qkv: np.ndarray, head_dim: int, scale: float, causal: bool) -> list:
    y, probs = _attention_ref(*_heads(qkv, head_dim), scale=scale, causal=causal)
    return [np.moveaxis(y, 1, 2).reshape(qkv.shape[0], qkv.shape[1], -1), probs]


def _qkv_grad_ref(
    qkv: np.ndarray, probs: np.ndarray, dy: np.ndarray, head_dim: int, scale: float, causal: bool
) -> list:
    b, t, _ = dy.shape
    dy_heads = np.moveaxis(dy.reshape(b, t, -1, head_dim), 2, 1)
    grads = _attention_grad_ref(*_heads(qkv, head_dim), probs, dy_heads, scale, causal)
    return [np.stack([np.moveaxis(g, 1, 2) for g in grads], axis=3).reshape(qkv.shape)]


case(OpCase("qkv_attention", _qkv(), _qkv_ref, differentiable=()))
case(OpCase("qkv_attention_grad", _qkv(backward=True), _qkv_grad_ref, differentiable=()))
