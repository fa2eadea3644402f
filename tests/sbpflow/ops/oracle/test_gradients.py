"""Every gradient rule against central finite differences, in float64.

For a drawn example and a random cotangent ``dy`` per float output, the rule's input gradients (run
eagerly by :func:`sbpflow.ops.eager.vjp`) must equal the derivative of ``L(x) = sum_k sum(dy_k * y_k(x))``
along each checked coordinate of every input the case marks ``differentiable``, and along one random
direction (which covers every coordinate at once). Inputs not marked must get ``None`` or zeros: a float
input with a real gradient that is not marked would go unchecked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.base import get_op
from sbpflow.ops.eager import EagerBuilder, vjp
from tests.sbpflow.ops import all_cases
from tests.sbpflow.ops.cases import CASES, Example, OpCase

all_cases.load()

STEP = 1e-6
MAX_COORDS = 48  # per input; larger inputs get a random subset (plus the random direction)
EPS = float(np.finfo(np.float64).eps)

GRAD_CASES = [name for name, c in CASES.items() if c.differentiable or c.stops_gradient]


def is_float(x: Any) -> bool:
    return np.issubdtype(np.asarray(x).dtype, np.floating)


def loss_fn(
    c: OpCase, example: Example, dys: Sequence[Any], i: int
) -> Callable[[np.ndarray], tuple[float, float]]:
    """``x_i -> (L, sum |dy * y|)``: the scalar whose gradient the rule computes, and its rounding scale."""
    builder = EagerBuilder()

    def loss(x: np.ndarray) -> tuple[float, float]:
        inputs = list(example.inputs)
        inputs[i] = x
        outs = builder.call(c.op, *inputs, **example.attrs)
        terms = [dy * y for dy, y in zip(dys, outs, strict=True) if dy is not None]
        return float(sum(np.sum(t) for t in terms)), float(sum(np.sum(np.abs(t)) for t in terms))

    return loss


def central_difference(
    loss: Callable[[np.ndarray], tuple[float, float]], x: np.ndarray, v: np.ndarray
) -> tuple[float, float]:
    """(d/dt L(x + t v) at 0, an estimate of its rounding error)."""
    h = STEP * max(1.0, float(np.max(np.abs(x), initial=0.0)))
    (hi, scale_hi), (lo, scale_lo) = loss(x + h * v), loss(x - h * v)
    # L is a sum of many terms, each rounded: the difference of two such sums is good to about
    # eps * sum|terms|, which the division by 2h magnifies
    return (hi - lo) / (2 * h), 16 * EPS * max(scale_hi, scale_lo, 1.0) / h


def check_input(
    c: OpCase, example: Example, dys: Sequence[Any], i: int, grad: Any, rng: np.random.Generator
) -> None:
    x = example.inputs[i]
    name = get_op(c.op).inputs[0].lstrip("*") + f"[{i}]" if get_op(c.op).variadic else get_op(c.op).inputs[i]
    where = f"{c.op} input {name!r} {list(x.shape)}"
    assert is_float(x), f"case {c.name or c.op!r} marks input {i} differentiable, but it is {x.dtype}"
    assert grad is not None, f"{where}: the gradient rule returned None for a differentiable input"
    assert grad.shape == x.shape and grad.dtype == x.dtype, (
        f"{where}: gradient is {list(grad.shape)} {grad.dtype}, expected the input's {list(x.shape)} {x.dtype}"
    )
    loss = loss_fn(c, example, dys, i)
    coords = np.arange(x.size) if x.size <= MAX_COORDS else rng.choice(x.size, MAX_COORDS, replace=False)
    directions = [
        (
            f"coordinate {tuple(int(k) for k in np.unravel_index(j, x.shape))}",
            np.eye(1, x.size, j).reshape(x.shape),
        )
        for j in coords
    ]
    directions.append(("a random direction", rng.standard_normal(x.shape)))
    for what, v in directions:
        numeric, noise = central_difference(loss, x, v)
        analytic = float(np.sum(grad * v))
        tol = noise + 1e-8 + c.grad_rtol * max(abs(numeric), abs(analytic))
        assert abs(numeric - analytic) <= tol, (
            f"{where}, attrs {example.attrs}: along {what} the rule gives {analytic:.10g}, finite differences "
            f"give {numeric:.10g} (|diff| {abs(numeric - analytic):.3g} > tol {tol:.3g})"
        )


@pytest.mark.parametrize("name", GRAD_CASES)
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_gradient_matches_finite_differences(name: str, data: st.DataObject) -> None:
    c = CASES.get(name)
    example = data.draw(c.examples, label="example")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    outs = EagerBuilder().call(c.op, *example.inputs, **example.attrs)
    dys = [rng.standard_normal(y.shape).astype(y.dtype) if is_float(y) else None for y in outs]
    grads = vjp(c.op, example.inputs, dys, **example.attrs)
    for i, g in enumerate(grads):
        if i in c.differentiable:
            check_input(c, example, dys, i, g, rng)
        else:
            assert g is None or not np.any(np.asarray(g)), (
                f"{c.op}: input {i} is not in case {name!r}'s differentiable {c.differentiable} but its "
                "gradient is non-zero; mark it differentiable so that it is checked, or return None"
            )
