"""sbpflow/ops/kernels/rows_jit.py's one-pass row loops against nn.py's numpy kernels, the reference they replace.

The same op runs twice on the same values: on C-contiguous arrays, which take the numba loops, and on a
strided view of them, which rowwise.jit_rows refuses, so the numpy kernel runs. float64 must agree to
the last few bits (only the sums' order differs), float32 to its precision; -inf scores (a causal
mask), whole -inf rows, nan, ignored and negative labels included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.dtype import DType
from sbpflow.errors import ShapeError
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.ops.eager import EagerBuilder, full_index
from sbpflow.ops.kernels.rowwise import jit_rows
from sbpflow.ops.layers import vocab
from sbpflow.tensor_meta import TensorMeta

numba = pytest.importorskip("numba")
from sbpflow.ops.kernels.jit_math import FLAGS, vexp, vlog, vlog1p  # noqa: E402  (needs numba)


@numba.njit(fastmath=FLAGS)  # as the kernels that call it are compiled
def _vexp_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    for i in range(x.size):
        out[i] = vexp(x[i])


@numba.njit(fastmath=FLAGS)
def _vlog_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    for i in range(x.size):
        out[i] = vlog(x[i])


@numba.njit(fastmath=FLAGS)  # reassociating, as the loss's loops: the correction term must survive it
def _vlog1p_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    for i in range(x.size):
        out[i] = vlog1p(x[i])


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
TOL = {np.float64: (1e-12, 1e-13), np.float32: (2e-5, 2e-6)}
IGNORE = -100


def strided(a: Any) -> Any:
    """The same values as a view with a step of 2 along the last axis: not C-contiguous."""
    wide = np.repeat(a, 2, axis=-1) if a.ndim else a
    return wide[..., ::2]


def both(op: str, *inputs: Any, **attrs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The op's outputs through rows_jit (contiguous inputs) and through the numpy kernel (the first
    input strided), after checking that each took the path it should."""
    assert jit_rows(np, inputs[0]) is not None, "numba is a dependency: the fast path must be taken here"
    slow = (strided(inputs[0]), *inputs[1:])
    assert jit_rows(np, slow[0]) is None
    with np.errstate(all="ignore"):
        return EagerBuilder().call(op, *inputs, **attrs), EagerBuilder().call(op, *slow, **attrs)


def same(got: tuple[Any, ...], want: tuple[Any, ...], dtype: Any, what: str) -> None:
    rtol, atol = TOL[dtype]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what} output {i}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        )
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{what} output {i}")


@st.composite
def rows(draw: st.DrawFn, dtype: Any) -> Any:
    lead = draw(st.lists(st.integers(1, 5), min_size=0, max_size=2))
    n = draw(st.sampled_from([2, 3, 7, 16, 64, 130]))  # n = 1: a strided view would be contiguous
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).standard_normal((*lead, n)).astype(dtype) * 3


DTYPES = [np.float64, np.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_softmax_and_its_gradient(dtype: Any, data: st.DataObject) -> None:
    x = data.draw(rows(dtype))
    if x.shape[-1] > 1 and data.draw(st.booleans()):
        x[..., -1] = -np.inf  # a masked score
    (y,), (y_ref,) = both("softmax", x, axis=-1)
    same((y,), (y_ref,), dtype, f"softmax {x.shape}")
    dy = np.random.default_rng(1).standard_normal(x.shape).astype(dtype)
    got, want = both("softmax_grad", y_ref, dy, axis=-1)
    same(got, want, dtype, f"softmax_grad {x.shape}")
    (ly,), (ly_ref,) = both("log_softmax", x, axis=-1)
    same((ly,), (ly_ref,), dtype, f"log_softmax {x.shape}")
    if np.isfinite(ly_ref).all():  # a masked score's log-probability is -inf: its gradient is nan
        same(*both("log_softmax_grad", ly_ref, dy, axis=-1), dtype, f"log_softmax_grad {x.shape}")


def test_softmax_rows_of_minus_inf_and_nan_stay_nan() -> None:
    x = np.zeros((3, 5))
    x[0] = -np.inf
    x[1, 2] = np.nan
    (y,), (y_ref,) = both("softmax", x, axis=-1)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(y_ref))
    assert np.isnan(y[:2]).all() and np.allclose(y[2], 0.2)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_layer_norm_and_its_gradient(dtype: Any, data: st.DataObject) -> None:
    x = data.draw(rows(dtype))
    rng = np.random.default_rng(2)
    w, b = (rng.standard_normal(x.shape[-1]).astype(dtype) for _ in range(2))
    same(*both("layer_norm", x, w, b, eps=1e-5), dtype, f"layer_norm {x.shape}")
    dy = rng.standard_normal(x.shape).astype(dtype)
    slow = EagerBuilder().call("layer_norm_grad", dy, strided(x), w, eps=1e-5)
    assert jit_rows(np, dy, x, w) is not None
    same(
        EagerBuilder().call("layer_norm_grad", dy, x, w, eps=1e-5), slow, dtype, f"layer_norm_grad {x.shape}"
    )


