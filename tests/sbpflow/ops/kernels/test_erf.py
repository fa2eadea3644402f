"""sbpflow/ops/kernels/erf.py (numpy has no erf) against ``math.erf``, element by element."""

from __future__ import annotations

import math

import numpy as np

from sbpflow.ops.kernels.erf import erf


def test_erf_matches_math_erf_to_float64_rounding() -> None:
    """Cody's approximations within 4 ulp (2.3e-16 absolute) of the correctly rounded erf, on every
    interval and its edges, the tails where erf rounds to 1, signed zeros, inf and nan."""
    rng = np.random.default_rng(0)
    edges = np.array([0.0, -0.0, 0.46875, 4.0, 5.9, 5.93, 6.0, 1e-300, 1e-20, 27.0])
    x = np.concatenate(
        [
            rng.uniform(-7, 7, 20000),
            rng.uniform(-0.5, 0.5, 5000),
            np.linspace(-6.5, 6.5, 20001),
            edges,
            -edges,
        ]
    )
    got = erf(np, x)
    want = np.array([math.erf(v) for v in x])
    ulps = np.abs(got - want) / np.spacing(np.maximum(np.abs(want), np.finfo(np.float64).tiny))
    worst = int(np.argmax(ulps))
    assert ulps.max() <= 4 and np.abs(got - want).max() <= 2.3e-16, (
        f"erf({x[worst]!r}): {got[worst]!r} vs {want[worst]!r}"
    )
    assert np.array_equal(np.signbit(got), np.signbit(want)), "erf is odd: the sign of every input, -0.0 too"
    special = erf(np, np.array([np.inf, -np.inf, np.nan]))
    assert special[0] == 1.0 and special[1] == -1.0 and np.isnan(special[2])
    assert erf(np, np.float32([0.5, -2.0])).dtype == np.float32
