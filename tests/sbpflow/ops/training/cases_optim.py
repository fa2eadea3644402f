"""Cases for sbpflow/ops/training/optim.py.

References are the textbook update formulas (torch.optim.SGD, torch.optim.AdamW) in plain numpy, at step 0
(the eager builder's default); tests/control_plane/compiler/passes/test_optimizer.py runs later steps.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


def lr_factor(step: int, schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 0,
              min_lr_ratio: float = 0.0) -> float:  # fmt: skip
    """Linear warm-up over ``warmup_steps`` (reaching 1 at the last warm-up step), then a half cosine from 1
    down to ``min_lr_ratio`` at ``total_steps``, flat after."""
    if schedule == "constant":
        return 1.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0


@st.composite
def schedule_attrs(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):
        return {}
    warmup = draw(st.integers(0, 3))
    return {
        "schedule": "warmup_cosine",
        "warmup_steps": warmup,
        "total_steps": warmup + draw(st.integers(0, 10)),
        "min_lr_ratio": draw(st.sampled_from([0.0, 0.1])),
    }


@st.composite
def _sgd(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    momentum = draw(st.sampled_from([0.0, 0.9]))
    attrs = {
        "lr": draw(st.sampled_from([0.1, 0.01])),
        "momentum": momentum,
        "weight_decay": draw(st.sampled_from([0.0, 0.05])),
        "nesterov": momentum > 0 and draw(st.booleans()),
        **draw(schedule_attrs()),
    }
    return Example((arrays(shape, draw), arrays(shape, draw), arrays(shape, draw)), attrs)


def sgd_reference(
    param: np.ndarray,
    grad: np.ndarray,
    buf: np.ndarray,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    step: int = 0,
    **schedule: Any,
) -> list[np.ndarray]:
    d = grad + weight_decay * param
    buf = momentum * buf + d
    direction = d + momentum * buf if nesterov else buf
    return [param - lr * lr_factor(step, **schedule) * direction, buf]


case(OpCase("sgd_update", _sgd(), sgd_reference, differentiable=()))


@st.composite
def _adamw(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    attrs = {
        "lr": draw(st.sampled_from([1e-3, 0.1])),
        "beta1": draw(st.sampled_from([0.9, 0.5])),
        "beta2": draw(st.sampled_from([0.999, 0.95])),
        "eps": draw(st.sampled_from([1e-8, 1e-3])),
        "weight_decay": draw(st.sampled_from([0.0, 0.1])),
        **draw(schedule_attrs()),
    }
    param, grad, m = (arrays(shape, draw) for _ in range(3))
    v = arrays(shape, draw, 0.0, 2.0)  # a second moment is never negative
    return Example((param, grad, m, v), attrs)


def adamw_reference(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    step: int = 0,
    **schedule: Any,
) -> list[np.ndarray]:
    lr = lr * lr_factor(step, **schedule)
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad**2
    m_hat, v_hat = m / (1 - beta1 ** (step + 1)), v / (1 - beta2 ** (step + 1))
    return [param - lr * weight_decay * param - lr * m_hat / (np.sqrt(v_hat) + eps), m, v]


case(OpCase("adamw_update", _adamw(), adamw_reference, differentiable=()))


def _clipped(plain: st.SearchStrategy[Example]) -> st.SearchStrategy[Example]:
    """``plain``'s example with a clipping factor in [0, 1] after its inputs (one value, shape (1,))."""
    return st.builds(
        lambda e, c: Example((*e.inputs, np.asarray([c], dtype=e.inputs[0].dtype)), e.attrs),
        plain,
        st.floats(0.0, 1.0),
    )


def _on_clipped(reference: Any) -> Any:
    return lambda param, grad, *rest, **attrs: reference(param, grad * rest[-1], *rest[:-1], **attrs)


case(OpCase("clipped_sgd_update", _clipped(_sgd()), _on_clipped(sgd_reference), differentiable=()))
case(OpCase("clipped_adamw_update", _clipped(_adamw()), _on_clipped(adamw_reference), differentiable=()))


@st.composite
def _clip(draw: st.DrawFn) -> Example:
    shape = draw(st.sampled_from([(), (1,)]) | shapes())
    return Example((arrays(shape, draw, 0.0, 9.0),), {"max_norm": draw(st.sampled_from([0.5, 1.0, 2.5]))})


def clip_reference(norm_sq: np.ndarray, max_norm: float) -> list[np.ndarray]:
    norm = np.sqrt(norm_sq)
    return [np.where(norm + 1e-6 > max_norm, max_norm / (norm + 1e-6), 1.0)]


case(OpCase("clip_coef", _clip(), clip_reference, differentiable=()))
