"""sbpflow/ops/kernels/conv_jit.py's window rows against conv.py's numpy im2col kernels, the reference they
replace.

Each convolution op runs twice on the same values: on C-contiguous inputs, which take conv_jit's loops
and the row-layout GEMM, and on a strided view of them, which ``rowwise.jit_loops`` refuses, so the numpy
kernel runs. Odd sizes, strides, padding, dilation and 1x1 kernels, in one block of samples and a sample
a block; float64 to rounding, float32 to its precision (the GEMMs add in another order). Grouped convolutions keep the numpy kernel on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.dtype import as_dtype
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.ops.eager import EagerBuilder
from sbpflow.ops.kernels.rowwise import jit_loops
from sbpflow.ops.layers.conv import out_size
from sbpflow.tensor_meta import TensorMeta

pytest.importorskip("numba")
from sbpflow.ops.kernels import conv_jit  # noqa: E402  (needs numba)

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
TOL = {np.float64: (1e-11, 1e-12), np.float32: (2e-4, 2e-5)}
DTYPES = [np.float64, np.float32]


def strided(a: Any) -> Any:
    """The same values as a view with a step of 2 along the last axis: not C-contiguous."""
    return np.repeat(a, 2, axis=-1)[..., ::2]


def both(op: str, *inputs: Any, at: int = 0, **attrs: Any) -> tuple[Any, Any]:
    """The op's output on contiguous inputs (the fast path) and with input ``at``, the one conv_jit
    reads, strided (the numpy kernel)."""
    assert jit_loops("conv_jit", np, inputs[at]) is not None, "numba is a dependency: the fast path runs"
    slow = tuple(strided(t) if i == at else t for i, t in enumerate(inputs))
    assert jit_loops("conv_jit", np, slow[at]) is None
    (got,) = EagerBuilder().call(op, *inputs, **attrs)
    (want,) = EagerBuilder().call(op, *slow, **attrs)
    return got, want


def same(got: Any, want: Any, dtype: Any, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape} vs {want.shape}"
    )
    assert got.flags.c_contiguous, what
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


@st.composite
def geometries(draw: st.DrawFn, groups: int = 1) -> dict[str, Any]:
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    extent = [d * (k - 1) + 1 - 2 * p for k, d, p in zip(kernel, dilation, padding, strict=True)]
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    # two columns out at least, so that a strided view of dy is not contiguous
    hw = (draw(st.integers(max(1, extent[0]), 9)), draw(st.integers(max(2, extent[1] + stride[1]), 10)))
    return {
        "n": draw(st.integers(1, 3)),
        "c": draw(st.integers(1, 5)) * groups,
        "o": draw(st.integers(1, 6)) * groups,
        "hw": hw,
        "kernel": kernel,
        "attrs": {
            "stride": stride,
            "padding": padding,
            "dilation": dilation,
            "groups": groups,
        },
    }


def _tensors(g: dict[str, Any], dtype: Any, seed: int) -> tuple[Any, Any, Any]:
    a = g["attrs"]
    oh, ow = (
        out_size(g["hw"][i], g["kernel"][i], a["stride"][i], a["padding"][i], a["dilation"][i])
        for i in (0, 1)
    )
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((g["n"], g["c"], *g["hw"])).astype(dtype)
    w = rng.standard_normal((g["o"], g["c"] // a["groups"], *g["kernel"])).astype(dtype)
    dy = rng.standard_normal((g["n"], g["o"], oh, ow)).astype(dtype)
    return x, w, dy


@pytest.mark.parametrize("block_bytes", [conv_jit.BLOCK_BYTES, 1])  # 1: a sample a block
@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(g=geometries(), seed=st.integers(0, 2**32 - 1))
def test_conv2d_and_its_gradients(
    dtype: Any, g: dict[str, Any], seed: int, block_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conv_jit, "BLOCK_BYTES", block_bytes)
    x, w, dy = _tensors(g, dtype, seed)
    a = g["attrs"]
    what = f"{x.shape} by {w.shape}, {a}"
    same(*both("conv2d", x, w, **a), dtype, f"conv2d {what}")
    same(*both("conv2d_grad_input", dy, w, input_hw=g["hw"], **a), dtype, f"conv2d_grad_input {what}")
    got, want = both("conv2d_grad_weight", dy, x, at=1, kernel_hw=g["kernel"], **a)
    same(got, want, dtype, f"conv2d_grad_weight {what}")


def test_grad_weight_strided_dy_and_grouped_take_the_numpy_kernel() -> None:
    """conv2d_grad_weight's window rows come from x; a strided dy is only read by numpy's transpose. A
    grouped convolution keeps the numpy kernel on contiguous inputs too."""
    a = {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2), "groups": 2}
    g = {"n": 2, "c": 4, "o": 6, "hw": (7, 6), "kernel": (3, 2), "attrs": a}
    x, w, dy = _tensors(g, np.float64, 0)
    for op, inputs, extra in [
        ("conv2d", (x, w), {}),
        ("conv2d_grad_input", (dy, w), {"input_hw": g["hw"]}),
        ("conv2d_grad_weight", (dy, x), {"kernel_hw": g["kernel"]}),
    ]:
        (got,) = EagerBuilder().call(op, *inputs, **a, **extra)
        (want,) = EagerBuilder().call(op, strided(inputs[0]), *inputs[1:], **a, **extra)
        same(got, want, np.float64, f"{op} grouped")
    g1 = {**g, "c": 3, "o": 4, "attrs": {**a, "groups": 1}}
    x, w, dy = _tensors(g1, np.float32, 1)
    (got,) = EagerBuilder().call("conv2d_grad_weight", strided(dy), x, kernel_hw=g1["kernel"], **g1["attrs"])
    (want,) = EagerBuilder().call(
        "conv2d_grad_weight", strided(dy), strided(x), kernel_hw=g1["kernel"], **g1["attrs"]
    )
    same(got, want, np.float32, "conv2d_grad_weight, strided dy")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stride", [(1, 1), (2, 2), (2, 3)])
@pytest.mark.parametrize("hw", [(6, 6), (7, 5)])
def test_pointwise_convolutions_skip_the_window_rows(dtype: Any, stride: tuple[int, int], hw: Any) -> None:
    """A 1x1 kernel without padding (ResNet's shortcuts, a bottleneck's ends) runs as a GEMM a sample on x
    in place: against the numpy kernel and torch, at stride 1 and strided (x's odd last row and column
    unread, their dx zero), square and not."""
    torch = pytest.importorskip("torch")
    a = {"stride": stride, "padding": (0, 0), "dilation": (1, 1), "groups": 1}
    g = {"n": 3, "c": 5, "o": 4, "hw": hw, "kernel": (1, 1), "attrs": a}
    x, w, dy = _tensors(g, dtype, 7)
    what = f"{x.shape} by 1x1, stride {stride}"
    runs = {
        "y": both("conv2d", x, w, **a),
        "dx": both("conv2d_grad_input", dy, w, input_hw=hw, **a),
        "dw": both("conv2d_grad_weight", dy, x, at=1, kernel_hw=(1, 1), **a),
    }
    for name, (got, want) in runs.items():
        same(got, want, dtype, f"{name}, {what}")
    tx, tw = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
    ty = torch.nn.functional.conv2d(tx, tw, None, stride)
    ty.backward(torch.from_numpy(dy))
    for name, peer in [("y", ty), ("dx", tx.grad), ("dw", tw.grad)]:
        same(runs[name][0], peer.detach().numpy(), dtype, f"{name} against torch, {what}")


@dataclass(frozen=True)
class _Lending(KernelContext):
    out_buffers: tuple[Any, ...] = ()


def _lent_run(op: str, ins: tuple[Any, ...], attrs: dict[str, Any], lent: Any) -> Any:
    """The op's kernel with ``lent`` as the runtime's dead buffer for its output (None: no buffer)."""
    opdef = get_op(op)
    full = opdef.normalize_attrs(attrs)
    metas = tuple(TensorMeta(a.shape, as_dtype(a.dtype.name)) for a in ins)
    (out,) = opdef.infer(metas, full)
    index = tuple(tuple(slice(0, s) for s in m.shape) for m in (*metas, out))
    ctx = _Lending(np, full, metas, (out,), index[:-1], index[-1:], out_buffers=(lent,))
    return opdef.kernel(ctx, *ins)


# (x shape, weight shape, stride, padding): each of conv_jit's paths
LENT_CASES = {
    "pointwise": ((3, 8, 6, 6), (5, 8, 1, 1), (1, 1), (0, 0)),
    "pointwise strided": ((3, 8, 7, 7), (5, 8, 1, 1), (2, 2), (0, 0)),
    "dense": ((3, 8, 2, 2), (6, 8, 3, 3), (1, 1), (1, 1)),
    "stem taps": ((2, 3, 33, 33), (8, 3, 3, 3), (1, 1), (1, 1)),
    "winograd": ((2, 8, 16, 16), (8, 8, 3, 3), (1, 1), (1, 1)),
    "winograd odd": ((2, 8, 17, 17), (8, 8, 3, 3), (1, 1), (1, 1)),
    "rows strided": ((3, 5, 9, 9), (4, 5, 3, 3), (2, 2), (1, 1)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(LENT_CASES))
def test_writes_into_a_lent_buffer_the_values_of_a_run_without(case: str, dtype: Any) -> None:
    """Each convolution op returns the runtime's dead buffer where one fits, bit for bit the array it
    allocates without one; a buffer of another dtype is not taken."""
    xs, ws, stride, padding = LENT_CASES[case]
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=xs).astype(dtype), rng.normal(size=ws).astype(dtype)
    geometry = {"stride": stride, "padding": padding}
    y = _lent_run("conv2d", (x, w), geometry, None)
    dy = rng.normal(size=y.shape).astype(dtype)
    runs = {
        "conv2d": ((x, w), geometry),
        "conv2d_grad_input": ((dy, w), {**geometry, "input_hw": xs[2:]}),
        "conv2d_grad_weight": ((dy, x), {**geometry, "kernel_hw": ws[2:]}),
    }
    for op, (ins, attrs) in runs.items():
        want = _lent_run(op, ins, attrs, None)
        lent = np.full(want.shape, np.nan, dtype)
        got = _lent_run(op, ins, attrs, lent)
        assert got is lent and np.array_equal(got, want), f"{case}: {op}"
        other = np.empty(want.shape, np.float16)
        assert _lent_run(op, ins, attrs, other) is not other
