"""sbpflow/ops/kernels/pool_jit.py's loops against pool.py's and indexing.py's numpy kernels, the reference
they replace, gather's included (and gather_grad's scatter through rows_jit.add_rows_at against numpy's
``add.at``).

The same op runs twice on the same values: on C-contiguous inputs, which take the numba loops, and on a
strided view of them, which ``rowwise.jit_loops`` refuses, so the numpy kernel runs. Odd sizes, strides
and padding; ties, -inf and nan where the max pool and top-k must resolve them as the numpy kernels do
(the first maximum, the lower index, nan last): those compare exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.eager import EagerBuilder
from sbpflow.ops.kernels.rowwise import jit_loops
from tests.sbpflow.ops.kernels.test_conv_jit import DTYPES, SETTINGS, strided

pytest.importorskip("numba")
from sbpflow.ops.kernels import pool_jit  # noqa: E402  (needs numba)

TOL = {np.float64: (1e-12, 1e-13), np.float32: (2e-5, 2e-6)}
DTYPES_INT = [np.int32, np.int64]


def both(op: str, *inputs: Any, at: int = 0, **attrs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The op's outputs on contiguous inputs (the loops) and with input ``at`` strided (numpy)."""
    assert jit_loops("pool_jit", np, inputs[at]) is not None, "numba is a dependency: the fast path runs"
    slow = tuple(strided(t) if i == at else t for i, t in enumerate(inputs))
    assert jit_loops("pool_jit", np, slow[at]) is None
    with np.errstate(invalid="ignore"):
        return EagerBuilder().call(op, *inputs, **attrs), EagerBuilder().call(op, *slow, **attrs)


def same(got: tuple[Any, ...], want: tuple[Any, ...], dtype: Any, what: str, exact: bool = False) -> None:
    rtol, atol = (0, 0) if exact else TOL[dtype]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what} {i}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        )
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{what} output {i}")


def _values(rng: Any, shape: tuple[int, ...], dtype: Any, special: bool) -> Any:
    """Normal values, or few distinct ones (ties) with some -inf and nan where ``special``."""
    if not special:
        return rng.standard_normal(shape).astype(dtype)
    x = rng.integers(-2, 3, size=shape).astype(dtype)
    x[rng.random(shape) < 0.1] = -np.inf
    x[rng.random(shape) < 0.05] = np.nan
    return x


