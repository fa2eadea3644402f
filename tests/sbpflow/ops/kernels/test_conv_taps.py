"""sbpflow/ops/kernels/conv_taps.py's shifted-taps conv2d and its grid weight gradient against conv.py's
numpy kernels and torch.

Each op runs on C-contiguous inputs that take the path (checked: it counts its calls) and on a strided
view of x, which takes the numpy im2col kernel; the functions also run alone against torch. Kernels 3x3,
5x3 and 2x2, dilation 1 and 2, padding 0 to 3, odd and non-square images, output channels in blocks of
four and not; float64 to rounding, float32 to its precision. An x that is not all finite leaves the grid
for the window rows, whose nans are only where the true sums have them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.eager import EagerBuilder
from tests.sbpflow.ops.kernels.test_conv_winograd import close

pytest.importorskip("numba")
from sbpflow.ops.kernels import conv_taps  # noqa: E402  (needs numba)

# (n, c, h, w, o, kernel, padding, dilation): outputs 32 wide or more and 7 channels or fewer
CASES = [
    (2, 3, 32, 32, 16, (3, 3), (1, 1), (1, 1)),  # a ResNet stem
    (3, 1, 9, 35, 4, (5, 3), (2, 1), (1, 1)),  # one channel, not square, odd
    (1, 7, 6, 40, 5, (3, 3), (0, 3), (2, 1)),  # dilated rows, wide padding, no row padding
    (2, 2, 5, 35, 3, (2, 2), (1, 0), (1, 2)),  # an even kernel, dilated columns
]


def tensors(case: tuple[Any, ...], dtype: Any) -> tuple[Any, Any]:
    n, c, h, w, o, kernel = case[:6]
    rng = np.random.default_rng(3)
    return rng.standard_normal((n, c, h, w)).astype(dtype), rng.standard_normal((o, c, *kernel)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES)
def test_conv2d_takes_the_taps_and_matches_the_numpy_kernel_and_torch(
    case: tuple[Any, ...], dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = conv_taps.conv
    monkeypatch.setattr(conv_taps, "conv", lambda *a: calls.append(1) or real(*a))
    x, w = tensors(case, dtype)
    padding, dilation = case[6], case[7]
    attrs = {"stride": (1, 1), "padding": padding, "dilation": dilation, "groups": 1}
    (got,) = EagerBuilder().call("conv2d", x, w, **attrs)
    assert calls == [1], "the taps path ran"
    (want,) = EagerBuilder().call("conv2d", np.repeat(x, 2, axis=-1)[..., ::2], w, **attrs)
    close(got, want, dtype, f"conv2d {case} against the numpy kernel")
    torch = pytest.importorskip("torch")
    peer = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), None, 1, padding, dilation)
    close(real(x, w, padding, dilation), peer.numpy(), dtype, f"conv2d {case} against torch")


def test_applies_to_few_channels_wide_and_stride_1_only() -> None:
    assert conv_taps.applies(3, (1, 1), 32)
    assert not conv_taps.applies(8, (1, 1), 32)  # Winograd's or the window rows'
    assert not conv_taps.applies(3, (1, 1), 16)  # too narrow to pay
    assert not conv_taps.applies(3, (2, 2), 32)
    assert not conv_taps.applies(3, (1, 2), 32)


# the weight gradient's grid at any width too: narrow and square images, 1 to 9 output channels
GRAD_CASES = [
    *CASES,
    (2, 3, 8, 8, 9, (3, 3), (1, 1), (1, 1)),  # two blocks of four and one channel more
    (1, 2, 5, 4, 1, (3, 2), (0, 1), (1, 1)),  # one output channel: no block
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", GRAD_CASES)
def test_grad_weight_takes_the_grid_and_matches_the_numpy_kernel_and_torch(
    case: tuple[Any, ...], dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = conv_taps.grad_weight
    monkeypatch.setattr(conv_taps, "grad_weight", lambda *a: calls.append(1) or real(*a))
    x, w = tensors(case, dtype)
    kernel, padding, dilation = case[5], case[6], case[7]
    attrs = {"stride": (1, 1), "padding": padding, "dilation": dilation, "groups": 1}
    (y,) = EagerBuilder().call("conv2d", x, w, **attrs)
    dy = np.random.default_rng(4).standard_normal(y.shape).astype(dtype)
    (got,) = EagerBuilder().call("conv2d_grad_weight", dy, x, kernel_hw=kernel, **attrs)
    assert calls == [1], "the grid path ran"
    (want,) = EagerBuilder().call(
        "conv2d_grad_weight", dy, np.repeat(x, 2, axis=-1)[..., ::2], kernel_hw=kernel, **attrs
    )
    close(got, want, dtype, f"conv2d_grad_weight {case} against the numpy kernel")
    torch = pytest.importorskip("torch")
    tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))
    peer = torch.ops.aten.convolution_backward(
        tdy, tx, tw, None, (1, 1), padding, dilation, False, (0, 0), 1, (False, True, False)
    )[1]
    close(real(dy, x, kernel, padding, dilation), peer.numpy(), dtype, f"grad_weight {case} against torch")


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_x_leaves_the_grid_for_the_window_rows(bad: float) -> None:
    """The grid's zero columns of dy meet x's values outside a tap's true windows: 0 * inf would make a
    nan where the true sum is finite. Such an x takes the window rows, whose nans and infs are exactly the
    numpy kernel's."""
    x, w = tensors(CASES[0], np.float64)
    x[1, 2, 5, 31] = bad  # the last column: read by the grid's wrapped runs of taps that never see it
    dy = np.random.default_rng(5).standard_normal((2, 16, 32, 32))
    attrs = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    assert conv_taps.grad_weight(dy, x, (3, 3), (1, 1), (1, 1)) is None
    (got,) = EagerBuilder().call("conv2d_grad_weight", dy, x, kernel_hw=(3, 3), **attrs)
    (want,) = EagerBuilder().call(
        "conv2d_grad_weight", dy, np.repeat(x, 2, axis=-1)[..., ::2], kernel_hw=(3, 3), **attrs
    )
    assert np.array_equal(np.isfinite(got), np.isfinite(want)) and np.isfinite(got[:, :2]).all()
    close(np.nan_to_num(got), np.nan_to_num(want), np.float64, "the finite taps")


def test_grad_weight_applies_to_few_channels_and_stride_1_at_any_width() -> None:
    assert conv_taps.applies_grad_weight(3, (1, 1))
    assert conv_taps.applies_grad_weight(7, (1, 1))
    assert not conv_taps.applies_grad_weight(8, (1, 1))  # Winograd's or the window rows'
    assert not conv_taps.applies_grad_weight(3, (2, 1))
