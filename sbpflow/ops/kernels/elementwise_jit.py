"""GELU's kernels, both forms and their backward, exp, log, sigmoid, relu, the logistic loss and a bias
add, as one-pass numba loops on numpy arrays.

numpy spends ~12 passes over the array on the tanh form's gradient, each a temporary written and read
back; PyTorch makes one. These make one pass, with jit_math's ``vexp``, an exp that vectorises inside
the loop. The flags and the error model are rows_jit.py's (see its docstring): reassociation is allowed,
nan and inf keep their meaning, a division by zero is inf or nan, not a check an element. ``nogil``: a kernel
releases the GIL, as numpy's loops do, so the runtime's other actor threads run meanwhile.

The tanh form is written through the logistic function, which needs one exp and no tanh:
0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)), so gelu(x) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3),
and its derivative is s + 2 x s (1 - s) u', s = 1 / (1 + e), s (1 - s) = e s s, e = exp(-2u). This form has
no cancellation where numpy's has (1 + tanh(u) for u << 0 loses every bit of float32 near x = -5); in
float64 the two agree within ~1e-15 (the gradient within 1e-13 of a long double reference). Where
exp(-2u) overflows (x << 0) the product e s s is inf * 0: taken as its limit 0, so the gradient at -inf
is 0 and at +inf is dy, where numpy's formula gives nan.

Exact GELU, x Phi(x), and its gradient dy (Phi(x) + x phi(x)), phi the normal density, take
``normal_cdf`` here: (Phi(x), exp(-x^2 / 2)). In float64 that is jit_math's (erf.py's Cody erf, to
float64's rounding). In float32 it is ``_cdf32``, in float32 arithmetic, without a branch or a call, so
the loop vectorises: Phi(x) = Q(|x|) for x < 0 and 1 - Q(|x|) otherwise, the upper tail
Q(a) = exp(-a^2 / 2) P(a) / R(a), a [4/5] rational fitted to Q(a) exp(a^2 / 2) (= erfcx(a / sqrt 2) / 2)
for relative error on [0, 13.25] (Lawson's iterated weighted least squares against scipy's erfcx: 5e-9,
1.7e-8 with float32 coefficients). exp(-a^2 / 2) is a^2 / 2 rounded, the exact rounding error of the
square (an fma) added to the reduced argument, then a degree-6 polynomial (3e-9) and 2^k, so neither the
square's rounding nor the reduction is magnified by the exponential. Phi is within 4 ulp of the true
value relative to itself (3.6 measured) for every x whose Phi is a normal float32, its far negative tail
too: no cancellation as in 0.5 (1 + erf(x / sqrt 2)), PyTorch's form, whose absolute error near 1e-7 is a
quarter of Phi(-5) and all of it below -5.5. The loop is bound by latency (a 256-bit op is two on this
machine's cores, few iterations overlap), so the chain is kept short: exp's polynomial by Estrin's
scheme, and the rational, its division and the sign's select computed beside exp, then joined in one fma
(Phi = g (P / R) or 1 - g (P / R)). [16, 64, 256] float32, 1 thread: 335 -> 241 us, PyTorch 276 (the
former form, a degree-9 polynomial in 1 / (1 + 0.4 a) times Cephes' exp, within 8 ulp); the gradient
345 -> 270 us, PyTorch 358.

Each function is the fast path only: the numpy kernels in activation.py and elementwise.py stay the
reference and the path for cupy and for arrays these do not take (elementwise.jit_elementwise says which);
``tests/sbpflow/ops/kernels/test_elementwise_jit.py`` checks each against them. Arrays are flat (add_rows: rows),
of one float dtype, C-contiguous; ``out`` is written.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from sbpflow.ops.kernels import jit_math
from sbpflow.ops.kernels.jit_math import EXACT, FLAGS, vexp, vfma, vlog, vlog1p

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# Q(a) exp(a^2 / 2) = P(a) / R(a), highest degree first (see the module's docstring); P(0) / R(0) = 1/2
_TAIL_P = (0.0040155439637601376, 0.03995269909501076, 0.18121306598186493, 0.4355592131614685, 0.5)
_TAIL_R = (
    0.010065332055091858,
    0.10015399008989334,
    0.46413302421569824,
    1.1940940618515015,
    1.6690033674240112,
)
# exp(r / 2) on |r| <= ln 2, a degree-6 polynomial, highest first (relative error 3e-9)
_EXP = (2.158296e-05, 0.0002615434, 0.002604279, 0.02083314, 0.12499999, 0.5, 1.0)
_FAR = 13.2164  # exp(-a^2 / 2) below float32's smallest normal past it: Q and exp(-a^2 / 2) are 0


@intrinsic
def _exp2_32(typingctx: Any, k: Any) -> Any:
    """2^k for a float32 k that holds an integer in [-126, 127]: k + 127 shifted into the exponent's
    bits, in int32 (jit_math's vexp builds its 2^k so, for either width)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        bits = builder.add(builder.fptosi(args[0], ir.IntType(32)), ir.IntType(32)(127))
        return builder.bitcast(builder.shl(bits, ir.IntType(32)(23)), ir.FloatType())

    return types.float32(types.float32), codegen


def normal_cdf(x: Any) -> Any:
    """(Phi(x), exp(-x^2 / 2)) of a float32 or float64 scalar, inside numba-compiled code only: the
    standard normal CDF and the normal density but for its constant (see the module's docstring)."""
    raise NotImplementedError("normal_cdf runs inside numba-compiled code")


def _cdf32(x: Any) -> Any:  # pragma: no cover - compiled
    f = np.float32
    a = abs(x)
    far = a > f(_FAR)
    c = f(_FAR) if far else a  # nan stays nan
    s = c * c
    k = np.floor(s * f(-0.5 * 1.44269504088896341) + f(0.5))
    # r = -c^2 - 2 k ln 2, twice exp's reduced argument (E takes it so): fmas, which no reassociation
    # undoes (this is inlined into loops compiled with reassoc), for the two parts of 2 k ln 2, then the
    # square's exact rounding error, so that r is -c^2 - 2 k ln 2 to float32's rounding
    r: Any = vfma(k, f(-2 * 0.693359375), -s)  # type: ignore[call-arg]
    r = vfma(k, f(2 * 2.12194440e-4), r)  # type: ignore[call-arg]
    r = r - vfma(c, c, -s)  # type: ignore[call-arg]
    r2 = r * r  # exp(r / 2) by Estrin's scheme: a shorter chain than Horner's (the loop is latency-bound)
    e = (f(_EXP[0]) * r + f(_EXP[1])) * r2 + (f(_EXP[2]) * r + f(_EXP[3]))
    e = (e * r2 + (f(_EXP[4]) * r + f(_EXP[5]))) * r + f(_EXP[6])
    g = e * _exp2_32(k)  # type: ignore[call-arg]
    # the rational and the sign are ready before g: Phi = g (P / R) for x < 0 and 1 - g (P / R) in one fma
    num, den = f(_TAIL_P[0]), f(_TAIL_R[0])
    for i in range(1, 5):
        num, den = num * c + f(_TAIL_P[i]), den * c + f(_TAIL_R[i])
    ratio = f(0) if far else num / (den * c + f(1))
    below = x < f(0)
    cdf = vfma(g, ratio if below else -ratio, f(0) if below else f(1))  # type: ignore[call-arg]
    return cdf, (f(0) if far else g)


def _cdf64(x: Any) -> Any:  # pragma: no cover - compiled
    return jit_math.normal_cdf(x)


@overload(normal_cdf, inline="always", jit_options={"fastmath": EXACT, "error_model": "numpy"})
def _normal_cdf_overload(x: Any) -> Any:
    if isinstance(x, types.Float):
        return _cdf32 if x.bitwidth == 32 else _cdf64
    return None


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def gelu_tanh_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = x / (1 + exp(-2u)): activation.py's gelu (the tanh form)."""
    f = x.dtype.type
    c, a, one = f(-2 * _C), f(-2 * _C * _A), f(1)
    for i in range(x.size):
        v = x[i]
        out[i] = v / (one + vexp(v * (c + a * v * v)))


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def gelu_tanh_grad_all(dy: Any, x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = dy (s + x (2 sqrt(2/pi)) (1 + 3 * 0.044715 x^2) e s s): activation.py's gelu_grad."""
    f = x.dtype.type
    c, a, one, zero = f(-2 * _C), f(-2 * _C * _A), f(1), f(0)
    k1, k3 = f(2 * _C), f(2 * _C * 3 * _A)
    for i in range(x.size):
        v = x[i]
        vv = v * v
        e = vexp(v * (c + a * vv))
        s = one / (one + e)
        w = zero if s == zero else e * s * s  # inf * 0 where exp overflowed: its limit
        slope = zero if w == zero else v * (k1 + k3 * vv) * w  # and 0 * inf where x^3 did
        out[i] = dy[i] * (s + slope)


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def gelu_erf_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = x Phi(x): activation.py's gelu_erf."""
    for i in range(x.size):
        v = x[i]
        out[i] = v * normal_cdf(v)[0]


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def gelu_erf_grad_all(dy: Any, x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = dy (Phi(x) + x exp(-x^2 / 2) / sqrt(2 pi)): activation.py's gelu_erf_grad."""
    k = x.dtype.type(_INV_SQRT_2PI)
    for i in range(x.size):
        v = x[i]
        cdf, g = normal_cdf(v)
        out[i] = dy[i] * (cdf + v * g * k)


# The unary loops below run in place where ``out`` is x itself (a fused chain's step writing over its
# dying input): one array, a loop LLVM vectorises. Given two arrays that may overlap, LLVM checks at run
# time and takes its scalar copy of the loop where they do (exp over 262,144 float32 numbers 141 ->
# 1,312 us); rowwise.loop_into passes no other overlap.
IN_PLACE = frozenset({"exp_all", "log_all", "relu_all", "sigmoid_all"})


@njit(inline="always")
def _same(x: Any, out: Any) -> bool:  # pragma: no cover - compiled
    return x.ctypes.data == out.ctypes.data  # type: ignore[no-any-return]


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def exp_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = e ** x: elementwise.py's exp (jit_math's vexp; numpy's float32 exp is scalar on AVX2)."""
    if _same(x, out):
        for i in range(x.size):
            x[i] = vexp(x[i])
    else:
        for i in range(x.size):
            out[i] = vexp(x[i])


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def log_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = ln x: elementwise.py's log (jit_math's vlog)."""
    if _same(x, out):
        for i in range(x.size):
            x[i] = vlog(x[i])
    else:
        for i in range(x.size):
            out[i] = vlog(x[i])


@intrinsic
def _maximum(typingctx: Any, a: Any, b: Any) -> Any:
    """LLVM's ``maximum``: nan where either is, else the larger (numpy's maximum, PyTorch's relu). Not a
    compare and select: written in place, ``v <= 0 ? 0 : v`` becomes a store of 0 where v <= 0, a masked
    store, microcoded on this AMD core (relu over 262,144 float32 numbers in place 245 us, this 31)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ty = context.get_value_type(sig.return_type)
        fn = builder.module.declare_intrinsic("llvm.maximum", [ty], ir.FunctionType(ty, [ty, ty]))
        return builder.call(fn, args)

    return a(a, b), codegen


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def relu_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = max(x, 0): elementwise.py's relu (numpy's float32 maximum ran ~0.7 ns an element here); nan
    stays nan and, under the loops' no-signed-zeros flag, -0 stays -0 (as PyTorch's relu; numpy's gives 0:
    equal values, another sign bit)."""
    zero = x.dtype.type(0)
    if _same(x, out):
        for i in range(x.size):
            x[i] = _maximum(x[i], zero)  # type: ignore[call-arg]
    else:
        for i in range(x.size):
            out[i] = _maximum(x[i], zero)  # type: ignore[call-arg]


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def relu_grad_all(dy: Any, y: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = dy (y > 0): elementwise.py's relu_grad, numpy's dy * (y > 0) to the bit (a product by 1 or 0,
    so -0 and nan where numpy has them), one pass and no boolean temporary."""
    one, zero = dy.dtype.type(1), dy.dtype.type(0)
    for i in range(dy.size):
        out[i] = dy[i] * (one if y[i] > zero else zero)


