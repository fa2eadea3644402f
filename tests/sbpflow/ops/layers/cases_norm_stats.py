"""Cases for sbpflow/ops/layers/norm_stats.py: the running statistic as PyTorch's BatchNorm writes it."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


@st.composite
def _running(draw: st.DrawFn) -> Example:
    shape = draw(shapes(max_side=7))
    n = draw(st.integers(2, 50))  # the values each statistic was taken over
    attrs = {
        "momentum": draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        "scale": draw(st.sampled_from([1.0, n / (n - 1)])),
    }
    return Example((arrays(shape, draw), arrays(shape, draw, 0.0, 3.0)), attrs)


def _running_ref(
    running: np.ndarray, stat: np.ndarray, momentum: float, scale: float = 1.0
) -> list[np.ndarray]:
    out = np.empty_like(running)
    for i in np.ndindex(running.shape):  # torch: running = (1 - momentum) * running + momentum * stat
        out[i] = (1.0 - momentum) * running[i] + momentum * (stat[i] * scale)
    return [out]


case(OpCase("running_stat", _running(), _running_ref, differentiable=()))
