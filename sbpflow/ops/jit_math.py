"""Scalar maths that LLVM vectorises inside numba loops (rows_jit.py's softmax, cross entropy and exact
GELU): ``vexp``, ``vmax`` and ``erf64``.

numba's ``np.exp`` on a scalar calls libm once an element, which no loop around it can vectorise (the
wheels have no SVML), so a fused softmax row would run its exponentials one by one, slower than
numpy's vectorised ``exp`` over the whole array. ``vexp`` is Cody-Waite range reduction and a
polynomial, all arithmetic and one bit cast, so a loop that calls it vectorises:

    exp(x) = 2^k * p(r),  k = round(x / ln 2),  r = x - k ln 2 (in two parts, so r is exact),

- float32: Cephes' ``expf`` polynomial, within ~2 ulp of the true value (numpy's is within 1);
- float64: the Taylor series to degree 13, within ~40 ulp (4e-15 relative) on |x| < 709.

Outside the range where the result is a normal number it gives 0 below (where numpy gives a denormal
or 0) and inf above; -inf gives 0, inf gives inf and nan gives nan, as numpy's. ``tests/sbpflow/ops/
test_rows_jit.py`` measures the error against numpy's exp in float64.

``vmax(a, b)`` is LLVM's ``maxnum`` under no-nans, the one form of a running maximum that LLVM reduces in
vector lanes (a compare-and-select loop, numba's ``max`` and ``np.max`` all run one element a cycle):
6 us for the row maxima of [1024, 128] float32, where numpy's ``argmax`` takes 13 and ``max`` 68. Given
a nan it returns some operand, not nan: a row maximum over a row with a nan is some value of the row,
and whatever is computed from ``x - max`` still meets the nan element, so a softmax row or a loss with a
nan is nan, as numpy's (tested).

``erf64`` is erf.py's W. J. Cody approximation with ``vexp``, branch-free so that it vectorises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from sbpflow.ops.erf import _A, _A4, _B, _BIG, _C, _C8, _D, _FOUR, _P, _P4, _P5, _Q, _Q4, _SQRT_1_PI, _THRESH

FLAGS = {"reassoc", "contract", "arcp", "nsz"}  # not nnan/ninf: -inf scores (a mask) are data
# vexp and erf64 themselves: no reassociation, which would undo the two-part ln 2 of the reduction
EXACT = {"contract", "nsz"}

# float64 Taylor coefficients 1/13! ... 1/2!, 1, 1 (Horner from the highest)
_T = tuple(1.0 / float(np.prod(np.arange(1, k + 1))) for k in range(13, -1, -1))


@intrinsic
def _as_float(typingctx: Any, bits: Any) -> Any:
    """The float with the bits of ``bits`` (int32 -> float32, int64 -> float64)."""
    ret = types.float32 if bits.bitwidth == 32 else types.float64

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(sig.return_type))

    return ret(bits), codegen


@intrinsic
def vmax(typingctx: Any, a: Any, b: Any) -> Any:
    """max(a, b) of two floats of one type, vectorisable in a reduction (see the module's docstring)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ty = context.get_value_type(sig.return_type)
        fn = builder.module.declare_intrinsic("llvm.maxnum", [ty], ir.FunctionType(ty, [ty, ty]))
        return builder.call(fn, args, fastmath=("nnan", "nsz"))

    return a(a, b), codegen


def vexp(x: Any) -> Any:
    """exp(x) for a float32 or float64 scalar, inside numba-compiled code only."""
    raise NotImplementedError("vexp runs inside numba-compiled code (rows_jit.py); use numpy's exp")


def _vexp32(x: Any) -> Any:  # pragma: no cover - compiled
    lo, hi = np.float32(-87.33654), np.float32(88.72283)  # exp of these is float32's smallest normal, max
    c = hi if x > hi else x  # nan stays nan
    c = lo if c < lo else c
    k = np.floor(c * np.float32(1.44269504088896341) + np.float32(0.5))
    r = c - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1)
    y = p * _as_float(np.int32((np.int64(k) + 127) << 23))  # type: ignore[call-arg]  # 2^k, its exponent bits
    y = np.float32(0) if x < lo else y
    return np.float32(np.inf) if x > hi else y


def _vexp64(x: Any) -> Any:  # pragma: no cover - compiled
    lo, hi = -708.3964185322641, 709.782712893384
    c = hi if x > hi else x
    c = lo if c < lo else c
    k = np.floor(c * 1.4426950408889634 + 0.5)
    r = c - k * 6.93147180369123816490e-01 - k * 1.90821492927058770002e-10  # fdlibm's ln 2, hi + lo
    p = 0.0
    for a in _T:  # Horner, from 1/13!
        p = p * r + a
    y = p * _as_float((np.int64(k) + 1023) << 52)  # type: ignore[call-arg]
    y = 0.0 if x < lo else y
    return np.inf if x > hi else y


@overload(vexp, jit_options={"fastmath": EXACT, "error_model": "numpy"})
def _vexp_overload(x: Any) -> Any:
    if isinstance(x, types.Float):
        return _vexp32 if x.bitwidth == 32 else _vexp64
    return None


@njit(cache=True, error_model="numpy", fastmath=EXACT)
def erf64(x: Any) -> Any:  # pragma: no cover - compiled
    """erf.py's Cody erf of one float64, its three rational approximations all evaluated and the one for
    |x|'s interval selected (a branch an element would keep the loop scalar); exp by vexp."""
    y = abs(x)
    ysq = y * y
    num, den = _A4 * ysq, ysq
    for k in range(3):
        num, den = (num + _A[k]) * ysq, (den + _B[k]) * ysq
    small = x * (num + _A[3]) / (den + _B[3])
    r = np.trunc(y * 16.0) / 16.0
    g = vexp(-r * r) * vexp(-(y - r) * (y + r))  # exp(-y^2), the square's rounding not magnified
    num, den = _C8 * y, y
    for k in range(7):
        num, den = (num + _C[k]) * y, (den + _D[k]) * y
    mid = g * (num + _C[7]) / (den + _D[7])
    z = 1.0 / ysq
    num, den = _P5 * z, z
    for k in range(4):
        num, den = (num + _P[k]) * z, (den + _Q[k]) * z
    large = g * ((_SQRT_1_PI - z * (num + _P4) / (den + _Q4)) / y)
    erfc = mid if y <= _FOUR else large
    big = 1.0 if y >= _BIG else (0.5 - erfc) + 0.5
    whole = big if x >= 0 else -big
    out = small if y <= _THRESH else whole
    return x if x != x else out  # nan stays nan
