"""Cases for sbpflow/ops/layers/vocab.py: the vocabulary-parallel cross entropy, op by op.

The references loop over positions in plain numpy. Vocabularies are ``chunks * k`` with chunks in
1..6, so that the oracle's meshes of 2, 3 and 4 ranks find some that split into whole chunks (the
chunk-max row needs even splits) and others that do not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


@st.composite
def _logits(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(logits [..., V], labels [...] with some ignored, ignore_index, chunks)."""
    chunks = draw(st.sampled_from([1, 2, 3, 4, 6]))
    rows = draw(shapes(min_dims=1, max_dims=2, max_side=4))
    vocab = chunks * draw(st.integers(1, 3))
    logits = arrays((*rows, vocab), draw, -3.0, 3.0)
    ignore = draw(st.sampled_from([-100, 0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    labels = rng.integers(0, vocab, size=rows)
    labels[rng.random(rows) < 0.25] = ignore
    return logits, labels.astype(draw(st.sampled_from([np.int32, np.int64]))), ignore, chunks


def _chunk_max_ref(logits: np.ndarray, chunks: int) -> list:
    out = np.empty((*logits.shape[:-1], chunks))
    size = logits.shape[-1] // chunks
    for pos in np.ndindex(*logits.shape[:-1]):
        for c in range(chunks):
            out[(*pos, c)] = max(logits[(*pos, slice(c * size, (c + 1) * size))])
    return [out]


def _kept_rows(labels: np.ndarray, ignore_index: int) -> Any:
    for pos in np.ndindex(*labels.shape):
        yield pos, labels[pos] != ignore_index


@st.composite
def _chunk_max(draw: st.DrawFn) -> Example:
    logits, _, _, chunks = draw(_logits())
    return Example((logits,), {"chunks": chunks})


@st.composite
def _terms(draw: st.DrawFn, backward: bool = False) -> Example:
    logits, labels, ignore, chunks = draw(_logits())
    (chunk_max,) = _chunk_max_ref(logits, chunks)
    inputs: tuple[np.ndarray, ...] = (logits, labels, chunk_max)
    if backward:
        inputs += (arrays(labels.shape, draw), arrays(labels.shape, draw))
    return Example(inputs, {"ignore_index": ignore})


def _terms_ref(
    logits: np.ndarray, labels: np.ndarray, chunk_max: np.ndarray, ignore_index: int = -100
) -> list:
    sum_exp, target = np.zeros(labels.shape), np.zeros(labels.shape)
    for pos, kept in _kept_rows(labels, ignore_index):
        sum_exp[pos] = np.exp(logits[pos] - chunk_max[pos].max()).sum()
        target[pos] = logits[pos][labels[pos]] if kept else 0.0
    return [sum_exp, target]


def _terms_grad_ref(
    logits: np.ndarray,
    labels: np.ndarray,
    chunk_max: np.ndarray,
    dsum: np.ndarray,
    dtarget: np.ndarray,
    ignore_index: int = -100,
) -> list:
    out = np.zeros_like(logits)
    for pos, kept in _kept_rows(labels, ignore_index):
        out[pos] = np.exp(logits[pos] - chunk_max[pos].max()) * dsum[pos]
        if kept:
            out[pos][labels[pos]] += dtarget[pos]
    return [out]


@st.composite
def _loss(draw: st.DrawFn) -> Example:
    logits, labels, ignore, chunks = draw(_logits())
    (chunk_max,) = _chunk_max_ref(logits, chunks)
    sum_exp, target = arrays(labels.shape, draw, 0.5, 3.0), arrays(labels.shape, draw)
    return Example((logits, labels, chunk_max, sum_exp, target), {"ignore_index": ignore})


def _loss_ref(
    logits: np.ndarray,
    labels: np.ndarray,
    chunk_max: np.ndarray,
    sum_exp: np.ndarray,
    target: np.ndarray,
    ignore_index: int = -100,
) -> list:
    loss = np.zeros(labels.shape)
    for pos, kept in _kept_rows(labels, ignore_index):
        if kept:
            loss[pos] = chunk_max[pos].max() + np.log(sum_exp[pos]) - target[pos]
    return [loss]


@st.composite
def _loss_grad(draw: st.DrawFn) -> Example:
    _, labels, ignore, _ = draw(_logits())
    sum_exp, dy = arrays(labels.shape, draw, 0.5, 3.0), arrays(labels.shape, draw)
    return Example((labels, sum_exp, dy), {"ignore_index": ignore})


def _loss_grad_ref(labels: np.ndarray, sum_exp: np.ndarray, dy: np.ndarray, ignore_index: int = -100) -> list:
    dsum, dtarget = np.zeros(labels.shape), np.zeros(labels.shape)
    for pos, kept in _kept_rows(labels, ignore_index):
        if kept:
            dsum[pos], dtarget[pos] = dy[pos] / sum_exp[pos], -dy[pos]
    return [dsum, dtarget]


case(OpCase("vocab_chunk_max", _chunk_max(), _chunk_max_ref, differentiable=()))
case(OpCase("vocab_terms", _terms(), _terms_ref, differentiable=(0,)))
case(OpCase("vocab_terms_grad", _terms(backward=True), _terms_grad_ref, differentiable=()))
case(OpCase("vocab_cross_entropy", _loss(), _loss_ref, differentiable=(3, 4)))
case(OpCase("vocab_cross_entropy_grad", _loss_grad(), _loss_grad_ref, differentiable=()))
