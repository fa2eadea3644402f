"""Cases for sbpflow/ops/fused.py: the chains the fusion pass makes, each against a plain numpy formula.

Each case fixes one chain (``chain`` attribute) and draws shapes and values; the oracle then checks every
composed SBP row (a P input into a linear chain included), the gradient test the composed rules.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

from sbpflow.ops.fused import encode
from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes

_C = math.sqrt(2.0 / math.pi)


def _gelu(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1.0 + np.tanh(_C * (z + 0.044715 * z**3)))


# bias add, then the residual add (attention's and the MLP's c_proj in the GPT block)
_BIAS_RESIDUAL = encode([("add", {}, ["in0", "in1"]), ("add", {}, ["in2", "s0"])])
# bias add, a scale and GELU
_BIAS_SCALE_GELU = encode(
    [("add", {}, ["in0", "in1"]), ("mul_scalar", {"value": 0.5}, ["s0"]), ("gelu", {}, ["s1"])]
)
# an intermediate read twice: (x - y) * (x - y) + x, then tanh
_SQUARE_TANH = encode(
    [("sub", {}, ["in0", "in1"]), ("mul", {}, ["s0", "s0"]), ("add", {}, ["s1", "in0"]), ("tanh", {}, ["s2"])]
)
# batch norm's scale, 1 / sqrt(var + eps) * weight, with the sqrt and its reciprocal exported (outputs 1
# and 2: its backward reads them); the reciprocal writes into the dying var + eps, never into the sqrt
_BN_SCALE = encode(
    [
        ("add_scalar", {"value": 1e-5}, ["in0"]),
        ("sqrt", {}, ["s0"]),
        ("rdiv_scalar", {"value": 1.0}, ["s1"]),
        ("mul", {}, ["s2", "in1"]),
    ]
)
# the clipping norm's squared sum of one gradient: a reduction ends the chain
_SQUARED_SUM = encode([("pow_scalar", {"exponent": 2.0}, ["in0"]), ("sum", {}, ["s0"])])


@st.composite
def _bias_chain(draw: st.DrawFn, chain: str, residual: bool) -> Example:
    shape = draw(shapes(min_dims=2))
    ins = [arrays(shape, draw), arrays(shape[-1:], draw)]
    if residual:
        ins.append(arrays(shape, draw))
    return Example(tuple(ins), {"chain": chain})


@st.composite
def _pair(draw: st.DrawFn, chain: str) -> Example:
    shape = draw(shapes())
    return Example((arrays(shape, draw), arrays(shape, draw)), {"chain": chain})


def _bias_residual(x: np.ndarray, b: np.ndarray, r: np.ndarray, chain: Any) -> list[np.ndarray]:
    return [r + (x + b)]


def _bias_scale_gelu(x: np.ndarray, b: np.ndarray, chain: Any) -> list[np.ndarray]:
    return [_gelu((x + b) * 0.5)]


def _square_tanh(x: np.ndarray, y: np.ndarray, chain: Any) -> list[np.ndarray]:
    return [np.tanh((x - y) ** 2 + x)]


@st.composite
def _var_weight(draw: st.DrawFn) -> Example:
    shape = draw(shapes(max_dims=1))
    return Example(
        (arrays(shape, draw, 0.1, 2.0), arrays(shape, draw)), {"chain": _BN_SCALE, "exports": (1, 2)}
    )


def _bn_scale(var: np.ndarray, w: np.ndarray, chain: Any, exports: Any) -> list[np.ndarray]:
    root = np.sqrt(var + 1e-5)
    return [1.0 / root * w, root, 1.0 / root]


@st.composite
def _one(draw: st.DrawFn, chain: str) -> Example:
    return Example((arrays(draw(shapes()), draw),), {"chain": chain})


def _squared_sum(x: np.ndarray, chain: Any) -> list[np.ndarray]:
    return [np.asarray(np.sum(x * x))]


case(
    OpCase(
        "fused_elementwise",
        _bias_chain(_BIAS_RESIDUAL, residual=True),
        _bias_residual,
        differentiable=(0, 1, 2),
        name="fused_elementwise/bias_residual",
    )
)
case(
    OpCase(
        "fused_elementwise",
        _bias_chain(_BIAS_SCALE_GELU, residual=False),
        _bias_scale_gelu,
        differentiable=(0, 1),
        name="fused_elementwise/bias_scale_gelu",
    )
)
case(
    OpCase(
        "fused_elementwise",
        _pair(_SQUARE_TANH),
        _square_tanh,
        differentiable=(0, 1),
        name="fused_elementwise/square_tanh",
    )
)
case(
    OpCase(
        "fused_elementwise",
        _var_weight(),
        _bn_scale,
        differentiable=(0, 1),
        name="fused_elementwise/bn_scale_exported",
    )
)
case(
    OpCase(
        "fused_elementwise",
        _one(_SQUARED_SUM),
        _squared_sum,
        differentiable=(0,),
        name="fused_elementwise/squared_sum",
    )
)


@st.composite
def _many(draw: st.DrawFn) -> Example:
    """Two or three arrays of their own shapes; one P row splitting each on an axis of its own."""
    xs = tuple(arrays(draw(shapes()), draw) for _ in range(draw(st.integers(2, 3))))
    axes = tuple(draw(st.integers(0, x.ndim - 1)) for x in xs)
    return Example(xs, {"split_axes": axes})


def _sum_squares(*xs: np.ndarray, split_axes: Any) -> list[np.ndarray]:
    total = np.asarray(0.0, xs[0].dtype)
    for x in xs:
        total = total + np.sum(x * x)
    return [np.asarray(total)]


case(OpCase("sum_squares", _many(), _sum_squares, differentiable=()))
