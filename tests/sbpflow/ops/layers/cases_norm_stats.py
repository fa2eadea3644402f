"""Cases for sbpflow/ops/layers/norm_stats.py: the running statistic as PyTorch's BatchNorm writes it."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


@st.composite
def _running(draw: st.DrawFn) -> Example:
    shape = draw(shapes(max_side=7))
    n = draw(st.integers(2, 50))  # the values each statistic was taken over
    attrs = {
        "momentum": draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        "scale": draw(st.sampled_from([1.0, n / (n - 1)])),
    }
    return Example((arrays(shape, draw), arrays(shape, draw, 0.0, 3.0)), attrs)


def _running_ref(
    running: np.ndarray, stat: np.ndarray, momentum: float, scale: float = 1.0
) -> list[np.ndarray]:
    out = np.empty_like(running)
    for i in np.ndindex(running.shape):  # torch: running = (1 - momentum) * running + momentum * stat
        out[i] = (1.0 - momentum) * running[i] + momentum * (stat[i] * scale)
    return [out]


case(OpCase("running_stat", _running(), _running_ref, differentiable=()))


# ---- batch norm's passes: x [N, C, ...] with its per-channel values [C] ------------------------------------


@st.composite
def _channel_shape(draw: st.DrawFn) -> tuple[int, ...]:
    return (draw(st.integers(1, 5)), draw(st.integers(1, 5)), *draw(shapes(0, 2, max_side=5)))


@st.composite
def _planes_and_channels(draw: st.DrawFn, planes: int, channels: int) -> Example:
    """``planes`` arrays of one [N, C, ...] shape, then ``channels`` arrays [C]."""
    shape = draw(_channel_shape())
    return Example(
        (*(arrays(shape, draw) for _ in range(planes)), *(arrays((shape[1],), draw) for _ in range(channels)))
    )


def _channel_values(x: np.ndarray) -> list[np.ndarray]:
    """Each channel's values, every axis but 1 (plain indexing, no reduction over axes)."""
    rest = x.shape[:1] + x.shape[2:]
    return [np.array([x[(i[0], c, *i[1:])] for i in np.ndindex(rest)]) for c in range(x.shape[1])]


def _by_channel(x: np.ndarray, mean: np.ndarray, scale: np.ndarray, shift: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for c in range(x.shape[1]):
        out[:, c] = (x[:, c] - mean[c]) * scale[c] + shift[c]
    return out


def _var_ref(x: np.ndarray, mean: np.ndarray) -> list[np.ndarray]:
    return [np.array([((v - m) ** 2).mean() for v, m in zip(_channel_values(x), mean, strict=True)])]


def _var_grad_ref(x: np.ndarray, mean: np.ndarray, dvar: np.ndarray) -> list[np.ndarray]:
    count = x.size // x.shape[1]
    dx = _by_channel(x, mean, 2 * dvar / count, np.zeros_like(mean))
    values = _channel_values(x)
    return [
        dx,
        np.array([-2 * (v - m).sum() * d / count for v, m, d in zip(values, mean, dvar, strict=True)]),
    ]


def _affine_grad_ref(dy: np.ndarray, x: np.ndarray, mean: np.ndarray) -> list[np.ndarray]:
    dys, xs = _channel_values(dy), _channel_values(x)
    dot = [(d * (v - m)).sum() for d, v, m in zip(dys, xs, mean, strict=True)]
    return [np.array(dot), np.array([d.sum() for d in dys])]


case(OpCase("channel_var", _planes_and_channels(1, 1), _var_ref, differentiable=(0, 1)))
case(OpCase("channel_var_grad", _planes_and_channels(1, 2), _var_grad_ref, differentiable=()))
case(
    OpCase(
        "channel_affine",
        _planes_and_channels(1, 3),
        lambda *a: [_by_channel(*a)],
        differentiable=(0, 1, 2, 3),
    )
)
case(OpCase("channel_affine_grad", _planes_and_channels(2, 1), _affine_grad_ref, differentiable=()))


def _var_dmean_ref(x: np.ndarray, mean: np.ndarray, dvar: np.ndarray) -> list[np.ndarray]:
    return [_var_grad_ref(x, mean, dvar)[1]]


def _input_grad_ref(dy: np.ndarray, x: np.ndarray, *cs: np.ndarray) -> list[np.ndarray]:
    """channel_affine's dx (mean and shift zero) + channel_var_grad's dx + mean_grad's broadcast."""
    mean, scale, dvar, dmean = cs
    zero = np.zeros_like(mean)
    count = x.size // x.shape[1]
    dx3 = np.empty_like(x)
    for c in range(x.shape[1]):
        dx3[:, c] = dmean[c] / count
    return [_by_channel(dy, zero, scale, zero) + _var_grad_ref(x, mean, dvar)[0] + dx3]


case(OpCase("channel_var_dmean", _planes_and_channels(1, 2), _var_dmean_ref, differentiable=()))
case(OpCase("channel_input_grad", _planes_and_channels(2, 4), _input_grad_ref, differentiable=()))
