"""Cases for sbpflow/ops/training/packing.py: a gradient bucket's pack and unpack, against plain numpy."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from sbpflow.ops.training.packing import shapes_attrs, unpacked_shapes
from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


@st.composite
def _pack(draw: st.DrawFn) -> Example:
    parts = draw(st.lists(shapes(0, 3, max_side=4), min_size=1, max_size=3))  # 0-d parts too (a scalar)
    return Example(tuple(arrays(s, draw) for s in parts))


def _pack_ref(*xs: np.ndarray) -> list[np.ndarray]:
    return [np.array([v for x in xs for v in np.asarray(x).flat])]


@st.composite
def _unpack(draw: st.DrawFn) -> Example:
    parts = draw(st.lists(shapes(0, 3, max_side=4), min_size=1, max_size=4))
    total = sum(int(np.prod(s)) for s in parts)
    return Example((arrays((total,), draw),), shapes_attrs(parts))


def _unpack_ref(x: np.ndarray, ndims: tuple[int, ...], dims: tuple[int, ...]) -> list[np.ndarray]:
    out, at = [], 0
    for shape in unpacked_shapes({"ndims": ndims, "dims": dims}):
        n = int(np.prod(shape))
        out.append(np.array(x[at : at + n]).reshape(shape))
        at += n
    return out


case(OpCase("pack", _pack(), _pack_ref, differentiable=(0, 1, 2)))
case(OpCase("unpack", _unpack(), _unpack_ref))
