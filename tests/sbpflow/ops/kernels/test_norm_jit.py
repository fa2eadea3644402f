"""sbpflow/ops/kernels/norm_jit.py's loops against norm_stats.py's numpy kernels, the reference they replace.

Each op runs twice on the same values: on C-contiguous inputs (the numba loops) and with x as a strided
view, which ``rowwise.jit_loops`` refuses (the numpy kernel). Odd shapes, batch 1, 2-d to 4-d x, and a
float32 channel whose mean is far from zero, where a float32 accumulator would lose the variance.
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

TOL = {np.float64: (1e-12, 1e-13), np.float32: (2e-6, 2e-6)}


def both(op: str, *inputs: Any, at: int = 0) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The op's outputs on contiguous inputs (the loops) and with input ``at`` strided (numpy)."""
    assert jit_loops("norm_jit", np, *inputs) is not None, "numba is a dependency: the fast path runs"
    slow = tuple(strided(t) if i == at else t for i, t in enumerate(inputs))
    assert jit_loops("norm_jit", np, *slow) is None
    return EagerBuilder().call(op, *inputs), EagerBuilder().call(op, *slow)


def same(got: tuple[Any, ...], want: tuple[Any, ...], dtype: Any) -> None:
    rtol, atol = TOL[dtype]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"output {i}")


@st.composite
def images(draw: st.DrawFn) -> tuple[int, ...]:
    # the last axis >= 2, else its strided view would still count as contiguous
    rest = draw(
        st.lists(st.integers(1, 9), min_size=0, max_size=2).map(lambda r: [*r[:-1], r[-1] + 1] if r else r)
    )
    return (draw(st.integers(1, 5)), draw(st.integers(1 if rest else 2, 6)), *rest)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(shape=images(), seed=st.integers(0, 2**31))
def test_each_loop_equals_the_numpy_kernel(dtype: Any, shape: tuple[int, ...], seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, dy = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    mean, a, b = (rng.standard_normal(shape[1]).astype(dtype) for _ in range(3))
    same(*both("channel_var", x, mean), dtype)
    same(*both("channel_var_grad", x, mean, a), dtype)
    same(*both("channel_affine", x, mean, a, b), dtype)
    same(*both("channel_affine_grad", dy, x, mean), dtype)
    same(*both("channel_affine_grad", dy, x, mean, at=1), dtype)
    c, d = (rng.standard_normal(shape[1]).astype(dtype) for _ in range(2))
    same(*both("channel_var_dmean", x, mean, a), dtype)
    same(*both("channel_input_grad", dy, x, mean, a, c, d), dtype)
    same(*both("channel_input_grad", dy, x, mean, a, c, d, at=1), dtype)


def test_float32_variance_of_an_offset_channel_keeps_its_digits() -> None:
    rng = np.random.default_rng(0)
    x = (100.0 + rng.standard_normal((16, 3, 32, 32))).astype(np.float32)
    mean = x.astype(np.float64).mean(axis=(0, 2, 3))
    (var,) = EagerBuilder().call("channel_var", x, mean.astype(np.float32))
    # centred in float64: only the float32 rounding of the mean (1e2 * 6e-8) is lost, squared
    np.testing.assert_allclose(var, x.astype(np.float64).var(axis=(0, 2, 3)), rtol=1e-6)
