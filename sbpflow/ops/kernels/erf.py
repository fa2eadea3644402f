"""The error function on ``xp``, for exact GELU: W. J. Cody's rational approximations (CALERF, 1969).

numpy has no erf and sbpflow does not depend on scipy, so numpy arrays take Cody's three rational
approximations, each on its own interval and evaluated only on the elements that lie in it (no branch
is computed where it would divide by zero). Their error is below float64's rounding (Cody: 1e-18 on
the first two intervals); ``exp(-y*y)`` is taken as ``exp(-r*r) exp(-(y-r)(y+r))`` with ``r`` the value
rounded down to a multiple of 1/16, so that the square's rounding is not magnified by the exponential.
cupy arrays take ``cupyx.scipy.special.erf``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02, 3.20937758913846947e03)
A4 = 1.85777706184603153e-1
B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03, 2.84423683343917062e03)
C = (
    5.64188496988670089e-1,
    8.88314979438837594e00,
    6.61191906371416295e01,
    2.98635138197400131e02,
    8.81952221241769090e02,
    1.71204761263407058e03,
    2.05107837782607147e03,
    1.23033935479799725e03,
)
C8 = 2.15311535474403846e-8
D = (
    1.57449261107098347e01,
    1.17693950891312499e02,
    5.37181101862009858e02,
    1.62138957456669019e03,
    3.29079923573345963e03,
    4.36261909014324716e03,
    3.43936767414372164e03,
    1.23033935480374942e03,
)
P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1, 1.60837851487422766e-2)
P4, P5 = 6.58749161529837803e-4, 1.63153871373020978e-2
Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1, 6.05183413124413191e-2)
Q4 = 2.33520497626869185e-3
SQRT_1_PI = 5.6418958354775628695e-1
THRESH, FOUR, BIG = 0.46875, 4.0, 6.0  # erf(y) rounds to 1 in float64 for y >= 5.93


def _small(x: np.ndarray) -> np.ndarray:
    """erf(x) for |x| <= 0.46875: x P(x^2) / Q(x^2)."""
    ysq = x * x
    num, den = A4 * ysq, ysq
    for a, b in zip(A[:3], B[:3], strict=True):
        num, den = (num + a) * ysq, (den + b) * ysq
    return x * (num + A[3]) / (den + B[3])


def _exp_neg_square(y: np.ndarray) -> np.ndarray:
    r = np.trunc(y * 16.0) / 16.0
    return np.exp(-r * r) * np.exp(-(y - r) * (y + r))


def _erfc_mid(y: np.ndarray) -> np.ndarray:
    """erfc(y) for 0.46875 < y <= 4: exp(-y^2) P(y) / Q(y)."""
    num, den = C8 * y, y
    for c, d in zip(C[:7], D[:7], strict=True):
        num, den = (num + c) * y, (den + d) * y
    return _exp_neg_square(y) * (num + C[7]) / (den + D[7])


def _erfc_large(y: np.ndarray) -> np.ndarray:
    """erfc(y) for y > 4: exp(-y^2) / y (1/sqrt(pi) + P(1/y^2) / (y^2 Q(1/y^2)))."""
    z = 1.0 / (y * y)
    num, den = P5 * z, z
    for p, q in zip(P, Q, strict=True):
        num, den = (num + p) * z, (den + q) * z
    r = z * (num + P4) / (den + Q4)
    return _exp_neg_square(y) * ((SQRT_1_PI - r) / y)


def erf(xp: Any, x: Any) -> Any:
    """erf of every element, in x's dtype (float16 and float32 computed in float64, then rounded)."""
    if xp.__name__ != "numpy":
        from cupyx.scipy import special  # only present where cupy is

        return special.erf(x)
    wide = np.asarray(x, dtype=np.float64)
    out = np.empty_like(wide)
    y = np.abs(wide)
    small = y <= THRESH
    mid = (y > THRESH) & (y <= FOUR)
    large = (y > FOUR) & (y < BIG)
    out[small] = _small(wide[small])
    out[mid] = (0.5 - _erfc_mid(y[mid])) + 0.5  # 1 - erfc, rounded as Cody does
    out[large] = (0.5 - _erfc_large(y[large])) + 0.5
    out[y >= BIG] = 1.0
    out[np.isnan(wide)] = np.nan
    out[~small] = np.copysign(out[~small], wide[~small])
    return out.astype(x.dtype, copy=False)
