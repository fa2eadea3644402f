"""sbpflow/ops/kernels/conv_taps.py's shifted-taps conv2d against conv.py's numpy kernel and torch.

conv2d runs on C-contiguous inputs that take the path (checked: it counts its calls) and on a strided
view of x, which takes the numpy im2col kernel; the function also runs alone against torch. Kernels 3x3,
5x3 and 2x2, dilation 1 and 2, padding 0 to 3, odd and non-square images; float64 to rounding, float32
to its precision.
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
