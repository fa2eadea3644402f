"""KernelContext.out_zeros: a scatter's zeroed output written into the runtime's lent array.

The lent array is the kernel's own dead previous output, holding that step's values (or, after an op
that wrote into a donated input, anything); a kernel that takes it must clear it, and gives the values
it gives on a new array."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.dtype import as_dtype
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.tensor_meta import TensorMeta


@dataclass(frozen=True)
class _Lending(KernelContext):
    out_buffers: tuple[Any, ...] = ()


def _whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, s) for s in shape)


def _context(ins: list[Any], out: tuple[int, ...], attrs: dict[str, Any], lent: Any) -> KernelContext:
    metas = tuple(TensorMeta(a.shape, as_dtype(a.dtype.name)) for a in ins)
    out_meta = TensorMeta(out, as_dtype(ins[0].dtype.name))
    return _Lending(
        np,
        attrs,
        metas,
        (out_meta,),
        tuple(_whole(a.shape) for a in ins),
        (_whole(out),),
        out_buffers=(lent,),
    )


CASES = {  # op -> (inputs, output shape, attrs)
    "embedding_grad": (
        [np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.array([[1, 5, 1], [0, 5, 7]])],
        (8, 4),
        {"num_embeddings": 8},
    ),
    "slice_grad": ([np.ones((2, 3), np.float64)], (5, 4), {"shape": (5, 4), "starts": (1, 1)}),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_a_lent_output_is_cleared_and_written_into(op: str) -> None:
    ins, out, attrs = CASES[op]
    kernel = get_op(op)
    fresh = kernel.kernel(_context(ins, out, kernel.normalize_attrs(attrs), None), *ins)
    lent = np.full(out, np.nan, dtype=ins[0].dtype)  # the dead previous value: anything at all
    got = kernel.kernel(_context(ins, out, kernel.normalize_attrs(attrs), lent), *ins)
    assert got is lent and np.array_equal(got, fresh)
    assert np.count_nonzero(fresh) < fresh.size  # some of it is the zeros the lent array did not hold


@pytest.mark.parametrize("op", sorted(CASES))
def test_a_lent_array_of_another_dtype_or_shape_is_not_taken(op: str) -> None:
    ins, out, attrs = CASES[op]
    kernel = get_op(op)
    for lent in (np.full(out, np.nan, np.float16), np.full((out[0] + 1, *out[1:]), np.nan, ins[0].dtype)):
        got = kernel.kernel(_context(ins, out, kernel.normalize_attrs(attrs), lent), *ins)
        assert got is not lent and not np.isnan(got).any() and got.shape == out
