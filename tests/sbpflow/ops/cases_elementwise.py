"""Cases for sbpflow/ops/elementwise.py."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, away_from, case, shapes


@st.composite
def _broadcast_pair(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    # drop leading axes and set some sizes to 1 on the second operand so that broadcasting is exercised
    k = draw(st.integers(0, len(shape) - 1))
    other = tuple(1 if draw(st.booleans()) else d for d in shape[k:])
    a, b = (arrays(shape, draw), arrays(other, draw))
    return Example((a, b) if draw(st.booleans()) else (b, a))


@st.composite
def _unary(draw: st.DrawFn, kinks: tuple[float, ...] = ()) -> Example:
    return Example((away_from(arrays(draw(shapes()), draw), kinks),))


case(OpCase("add", _broadcast_pair(), lambda a, b: [np.add(a, b)], differentiable=(0, 1)))
case(OpCase("mul", _broadcast_pair(), lambda a, b: [a * b], differentiable=(0, 1)))
case(OpCase("relu", _unary(kinks=(0.0,)), lambda x: [np.where(x > 0, x, 0.0)]))
case(
    OpCase(
        "relu_grad",
        _broadcast_pair().filter(lambda e: e.inputs[0].shape == e.inputs[1].shape),
        lambda dy, y: [dy * (y > 0)],
        differentiable=(),
    )
)
