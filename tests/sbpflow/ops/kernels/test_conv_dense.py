"""conv_jit's dense path (an image no larger than the kernel's window: one GEMM by a dense matrix) against
conv.py's numpy kernels and torch.

Each op runs on C-contiguous inputs, which take the path (checked: the dense matrix's builder and its
adjoint count their calls), and where the image is 2 wide or more on a strided view too, which takes
the numpy im2col kernel; all three ops also run against torch. A ResNet 2x2 block, a batch of one,
padding 0 to 3, stride 2, dilation 2, non-square images and kernels, a 1x1 image; float64 to ~1e-12
relative, float32 to its precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.eager import EagerBuilder
from tests.sbpflow.ops.kernels.test_conv_winograd import close, strided

pytest.importorskip("numba")
from sbpflow.ops.kernels import conv_jit  # noqa: E402  (needs numba)

# (n, c, h, w, o, kernel, stride, padding, dilation): images no larger than the kernel's window
CASES = [
    (3, 6, 2, 2, 5, (3, 3), (1, 1), (1, 1), (1, 1)),  # ResNet's last stage
    (1, 4, 2, 2, 3, (3, 3), (1, 1), (1, 1), (1, 1)),  # a batch of one
    (2, 3, 3, 3, 4, (3, 3), (1, 1), (0, 0), (1, 1)),  # no padding: one output position
    (2, 3, 2, 3, 4, (3, 3), (2, 1), (1, 0), (1, 1)),  # stride 2, not square
    (2, 5, 2, 2, 3, (3, 3), (1, 1), (2, 2), (2, 2)),  # dilation 2 (taps past the image: zero blocks)
    (2, 2, 1, 1, 3, (7, 7), (1, 1), (3, 3), (1, 1)),  # padding 3, a 1x1 image
    (2, 3, 2, 3, 2, (2, 4), (2, 2), (1, 1), (1, 1)),  # an even, non-square kernel
]


def tensors(case: tuple[Any, ...], dtype: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    n, c, h, w, o, kernel, stride, padding, dilation = case
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": 1}
    oh, ow = conv_jit._out_hw((h, w), kernel, stride, padding, dilation)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((o, c, *kernel)).astype(dtype)
    return x, wt, rng.standard_normal((n, o, oh, ow)).astype(dtype), attrs


def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("dense_weight", "dense_fold"):
        real = getattr(conv_jit, name)
        monkeypatch.setattr(conv_jit, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    return calls


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES)
def test_ops_take_the_dense_path_and_match_the_numpy_kernel_and_torch(
    case: tuple[Any, ...], dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, w, dy, attrs = tensors(case, dtype)
    hw, kernel = x.shape[2:], w.shape[2:]
    assert conv_jit.dense_taps(hw, kernel, attrs["stride"], attrs["padding"], attrs["dilation"]) is not None
    calls = counted(monkeypatch)
    ops = [
        ("conv2d", (x, w), {}),
        ("conv2d_grad_input", (dy, w), {"input_hw": hw}),
        ("conv2d_grad_weight", (dy, x), {"kernel_hw": kernel}),
    ]
    got = {op: EagerBuilder().call(op, *inputs, **attrs, **extra)[0] for op, inputs, extra in ops}
    assert calls == ["dense_weight", "dense_weight", "dense_fold"], calls
    if x.shape[3] > 1 and dy.shape[3] > 1:  # a strided view of a 1-wide image is contiguous
        for (op, inputs, extra), at in zip(ops, (0, 0, 1), strict=True):
            slow = tuple(strided(t) if i == at else t for i, t in enumerate(inputs))
            (want,) = EagerBuilder().call(op, *slow, **attrs, **extra)
            close(got[op], want, dtype, f"{op} {case} against the numpy kernel")
    torch = pytest.importorskip("torch")
    tx, tw = (torch.from_numpy(a).requires_grad_() for a in (x, w))
    peer = torch.nn.functional.conv2d(tx, tw, None, attrs["stride"], attrs["padding"], attrs["dilation"])
    peer.backward(torch.from_numpy(dy))
    close(got["conv2d"], peer.detach().numpy(), dtype, f"conv2d {case} against torch")
    close(got["conv2d_grad_input"], tx.grad.numpy(), dtype, f"conv2d_grad_input {case} against torch")
    close(got["conv2d_grad_weight"], tw.grad.numpy(), dtype, f"conv2d_grad_weight {case} against torch")


def test_dense_path_applies_to_images_no_larger_than_the_window_only() -> None:
    one = ((1, 1), (1, 1), (1, 1))
    assert conv_jit.dense_taps((2, 2), (3, 3), *one) is not None  # ResNet's 2x2 stage: 16 <= 2 * 9
    assert conv_jit.dense_taps((1, 1), (3, 3), *one) is not None
    assert conv_jit.dense_taps((4, 4), (3, 3), *one) is None  # larger than the window: more multiplies
    assert conv_jit.dense_taps((4, 4), (3, 3), (2, 2), (1, 1), (1, 1)) is None  # ResNet's stride-2 into 2x2
    assert conv_jit.dense_taps((3, 3), (3, 3), *one) is None  # 9 x 9 blocks: 4.5x the weight
    assert conv_jit.dense_taps((3, 3), (3, 3), (1, 1), (0, 0), (1, 1)) is not None  # one output position
    assert conv_jit.DENSE_MAX_SHARE == 2
    taps = conv_jit.dense_taps((2, 2), (3, 3), *one)
    # output (0, 0) reads input (0, 0) by the centre tap 4 and (1, 1) by tap 8; output (1, 1) reads
    # input (0, 0) by tap 0
    assert taps.shape == (4, 4) and taps[0, 0] == 4 and taps[0, 3] == 8 and taps[3, 0] == 0
    assert not taps.flags.writeable


def test_conv_jit_dense_stage_matches_the_window_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense path against conv_jit's own window rows (the path it replaced) on ResNet's 2x2 block."""
    x, w, dy, attrs = tensors((4, 16, 2, 2, 16, (3, 3), (1, 1), (1, 1), (1, 1)), np.float64)
    a = (attrs["stride"], attrs["padding"], attrs["dilation"])
    dense = conv_jit.conv(x, w, *a), conv_jit.conv_grad_weight(dy, x, (3, 3), *a)
    dense_in = conv_jit.conv_grad_input(dy, w, (2, 2), *a)
    monkeypatch.setattr(conv_jit, "DENSE_MAX_SHARE", 0)
    conv_jit.dense_taps.cache_clear()
    try:
        assert conv_jit.dense_taps((2, 2), (3, 3), *a) is None
        close(dense[0], conv_jit.conv(x, w, *a), np.float64, "conv2d")
        close(dense[1], conv_jit.conv_grad_weight(dy, x, (3, 3), *a), np.float64, "grad_weight")
        close(dense_in, conv_jit.conv_grad_input(dy, w, (2, 2), *a), np.float64, "grad_input")
    finally:
        conv_jit.dense_taps.cache_clear()
