"""Cases for sbpflow/ops/elementwise.py.

References take the inputs positionally and the attributes by keyword, and are written with plain numpy
formulas (never the kernels). Random ops are referenced at seed 0, step 0, the eager builder's default.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from sbpflow.dtype import DType
from tests.sbpflow.ops.cases import Example, OpCase, arrays, away_from, case, shapes


def broadcastable(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``shape``: some leading axes dropped, some sizes set to 1."""
    k = draw(st.integers(0, len(shape) - 1))
    return tuple(1 if draw(st.booleans()) else d for d in shape[k:])


def _positive(draw: st.DrawFn, shape: tuple[int, ...]) -> np.ndarray:
    return arrays(shape, draw, 0.5, 2.0)


def _nonzero(draw: st.DrawFn, shape: tuple[int, ...]) -> np.ndarray:
    """Magnitudes in [0.5, 2] with either sign: safe to divide by."""
    return _positive(draw, shape) * np.where(arrays(shape, draw) >= 0, 1.0, -1.0)


@st.composite
def _broadcast_pair(draw: st.DrawFn, nonzero_b: bool = False) -> Example:
    shape = draw(shapes())
    other = broadcastable(draw, shape)
    big, small = draw(st.sampled_from([(shape, other), (other, shape)]))
    b = _nonzero(draw, small) if nonzero_b else arrays(small, draw)
    return Example((arrays(big, draw), b))


@st.composite
def unary(draw: st.DrawFn, kinks: tuple[float, ...] = (), positive: bool = False, **attrs: Any) -> Example:
    shape = draw(shapes())
    x = _positive(draw, shape) if positive else away_from(arrays(shape, draw), kinks)
    return Example((x,), {k: draw(v) for k, v in attrs.items()})


_values = st.sampled_from([-1.5, 0.0, 0.5, 2.0])

# ---- binary ---------------------------------------------------------------------------------------------

case(OpCase("add", _broadcast_pair(), lambda a, b: [np.add(a, b)], differentiable=(0, 1)))
case(OpCase("sub", _broadcast_pair(), lambda a, b: [np.subtract(a, b)], differentiable=(0, 1)))
case(OpCase("mul", _broadcast_pair(), lambda a, b: [a * b], differentiable=(0, 1)))
case(OpCase("div", _broadcast_pair(nonzero_b=True), lambda a, b: [a / b], differentiable=(0, 1)))

# ---- scalar ---------------------------------------------------------------------------------------------

case(OpCase("add_scalar", unary(value=_values), lambda x, value: [x + value]))
case(OpCase("mul_scalar", unary(value=_values), lambda x, value: [x * value]))
case(OpCase("rsub_scalar", unary(value=_values), lambda x, value: [value - x]))


@st.composite
def _nonzero_unary(draw: st.DrawFn, **attrs: Any) -> Example:
    return Example((_nonzero(draw, draw(shapes())),), {k: draw(v) for k, v in attrs.items()})


case(OpCase("rdiv_scalar", _nonzero_unary(value=_values), lambda x, value: [value / x]))
case(
    OpCase(
        "pow_scalar",
        unary(positive=True, exponent=st.sampled_from([0.0, 1.0, 2.0, 3.0, 0.5, -1.5])),
        lambda x, exponent: [np.power(x, exponent)],
    )
)
case(
    OpCase(
        "pow_scalar",
        unary(exponent=st.sampled_from([0.0, 2.0, 3.0])),  # integral exponents take negative x too
        lambda x, exponent: [np.power(x, exponent)],
        name="pow_scalar/signed",
    )
)

# ---- activations and unary math -------------------------------------------------------------------------


@st.composite
def _same_shape_pair(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    return Example((arrays(shape, draw), away_from(arrays(shape, draw), (0.0,))))


case(OpCase("relu", unary(kinks=(0.0,)), lambda x: [np.where(x > 0, x, 0.0)]))
case(OpCase("relu_grad", _same_shape_pair(), lambda dy, y: [dy * (y > 0)], differentiable=()))
case(OpCase("tanh", unary(), lambda x: [np.tanh(x)]))
case(OpCase("exp", unary(), lambda x: [np.exp(x)]))
case(OpCase("log", unary(positive=True), lambda x: [np.log(x)]))
case(OpCase("sqrt", unary(positive=True), lambda x: [np.sqrt(x)]))
case(OpCase("neg", unary(), lambda x: [0.0 - x]))
case(OpCase("identity", unary(), lambda x: [x.copy()]))
case(OpCase("detach", unary(), lambda x: [x.copy()], differentiable=(), stops_gradient=True))

# ---- casts and comparisons ------------------------------------------------------------------------------


@st.composite
def _cast(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    if draw(st.booleans()):
        x = arrays(shape, draw, -4.0, 4.0)
    else:
        x = np.floor(arrays(shape, draw, -4.0, 4.0)).astype(np.int64)
    return Example(
        (x,), {"dtype": draw(st.sampled_from([DType.float64, DType.float32, DType.int64, DType.bool]))}
    )


def _cast_reference(x: np.ndarray, dtype: DType) -> list[np.ndarray]:
    return [np.array(x, dtype=np.dtype(dtype.value))]


case(OpCase("cast", _cast(), _cast_reference, differentiable=()))
case(OpCase("cast", unary(dtype=st.just(DType.float64)), _cast_reference, name="cast/float64"))


@st.composite
def _labels(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    labels = np.floor(arrays(shape, draw, -1.0, 4.0)).astype(np.int64)  # -1 stands for an ignored label
    x = labels if draw(st.booleans()) else labels.astype(np.float64)
    return Example((x,), {"value": draw(st.sampled_from([-1, 0, 2, 0.5]))})


case(OpCase("ne_scalar", _labels(), lambda x, value: [np.not_equal(x, value)], differentiable=()))
case(OpCase("eq_scalar", _labels(), lambda x, value: [np.equal(x, value)], differentiable=()))
