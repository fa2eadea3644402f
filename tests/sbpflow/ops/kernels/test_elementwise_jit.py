"""sbpflow/ops/kernels/elementwise_jit.py's one-pass loops (GELU's, exp, log, sigmoid) against the numpy
kernels they replace.

Each op runs on C-contiguous arrays, which take the loop (checked: the op's result is the loop's, bit
for bit), and on a strided view of the same values, which ``jit_elementwise`` refuses, so the numpy
kernel runs. float64 must agree to the last few bits. In float32 the loops are compared with the numpy
kernel run in float64: numpy's float32 tanh form loses every bit to cancellation near x = -5 (1 + tanh),
where the loop's logistic form does not, so the float32 numpy kernel is no reference there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.special import ndtr

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.dtype import as_dtype
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.ops.eager import EagerBuilder
from sbpflow.ops.elementwise import jit_elementwise
from sbpflow.ops.fused import encode
from sbpflow.ops.kernels.rowwise import loop_into
from sbpflow.tensor_meta import TensorMeta

numba = pytest.importorskip("numba")
from sbpflow.ops.kernels import elementwise_jit  # noqa: E402  (needs numba)
from sbpflow.ops.kernels.elementwise_jit import normal_cdf  # noqa: E402
from sbpflow.ops.kernels.jit_math import FLAGS  # noqa: E402

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
# op: (its loop, unary); float32 tolerances against the float64 numpy kernel (rtol, atol)
LOOPS = {
    "gelu": ("gelu_tanh_all", True),
    "gelu_grad": ("gelu_tanh_grad_all", False),
    "gelu_erf": ("gelu_erf_all", True),
    "gelu_erf_grad": ("gelu_erf_grad_all", False),
    "exp": ("exp_all", True),
    "log": ("log_all", True),
    "sigmoid": ("sigmoid_all", True),
    "relu": ("relu_all", True),
    "relu_grad": ("relu_grad_all", False),
}
POSITIVE = frozenset({"log"})  # drawn x taken as |x|: a negative x's log is nan either way
F32_TOL = (4e-6, 2e-7)
F64_TOL = (1e-13, 1e-14)  # the gradients cross 0, where 1e-13 relative is below their rounding


def strided(a: Any) -> Any:
    """The same values as a view with a step of 2 along the last axis: not C-contiguous."""
    return np.repeat(a, 2, axis=-1)[..., ::2]


def call(op: str, *inputs: Any, **attrs: Any) -> Any:
    with np.errstate(all="ignore"):
        return EagerBuilder().call(op, *inputs, **attrs)[0]


def inputs_of(op: str, x: Any, dy: Any, domain: bool = True) -> tuple[Any, ...]:
    """The op's inputs; ``domain``: x within the op's domain (|x| for log)."""
    x = np.abs(x) if domain and op in POSITIVE else x
    return (x,) if LOOPS[op][1] else (dy, x)


@st.composite
def arrays(draw: st.DrawFn, dtype: Any) -> tuple[Any, Any]:
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
    n = draw(st.sampled_from([2, 3, 7, 17, 64, 1001]))  # odd sizes: the loops' vector remainders
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((*lead, n)) * draw(st.sampled_from([0.3, 3.0, 8.0]))
    return x.astype(dtype), rng.standard_normal(x.shape).astype(dtype)


@pytest.mark.parametrize("op", sorted(LOOPS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@SETTINGS
@given(data=st.data())
def test_loop_matches_the_numpy_kernel(op: str, dtype: Any, data: st.DataObject) -> None:
    x, dy = data.draw(arrays(dtype))
    ins = inputs_of(op, x, dy)
    got = call(op, *ins)
    loop_out = np.empty_like(x)
    getattr(elementwise_jit, LOOPS[op][0])(*(a.reshape(-1) for a in ins), loop_out.reshape(-1))
    assert got.dtype == x.dtype and got.shape == x.shape
    assert np.array_equal(got, loop_out, equal_nan=True), f"{op}: the op did not take the loop"
    slow = call(op, *(strided(a) for a in ins))
    if dtype == np.float64:
        np.testing.assert_allclose(got, slow, *F64_TOL, err_msg=op)
    else:
        want = call(op, *(a.astype(np.float64) for a in ins))
        np.testing.assert_allclose(got, want, *F32_TOL, err_msg=op)


@pytest.mark.parametrize("op", sorted(LOOPS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_nan_and_infinities(op: str, dtype: Any) -> None:
    """nan stays nan; +-inf give numpy's kernel's results, except the tanh form's gradient, which takes
    its limits (0 at -inf, 1 at +inf) where numpy's formula gives inf * 0; finite results within 4 ulp."""
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 40.0, -40.0], dtype)
    dy = np.ones_like(x)
    ins = inputs_of(op, x, dy, domain=False)
    got = call(op, *ins)
    want = call(op, *(strided(a) for a in ins))
    if op == "gelu_grad":
        assert got[1] == 1.0 and got[2] == 0.0, got
        got, want = got[3:], want[3:]
        assert np.isfinite(got).all(), got  # huge finite x: the limits too, where numpy overflows x^3
        got, want = got[:2], want[:2]
    finite = np.isfinite(want)  # exp, log: the loop within a few ulp of numpy's there, not its bits
    np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=op)
    np.testing.assert_allclose(got[finite], want[finite], rtol=4 * np.finfo(dtype).eps, atol=0, err_msg=op)


