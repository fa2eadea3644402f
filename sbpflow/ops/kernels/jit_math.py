"""Scalar maths that LLVM vectorises inside numba loops (rows_jit.py's softmax and cross entropy,
elementwise_jit.py's GELU, exp, log, sigmoid and logistic loss): ``vexp``, ``vlog``, ``vlog1p``, ``vmax``,
``vfma``, ``erf64`` and ``normal_cdf``.

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

``vlog`` is fdlibm's log in the same way: x = 2^k m with m in [sqrt(2)/2, sqrt(2)) by integer arithmetic
on x's bits (subnormals scaled up first), then ln m = f - f^2/2 + s (f^2/2 + R(s^2)), f = m - 1,
s = f / (2 + f), R a minimax polynomial (4 terms for float32, 7 for float64), and k ln 2 in two parts:
within 1 ulp in both widths (``test_rows_jit.py``), 0 -> -inf, x < 0 -> nan, inf -> inf, nan -> nan.

``vmax(a, b)`` is LLVM's ``maxnum`` under no-nans, the one form of a running maximum that LLVM reduces in
vector lanes (a compare-and-select loop, numba's ``max`` and ``np.max`` all run one element a cycle):
6 us for the row maxima of [1024, 128] float32, where numpy's ``argmax`` takes 13 and ``max`` 68. Given
a nan it returns some operand, not nan: a row maximum over a row with a nan is some value of the row,
and whatever is computed from ``x - max`` still meets the nan element, so a softmax row or a loss with a
nan is nan, as numpy's (tested).

``erf64`` is erf.py's W. J. Cody approximation with ``vexp``, branch-free so that it vectorises;
``normal_cdf`` is the normal distribution's CDF for exact GELU, in float32 for float32 (see each).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from sbpflow.ops.kernels.erf import (
    A4,
    BIG,
    C8,
    FOUR,
    P4,
    P5,
    Q4,
    SQRT_1_PI,
    THRESH,
    A,
    B,
    C,
    D,
    P,
    Q,
)

FLAGS = {"reassoc", "contract", "arcp", "nsz"}  # not nnan/ninf: -inf scores (a mask) are data
# vexp and erf64 themselves: no reassociation, which would undo the two-part ln 2 of the reduction
EXACT = {"contract", "nsz"}

# float64 Taylor coefficients 1/13! ... 1/2!, 1, 1 (Horner from the highest)
_T = tuple(1.0 / float(np.prod(np.arange(1, k + 1))) for k in range(13, -1, -1))


@intrinsic
def _pow2(typingctx: Any, k: Any) -> Any:
    """2^k for a float ``k`` that holds an integer of the exponent's range, its bits built in k's own
    width (int32 for float32): numba would widen an int32 sum to int64, and 16 float32 lanes would then
    convert and shift in two vectors of int64 (vexp32 took 55 us on [16, 64, 256], now 42)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        width = sig.return_type.bitwidth
        ity = ir.IntType(width)
        bias, shift = (127, 23) if width == 32 else (1023, 52)
        bits = builder.add(builder.fptosi(args[0], ity), ity(bias))
        return builder.bitcast(builder.shl(bits, ity(shift)), context.get_value_type(sig.return_type))

    return k(k), codegen


