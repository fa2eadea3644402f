"""sbpflow/ops/reduction.py's kernels beyond their cases (cases_reduction.py): what they hand back.

broadcast_to returns a read-only view of its input on numpy, as PyTorch's expand. Writers into arrays
check that they may (a donation needs a writeable array; the runtime's OutputReuse keeps only arrays that
own their memory, tests/actor_workers/execution/test_output_reuse.py), so a consumer that would write into
it gets an error, never x's values changed behind its back.
"""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.ops.eager import EagerBuilder


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
