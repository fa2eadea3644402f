"""Test cases for every op: how to draw inputs (Hypothesis), and an independent numpy reference.

Each op family has a ``cases_<family>.py`` beside this file that calls :func:`case` once per op (an op
may have several cases). The oracle, gradient and reference tests iterate over :data:`CASES`, and a
coverage test fails when an op in the registry has no case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

from sbpflow.registry import Registry


@dataclass(frozen=True)
class Example:
    """Concrete inputs (float64 for float tensors) and attributes for one op call."""

    inputs: tuple[np.ndarray, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OpCase:
    op: str
    examples: st.SearchStrategy[Example]
    # an implementation written independently of the kernel (plain formulas, loops, np.einsum, ...)
    reference: Callable[..., Sequence[np.ndarray]]
    # inputs whose gradient is checked by finite differences (float inputs the op is smooth in)
    differentiable: tuple[int, ...] = (0,)
    # relative tolerance of the finite-difference check (raise for ops with kinks or large curvature)
    grad_rtol: float = 1e-5
    name: str = ""
    # the rule gives no gradient on purpose (detach): checked to be None, as a non-differentiable input's
    stops_gradient: bool = False


CASES: Registry[OpCase] = Registry("op test case")


def case(c: OpCase) -> OpCase:
    return CASES.register(c.name or c.op, c)


# ---- strategies shared by the family case modules -------------------------------------------------


def shapes(
    min_dims: int = 1, max_dims: int = 3, min_side: int = 1, max_side: int = 6
) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def arrays(shape: tuple[int, ...], draw: Any, low: float = -2.0, high: float = 2.0) -> np.ndarray:
    """Float64 values drawn through a seed (Hypothesis shrinks the seed, numpy fills the array)."""
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).uniform(low, high, size=shape)


def away_from(x: np.ndarray, points: Sequence[float], gap: float = 0.05) -> np.ndarray:
    """Nudge values off kinks (relu at 0, max ties) so that finite differences are meaningful."""
    out = x.copy()
    for p in points:
        near = np.abs(out - p) < gap
        out[near] = p + gap * np.where(out[near] >= p, 1.0, -1.0) * 2
    return out