@numba.njit(error_model="numpy", fastmath=FLAGS)  # as the loops that call it are compiled
def _cdf_all(x: Any, cdf: Any, pdf: Any) -> None:  # pragma: no cover - compiled
    for i in range(x.size):
        cdf[i], pdf[i] = normal_cdf(x[i])


@pytest.mark.parametrize("dtype, ulps", [(np.float32, 4), (np.float64, 4)])
def test_normal_cdf_is_within_a_few_ulp(dtype: Any, ulps: int) -> None:
    """Relative to scipy's in float64 wherever the result is a normal number of the dtype, the far tails
    and the float32 rational's cut-off at 13.2164 included; in float64 Phi of x < 0 is 0.5 (1 + erf) as
    numpy's kernel computes it, so there it is held to 4 ulp of 1. Below the normal range, within the
    smallest normal of the true value; nan and +-inf give nan and the limits."""
    grid = [np.linspace(-14, 14, 1_000_001), np.linspace(13.2, 13.23, 3001), np.linspace(-1, 1, 2001)]
    tiny_x = np.geomspace(1e-45, 1e-3, 2001)
    x = np.concatenate([*grid, -grid[1], tiny_x, -tiny_x, [0.0, -0.0]]).astype(dtype)
    cdf, pdf = np.empty_like(x), np.empty_like(x)
    _cdf_all(x, cdf, pdf)
    wide = x.astype(np.float64)
    tiny, eps = np.finfo(dtype).tiny, np.finfo(dtype).eps
    for got, want, name in ((cdf, ndtr(wide), "Phi"), (pdf, np.exp(-wide * wide / 2), "exp(-x^2/2)")):
        scale = np.maximum(want, 1.0) if (dtype == np.float64 and name == "Phi") else want
        err = np.abs(got - want)[want > tiny] / scale[want > tiny]
        worst = int(np.argmax(err))
        assert err.max() <= ulps * eps, f"{name}({x[want > tiny][worst]!r}): {err.max() / eps:.1f} ulp"
        assert (np.abs(got - want)[want <= tiny] <= tiny).all(), name
    special = np.array([np.nan, np.inf, -np.inf], dtype)
    cdf, pdf = np.empty_like(special), np.empty_like(special)
    _cdf_all(special, cdf, pdf)
    np.testing.assert_array_equal(cdf, [np.nan, 1.0, 0.0])
    np.testing.assert_array_equal(pdf, [np.nan, 0.0, 0.0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exact_gelu_and_its_gradient_match_pytorch(dtype: Any) -> None:
    """The oracle: torch.nn.functional.gelu (approximate="none") and the ATen backward autograd calls, in
    float64, on a dense grid through the tails. float64 to 1e-12; float32 to a few ulp of the float64
    result (PyTorch's own float32, 0.5 x (1 + erf), is off by up to ~1e-7 |x| in absolute terms: held to
    that, it agrees too)."""
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.linspace(-12, 12, 240_001), np.linspace(-0.01, 0.01, 2001)]).astype(dtype)
    dy = np.random.default_rng(0).standard_normal(x.shape).astype(dtype)
    tx, tdy = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(dy.astype(np.float64))
    want_y = torch.nn.functional.gelu(tx).numpy()
    want_g = torch.ops.aten.gelu_backward(tdy, tx).numpy()
    got_y, got_g = call("gelu_erf", x), call("gelu_erf_grad", dy, x)
    rtol = 1e-12 if dtype == np.float64 else 4 * np.finfo(np.float32).eps
    # PyTorch's float64 is 0.5 x (1 + erf) too: off by ~1e-16 |x| absolute, all of Phi below x = -8
    slack = 4e-16 * np.abs(x)
    assert (np.abs(got_y - want_y) <= rtol * np.abs(want_y) + slack).all()
    # the gradient crosses 0 near x = -0.75, where its relative error is unbounded: absolute there
    near_0 = 16 * np.finfo(dtype).eps * np.abs(dy)
    assert (np.abs(got_g - want_g) <= rtol * np.abs(want_g) + np.abs(dy) * slack + near_0).all()
    if dtype == np.float32:  # PyTorch's float32: 0.5 x (1 + erf(x / sqrt 2)), its own error CPU-dependent:
        # ~1e-7 |x| on AVX2 (AMD EPYC), up to 3.5e-7 |x| on an AVX-512 Xeon (Emerald Rapids), measured
        # against its float64 on this grid, where ours stays within the 4 ulp above
        ty = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
        tg = torch.ops.aten.gelu_backward(torch.from_numpy(dy), torch.from_numpy(x)).numpy()
        bound = 5e-7 * np.abs(x) + 4 * np.finfo(dtype).eps * np.abs(want_y)
        assert (np.abs(got_y - ty) <= bound).all()
        assert (
            np.abs(got_g - tg)
            <= np.abs(dy) * 2e-7 * np.maximum(np.abs(x), 1.0) + 4 * np.finfo(dtype).eps * np.abs(tg)
        ).all()