@st.composite
def pools(draw: st.DrawFn) -> tuple[tuple[int, ...], dict[str, Any]]:
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = draw(st.sampled_from([(0, 0), (1, 1), (1, 2), (2, 1), (2, 2), (3, 2)]))
    padding = (draw(st.integers(0, kernel[0] // 2)), draw(st.integers(0, kernel[1] // 2)))
    s1 = kernel[1] if stride == (0, 0) else stride[1]
    h = draw(st.integers(kernel[0], 9))
    w = draw(st.integers(max(kernel[1] + s1, 2), 10))  # two columns out: a strided dy is not contiguous
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 4)), h, w)
    return shape, {"kernel_size": kernel, "stride": stride, "padding": padding}


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(pool=pools(), seed=st.integers(0, 2**32 - 1), special=st.booleans())
def test_pools_and_their_gradients(dtype: Any, pool: Any, seed: int, special: bool) -> None:
    shape, attrs = pool
    rng = np.random.default_rng(seed)
    x = _values(rng, shape, dtype, special)
    (y,) = EagerBuilder().call("max_pool2d", x, **attrs)
    dy = rng.standard_normal(y.shape).astype(dtype)
    what = f"{shape} {attrs}"
    same(*both("max_pool2d", x, **attrs), dtype, f"max_pool2d {what}", exact=True)
    same(*both("max_pool2d_grad", x, dy, **attrs), dtype, f"max_pool2d_grad {what}")
    same(*both("max_pool2d_grad", x, dy, at=1, **attrs), dtype, f"max_pool2d_grad, strided dy, {what}")
    x = rng.standard_normal(shape).astype(dtype)
    same(*both("avg_pool2d", x, **attrs), dtype, f"avg_pool2d {what}")
    out = (int(rng.integers(1, shape[2] + 1)), int(rng.integers(1, shape[3] + 1)))
    same(*both("adaptive_avg_pool2d", x, output_size=out), dtype, f"adaptive_avg_pool2d {shape} -> {out}")
    dy = rng.standard_normal((*shape[:2], *out)).astype(dtype)
    if out[1] > 1:  # a strided view of one column is contiguous
        grad = both("adaptive_avg_pool2d_grad", dy, output_size=out, input_hw=shape[2:])
        same(*grad, dtype, f"adaptive_avg_pool2d_grad {out} -> {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hw", "out"), [((7, 5), (1, 1)), ((6, 9), (3, 3)), ((4, 4), (4, 2)), ((1, 3), (1, 1))]
)
def test_adaptive_grad_of_tiling_bins_writes_each_bin_once(dtype: Any, hw: Any, out: Any) -> None:
    """Bins that tile the image (a global pool among them, which the strided-view test cannot reach: a
    view of one column is contiguous) take the loop's one-pass path: each dy spread over its bin."""
    dy = np.random.default_rng(0).standard_normal((2, 3, *out)).astype(dtype)
    assert jit_loops("pool_jit", np, dy) is not None
    (dx,) = EagerBuilder().call("adaptive_avg_pool2d_grad", dy, output_size=out, input_hw=hw)
    bh, bw = hw[0] // out[0], hw[1] // out[1]
    want = np.repeat(np.repeat(dy, bh, axis=2), bw, axis=3) / dtype(bh * bw)
    same((dx,), (want,), dtype, f"adaptive_avg_pool2d_grad {out} -> {hw}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_matches_numpy_bit_for_bit_signed_zeros_nan_and_resnets_stem_pool(
    dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pool_jit.max_pool_planes (padded pools take it) against the numpy kernel's bits: of equal values
    (0 and -0) the later tap wins, as numpy's ``maximum`` keeps its second argument; nan propagates;
    -inf padding; and torch's values on ResNet's 3x3 stride-2 padding-1 pool."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 9, 12)).astype(dtype)
    x.flat[::3], x.flat[1::5], x.flat[::17], x.flat[::19] = 0.0, -0.0, np.nan, -np.inf
    bits = np.int64 if dtype == np.float64 else np.int32
    calls: list[int] = []
    real = pool_jit.max_pool_planes
    monkeypatch.setattr(pool_jit, "max_pool_planes", lambda *a: calls.append(1) or real(*a))
    for attrs in [
        {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1)},
        {"kernel_size": (2, 3), "stride": (1, 2), "padding": (1, 0)},
        {"kernel_size": (3, 2), "stride": (1, 1), "padding": (0, 1)},
    ]:
        (got,), (want,) = both("max_pool2d", x, **attrs)
        np.testing.assert_array_equal(got.view(bits), want.view(bits), err_msg=f"{attrs}")
    assert calls == [1, 1, 1], "padded pools take the loops"
    EagerBuilder().call("max_pool2d", x, kernel_size=(2, 2), stride=(2, 2), padding=(0, 0))
    assert calls == [1, 1, 1], "unpadded ones numpy's passes"
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((4, 16, 32, 32)).astype(dtype)
    (got,) = EagerBuilder().call("max_pool2d", x, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1))
    np.testing.assert_array_equal(got, torch.nn.functional.max_pool2d(torch.from_numpy(x), 3, 2, 1).numpy())


def test_max_pool_grad_ties_go_to_the_first_maximum() -> None:
    """A window of equal values gives its dy to its first tap; one whose every value is -inf to its first
    tap when that is in the image, and to nobody when tap 0 is padding; one with a nan to nobody."""
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, :2] = -np.inf
    x[0, 0, 2, 2] = np.nan
    dy = np.arange(1.0, 10.0).reshape(1, 1, 3, 3)
    attrs = {"kernel_size": (2, 2), "stride": (2, 2), "padding": (1, 1)}
    (got,), (want,) = both("max_pool2d_grad", x, dy, **attrs)
    np.testing.assert_array_equal(got, want)
    assert got[0, 0, 2, 2] == 0 and got[0, 0, 0, 0] == 0  # the nan's window; tap 0 in the padding


