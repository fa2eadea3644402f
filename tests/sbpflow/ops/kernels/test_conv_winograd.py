"""sbpflow/ops/kernels/conv_winograd.py's F(2x2, 3x3) convolutions against conv.py's numpy kernels and torch.

The ops run on C-contiguous inputs wide enough for the Winograd path (checked: the path counts its
calls) and on a strided view, which takes the numpy im2col kernel; the functions also run alone against
torch. Odd output sizes (a half-empty last tile), padding 0, 1 and 2, non-square images, one sample a
block and several; float64 to ~1e-12 of the outputs' scale, float32 to its precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.eager import EagerBuilder

pytest.importorskip("numba")
from sbpflow.ops.kernels import conv_jit, conv_winograd  # noqa: E402  (needs numba)

TOL = {np.float64: (1e-11, 1e-12), np.float32: (2e-4, 2e-6)}  # rtol, atol as a share of the largest |value|
# (n, c, h, w, o, padding): outputs 8 wide or more and 8 channels or more, so that the path applies
CASES = [
    (2, 32, 8, 8, 32, 1),  # ResNet-18's second stage: 4 x 4 tiles
    (2, 8, 9, 10, 3, 0),  # the narrowest: 8 wide from 10 without padding
    (3, 8, 17, 16, 8, 1),  # odd output height: the last row of tiles half outside
    (2, 9, 18, 33, 5, 0),  # odd output width, no padding, fewer output channels
    (2, 8, 16, 20, 9, 2),  # padding 2, not square
    (1, 16, 32, 32, 16, 1),  # a ResNet block
]


def strided(a: Any) -> Any:
    """The same values as a view with a step of 2 along the last axis: not C-contiguous."""
    return np.repeat(a, 2, axis=-1)[..., ::2]


def close(got: Any, want: Any, dtype: Any, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape} vs {want.shape}"
    )
    assert got.flags.c_contiguous, what
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * np.abs(want).max(), err_msg=what)


def tensors(case: tuple[int, ...], dtype: Any, seed: int = 0) -> tuple[Any, Any, Any]:
    n, c, h, w, o, p = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((o, c, 3, 3)).astype(dtype)
    dy = rng.standard_normal((n, o, h + 2 * p - 2, w + 2 * p - 2)).astype(dtype)
    return x, wt, dy


@pytest.mark.parametrize("block_bytes", [conv_winograd.BLOCK_BYTES, 1])  # 1: a sample a block
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES)
def test_ops_take_winograd_and_match_the_numpy_kernel(
    case: tuple[int, ...], dtype: Any, block_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conv_winograd, "BLOCK_BYTES", block_bytes)
    calls: list[str] = []
    for name in ("conv", "grad_weight"):
        real = getattr(conv_winograd, name)
        monkeypatch.setattr(conv_winograd, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    x, w, dy = tensors(case, dtype)
    p = case[-1]
    attrs = {"stride": (1, 1), "padding": (p, p), "dilation": (1, 1), "groups": 1}
    runs = [
        ("conv2d", (x, w), 0, {}),
        ("conv2d_grad_input", (dy, w), 0, {"input_hw": x.shape[2:]}),
        ("conv2d_grad_weight", (dy, x), 1, {"kernel_hw": (3, 3)}),
    ]
    for op, inputs, at, extra in runs:
        (got,) = EagerBuilder().call(op, *inputs, **attrs, **extra)
        slow = tuple(strided(t) if i == at else t for i, t in enumerate(inputs))
        (want,) = EagerBuilder().call(op, *slow, **attrs, **extra)
        close(got, want, dtype, f"{op} {case}")
    # grad_input at stride 1 is conv2d of dy (o channels) by the flipped weight: Winograd where o >= 8
    assert calls == ["conv"] * (1 + (case[4] >= conv_winograd.MIN_CHANNELS)) + ["grad_weight"], calls


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", [*CASES, (2, 1, 3, 3, 1, 0), (1, 2, 5, 6, 3, 0), (2, 3, 7, 9, 5, 2)])
def test_against_torch(case: tuple[int, ...], dtype: Any) -> None:
    """The functions alone, tiny and odd shapes included (one tile, a half tile, padding past a 3-wide
    image): y and dw of torch's conv2d and its backward."""
    torch = pytest.importorskip("torch")
    x, w, dy = tensors(case, dtype, seed=1)
    p = case[-1]
    tx, tw = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
    ty = torch.nn.functional.conv2d(tx, tw, None, 1, p)
    ty.backward(torch.from_numpy(dy))
    close(conv_winograd.conv(x, w, (p, p)), ty.detach().numpy(), dtype, f"y {case}")
    close(conv_winograd.grad_weight(dy, x, (p, p)), tw.grad.numpy(), dtype, f"dw {case}")