def _layer_norm_grad_exact(dy: Any, x: Any, w: Any, eps: float) -> tuple[Any, Any, Any]:
    """layer_norm_grad's formula in long double, centred: the reference both kernels are judged by."""
    dy, x, w = (a.astype(np.longdouble) for a in (dy, x, w))
    c = x - x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt((c * c).mean(-1, keepdims=True) + np.longdouble(eps))
    xhat, g = c * rstd, dy * w
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_grad_of_rows_far_from_zero_and_constant(dtype: Any) -> None:
    """The backward loop takes the variance from sums shifted by each row's first value. On rows whose
    mean is 1e4 deviations away (where the rounding of x itself is the error), and a constant row
    (variance 0, eps alone), it must be no further from the exact gradient than the centred numpy
    kernel is."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((7, 64)) + 1e4).astype(dtype)
    x[2] = 5.0
    w = rng.standard_normal(64).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    got = EagerBuilder().call("layer_norm_grad", dy, x, w, eps=1e-5)
    ref = EagerBuilder().call("layer_norm_grad", dy, strided(x), w, eps=1e-5)
    for i, (g, r, e) in enumerate(zip(got, ref, _layer_norm_grad_exact(dy, x, w, 1e-5), strict=True)):
        err, ref_err = np.abs(g - e).max(), np.abs(r - e).max()
        assert err <= 2 * ref_err + TOL[dtype][1] * np.abs(e).max(), f"output {i}: {err} vs numpy's {ref_err}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
@SETTINGS
@given(data=st.data())
def test_cross_entropy_and_its_gradient(dtype: Any, label_dtype: Any, data: st.DataObject) -> None:
    logits = data.draw(rows(dtype))
    n = logits.shape[-1]
    choices = st.one_of(st.integers(0, n - 1), st.just(IGNORE), st.integers(-n, -1))
    labels = np.array(
        data.draw(st.lists(choices, min_size=logits[..., 0].size, max_size=logits[..., 0].size)), label_dtype
    ).reshape(logits.shape[:-1])
    same(*both("cross_entropy", logits, labels, ignore_index=IGNORE), dtype, f"cross_entropy {logits.shape}")
    dy = np.random.default_rng(3).standard_normal(labels.shape).astype(dtype)
    got, want = both("cross_entropy_grad", logits, labels, dy, ignore_index=IGNORE)
    same(got, want, dtype, f"cross_entropy_grad {logits.shape}")


@pytest.mark.parametrize(
    ("dtype", "lo", "hi", "rtol"), [(np.float64, -708.0, 709.0, 1e-14), (np.float32, -87.0, 88.0, 3e-7)]
)
def test_vexp_is_within_a_few_ulp_of_exp(dtype: Any, lo: float, hi: float, rtol: float) -> None:
    x = np.concatenate([np.linspace(lo, hi, 200_001), np.random.default_rng(4).uniform(-1, 1, 10_000)])
    x = x.astype(dtype)
    got = np.empty_like(x)
    _vexp_all(x, got)
    want = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)
    special = np.array([-np.inf, np.inf, np.nan, 0.0, -1e4, 1e4, lo - 30], dtype)
    out = np.empty_like(special)
    _vexp_all(special, out)
    np.testing.assert_array_equal(out[:6], np.array([0.0, np.inf, np.nan, 1.0, 0.0, np.inf], dtype))
    assert 0 <= out[6] <= np.finfo(dtype).tiny  # below the normal range: 0 (numpy: a denormal)


def _worst_ulp(loop: Any, x: Any, exact: Any) -> tuple[float, Any]:
    """The loop's largest error on x, in ulp of the result in x's dtype against ``exact`` in long double,
    and the x where it is."""
    got = np.empty_like(x)
    loop(x, got)
    want = exact(x.astype(np.longdouble))
    ulp = np.spacing(np.abs(want).astype(x.dtype)).astype(np.longdouble)
    err = np.abs(got.astype(np.longdouble) - want) / ulp
    return float(err.max()), x[np.argmax(err)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_vlog_is_within_one_ulp_of_log(dtype: Any) -> None:
    """Against numpy's log in long double over the whole positive range, subnormals included, around 1
    (where ln x is small and the reduction's rounding would show) and at the reduction's cut at
    sqrt(2)/2; in ulp of the result in the dtype. 0 and -0 give -inf, x < 0 nan, inf inf, nan nan."""
    info, rng = np.finfo(dtype), np.random.default_rng(5)
    x = np.concatenate(
        [
            np.geomspace(float(info.smallest_subnormal), float(info.max) / 2, 400_001),
            rng.uniform(0.5, 2.0, 100_000),
            1.0 + rng.uniform(-1e-3, 1e-3, 10_000),
            np.sqrt(0.5) + rng.uniform(-1e-6, 1e-6, 10_000),
        ]
    ).astype(dtype)
    x = x[x > 0]
    err, worst = _worst_ulp(_vlog_all, x, np.log)
    assert err <= 1.0, f"vlog({worst!r}): {err:.2f} ulp"
    special = np.array([0.0, -0.0, -1.0, -np.inf, np.inf, np.nan, 1.0], dtype)
    out = np.empty_like(special)
    _vlog_all(special, out)
    np.testing.assert_array_equal(
        out, np.array([-np.inf, -np.inf, np.nan, np.nan, np.inf, np.nan, 0.0], dtype)
    )


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_vlog1p_is_within_two_ulp_of_log1p(dtype: Any) -> None:
    """Against long double over (-1, max), the tiny x where 1 + x rounds to 1 (log1p is x there) and
    (0, 1], the logistic loss's exp(-|x|); -1 gives -inf, below it nan, inf inf, nan nan."""
    info, rng = np.finfo(dtype), np.random.default_rng(8)
    x = np.concatenate(
        [
            np.geomspace(float(info.tiny), float(info.max) / 2, 200_001),
            -np.geomspace(float(info.tiny), 1.0 - float(info.eps), 100_001),
            rng.uniform(0.0, 1.0, 100_000),
            np.geomspace(float(info.eps) ** 2, float(info.eps) * 64, 10_001),
        ]
    ).astype(dtype)
    err, worst = _worst_ulp(_vlog1p_all, x, np.log1p)
    assert err <= 2.0, f"vlog1p({worst!r}): {err:.2f} ulp"
    special = np.array([-1.0, -2.0, -np.inf, np.inf, np.nan, 0.0], dtype)
    out = np.empty_like(special)
    _vlog1p_all(special, out)
    np.testing.assert_array_equal(out, np.array([-np.inf, np.nan, np.nan, np.inf, np.nan, 0.0], dtype))


def test_cross_entropy_of_a_row_with_nan_is_nan() -> None:
    logits = np.zeros((3, 4))
    logits[1, 2] = np.nan
    labels = np.array([0, 1, 2])
    (loss,), (ref,) = both("cross_entropy", logits, labels, ignore_index=IGNORE)
    np.testing.assert_array_equal(np.isnan(loss), [False, True, False])
    np.testing.assert_array_equal(np.isnan(ref), [False, True, False])
    (g,), _ = both("cross_entropy_grad", logits, labels, np.ones(3), ignore_index=IGNORE)
    assert np.isnan(g[1]).all() and not np.isnan(g[[0, 2]]).any()


def test_cross_entropy_label_out_of_range_raises_numpys_error() -> None:
    logits = np.zeros((2, 4))
    with pytest.raises(IndexError):
        EagerBuilder().call("cross_entropy", logits, np.array([1, 4]), ignore_index=IGNORE)
    with pytest.raises(IndexError):
        EagerBuilder().call("cross_entropy", strided(logits), np.array([1, 4]), ignore_index=IGNORE)


@pytest.mark.parametrize(
    "arrays",
    [
        [np.zeros((2, 3), np.float16)],  # numba has no float16 loops: numpy's kernel
        [np.zeros((2, 3)), np.zeros((2, 3), np.float32)],  # mixed dtypes
        [np.zeros((2, 0))],  # no elements
        [np.float64(1.0)],  # 0-d
        [np.zeros((3, 2)).T],  # not C-contiguous
    ],
)
def test_jit_rows_refuses_what_the_loops_do_not_take(arrays: list[Any]) -> None:
    assert jit_rows(np, *arrays) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rows_at_sums_each_ids_rows_in_its_range(dtype: Any) -> None:
    from sbpflow.ops.kernels import rows_jit

    rng = np.random.default_rng(5)
    ids = rng.integers(-3, 40, 500)  # some below, some above this shard's rows 10..29
    values = rng.standard_normal((500, 7)).astype(dtype)
    out = np.zeros((20, 7), dtype)
    rows_jit.add_rows_at(out, ids, 10, values)
    want = np.zeros((20, 7), dtype)
    hit = (ids >= 10) & (ids < 30)
    np.add.at(want, ids[hit] - 10, values[hit])  # in row order too: the same sums
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_in_one_pass_matches_numpys(dtype: Any) -> None:
    x = np.random.default_rng(6).standard_normal((9, 33)).astype(dtype) * 20
    x[0, :4] = [-np.inf, np.inf, np.nan, 0.0]
    (y,), (y_ref,) = both("sigmoid", x)
    same((y,), (y_ref,), dtype, "sigmoid")
    np.testing.assert_array_equal(y[0, :4], np.array([0.0, 1.0, np.nan, 0.5], dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_gelu_and_its_gradient_match_numpys(dtype: Any) -> None:
    x = np.concatenate([np.linspace(-9, 9, 4002), [0.46875, -0.46875, 4.0, -4.0, 6.0, -6.0, 0.0]])
    x = np.concatenate([x, [np.inf, -np.inf, np.nan]]).astype(dtype).reshape(4, -1)
    (y,), (y_ref,) = both("gelu_erf", x)
    rtol, atol = TOL[dtype]
    # 1 + erf(x) cancels for negative x (in both): compare to the scale of x, not of the tiny result
    np.testing.assert_allclose(y, y_ref, rtol=rtol, atol=max(atol, 1e-15))
    dy = np.random.default_rng(7).standard_normal(x.shape).astype(dtype)
    (g,), (g_ref,) = both("gelu_erf_grad", dy, x)
    finite = np.isfinite(x)
    np.testing.assert_allclose(g[finite], g_ref[finite], rtol=rtol, atol=max(atol, 1e-15))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5), (16, 64, 64), (7, 3, 2, 4)])