@intrinsic
def vfma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """a b + c rounded once (LLVM's fma): with c = -(a b) rounded, the exact error of that product."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ty = context.get_value_type(sig.return_type)
        fn = builder.module.declare_intrinsic("llvm.fma", [ty], ir.FunctionType(ty, [ty, ty, ty]))
        return builder.call(fn, args)

    return a(a, b, c), codegen


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


def _exp32_normal(c: Any) -> Any:
    """exp(c) of a float32 c whose exp is a normal float32 (vexp32 less its range checks)."""
    raise NotImplementedError("_exp32_normal runs inside numba-compiled code")


def _exp32_normal_impl(c: Any) -> Any:  # pragma: no cover - compiled
    k = np.floor(c * np.float32(1.44269504088896341) + np.float32(0.5))
    # r = c - k ln 2 in two parts by fma, which no reassociation undoes: inlined into normal_cdf, this
    # runs under its caller's flags, and reassociated, the two parts fold into one rounded k ln 2 (35 ulp)
    r: Any = vfma(k, np.float32(-0.693359375), c)  # type: ignore[call-arg]
    r = vfma(k, np.float32(2.12194440e-4), r)  # type: ignore[call-arg]
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1)
    return p * _pow2(k)  # type: ignore[call-arg]


@overload(_exp32_normal, inline="always", jit_options={"fastmath": EXACT, "error_model": "numpy"})
def _exp32_normal_overload(c: Any) -> Any:
    return _exp32_normal_impl if c == types.float32 else None


def _vexp32(x: Any) -> Any:  # pragma: no cover - compiled
    lo, hi = np.float32(-87.33654), np.float32(88.72283)  # exp of these is float32's smallest normal, max
    c = hi if x > hi else x  # nan stays nan
    c = lo if c < lo else c
    y = _exp32_normal(c)
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
    y = p * _pow2(k)  # type: ignore[call-arg]
    y = 0.0 if x < lo else y
    return np.inf if x > hi else y


@overload(vexp, jit_options={"fastmath": EXACT, "error_model": "numpy"})
def _vexp_overload(x: Any) -> Any:
    if isinstance(x, types.Float):
        return _vexp32 if x.bitwidth == 32 else _vexp64
    return None


# ln 2 in two parts (fdlibm's), per width: k ln2_hi is exact for every k of the exponent's range
_LN2_HI32, _LN2_LO32 = 6.9313812256e-01, 9.0580006145e-06
_LN2_HI64, _LN2_LO64 = 6.93147180369123816490e-01, 1.90821492927058770002e-10
# fdlibm's (musl's) log(1 + f) = f - f^2 / 2 + s (f^2 / 2 + R(s^2)), s = f / (2 + f): R's coefficients
# Lg1.. for s^2, s^4, ... (float32: the 4 of logf; float64: the 7 of log), minimax on the reduced range
_LG32 = (0.66666662693, 0.40000972152, 0.28498786688, 0.24279078841)
_LG64 = (
    6.666666666666735130e-01,
    3.999999999940941908e-01,
    2.857142874366239149e-01,
    2.222219843214978396e-01,
    1.818357216161805012e-01,
    1.531383769920937332e-01,
    1.479819860511658591e-01,
)
# the bits of sqrt(2) / 2, the reduced argument's lower end (float64: its high word, as fdlibm's)
_HALF_SQRT2 = {32: 0x3F3504F3, 64: 0x3FE6A09E << 32}
_ONE = {32: 0x3F800000, 64: 0x3FF0 << 48}
_MANTISSA = {32: (1 << 23) - 1, 64: (1 << 52) - 1}


def _reduced(part: str) -> Any:
    """An intrinsic of a positive normal float x, in x's width: with x = 2^k m, m in [sqrt(2)/2, sqrt(2)),
    ``part`` "m" gives m and "k" gives k as a float, by integer arithmetic on x's bits (fdlibm's
    reduction: the bits plus 1's less sqrt(2)/2's carry into the exponent exactly where m >= sqrt(2))."""

    @intrinsic
    def reduce(typingctx: Any, x: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            w = sig.return_type.bitwidth
            ity, fty = ir.IntType(w), context.get_value_type(sig.return_type)
            bits = builder.add(builder.bitcast(args[0], ity), ity(_ONE[w] - _HALF_SQRT2[w]))
            if part == "k":
                shift, bias = (23, 127) if w == 32 else (52, 1023)
                k = builder.sub(builder.lshr(bits, ity(shift)), ity(bias))
                return builder.sitofp(k, fty)
            m = builder.add(builder.and_(bits, ity(_MANTISSA[w])), ity(_HALF_SQRT2[w]))
            return builder.bitcast(m, fty)

        return x(x), codegen

    return reduce


_log_m, _log_k = _reduced("m"), _reduced("k")


def vlog(x: Any) -> Any:
    """ln x for a float32 or float64 scalar, inside numba-compiled code only: fdlibm's log (see _LG32),
    all arithmetic and bit casts, so a loop that calls it vectorises (numpy's float32 log on this AVX2
    machine took 6 ns an element, PyTorch's ~2). Within 1 ulp of the true value in tests; 0 gives -inf,
    x < 0 nan, inf inf, nan nan, and subnormal x are scaled into the normal range first."""
    raise NotImplementedError("vlog runs inside numba-compiled code; use numpy's log")


def _vlog32(x: Any) -> Any:  # pragma: no cover - compiled
    f = np.float32
    tiny = x < f(1.17549435e-38)
    c = x * f(33554432.0) if tiny else x  # 2^25
    m, k = _log_m(c), _log_k(c)
    k = k - f(25) if tiny else k
    g = m - f(1)
    s = g / (f(2) + g)
    z = s * s
    w = z * z
    r = z * (f(_LG32[0]) + w * f(_LG32[2])) + w * (f(_LG32[1]) + w * f(_LG32[3]))
    h = f(0.5) * g * g
    y = s * (h + r) + k * f(_LN2_LO32) - h + g + k * f(_LN2_HI32)
    y = y if x < f(np.inf) else x  # inf and nan: themselves
    y = f(-np.inf) if x == f(0) else y
    return f(np.nan) if x < f(0) else y


def _vlog64(x: Any) -> Any:  # pragma: no cover - compiled
    tiny = x < 2.2250738585072014e-308
    c = x * 18014398509481984.0 if tiny else x  # 2^54
    m, k = _log_m(c), _log_k(c)
    k = k - 54.0 if tiny else k
    g = m - 1.0
    s = g / (2.0 + g)
    z = s * s
    w = z * z
    r = z * (_LG64[0] + w * (_LG64[2] + w * (_LG64[4] + w * _LG64[6])))
    r = r + w * (_LG64[1] + w * (_LG64[3] + w * _LG64[5]))
    h = 0.5 * g * g
    y = s * (h + r) + k * _LN2_LO64 - h + g + k * _LN2_HI64
    y = y if x < np.inf else x
    y = -np.inf if x == 0.0 else y
    return np.nan if x < 0.0 else y


@overload(vlog, jit_options={"fastmath": EXACT, "error_model": "numpy"})
def _vlog_overload(x: Any) -> Any:
    if isinstance(x, types.Float):
        return _vlog32 if x.bitwidth == 32 else _vlog64
    return None


def vlog1p(x: Any) -> Any:
    """ln(1 + x) for a float32 or float64 scalar, inside numba-compiled code only: ln(u) + (x - (u - 1)) / u,
    u = 1 + x rounded, the second term the rounding of u carried over (within ~1 ulp where u is normal;
    x itself where u rounds to 1). Its own overload under EXACT flags: inlined into a reassociating loop,
    (1 + x) - 1 would fold to x and the correction to 0. -1 gives -inf, below it nan, inf inf, nan nan."""
    raise NotImplementedError("vlog1p runs inside numba-compiled code; use numpy's log1p")


def _log1p_of(f: Any) -> Any:
    def log1p(x: Any) -> Any:  # pragma: no cover - compiled
        one, zero = f(1), f(0)
        u = one + x
        y = vlog(u) + (x - (u - one)) / u
        y = y if u > zero else vlog(u)  # -1: -inf; below: nan
        return y if x < f(np.inf) else x  # inf and nan: themselves

    return log1p


_LOG1P = {32: _log1p_of(np.float32), 64: _log1p_of(np.float64)}


@overload(vlog1p, jit_options={"fastmath": EXACT, "error_model": "numpy"})
def _vlog1p_overload(x: Any) -> Any:
    return _LOG1P[x.bitwidth] if isinstance(x, types.Float) else None


def erf64(x: Any) -> Any:
    """erf.py's Cody erf of one float64, its three rational approximations all evaluated and the one for
    |x|'s interval selected (a branch an element would keep the loop scalar); exp by vexp. An overload
    inlined in numba's IR (``inline="always"``, as normal_cdf): LLVM leaves a call to another compiled
    function a call an element, and the loop around it ran scalar (14 ns an element; inlined, 2)."""
    raise NotImplementedError("erf64 runs inside numba-compiled code; use sbpflow.ops.kernels.erf.erf")


def _erf64(x: Any) -> Any:  # pragma: no cover - compiled
    y = abs(x)
    ysq = y * y
    num, den = A4 * ysq, ysq
    for k in range(3):
        num, den = (num + A[k]) * ysq, (den + B[k]) * ysq
    small = x * (num + A[3]) / (den + B[3])
    r = np.trunc(y * 16.0) / 16.0
    g = vexp(-r * r) * vexp(-(y - r) * (y + r))  # exp(-y^2), the square's rounding not magnified
    num, den = C8 * y, y
    for k in range(7):
        num, den = (num + C[k]) * y, (den + D[k]) * y
    mid = g * (num + C[7]) / (den + D[7])
    z = 1.0 / ysq
    num, den = P5 * z, z
    for k in range(4):
        num, den = (num + P[k]) * z, (den + Q[k]) * z
    large = g * ((SQRT_1_PI - z * (num + P4) / (den + Q4)) / y)
    erfc = mid if y <= FOUR else large
    big = 1.0 if y >= BIG else (0.5 - erfc) + 0.5
    whole = big if x >= 0 else -big
    out = small if y <= THRESH else whole
    return x if x != x else out  # nan stays nan


@overload(erf64, inline="always", jit_options={"fastmath": EXACT, "error_model": "numpy"})
def _erf64_overload(x: Any) -> Any:
    return _erf64 if isinstance(x, types.Float) else None


_SQRT_HALF = 0.7071067811865476

# normal_cdf's t P(t) ~ Q(a) exp(a^2 / 2), t = 1 / (1 + 0.4 a): a degree-9 polynomial fitted for
# relative error (iterated weighted least squares on [0, 13.5], 2e-8 in float64, 5 ulp once rounded to
# float32 and evaluated in float32), from t^9 down
_TAIL_P = 0.4
_TAIL = (
    0.03196563571691513,
    -0.17546279728412628,
    0.3791273534297943,
    -0.3697924017906189,
    0.11596621572971344,
    -0.024958934634923935,
    0.09069197624921799,
    0.13327445089817047,
    0.15961186587810516,
    0.1595766544342041,
)


def _cdf32(x: Any) -> Any:  # pragma: no cover - compiled
    one = np.float32(1)
    a = abs(x)
    t = one / (one + np.float32(_TAIL_P) * a)
    r = np.float32(_TAIL[0])
    for k in range(1, len(_TAIL)):
        r = r * t + np.float32(_TAIL[k])
    far = a > np.float32(13.2163)  # exp(-a^2 / 2) below float32's normal range: Q and g are 0
    c = np.float32(13.2163) if far else a  # (nan stays nan)
    s = c * c
    e: Any = vfma(c, c, -s)  # type: ignore[call-arg]
    g = _exp32_normal(np.float32(-0.5) * s)
    g = np.float32(0) if far else g - g * (np.float32(0.5) * e)
    q = g * t * r  # Q(|x|)
    return (q if x < 0 else one - q), g


def _cdf64(x: Any) -> Any:  # pragma: no cover - compiled
    return 0.5 * (1.0 + erf64(x * _SQRT_HALF)), vexp(-0.5 * x * x)


def normal_cdf(x: Any) -> Any:
    """(Phi(x), exp(-x^2 / 2)) of a float32 or float64 scalar: the standard normal CDF, and the normal
    density but for its constant, for exact GELU and its gradient (elementwise_jit.py).

    float64: Phi through erf64, to float64's rounding. float32: in float32, where erf64 in float64 would
    cost 5x PyTorch's whole op, within ~8 ulp relative of both (tested). One form for every x, so no
    branch and no cancellation: Phi(x) = Q(|x|) for x < 0 and 1 - Q(|x|) for x >= 0, with the upper tail
    Q(a) = exp(-a^2 / 2) t P(t), t = 1 / (1 + 0.4 a). exp's argument is a^2 / 2 rounded, times (1 - e / 2)
    with e the exact rounding error of a^2 (vfma), so the square's rounding (relative 6e-8, magnified by
    a^2 / 2, up to 87) does not reach the tail. Q is 0 past a = 13.2 (below float32's smallest normal)."""
    raise NotImplementedError("normal_cdf runs inside numba-compiled code")


@overload(normal_cdf, inline="always", jit_options={"fastmath": EXACT, "error_model": "numpy"})
def _normal_cdf_overload(x: Any) -> Any:
    if isinstance(x, types.Float):
        return _cdf32 if x.bitwidth == 32 else _cdf64
    return None
