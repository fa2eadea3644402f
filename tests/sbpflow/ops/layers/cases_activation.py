"""Cases for sbpflow/ops/layers/activation.py (erf itself: test_erf.py).

References are plain Python per element (``math.exp``, ``math.erf``, ``math.log1p``), never the kernels.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes

_elementwise = np.vectorize


def _sigmoid_one(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


def _phi(v: float) -> float:
    return 0.5 * (1.0 + math.erf(v / math.sqrt(2.0)))


@st.composite
def _unary(draw: st.DrawFn, low: float = -4.0, high: float = 4.0) -> Example:
    return Example((arrays(draw(shapes(max_side=7)), draw, low, high),))


@st.composite
def _gelu_grad(draw: st.DrawFn) -> Example:
    shape = draw(shapes(max_side=7))
    return Example((arrays(shape, draw), arrays(shape, draw, -4.0, 4.0)))


def _sigmoid_ref(x: np.ndarray) -> list[np.ndarray]:
    return [_elementwise(_sigmoid_one, otypes=[float])(x).reshape(x.shape)]


def _gelu_erf_ref(x: np.ndarray) -> list[np.ndarray]:
    return [_elementwise(lambda v: v * _phi(v), otypes=[float])(x).reshape(x.shape)]


def _gelu_erf_grad_ref(dy: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
    slope = _elementwise(
        lambda v: _phi(v) + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi), otypes=[float]
    )(x)
    return [dy * slope.reshape(x.shape)]


def _gelu_ref(x: np.ndarray) -> list[np.ndarray]:
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * np.power(x, 3))
    return [0.5 * x * (1 + np.tanh(inner))]


def _gelu_derivative(x: np.ndarray) -> np.ndarray:
    """The tanh-GELU's derivative, written out by the product and chain rules."""
    c = math.sqrt(2 / math.pi)
    u = c * (x + 0.044715 * x**3)
    sech2 = 1 / np.cosh(u) ** 2
    return 0.5 * (1 + np.tanh(u)) + 0.5 * x * sech2 * c * (1 + 3 * 0.044715 * x**2)


case(OpCase("sigmoid", _unary(-30.0, 30.0), _sigmoid_ref))
case(OpCase("gelu", _unary(), _gelu_ref))
case(OpCase("gelu_grad", _gelu_grad(), lambda dy, x: [dy * _gelu_derivative(x)], differentiable=()))
case(OpCase("gelu_erf", _unary(), _gelu_erf_ref))
case(OpCase("gelu_erf_grad", _gelu_grad(), _gelu_erf_grad_ref, differentiable=()))


# ---- binary cross-entropy with logits ------------------------------------------------------------


@st.composite
def _bce(draw: st.DrawFn) -> Example:
    shape = draw(shapes(max_side=7))
    logits = arrays(shape, draw, -40.0, 40.0) * draw(st.sampled_from([0.1, 1.0]))  # far out: no overflow
    soft = draw(st.booleans())  # 0/1 click labels, or soft targets in [0, 1]
    t = arrays(shape, draw, 0.0, 1.0)
    targets = t if soft else (t > 0.5).astype(np.float64)
    return Example((logits, targets), {"reduction": draw(st.sampled_from(["mean", "sum", "none"]))})


def _bce_one(x: float, t: float) -> float:
    # -(t log p + (1 - t) log(1 - p)), with log p = -log1p(exp(-x)) and log(1 - p) = -x + log p
    log_p = -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))
    return -(t * log_p + (1 - t) * (log_p - x))


def _bce_ref(logits: np.ndarray, targets: np.ndarray, reduction: str = "mean") -> list[np.ndarray]:
    per = np.array([_bce_one(x, t) for x, t in zip(logits.ravel(), targets.ravel(), strict=True)])
    per = per.reshape(logits.shape)
    if reduction == "none":
        return [per]
    total = math.fsum(per.ravel())
    return [np.array(total / per.size if reduction == "mean" else total)]


case(OpCase("binary_cross_entropy_with_logits", _bce(), _bce_ref, differentiable=(0, 1), grad_rtol=1e-4))