def test_sum_to_of_leading_axes_matches_numpys(dtype: Any, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(8).standard_normal(shape).astype(dtype)
    (got,), (want,) = both("sum_to", x, shape=shape[1:])
    same((got,), (want,), dtype, f"sum_to {shape}")
    np.testing.assert_allclose(got, x.sum(axis=0), rtol=TOL[dtype][0] * 10, atol=TOL[dtype][1] * 10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2,), (64,), (64, 256), (3, 5, 7)])  # (1,): its strided view is contiguous
@pytest.mark.parametrize("keepdims", [False, True])
def test_sum_of_a_whole_array_matches_numpys(dtype: Any, shape: tuple[int, ...], keepdims: bool) -> None:
    x = np.random.default_rng(9).standard_normal(shape).astype(dtype)
    (got,), (want,) = both("sum", x, keepdims=keepdims)
    same((got,), (want,), dtype, f"sum {shape}")
    assert got.shape == ((1,) * len(shape) if keepdims else ())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keepdims", [False, True])
@SETTINGS
@given(data=st.data())
def test_max_along_the_last_axis_matches_numpys(dtype: Any, keepdims: bool, data: st.DataObject) -> None:
    """rows_jit.max_rows sums a row beside vmax, which passes nans over: a row with a nan is nan, a row
    of -inf is -inf, a row with inf and -inf (a nan sum, no nan) is inf, as numpy's max."""
    x = data.draw(rows(dtype))
    flat = x.reshape(-1, x.shape[-1])
    if data.draw(st.booleans()):
        flat[0, -1] = np.nan
    if data.draw(st.booleans()):
        flat[-1] = -np.inf
    if data.draw(st.booleans()):
        flat[len(flat) // 2, 0] = np.inf
        flat[len(flat) // 2, -1] = -np.inf
    (got,), (want,) = both("max", x, axes=(x.ndim - 1,), keepdims=keepdims)
    np.testing.assert_array_equal(got, want)  # a maximum is one of the values: exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shapes", "axis"),
    [
        ([(16, 64, 4, 1, 16)] * 3, 3),  # attention's q, k and v gradients
        ([(3, 2), (3, 5), (3, 1)], 1),
        ([(2, 3), (4, 3)], 0),
        ([(2, 3, 4)], -1),
        ([(2, 1, 4), (2, 6, 4)], -2),
    ],
)
def test_concat_matches_numpys(dtype: Any, shapes: list[tuple[int, ...]], axis: int) -> None:
    rng = np.random.default_rng(10)
    xs = [rng.standard_normal(s).astype(dtype) for s in shapes]
    assert jit_rows(np, *xs) is not None
    (got,) = EagerBuilder().call("concat", *xs, axis=axis)
    np.testing.assert_array_equal(got, np.concatenate(xs, axis=axis))  # a copy: exact
    (slow,) = EagerBuilder().call("concat", strided(xs[0]), *xs[1:], axis=axis)
    np.testing.assert_array_equal(slow, got)
    # numpy lays its result out as strided inputs lie; the next reshape would copy it
    (flipped,) = EagerBuilder().call("concat", *(np.asfortranarray(x) for x in xs), axis=axis)
    assert flipped.flags.c_contiguous and np.array_equal(flipped, got)


def _vocab_inputs(dtype: Any, label_dtype: Any, seed: int) -> tuple[Any, Any]:
    """Logits [3, 5, 12] in 2 chunks and their labels, one of them ignored and one nan logit."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((3, 5, 12)) * 3).astype(dtype)
    logits[1, 2, 7] = np.nan
    labels = rng.integers(0, 12, size=(3, 5)).astype(label_dtype)
    labels[0, 1] = IGNORE
    return logits, labels


def _vocab_both(op: str, labels: Any, *inputs: Any, **attrs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``op`` through rows_jit (contiguous labels) and through the numpy kernel (the labels strided),
    ``inputs`` being the op's inputs with the labels in the place of None."""

    def call(lab: Any) -> tuple[Any, ...]:
        with np.errstate(all="ignore"):
            return EagerBuilder().call(op, *(lab if a is None else a for a in inputs), **attrs)

    return call(labels), call(strided(labels))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
def test_vocab_loss_and_its_gradient_match_numpys(dtype: Any, label_dtype: Any) -> None:
    """vocab_chunk_max (max_rows on each chunk), vocab_cross_entropy and its gradient (the loops over the
    per-row statistics) against the numpy kernels: an ignored label gives 0, a nan logit a nan loss."""
    logits, labels = _vocab_inputs(dtype, label_dtype, 11)
    (cm,), (cm_ref,) = both("vocab_chunk_max", logits, chunks=2)
    np.testing.assert_array_equal(cm, cm_ref)
    sum_exp, target = EagerBuilder().call("vocab_terms", logits, labels, cm, ignore_index=IGNORE)
    assert vocab._maxima_fit(cm, labels, sum_exp) and vocab._jit_stats(np, labels, sum_exp, target)
    got, want = _vocab_both(
        "vocab_cross_entropy", labels, logits, None, cm, sum_exp, target, ignore_index=IGNORE
    )
    same(got, want, dtype, "vocab_cross_entropy")
    assert np.isnan(got[0][1, 2]) and got[0][0, 1] == 0
    dy = np.random.default_rng(12).standard_normal(labels.shape).astype(dtype)
    got, want = _vocab_both("vocab_cross_entropy_grad", labels, None, sum_exp, dy, ignore_index=IGNORE)
    same(got, want, dtype, "vocab_cross_entropy_grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("classes", [slice(0, 12), slice(0, 6), slice(6, 12)])
def test_vocab_terms_and_their_gradient_match_numpys(dtype: Any, label_dtype: Any, classes: slice) -> None:
    """vocab_terms and vocab_terms_grad through rows_jit's loops against the numpy kernels (the labels
    strided), on whole rows and on each half of the classes (S(-1): the labels off a rank's classes give
    a target of 0 and no one-hot term); an ignored label gives 0, a nan logit (its chunk's max) a nan sum."""
    logits, labels = _vocab_inputs(dtype, label_dtype, 14)
    (cm,) = EagerBuilder().call("vocab_chunk_max", logits, chunks=2)
    metas = tuple(TensorMeta(a.shape, DType(np.dtype(a.dtype).name)) for a in (logits, labels, cm))
    rng = np.random.default_rng(15)
    dsum, dtarget = (rng.standard_normal(labels.shape).astype(dtype) for _ in range(2))
    d_metas = (*metas, *(TensorMeta(labels.shape, metas[0].dtype),) * 2)
    here = np.ascontiguousarray(logits[..., classes])  # a rank's shard is an array of its own
    for op, inputs, ins in (
        ("vocab_terms", [here, labels, cm], metas),
        ("vocab_terms_grad", [here, labels, cm, dsum, dtarget], d_metas),
    ):
        index = ((slice(None), slice(None), classes), *(full_index(m) for m in ins[1:]))
        ctx = KernelContext(np, {"ignore_index": IGNORE}, ins, (), index, ())
        assert vocab._jit_terms(ctx, *inputs[:3], *inputs[3:] or [np.empty(labels.shape, dtype)])
        with np.errstate(all="ignore"):
            got = get_op(op).run_kernel(ctx, inputs)
            want = get_op(op).run_kernel(ctx, [inputs[0], strided(labels), *inputs[2:]])
        same(got, want, dtype, op)
        if op == "vocab_terms":
            assert np.isnan(got[0][1, 2]) and got[1][0, 1] == 0  # the row's maximum is nan on every rank


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_shape", [(16, 64), (5,), (1,), (0, 3)])
@pytest.mark.parametrize("rows_here", [slice(0, 9), slice(3, 7)])
def test_embedding_gather_matches_numpys(dtype: Any, ids_shape: tuple[int, ...], rows_here: slice) -> None:
    """rows_jit.take_rows against the numpy kernel (the ids strided): on a shard of the vocabulary
    (rows 3..6 of 9, as under S(0)) the ids off it look up zeros; an id outside 0..V-1 is refused, by the
    loop as it reads the ids and by the numpy kernel's check."""
    rng = np.random.default_rng(13)
    weight = rng.standard_normal((rows_here.stop - rows_here.start, 4)).astype(dtype)
    ids = rng.integers(0, 9, size=ids_shape).astype(np.int64)
    meta = (TensorMeta((9, 4), DType(np.dtype(dtype).name)), TensorMeta(ids_shape, DType.int64))
    ctx = KernelContext(np, {}, meta, (), ((rows_here, slice(0, 4)), full_index(meta[1])), ())
    op = get_op("embedding")
    (got,) = op.run_kernel(ctx, [weight, ids])
    (want,) = op.run_kernel(ctx, [weight, strided(ids)])
    np.testing.assert_array_equal(got, want)  # a gather: exact
    if ids.size:  # at the first id and at the last (the loop checks as it reads), on both paths
        for at, bad in [(0, -1), (0, 9), (-1, 9), (-1, -3)]:
            wrong = ids.copy()
            wrong.flat[at] = bad
            for given in (wrong, strided(wrong)):
                with pytest.raises(ShapeError, match=f"id {bad} is outside the vocabulary \\[0, 9\\)"):
                    op.run_kernel(ctx, [weight, given])


def test_concat_of_inputs_that_differ_off_the_axis_raises_numpys_error() -> None:
    """concat_rows reads without bounds checks, so shards that do not fit (a signature the table lacks,
    tried by test_missed_signatures) must reach numpy's concatenate and its error, not the loop."""
    a, b = np.zeros((3, 2), np.float32), np.zeros((2, 2), np.float32)
    ctx = KernelContext(np, {"axis": 1}, (), (), (), ())
    with pytest.raises(ValueError, match="dimensions"):
        get_op("concat").run_kernel(ctx, [a, b])