def _grad_by_windows(x: Any, dy: Any, kernel: Any, stride: Any, padding: Any) -> Any:
    """The reference of max_pool_grad_planes: a window at a time in row-major order, its dy added at the
    first tap holding its strict maximum (padding -inf), nothing for a window with a nan."""
    dx = np.zeros_like(x)
    for p, r, q in np.ndindex(dy.shape):
        r0, c0 = r * stride[0] - padding[0], q * stride[1] - padding[1]
        best, at, nan = -np.inf, (r0, c0), False
        for i, j in np.ndindex(*kernel):
            if 0 <= r0 + i < x.shape[1] and 0 <= c0 + j < x.shape[2]:
                v = x[p, r0 + i, c0 + j]
                nan |= bool(v != v)
                best, at = (v, (r0 + i, c0 + j)) if v > best else (best, at)
        if not nan and 0 <= at[0] < x.shape[1] and 0 <= at[1] < x.shape[2]:
            dx[p, at[0], at[1]] += dy[p, r, q]
    return dx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kernel, stride, padding, hw",
    [
        ((3, 3), (2, 2), (1, 1), (8, 8)),  # ResNet's stem pool
        ((3, 3), (2, 2), (1, 1), (7, 9)),  # odd sizes
        ((3, 3), (2, 2), (0, 0), (7, 8)),
        ((2, 3), (1, 2), (1, 0), (5, 7)),
        ((3, 2), (3, 3), (1, 1), (8, 7)),  # the column phases' generic loop
        ((3, 3), (1, 1), (1, 1), (5, 6)),  # overlapping windows at stride 1
    ],
)
def test_max_pool_grad_matches_a_window_at_a_time_bit_for_bit(
    dtype: Any, kernel: Any, stride: Any, padding: Any, hw: Any
) -> None:
    """The phase planes' loops add the same values in the same order as a window-by-window search:
    ties, -inf, nan and signed zeros included."""
    rng = np.random.default_rng(11)
    x = _values(rng, (3, *hw), dtype, special=True)
    x[0] = rng.standard_normal(hw).astype(dtype)
    x[1, 0, :] = -0.0
    oh, ow = ((hw[a] + 2 * padding[a] - kernel[a]) // stride[a] + 1 for a in (0, 1))
    dy = rng.standard_normal((3, oh, ow)).astype(dtype)
    dy[1, 0, :] = -0.0
    dx = np.full_like(x, 5.0)
    pool_jit.max_pool_grad_planes(x, dy, kernel, stride, padding, dx)
    want = _grad_by_windows(x, dy, kernel, stride, padding)
    np.testing.assert_array_equal(dx, want)
    assert np.array_equal(np.signbit(dx), np.signbit(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hw", [(4, 6), (5, 7), (2, 2)])
@pytest.mark.parametrize("special", [False, True])
def test_max_pool_grad_2x2_tiles_match_numpy_and_torch(dtype: Any, hw: Any, special: bool) -> None:
    """The 2x2, stride 2 windows take their own branch-free loop: as the numpy kernel (ties to the first
    tap, nan windows to nobody, an odd last row and column zero), and, without nan, as torch's backward."""
    rng = np.random.default_rng(7)
    x = _values(rng, (2, 3, *hw), dtype, special)
    attrs = {"kernel_size": (2, 2), "stride": (2, 2), "padding": (0, 0)}
    dy = rng.standard_normal((2, 3, hw[0] // 2, hw[1] // 2)).astype(dtype)
    (got,), (want,) = both("max_pool2d_grad", x, dy, **attrs)
    np.testing.assert_array_equal(got, want)
    if not special:
        torch = pytest.importorskip("torch")
        tx = torch.from_numpy(x).requires_grad_()
        torch.nn.functional.max_pool2d(tx, 2, 2).backward(torch.from_numpy(dy))
        np.testing.assert_array_equal(got, tx.grad.numpy())


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(
    lead=st.lists(st.integers(1, 4), max_size=2),
    n=st.integers(2, 40),
    seed=st.integers(0, 2**32 - 1),
    special=st.booleans(),
)
def test_topk_and_its_gradient(dtype: Any, lead: list[int], n: int, seed: int, special: bool) -> None:
    rng = np.random.default_rng(seed)
    x = _values(rng, (*lead, n), dtype, special)
    k = int(rng.integers(1, n + 1))
    got, want = both("topk", x, k=k)
    same(got, want, dtype, f"topk {x.shape} k={k}", exact=True)  # ties: the lower index; nan last
    dy = rng.standard_normal(got[0].shape).astype(dtype)
    if k > 1:  # a strided view of one column is contiguous
        same(*both("topk_grad", dy, got[1], size=n), dtype, f"topk_grad {x.shape} k={k}", exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(
    shape=st.lists(st.integers(2, 4), min_size=1, max_size=3),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_and_its_gradient(dtype: Any, shape: list[int], data: st.DataObject, seed: int) -> None:
    """gather against the numpy kernel, with indices outside [0, n) too (rows of zeros on both); its
    gradient, repeated indices on any axis, each table row's sum in index order to the last bit, as
    numpy's unbuffered ``add.at`` (and the numpy kernel's stable sort and reduceat) add them."""
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(0, len(shape) - 1))
    idx_shape, size = data.draw(st.lists(st.integers(0, 5), max_size=2)), shape[axis]  # 0: no index
    itype = data.draw(st.sampled_from(DTYPES_INT))
    x = rng.standard_normal(shape).astype(dtype)
    outside = rng.integers(-1, size + 1, size=idx_shape).astype(itype)
    same(*both("gather", x, outside, axis=axis), dtype, f"gather {shape} axis {axis}", exact=True)
    indices = rng.integers(0, size, size=idx_shape).astype(itype)
    dy = rng.standard_normal((*shape[:axis], *indices.shape, *shape[axis + 1 :])).astype(dtype)
    (got,) = EagerBuilder().call("gather_grad", dy, indices, axis=axis, size=size)
    want = np.zeros(shape, dtype)
    rows = np.moveaxis(dy.reshape((*shape[:axis], indices.size, *shape[axis + 1 :])), axis, 0)
    np.add.at(np.moveaxis(want, axis, 0), indices.reshape(-1), rows)  # in index order, as both kernels
    np.testing.assert_array_equal(got, want)
