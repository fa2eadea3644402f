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
