"""AdamW's update as one numba pass over the parameter, its gradient and moments, bit for bit numpy's;
and each update's last step in place, where the runtime lets the new parameter overwrite the old; SGD
with momentum in one pass too (``sgd_momentum_in_place``), parameter and buffer both in place.

optim.py's numpy kernel makes the formula's 14 operations as 14 passes, each writing an array the size of
the parameter and reading it back; a table of a few MB is then 14 trips to memory where one does, and
ranks that share a host's memory bandwidth slow each other down (four in-process ranks updating a
replicated 16 MB table: 2-3x the probe's time). This loop does every operation of one element in the
numpy kernel's order, in the array's dtype, with no fast-math flags: each is IEEE's correctly rounded
operation, as each numpy pass is, so the result is the numpy kernel's bit for bit
(``tests/sbpflow/ops/kernels/test_optim_jit.py``), and a layout's shards update exactly as the whole would.

``nogil``: the loop releases the GIL, as numpy's passes do. The arrays are flat, of one float dtype,
C-contiguous (``rowwise.jit_loops`` decides). The moments are updated in place (the runtime donates
them; the kernel copies those it was not given) and the parameter goes to an array of its own: an
output passed as a separate argument that is the same array as an input makes LLVM's overlap check
fail at run time, and the loop then runs unvectorised (190 against 14 us for 65,536 float32). The
in-place forms (``adamw_in_place``, ``sgd_in_place``: the runtime lends the parameter itself once nothing
else holds it, ``tasks.Recycler``) take the parameter once, read and written, so no check fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")
def adamw_all(
    param: Any,
    grad: Any,
    m: Any,
    v: Any,
    b1: float,
    b2: float,
    bias1: float,
    bias2: float,
    lr: float,
    eps: float,
    decay: float,
    scale: float,
    new_param: Any,
) -> None:  # pragma: no cover - compiled
    """optim._adamw_kernel's operations an element, the moments ``m`` and ``v`` updated in place and the
    parameter written to ``new_param`` (another array): b1, b2 the betas, bias1 and bias2 the bias
    corrections' 1 - beta**n, decay 1 - lr * weight_decay, scale the clipping factor each gradient element
    is multiplied by first (1: unclipped, exact); every constant in the arrays' dtype."""
    f = param.dtype.type
    c1, c2, k1, k2 = f(1.0 - b1), f(1.0 - b2), f(b1), f(b2)
    d1, d2, step, e, keep, s = f(bias1), f(bias2), f(lr), f(eps), f(decay), f(scale)
    for i in range(param.size):
        g = grad[i] * s
        mi = m[i] * k1 + g * c1
        vi = v[i] * k2 + (g * g) * c2
        m[i] = mi
        v[i] = vi
        new_param[i] = param[i] * keep - ((mi / d1) * step) / (np.sqrt(vi / d2) + e)


@njit(cache=True, nogil=True, error_model="numpy")
def adamw_in_place(
    param: Any,
    grad: Any,
    m: Any,
    v: Any,
    b1: float,
    b2: float,
    bias1: float,
    bias2: float,
    lr: float,
    eps: float,
    decay: float,
    scale: float,
) -> None:  # pragma: no cover - compiled
    """:func:`adamw_all` with the new parameter written over the old, element by element."""
    f = param.dtype.type
    c1, c2, k1, k2 = f(1.0 - b1), f(1.0 - b2), f(b1), f(b2)
    d1, d2, step, e, keep, s = f(bias1), f(bias2), f(lr), f(eps), f(decay), f(scale)
    for i in range(param.size):
        g = grad[i] * s
        mi = m[i] * k1 + g * c1
        vi = v[i] * k2 + (g * g) * c2
        m[i] = mi
        v[i] = vi
        param[i] = param[i] * keep - ((mi / d1) * step) / (np.sqrt(vi / d2) + e)


@njit(cache=True, nogil=True, error_model="numpy")
def sgd_in_place(param: Any, direction: Any, alpha: float) -> None:  # pragma: no cover - compiled
    """``param = alpha * direction + param`` in place: optim._axpy's two operations an element (the
    product rounded, then the sum), so the bits of its two numpy passes."""
    a = param.dtype.type(alpha)
    for i in range(param.size):
        param[i] = direction[i] * a + param[i]


@njit(cache=True, nogil=True, error_model="numpy")
def sgd_momentum_in_place(
    param: Any,
    grad: Any,
    buf: Any,
    momentum: float,
    decay: float,
    nesterov: bool,
    alpha: float,
    scale: float,
    clipped: bool,
) -> None:  # pragma: no cover - compiled
    """optim._sgd_kernel's operations an element, with momentum: the gradient times the clipping factor
    ``scale`` where ``clipped``, plus ``decay`` (the weight decay) times the parameter where it is not 0,
    the buffer ``buf`` times ``momentum`` plus that, written over ``buf``; the direction (the buffer, or
    under ``nesterov`` the buffer times ``momentum`` plus the decayed gradient again) times ``alpha`` (-lr)
    plus the parameter, written over ``param``. One pass for the numpy kernel's three to five; each
    constant in the arrays' dtype, each operation rounded as its numpy pass is, so the same bits."""
    f = param.dtype.type
    k, wd, a, s = f(momentum), f(decay), f(alpha), f(scale)
    for i in range(param.size):
        g = grad[i] * s if clipped else grad[i]
        d = param[i] * wd + g if decay != 0.0 else g
        b = buf[i] * k + d
        buf[i] = b
        direction = b * k + d if nesterov else b
        param[i] = direction * a + param[i]
