"""GELU's kernels, both forms and their backward, and a bias add, as one-pass numba loops on numpy arrays.

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

Exact GELU, x Phi(x), takes jit_math's ``normal_cdf``: in float64 erf.py's Cody approximation, to
float64's rounding; in float32 an approximation in float32 within ~8 ulp, since Cody's in float64 costs
5x PyTorch's whole op. Its gradient is dy (Phi(x) + x phi(x)), phi the normal density, which normal_cdf
gives on the way.

Each function is the fast path only: the numpy kernels in activation.py and elementwise.py stay the
reference and the path for cupy and for arrays these do not take (elementwise.jit_elementwise says which);
``tests/sbpflow/ops/kernels/test_elementwise_jit.py`` checks each against them. Arrays are flat (add_rows: rows),
of one float dtype, C-contiguous; ``out`` is written.
"""

from __future__ import annotations

import math
from typing import Any

from numba import njit

from sbpflow.ops.kernels.jit_math import FLAGS, normal_cdf, vexp

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


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


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def add_rows(a: Any, b: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[i] = a[i] + b: elementwise.py's add of x and a bias of x's trailing shape, flattened to [n]
    (numpy's broadcast loop restarts at every row, twice this loop's time on the GPT's [16, 64, 192] +
    [192])."""
    rows, n = a.shape
    for i in range(rows):
        for j in range(n):
            out[i, j] = a[i, j] + b[j]
