"""Cases for sbpflow/ops/training/loss_scaling.py.

References are GradScaler's documented rule and the plain updates of cases_optim.py, written per case in
plain numpy: the scale read from its variable (0 reads as init), 1 / scale in float64 rounded to float32,
the count of non-finite elements, the scale's update, and a gated update that is the plain one on a clean
step and its inputs on another.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes
from tests.sbpflow.ops.training.cases_optim import _adamw, _sgd, adamw_reference, sgd_reference


def scalar(value: float) -> np.ndarray:
    return np.full((1,), value, dtype=np.float32)


_SCALES = st.sampled_from([0.0, 1.0, 1024.0, 2.0**16])


def _scale_of(scale: np.ndarray, init: float) -> float:
    return init if float(scale[0]) == 0 else float(scale[0])


@st.composite
def _read(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    values = np.array(
        draw(st.lists(_SCALES | st.just(3.0), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    )
    attrs = {"init": draw(st.sampled_from([2.0**16, 1000.0])), "inverse": draw(st.booleans())}
    return Example((values.reshape(shape).astype(np.float32),), attrs)


def read_reference(scale: np.ndarray, init: float, inverse: bool) -> list[np.ndarray]:
    out = np.array([_scale_of(np.array([s]), init) for s in scale.reshape(-1)]).reshape(scale.shape)
    return [(1.0 / out if inverse else out).astype(np.float32)]


case(OpCase("loss_scale_read", _read(), read_reference, differentiable=()))


@st.composite
def _count(draw: st.DrawFn) -> Example:
    x = arrays(draw(shapes()), draw)
    flat = x.reshape(-1)
    for i in draw(st.lists(st.integers(0, flat.size - 1), max_size=4)):
        flat[i] = draw(st.sampled_from([np.inf, -np.inf, np.nan]))
    return Example((x,))


def count_reference(x: np.ndarray) -> list[np.ndarray]:
    bad = sum(1 for v in x.reshape(-1) if v != v or v in (np.inf, -np.inf))
    return [scalar(bad)]


case(OpCase("nonfinite_count", _count(), count_reference, differentiable=()))


@st.composite
def _update(draw: st.DrawFn) -> Example:
    """Several scalers side by side (the op is elementwise): each element its own scale and counters."""
    interval = draw(st.sampled_from([1, 2, 2000]))
    attrs = {
        "init": 2.0**16,
        "growth_factor": draw(st.sampled_from([2.0, 4.0])),
        "backoff_factor": draw(st.sampled_from([0.5, 0.25])),
        "growth_interval": interval,
    }
    n = draw(st.integers(1, 6))
    # 2**127 grown overflows float32: kept
    scale = draw(st.lists(_SCALES | st.just(2.0**127), min_size=n, max_size=n))
    good = draw(st.lists(st.integers(0, interval - 1), min_size=n, max_size=n))
    skipped = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    found = draw(st.lists(st.sampled_from([0.0, 1.0, 7.0]), min_size=n, max_size=n))
    return Example(tuple(np.array(v, dtype=np.float32) for v in (scale, good, skipped, found)), attrs)


def update_reference(
    scale: np.ndarray,
    good: np.ndarray,
    skipped: np.ndarray,
    found: np.ndarray,
    init: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> list[np.ndarray]:
    out = []
    for s, n, k, f in zip(scale, good, skipped, found, strict=True):
        s, n, k = _scale_of(np.array([s]), init), int(n), int(k)
        if f > 0:
            out.append((s * backoff_factor, 0, k + 1))
        elif n + 1 < growth_interval:
            out.append((s, n + 1, k))
        else:
            grown = s * growth_factor
            out.append((grown if grown < 2.0**128 else s, 0, k))
    return [np.array(col, dtype=np.float32) for col in zip(*out, strict=True)]


case(OpCase("loss_scale_update", _update(), update_reference, differentiable=()))


@st.composite
def _gated_sgd(draw: st.DrawFn) -> Example:
    e = draw(_sgd())
    return Example((*e.inputs, scalar(draw(st.sampled_from([0.0, 2.0])))), e.attrs)


def gated_sgd_reference(param: Any, grad: Any, buf: Any, found: Any, **attrs: Any) -> list[np.ndarray]:
    return [param, buf] if found[0] > 0 else sgd_reference(param, grad, buf, **attrs)


case(OpCase("gated_sgd_update", _gated_sgd(), gated_sgd_reference, differentiable=()))


@st.composite
def _gated_adamw(draw: st.DrawFn) -> Example:
    e = draw(_adamw())
    found, skipped = draw(st.sampled_from([0.0, 1.0])), draw(st.sampled_from([0.0]))
    return Example((*e.inputs, scalar(found), scalar(skipped)), e.attrs)


def gated_adamw_reference(
    param: Any, grad: Any, m: Any, v: Any, found: Any, skipped: Any, **attrs: Any
) -> list[np.ndarray]:
    # the eager builder runs at step 0, so no step was skipped before it (later steps: test_loss_scaling.py)
    return [param, m, v] if found[0] > 0 else adamw_reference(param, grad, m, v, **attrs)


case(OpCase("gated_adamw_update", _gated_adamw(), gated_adamw_reference, differentiable=()))
