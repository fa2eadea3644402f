"""sbpflow/ops/reduction.py's kernels beyond their cases (cases_reduction.py): what they hand back.

broadcast_to returns a read-only view of its input on numpy, as PyTorch's expand. Writers into arrays
check that they may (a donation needs a writeable array; the runtime's OutputReuse keeps only arrays that
own their memory, tests/actor_workers/execution/test_output_reuse.py), so a consumer that would write into
it gets an error, never x's values changed behind its back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.dtype import as_dtype
from sbpflow.ops import fused
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.ops.eager import EagerBuilder
from sbpflow.tensor_meta import TensorMeta


def test_broadcast_to_is_a_read_only_view_of_x_on_numpy() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3, 1)
    (y,) = EagerBuilder().call("broadcast_to", x, shape=(4, 2, 3, 5))
    np.testing.assert_array_equal(y, np.broadcast_to(x, (4, 2, 3, 5)))
    assert np.shares_memory(y, x) and not y.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        y[0, 0, 0, 0] = 1.0
    (z,) = EagerBuilder().call("mul", y, y)  # a consumer reads it as any array
    np.testing.assert_array_equal(z, np.broadcast_to(x * x, z.shape))
    np.testing.assert_array_equal(x.ravel(), np.arange(6))


@pytest.mark.parametrize(
    ("shape", "to"),
    [
        ((), (2, 3)),
        ((3,), (3,)),
        ((0, 3), (2, 0, 3)),
        ((2, 1), (4, 2, 5)),
        ((1, 1), (1, 1)),
        ((5, 1, 4), (5, 3, 4)),
    ],
)
@pytest.mark.parametrize("contiguous", [True, False])
def test_broadcast_to_views_equal_numpys_on_every_shape(
    shape: tuple[int, ...], to: tuple[int, ...], contiguous: bool
) -> None:
    """The view is made from x's buffer and strides of its own (C-contiguous x); a strided x takes
    np.broadcast_to. Both must hold numpy's values, 0-d and empty arrays included."""
    base = np.random.default_rng(0).standard_normal((*shape[:-1], 2 * shape[-1]) if shape else ())
    x = (
        base[..., ::2]
        if shape and not contiguous
        else np.ascontiguousarray(base[..., : shape[-1]] if shape else base)
    )
    (y,) = EagerBuilder().call("broadcast_to", x, shape=to)
    assert y.shape == to and not y.flags.writeable
    np.testing.assert_array_equal(y, np.broadcast_to(x, to))


def test_broadcast_to_a_shape_x_does_not_fit_raises_numpys_error() -> None:
    """The strides are made by hand, so a local shape that does not broadcast (a mismatched shard) must
    reach np.broadcast_to's error, not a view of the wrong values."""
    x = np.zeros((3,), np.float32)
    ctx = KernelContext(np, {"shape": (2, 4)}, (), (), (), ((slice(0, 2), slice(0, 4)),))
    with pytest.raises(ValueError, match="broadcast"):
        get_op("broadcast_to").run_kernel(ctx, [x])


@dataclass(frozen=True)
class _Lending(KernelContext):
    out_buffers: tuple[Any, ...] = ()


