"""sbpflow/ops/attention.py (its numba passes, attention_jit.py, and its numpy path) against PyTorch's
scaled_dot_product_attention and against the unfused ops it replaced, forward and backward.

float64 within 1e-12 of both (only the order of a row's sums differs), float32 to its precision; causal
and not, odd sequence lengths and head sizes, a batch of one, fewer keys than queries. The numpy path (the
reference for cupy and half precision) runs by refusing the jit loops. client/functional.py's
scaled_dot_product_attention emits the one op without dropout and the unfused ops with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.ops import attention
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.ops.eager import EagerBuilder, full_index, meta_of
from tests.client.helpers import arrays, trace

torch = pytest.importorskip("torch")

TOL = {np.float64: (1e-12, 1e-12), np.float32: (2e-5, 2e-6)}
SHAPES = [  # (q, k, v)
    ((2, 3, 7, 5), (2, 3, 7, 5), (2, 3, 7, 5)),
    ((1, 4, 64, 16), (1, 4, 64, 16), (1, 4, 64, 16)),  # the main job's head shape, a batch of one
    ((1, 1, 1, 3), (1, 1, 1, 3), (1, 1, 1, 3)),
    ((2, 2, 9, 4), (2, 2, 5, 4), (2, 2, 5, 7)),  # fewer keys than queries, v's own width
]


def _inputs(shapes: Any, dtype: Any, seed: int = 0) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in shapes)
    dy = rng.standard_normal((*shapes[0][:-1], shapes[2][-1])).astype(dtype)
    return q, k, v, dy


def _fused(q: Any, k: Any, v: Any, dy: Any, scale: float, causal: bool) -> tuple[Any, ...]:
    b = EagerBuilder()
    y, p = b.call("attention", q, k, v, scale=scale, causal=causal)
    return (y, *b.call("attention_grad", q, k, v, p, dy, scale=scale, causal=causal))


def _torch(q: Any, k: Any, v: Any, dy: Any, scale: float, causal: bool) -> tuple[Any, ...]:
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale)
    y.backward(torch.tensor(dy))
    return tuple(t.detach().numpy() for t in (y, tq.grad, tk.grad, tv.grad))


def _unfused(q: Any, k: Any, v: Any, dy: Any, scale: float, causal: bool) -> tuple[Any, ...]:
    """The ops client/functional.py emitted before, and the backward ops their gradient rules emit."""
    b = EagerBuilder()

    def op(name: str, *xs: Any, **attrs: Any) -> Any:
        return b.call(name, *xs, **attrs)[0]

    s = op("mul_scalar", op("batch_matmul", q, k, transpose_b=True), value=scale)
    p = op("softmax", op("causal_mask", s) if causal else s, axis=-1)
    ds = op("softmax_grad", p, op("batch_matmul", dy, v, transpose_b=True), axis=-1)
    ds = op("mul_scalar", op("causal_mask", ds, value=0.0) if causal else ds, value=scale)
    dq, dk = op("batch_matmul", ds, k), op("batch_matmul", ds, q, transpose_a=True)
    return op("batch_matmul", p, v), dq, dk, op("batch_matmul", p, dy, transpose_a=True)


def _close(got: tuple[Any, ...], want: tuple[Any, ...], dtype: Any, what: str) -> None:
    rtol, atol = TOL[dtype]
    for name, g, w in zip(("y", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == dtype, f"{what}: {name} is {g.dtype}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shapes", SHAPES)
def test_matches_torch_and_the_unfused_ops(shapes: Any, causal: bool, dtype: Any) -> None:
    q, k, v, dy = _inputs(shapes, dtype)
    scale = 1.0 / np.sqrt(shapes[0][-1])
    got = _fused(q, k, v, dy, scale, causal)
    _close(got, _torch(q, k, v, dy, scale, causal), dtype, "against torch")
    _close(got, _unfused(q, k, v, dy, scale, causal), dtype, "against the unfused ops")


@pytest.mark.parametrize("causal", [True, False])
def test_numpy_path_matches_the_jit_passes(monkeypatch: pytest.MonkeyPatch, causal: bool) -> None:
    q, k, v, dy = _inputs(SHAPES[3], np.float64, seed=1)
    assert attention.jit_loops("attention_jit", np, q) is not None, "numba is a dependency: the fast path"
    jit = _fused(q, k, v, dy, 0.3, causal)
    monkeypatch.setattr(attention, "jit_loops", lambda *a: None)
    _close(_fused(q, k, v, dy, 0.3, causal), jit, np.float64, "numpy path")


def test_half_precision_takes_the_numpy_path() -> None:
    q, k, v, dy = _inputs(SHAPES[0], np.float64, seed=2)
    want = _fused(q, k, v, dy, 0.5, True)
    got = _fused(*(x.astype(np.float16) for x in (q, k, v, dy)), 0.5, True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=2e-2, atol=2e-2)


def _op_types(job: sf.Job) -> list[str]:
    return [o.op_type for o in job.graph.ops]


@pytest.mark.parametrize(
    ("rate", "training", "fused"), [(0.0, True, True), (0.1, False, True), (0.1, True, False)]
)
def test_functional_emits_one_op_without_dropout(rate: float, training: bool, fused: bool) -> None:
    data = arrays(batch=2, q=((2, 4, 3), "float32"), k=((2, 4, 3), "float32"), v=((2, 4, 3), "float32"))
    F = sf.nn.functional
    job = trace(lambda g, q, k, v: F.scaled_dot_product_attention(q, k, v, True, rate, training), data)
    ops = _op_types(job)
    assert ("attention" in ops) is fused and ("softmax" in ops) is not fused, ops


@dataclass(frozen=True)
class _Lending(KernelContext):
    out_buffers: tuple[Any, ...] = ()


def _call(op: str, ins: tuple[Any, ...], outs: tuple[Any, ...], lent: tuple[Any, ...]) -> tuple[Any, ...]:
    ctx = _Lending(
        np, {"scale": 0.25, "causal": True}, tuple(map(meta_of, ins)), tuple(map(meta_of, outs)),
        tuple(full_index(meta_of(a)) for a in ins), tuple(full_index(meta_of(a)) for a in outs), out_buffers=lent,
    )  # fmt: skip
    return tuple(get_op(op).kernel(ctx, *ins))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_outputs_lie_heads_inside_whatever_buffer_is_lent(dtype: Any) -> None:
    """y, dq, dk and dv of [B, H, T, D] are written laid out [B, T, H, D], so the model's transpose back
    is C-contiguous (its reshape and the qkv gradient's concat then copy nothing strided): into a new
    array, into their own previous output, or into a C-contiguous planned buffer, with the same bits."""
    q, k, v, dy = _inputs(((2, 3, 8, 4),) * 3, dtype, seed=3)
    probs = np.empty((2, 3, 8, 8), dtype)
    fwd = _call("attention", (q, k, v), (q, probs), ())
    bwd = _call("attention_grad", (q, k, v, fwd[1], dy), (q, k, v), ())
    want = (fwd[0], *bwd)
    for x in want:
        assert x.base is None and x.transpose(0, 2, 1, 3).flags.c_contiguous
    expect, planned = [x.copy() for x in want], tuple(np.empty_like(q, order="C") for _ in range(4))
    for lent in (want, planned):
        fwd2 = _call("attention", (q, k, v), (q, probs), (lent[0], None))
        got = (fwd2[0], *_call("attention_grad", (q, k, v, fwd2[1], dy), (q, k, v), lent[1:]))
        for g, w, buf in zip(got, expect, lent, strict=True):
            assert np.array_equal(g, w) and np.shares_memory(g, buf)
            assert g.transpose(0, 2, 1, 3).flags.c_contiguous