def test_applies_to_wide_3x3_stride_1_convolutions_only() -> None:
    ok = {"c": 16, "kernel": (3, 3), "stride": (1, 1), "dilation": (1, 1), "out_w": 32}
    assert conv_winograd.applies(**ok)
    assert conv_winograd.applies(**{**ok, "c": 8}) and conv_winograd.applies(**{**ok, "out_w": 8})
    for change in [
        {"c": 3},  # a stem: too few channels for the transforms to pay
        {"c": 7},
        {"out_w": 7},  # narrow: the window rows' GEMM is sooner
        {"kernel": (3, 1)},
        {"kernel": (5, 5)},
        {"stride": (2, 2)},
        {"stride": (1, 2)},
        {"dilation": (2, 2)},
    ]:
        assert not conv_winograd.applies(**{**ok, **change}), change


def test_conv_jit_routes_to_winograd_and_keeps_its_window_rows_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """conv2d and its weight gradient of 8 channels take Winograd; with fewer, the window rows."""
    x, w, dy = tensors((2, 8, 9, 16, 4, 1), np.float64)
    a = ((1, 1), (1, 1), (1, 1))
    np.testing.assert_array_equal(conv_jit.conv(x, w, *a), conv_winograd.conv(x, w, (1, 1)))
    np.testing.assert_array_equal(
        conv_jit.conv_grad_weight(dy, x, (3, 3), *a), conv_winograd.grad_weight(dy, x, (1, 1))
    )
    monkeypatch.setattr(conv_winograd, "MIN_CHANNELS", 9)  # the window rows now: the same values to rounding
    rows = conv_jit.conv_grad_weight(dy, x, (3, 3), *a)
    assert not np.array_equal(rows, conv_winograd.grad_weight(dy, x, (1, 1)))  # another rounding
    close(rows, conv_winograd.grad_weight(dy, x, (1, 1)), np.float64, "grad_weight by rows")
    close(conv_jit.conv(x, w, *a), conv_winograd.conv(x, w, (1, 1)), np.float64, "conv by rows")


def test_hard_coded_transforms_are_the_matrices() -> None:
    """input_tiles, dy_tiles, filter_tiles and fold_filters against B' d B, A dy A', G g G' and G' u G of
    the module's matrices, on every tile of a small image (odd sizes: tiles half past the edge)."""
    rng = np.random.default_rng(2)
    x, dy, w = (rng.standard_normal(s) for s in [(2, 3, 7, 9), (2, 4, 7, 9), (4, 3, 3, 3)])
    plan = conv_winograd._plan(x.shape, (1, 1), 8)
    th, tw = plan.th, plan.tw
    v, dm = np.empty((16, 3, 2 * plan.tiles)), np.empty((16, 4, 2 * plan.tiles))
    conv_winograd.input_tiles(x, 1, 1, plan.hh, v)
    conv_winograd.dy_tiles(dy, th + 1, dm)
    xp = np.zeros((2, 3, 2 * th + 2, 2 * tw + 2))
    xp[:, :, 1:8, 1:10] = x
    yp = np.zeros((2, 4, 2 * th, 2 * tw))
    yp[:, :, :7, :9] = dy
    bt, a_, g = conv_winograd.BT, conv_winograd.AT.T, conv_winograd.G
    for t, s in np.ndindex(th, tw):  # tile (t, s) is j = t (TW + 1) + s of each sample
        j = np.arange(2) * plan.tiles + t * (tw + 1) + s
        d = xp[:, :, 2 * t : 2 * t + 4, 2 * s : 2 * s + 4]  # [2, C, 4, 4]
        want = np.einsum("ar,ncrq,bq->abcn", bt, d, bt).reshape(16, 3, 2)
        np.testing.assert_allclose(v[:, :, j], want, rtol=1e-13, atol=1e-13)
        e = yp[:, :, 2 * t : 2 * t + 2, 2 * s : 2 * s + 2]
        want = np.einsum("ar,norq,bq->abon", a_, e, a_).reshape(16, 4, 2)
        np.testing.assert_allclose(dm[:, :, j], want, rtol=1e-13, atol=1e-13)
    u, back = np.empty((16, 4, 3)), np.empty((4, 3, 3, 3))
    conv_winograd.filter_tiles(w, u)
    np.testing.assert_allclose(u, np.einsum("ai,ocij,bj->aboc", g, w, g).reshape(16, 4, 3), rtol=1e-13)
    conv_winograd.fold_filters(u, back)
    np.testing.assert_allclose(back, np.einsum("ai,aboc,bj->ocij", g, u.reshape(4, 4, 4, 3), g), rtol=1e-13)


@pytest.mark.parametrize("case", CASES)
def test_float32_within_its_bound_of_float64(case: tuple[int, ...]) -> None:
    """float32 y and dw against the float64 result of the same inputs: within 2e-6 of the largest
    |value| (observed ~3e-7; the transforms add and subtract up to 16 inputs, the GEMM sums 16 C)."""
    x, w, dy = tensors(case, np.float64, seed=3)
    p = (case[-1], case[-1])
    f32 = [t.astype(np.float32) for t in (x, w, dy)]
    for got, want in [
        (conv_winograd.conv(f32[0], f32[1], p), conv_winograd.conv(x, w, p)),
        (conv_winograd.grad_weight(f32[2], f32[0], p), conv_winograd.grad_weight(dy, x, p)),
    ]:
        assert got.dtype == np.float32
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