def _channel_context(x_shape: tuple[int, ...], dtype: Any, lent: Any, keepdims: bool = False) -> Any:
    """mean_grad's context over batch norm's axes (all but 1) of x_shape, lending ``lent``."""
    dy_shape = (1, x_shape[1], 1, 1) if keepdims else (x_shape[1],)
    axes = (0, 2, 3)
    attrs = {"shape": x_shape, "axes": axes, "keepdims": keepdims}
    whole = tuple(slice(0, s) for s in x_shape)
    metas = (TensorMeta(dy_shape, as_dtype(np.dtype(dtype).name)),)
    out = (TensorMeta(x_shape, as_dtype(np.dtype(dtype).name)),)
    return _Lending(
        np, attrs, metas, out, (tuple(slice(0, s) for s in dy_shape),), (whole,), out_buffers=(lent,)
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("keepdims", [False, True])
def test_mean_grad_over_channels_fills_a_lent_buffer_bit_for_bit(dtype: Any, keepdims: bool) -> None:
    """Batch norm's mean_grad (norm_jit.fill_planes) returns the runtime's dead buffer, holding the bits
    of numpy's broadcast copy (the path it replaced, still cupy's); a buffer of another dtype is not
    taken."""
    x_shape = (3, 5, 4, 7)
    dy = np.random.default_rng(0).normal(size=(1, 5, 1, 1) if keepdims else (5,)).astype(dtype)
    kernel = get_op("mean_grad").kernel
    lent = np.full(x_shape, np.nan, dtype)
    got = kernel(_channel_context(x_shape, dtype, lent, keepdims), dy)
    want = np.broadcast_to(dy.reshape(1, 5, 1, 1) / dtype(3 * 4 * 7), x_shape)
    assert got is lent and np.array_equal(got, want)
    other = np.empty(x_shape, np.float16)
    assert kernel(_channel_context(x_shape, dtype, other, keepdims), dy) is not other


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mean_over_channels_is_the_float64_sum_rounded_once(dtype: Any) -> None:
    """Batch norm's mean (norm_jit.channel_sums): a float64 sum over the batch and positions, divided
    and rounded to x's dtype once, so float32 lands within an ulp of the float64 mean; a strided x takes
    numpy's sum and agrees to float32's precision."""
    x = (np.random.default_rng(1).normal(size=(8, 6, 9, 9)) + 3.0).astype(dtype)
    (got,) = EagerBuilder().call("mean", x, axes=(0, 2, 3))
    exact = x.astype(np.float64).mean(axis=(0, 2, 3))
    assert got.dtype == dtype and got.shape == (6,)
    # float64: the reference's own sum rounds too (numpy's pairwise order against the loop's)
    np.testing.assert_allclose(got, exact, rtol=np.finfo(dtype).eps if dtype == np.float32 else 1e-14)
    (slow,) = EagerBuilder().call("mean", np.repeat(x, 2, axis=-1)[..., ::2], axes=(0, 2, 3))
    np.testing.assert_allclose(slow, exact, rtol=1e-6 if dtype == np.float32 else 1e-14)


def _squares_by_ops(xs: list[np.ndarray]) -> Any:
    """The clipping norm's sum unfused: pow_scalar and a whole-array sum by the eager builder, then add."""
    b, total = EagerBuilder(), None
    for x in xs:
        (s,) = b.call("sum", b.call("pow_scalar", x, exponent=2.0)[0])
        total = s if total is None else b.call("add", total, s)[0]
    return total


@pytest.mark.parametrize("scratch", [fused.SQUARES_SCRATCH, 1000])  # 1000: the buffer filled many times
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_sum_squares_holds_the_bits_of_its_unfused_ops(
    dtype: Any, scratch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sum_squares calls the square and the whole-array sum loop directly (fused.py), not through their
    kernels: on contiguous, strided, 0-d and 1-element inputs, contiguous ones alone (squared into one
    scratch buffer, whose runs one call sums, filled once or many times), and float16 (which takes
    numpy's sum), the result is bit-for-bit the unfused ops'."""
    monkeypatch.setattr(fused, "SQUARES_SCRATCH", scratch)
    rng = np.random.default_rng(3)
    xs = [
        rng.standard_normal((128, 64)).astype(dtype),
        rng.standard_normal((64, 192)).astype(dtype)[:, ::3],
        np.asarray(rng.standard_normal(), dtype),
        rng.standard_normal((1,)).astype(dtype),
        (rng.standard_normal((1000,)) * 1e3).astype(dtype),
        rng.standard_normal((300, 301)).astype(dtype),
    ]
    # all of them, and the contiguous ones alone (float32/64: one scratch buffer, the loop called directly),
    # and sizes around the loop's vector widths one after another
    runs = [rng.standard_normal((n,)).astype(dtype) for n in (*range(0, 40), 63, 64, 65, 255, 257, 999)]
    for some in (xs, [xs[0], xs[3], xs[4], xs[5], xs[0]], runs):
        (got,) = EagerBuilder().call("sum_squares", *some)
        want = _squares_by_ops(some)
        assert got.dtype == want.dtype == dtype and got.shape == ()
        assert got.tobytes() == np.asarray(want).tobytes(), (got, want)