@njit(inline="always", error_model="numpy", fastmath=FLAGS)
def _bce(x: Any, t: Any, one: Any, zero: Any) -> Any:  # pragma: no cover - compiled
    """max(x, 0) - x t + log1p(exp(-|x|)), jit_math's vlog1p; max(x, 0) - x t as one term, x (1 - t) or
    -x t: reassociated, x - x t + log1p(e) regroups as x + (log1p(e) - x t), losing a small loss's bits
    to x's rounding (1e-8 relative in float64 at x = 11)."""
    a = x * (one - t) if x > zero else -(x * t)
    return a + vlog1p(vexp(-abs(x)))


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def bce_logits_all(x: Any, t: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = each element's loss: activation.py's binary_cross_entropy_with_logits, reduction none."""
    one, zero = x.dtype.type(1), x.dtype.type(0)
    for i in range(x.size):
        out[i] = _bce(x[i], t[i], one, zero)


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def bce_logits_sum(x: Any, t: Any) -> Any:  # pragma: no cover - compiled
    """The sum of the elements' losses, in x's dtype in vector lanes as reduction.py's sum_all sums: its
    mean and sum reductions."""
    total, one, zero = x.dtype.type(0), x.dtype.type(1), x.dtype.type(0)
    for i in range(x.size):
        total += _bce(x[i], t[i], one, zero)
    return total


@njit(inline="always", error_model="numpy", fastmath=FLAGS)
def _sigmoid(v: Any, one: Any) -> Any:  # pragma: no cover - compiled
    e = vexp(-abs(v))
    return (one if v >= 0 else e) / (one + e)


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def sigmoid_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = 1 / (1 + e) where x >= 0, e / (1 + e) where not, e = exp(-|x|): activation.py's sigmoid, its
    form that overflows for no x, in one pass."""
    one = x.dtype.type(1)
    if _same(x, out):
        for i in range(x.size):
            x[i] = _sigmoid(x[i], one)
    else:
        for i in range(x.size):
            out[i] = _sigmoid(x[i], one)


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def add_rows(a: Any, b: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[i] = a[i] + b: elementwise.py's add of x and a bias of x's trailing shape, flattened to [n]
    (numpy's broadcast loop restarts at every row, twice this loop's time on the GPT's [16, 64, 192] +
    [192])."""
    rows, n = a.shape
    for i in range(rows):
        for j in range(n):
            out[i, j] = a[i, j] + b[j]
