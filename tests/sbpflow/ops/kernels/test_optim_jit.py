"""sbpflow/ops/kernels/optim_jit.py's one-pass AdamW against optim.py's numpy passes, bit for bit.

The same values run as C-contiguous arrays (the loop) and as strided views (``jit_loops`` refuses them:
the numpy kernel); both results must be equal to the last bit, at every step's bias correction and
schedule, for float32 and float64, with the moments donated (written in place) and the parameter's
output lent by the runtime, and with the sizes that leave a vector loop's remainder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from sbpflow.ops.base import KernelContext, get_op

numba = pytest.importorskip("numba")
from sbpflow.ops.kernels import optim_jit  # noqa: E402  (needs numba)


@dataclass(frozen=True)
class Runtime(KernelContext):
    donated: frozenset[int] = frozenset()
    out_buffers: tuple[Any, ...] = ()


ATTRS: list[dict[str, Any]] = [
    {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
    {"lr": 3e-2, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.0},
    {
        "lr": 1e-2,
        "schedule": "warmup_cosine",
        "warmup_steps": 2,
        "total_steps": 10,
        "min_lr_ratio": 0.1,
    },
]


def strided(a: Any) -> Any:
    """``a``'s values as a view with a step of 2: not C-contiguous, so the numpy kernel runs."""
    return np.repeat(a, 2, axis=-1)[..., ::2]


def update(arrays: list[Any], attrs: dict[str, Any], step: int, **ctx: Any) -> Any:
    op = get_op("adamw_update")
    metas = tuple(None for _ in arrays)
    c = Runtime(np, op.normalize_attrs(attrs), metas, metas, (), (), 0, step, **ctx)  # type: ignore[arg-type]
    return op.run_kernel(c, arrays)


def draw(shape: tuple[int, ...], dtype: Any, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    param, grad, m = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    grad[..., :1] *= 1e-30  # a gradient far below eps, whose root underflows
    return [param, grad, m, (rng.random(shape) * rng.choice([1e-12, 1.0, 1e6], shape)).astype(dtype)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 17), (2, 3, 1001)])
@pytest.mark.parametrize("attrs", ATTRS)
@pytest.mark.parametrize("step", [0, 1, 5, 9])
def test_the_loop_is_the_numpy_kernel_bit_for_bit(
    dtype: Any, shape: tuple[int, ...], attrs: dict[str, Any], step: int
) -> None:
    arrays = draw(shape, dtype, seed=step)
    want = update([strided(a) for a in arrays], attrs, step)
    got = update([a.copy() for a in arrays], attrs, step)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == shape and g.flags.c_contiguous
        np.testing.assert_array_equal(g, w)


def test_the_loop_runs_on_contiguous_arrays() -> None:
    update(draw((5,), np.float32, 0), ATTRS[0], 0)
    update(draw((5,), np.float64, 0), ATTRS[0], 0)
    assert len(optim_jit.adamw_all.signatures) >= 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_donated_moments_and_a_lent_parameter_buffer_are_written_in_place(dtype: Any) -> None:
    arrays = draw((4, 33), dtype, 7)
    want = update([strided(a) for a in arrays], ATTRS[0], 2)
    param, grad, m, v = (a.copy() for a in arrays)
    lent = np.empty_like(param)
    got = update([param, grad, m, v], ATTRS[0], 2, donated=frozenset({2, 3}), out_buffers=(lent,))
    assert got[0] is lent and got[1] is m and got[2] is v
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(param, arrays[0])  # neither donated nor lent: unwritten
    np.testing.assert_array_equal(grad, arrays[1])


def test_moments_not_donated_and_a_strided_lent_buffer_are_left_alone() -> None:
    arrays = draw((64,), np.float32, 3)
    copies = [a.copy() for a in arrays]
    lent = np.empty(128, np.float32)[::2]  # the right shape, not C-contiguous: the loop cannot write it
    got = update(arrays, ATTRS[0], 0, out_buffers=(lent,))
    assert got[0] is not lent and got[1] is not arrays[2] and got[2] is not arrays[3]
    for a, c in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(a, c)


SGD_ATTRS: list[dict[str, Any]] = [
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 1e-3, "momentum": 0.8, "weight_decay": 1e-4},
    {"lr": 3e-2, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": True},
    {"lr": 1e-2, "momentum": 0.5, "schedule": "warmup_cosine", "warmup_steps": 2, "total_steps": 10},
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 17), (2, 3, 1001)])
@pytest.mark.parametrize("attrs", SGD_ATTRS)
@pytest.mark.parametrize("clipped", [False, True])
def test_sgd_with_momentum_in_one_pass_is_the_numpy_kernel_bit_for_bit(
    dtype: Any, shape: tuple[int, ...], attrs: dict[str, Any], clipped: bool
) -> None:
    """The runtime lends the parameter and donates the buffer: one loop writes both in place, and gives
    the numpy passes' bits (strided views of the same values, which the loop refuses), step after step."""
    rng = np.random.default_rng(len(shape))
    param, grad, buf = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    clip = [np.asarray([0.37], dtype)] if clipped else []
    op = get_op("clipped_sgd_update" if clipped else "sgd_update")
    metas = tuple(None for _ in range(3 + clipped))
    ref = [strided(param), strided(buf)]
    for step in range(3):
        grad = rng.standard_normal(shape).astype(dtype)
        c = Runtime(np, op.normalize_attrs(attrs), metas, metas, (), (), 0, step)  # type: ignore[arg-type]
        ref = list(op.run_kernel(c, [ref[0], strided(grad), ref[1], *clip]))
        lent = Runtime(
            np,
            op.normalize_attrs(attrs),
            metas,
            metas,
            (),
            (),
            0,
            step,  # type: ignore[arg-type]
            donated=frozenset({2}),
            out_buffers=(param,),
        )
        got = op.run_kernel(lent, [param, grad, buf, *clip])
        assert got[0] is param and got[1] is buf
        np.testing.assert_array_equal(param, ref[0])
        np.testing.assert_array_equal(buf, ref[1])
    assert len(optim_jit.sgd_momentum_in_place.signatures) >= 1