@dataclass(frozen=True)
class _Lending(KernelContext):
    out_buffers: tuple[Any, ...] = ()


def _context(x: Any, n_in: int, buffer: Any) -> KernelContext:
    meta = TensorMeta(x.shape, as_dtype(x.dtype.name))
    index = tuple(slice(0, s) for s in x.shape)
    return _Lending(np, {}, (meta,) * n_in, (meta,), (index,) * n_in, (index,), out_buffers=(buffer,))


@pytest.mark.parametrize("op", sorted(LOOPS))
def test_writes_into_a_lent_output_and_refuses_what_it_does_not_take(op: str) -> None:
    x = np.linspace(-3, 3, 60, dtype=np.float32).reshape(4, 15)
    ins = inputs_of(op, x, np.ones_like(x))
    lent = np.empty_like(x)
    y = get_op(op).kernel(_context(x, len(ins), lent), *ins)
    assert y is lent and np.array_equal(y, call(op, *ins))
    loop = LOOPS[op][0]
    ctx = _context(x, len(ins), None)
    assert jit_elementwise(ctx, loop, *(strided(a) for a in ins)) is None
    assert jit_elementwise(ctx, loop, *(a.astype(np.float16) for a in ins)) is None
    assert jit_elementwise(ctx, loop, *(np.float32(0.5) for _ in ins)) is None
    if len(ins) == 2:
        assert jit_elementwise(ctx, loop, ins[0], ins[1][:, :1]) is None  # shapes that do not fit


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_logistic_loss_takes_one_pass_and_keeps_tiny_losses(reduction: str, dtype: Any) -> None:
    """binary_cross_entropy_with_logits by elementwise_jit's loops against its numpy kernel (a strided
    view of the same values) and the formula in float64; a loss of ~4e-18 (x = +-40 on the right side)
    within a few ulp, where log(1 + e) would give 0; nan stays nan."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 333)) * 6.0
    x[0, :4] = [40.0, -40.0, 0.0, -0.0]
    t = (rng.random(x.shape) < 0.5).astype(np.float64)
    t[0, :4] = [1.0, 0.0, 0.5, 0.5]
    x, t = x.astype(dtype), t.astype(dtype)
    got = call("binary_cross_entropy_with_logits", x, t, reduction=reduction)
    slow = call("binary_cross_entropy_with_logits", strided(x), strided(t), reduction=reduction)
    wide, wt = x.astype(np.float64), t.astype(np.float64)
    each = np.where(wide > 0, wide * (1 - wt), -wide * wt) + np.log1p(np.exp(-np.abs(wide)))
    want = {"none": each, "mean": each.mean(), "sum": each.sum()}[reduction]
    assert got.dtype == x.dtype and got.shape == np.shape(want)
    rtol = 1e-13 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(got, want, rtol=rtol)
    np.testing.assert_allclose(slow, want, rtol=rtol)
    if reduction == "none":
        np.testing.assert_allclose(got[0, :2], [4.248354255291589e-18] * 2, rtol=4 * np.finfo(dtype).eps)
    # x = -inf, t = 1: the limit inf; x = inf, t = 1: inf * 0, nan, as numpy's and PyTorch's formulas
    special = np.array([np.nan, 1.0, np.inf, -np.inf], dtype)
    t = np.array([0, np.nan, 1, 1], dtype)
    np.testing.assert_array_equal(
        call("binary_cross_entropy_with_logits", special, t, reduction="none"),
        [np.nan, np.nan, np.nan, np.inf],
    )


# x / 2, then exp and log, each written into the step before it, which dies there
_EXP_LOG = encode([("mul_scalar", {"value": 0.5}, ["in0"]), ("exp", {}, ["s0"]), ("log", {}, ["s1"])])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_fused_chain_keeps_the_unfused_ops_bits(dtype: Any) -> None:
    """exp and log in a fused chain take the ops' own loops, not numpy's ufuncs (whose last bits differ),
    so fusion changes no result. A unary loop writes in place over its dying input (its one-array loop,
    which vectorises); any other overlap with an input gets a new array, not the loop's overlap fallback
    (scalar, ~10x slower)."""
    x = np.random.default_rng(6).standard_normal((8, 129)).astype(dtype)
    got = call("fused_elementwise", x, chain=_EXP_LOG)
    want = call("log", call("exp", call("mul_scalar", x, value=0.5)))
    assert np.array_equal(got, want), "the chain did not run the ops' loops"
    y = x.copy()
    assert loop_into(np, "exp_all", (y,), y) is y and np.array_equal(y, call("exp", x))
    lent = np.empty_like(x)
    assert loop_into(np, "exp_all", (x,), lent) is lent
    wide = np.concatenate([x.reshape(-1), x.reshape(-1)])
    shifted = wide[1 : x.size + 1].reshape(x.shape)  # overlaps x's copy in wide, not it
    out = loop_into(np, "exp_all", (wide[: x.size].reshape(x.shape),), shifted)
    assert out is not shifted and np.array_equal(out, call("exp", x))
    dy = np.ones_like(x)
    out = loop_into(np, "gelu_tanh_grad_all", (dy, x), dy)  # two inputs: never in place
    assert out is not dy and np.array_equal(out, call("gelu_grad", np.ones_like(x), x))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    "shape, bias",
    [((3, 7), 1), ((2, 5, 17), 1), ((16, 64, 192), 1), ((1, 3), 1), ((2, 5, 17), 2), ((16, 64, 64), 2)],
)
def test_bias_add_is_numpys_sum_bit_for_bit(dtype: Any, shape: tuple[int, ...], bias: int) -> None:
    """One rounding an element, as numpy's: the same bits; inf, nan and signed zeros included. The bias
    is x's last axis or its last two (a position table)."""
    rng = np.random.default_rng(sum(shape))
    a, b = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape[-bias:]).astype(dtype)
    a.reshape(-1)[:3] = [np.inf, np.nan, -0.0]
    b.reshape(-1)[0] = -0.0
    got = call("add", a, b)
    rows = np.empty_like(a)
    elementwise_jit.add_rows(a.reshape(-1, b.size), b.reshape(-1), rows.reshape(-1, b.size))
    assert np.array_equal(got.view(np.uint8), rows.view(np.uint8)), "add did not take the row loop"
    assert np.array_equal(got.view(np.uint8), np.add(a, b).view(np.uint8))
    assert np.array_equal(call("add", strided(a), b).view(np.uint8), np.add(a, b).view(np.uint8))


def test_bias_add_takes_only_a_bias_along_the_last_axis() -> None:
    a = np.ones((4, 6), np.float32)
    ctx = _context(a, 2, None)
    assert jit_elementwise(ctx, "add_rows", a, np.ones(4, np.float32)) is None  # [4, 6] + [4]: no bias
    assert jit_elementwise(ctx, "add_rows", a, np.ones((1, 6), np.float32)) is None  # nor [1, 6]
    assert jit_elementwise(ctx, "add_rows", a, np.ones(6, np.float64)) is None  # dtypes differ
    assert jit_elementwise(ctx, "gelu_tanh_grad_all", a, np.ones(6, np.float32)) is None  # not a row loop
    np.testing.assert_array_equal(call("add", np.ones(6, np.float32), a), a + 1)  # the bias first: numpy
