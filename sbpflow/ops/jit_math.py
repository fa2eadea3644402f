"""Scalar maths that LLVM vectorises inside numba loops (rows_jit.py's softmax and cross entropy):
``vexp`` and ``vmax``.

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
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

FLAGS = {"reassoc", "contract", "arcp", "nsz"}  # not nnan/ninf: -inf scores (a mask) are data

# float64 Taylor coefficients 1/13! ... 1/2!, 1, 1 (Horner from the highest)
_TAYLOR = tuple(1.0 / float(np.prod(np.arange(1, k + 1))) for k in range(13, -1, -1))


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
    for a in _TAYLOR:
        p = p * r + a
    y = p * _as_float((np.int64(k) + 1023) << 52)  # type: ignore[call-arg]
    y = 0.0 if x < lo else y
    return np.inf if x > hi else y


@overload(vexp, inline="always", jit_options={"fastmath": FLAGS})
def _vexp_overload(x: Any) -> Any:
    if isinstance(x, types.Float):
        return _vexp32 if x.bitwidth == 32 else _vexp64
    return None
