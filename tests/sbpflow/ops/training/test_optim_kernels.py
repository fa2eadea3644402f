"""The optimizer kernels compute in place (``out=``) for speed; these pin their results to the textbook
formulas bit for bit, with and without a donated state buffer, and check that inputs not donated are
never written (the reference and eager mode pass plain contexts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from sbpflow.dtype import DType
from sbpflow.errors import ShapeError
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.tensor_meta import TensorMeta
from tests.sbpflow.ops.training.cases_optim import lr_factor


@dataclass(frozen=True)
class Donating(KernelContext):
    donated: frozenset[int] = frozenset()


def sgd_formula(arrays: list[Any], a: dict[str, Any], step: int) -> list[Any]:
    param, grad, buf = arrays
    t = param.dtype.type
    momentum = t(a["momentum"])
    d = grad + t(a["weight_decay"]) * param if a["weight_decay"] else grad
    new_buf = momentum * buf + d
    direction = d + momentum * new_buf if a["nesterov"] else new_buf
    return [param - t(a["lr"] * lr_factor(step)) * direction, new_buf]


def adamw_formula(arrays: list[Any], a: dict[str, Any], step: int) -> list[Any]:
    param, grad, m, v = arrays
    t = param.dtype.type
    lr, b1, b2, n = a["lr"] * lr_factor(step), a["beta1"], a["beta2"], step + 1
    new_m = t(b1) * m + t(1.0 - b1) * grad
    new_v = t(b2) * v + t(1.0 - b2) * (grad * grad)
    m_hat, v_hat = new_m / t(1.0 - b1**n), new_v / t(1.0 - b2**n)
    decayed = param * t(1.0 - lr * a["weight_decay"])
    return [decayed - t(lr) * m_hat / (np.sqrt(v_hat) + t(a["eps"])), new_m, new_v]


def run(op_type: str, arrays: list[Any], attrs: dict[str, Any], step: int, donated: frozenset[int]) -> Any:
    op = get_op(op_type)
    attrs = op.normalize_attrs(attrs)
    metas = tuple(None for _ in arrays)
    ctx = Donating(np, attrs, metas, metas, (), (), 0, step, donated=donated)  # type: ignore[arg-type]
    return op.run_kernel(ctx, arrays)


SGD_ATTRS = [
    {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False},
    {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.05, "nesterov": False},
    {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "nesterov": False},
    {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.05, "nesterov": True},
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (3,), (5, 7)])
@pytest.mark.parametrize("attrs", SGD_ATTRS)
@pytest.mark.parametrize("donate", [False, True])
def test_sgd_is_the_formula_bit_for_bit(
    dtype: Any, shape: tuple[int, ...], attrs: dict[str, Any], donate: bool
) -> None:
    rng = np.random.default_rng(0)
    arrays = [np.asarray(rng.standard_normal(shape), dtype=dtype) for _ in range(3)]
    copies = [a.copy() for a in arrays]
    want = sgd_formula(copies, attrs, 2)
    got = run("sgd_update", arrays, attrs, 2, frozenset({2}) if donate else frozenset())
    for g, w in zip(got, want, strict=True):
        assert np.asarray(g).dtype == dtype and np.shape(g) == shape
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(arrays[0], copies[0])  # never written: not donated
    np.testing.assert_array_equal(arrays[1], copies[1])
    if not donate or not attrs["momentum"]:
        np.testing.assert_array_equal(arrays[2], copies[2])
    else:
        assert got[1] is arrays[2]  # the new buffer is the donated one


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (3,), (5, 7)])
@pytest.mark.parametrize("donate", [False, True])
def test_adamw_is_the_formula_bit_for_bit(dtype: Any, shape: tuple[int, ...], donate: bool) -> None:
    rng = np.random.default_rng(1)
    param, grad, m = (np.asarray(rng.standard_normal(shape), dtype=dtype) for _ in range(3))
    v = np.asarray(rng.random(shape), dtype=dtype)
    arrays = [param, grad, m, v]
    copies = [a.copy() for a in arrays]
    attrs = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    want = adamw_formula(copies, attrs, 3)
    got = run("adamw_update", arrays, attrs, 3, frozenset({2, 3}) if donate else frozenset())
    for g, w in zip(got, want, strict=True):
        assert np.asarray(g).dtype == dtype and np.shape(g) == shape
        np.testing.assert_array_equal(g, w)
    for a, c in zip(arrays[:2], copies[:2], strict=True):
        np.testing.assert_array_equal(a, c)
    if not donate:
        for a, c in zip(arrays[2:], copies[2:], strict=True):
            np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (3,), (5, 7), (64, 1024)])
@pytest.mark.parametrize("plain", ["sgd_update", "adamw_update"])
def test_a_clipped_update_is_the_mul_then_the_update_bit_for_bit(
    dtype: Any, shape: tuple[int, ...], plain: str
) -> None:
    # the fusion pass folds the clipping mul into the update: the same product in the same dtype, so a
    # fused run's parameters are an unfused run's bits (the numpy passes and the one-pass loop alike)
    rng = np.random.default_rng(2)
    n = len(get_op(plain).inputs)
    arrays = [np.asarray(rng.standard_normal(shape), dtype=dtype) for _ in range(n)]
    arrays[-1] = np.abs(arrays[-1])  # AdamW's v (SGD's momentum buffer: any sign)
    clip = np.asarray(0.3712, dtype=dtype)  # clip_coef's factor is 0-d, as the norm's sum
    attrs = {**(SGD_ATTRS[3] if plain == "sgd_update" else {"lr": 1e-2, "weight_decay": 0.01})}
    want = run(plain, [arrays[0], np.multiply(arrays[1], clip), *arrays[2:]], attrs, 2, frozenset())
    got = run("clipped_" + plain, [*arrays, clip], attrs, 2, frozenset())
    for g, w in zip(got, want, strict=True):
        assert np.asarray(g).dtype == dtype and np.shape(g) == shape
        np.testing.assert_array_equal(g, w)


@dataclass(frozen=True)
class Lending(Donating):
    out_buffers: tuple[Any, ...] = ()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (3,), (5, 7), (64, 1024)])
@pytest.mark.parametrize(
    ("op_type", "attrs"),
    [
        *(("sgd_update", a) for a in SGD_ATTRS),
        ("adamw_update", {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}),
        ("clipped_sgd_update", SGD_ATTRS[3]),
        ("clipped_adamw_update", {"lr": 1e-2, "weight_decay": 0.01}),
    ],
)
def test_an_update_lent_its_own_parameter_writes_the_same_bits_over_it(
    dtype: Any, shape: tuple[int, ...], op_type: str, attrs: dict[str, Any]
) -> None:
    # the runtime lends the parameter itself as out_buffers[0] once nothing else holds it (tasks.Recycler):
    # the new value goes over the old, as the out-of-place kernel computes it, bit for bit
    op = get_op(op_type)
    assert op.in_place
    rng = np.random.default_rng(3)
    arrays = [np.asarray(rng.standard_normal(shape), dtype=dtype) for _ in op.inputs]
    if op_type.endswith("adamw_update"):
        arrays[3] = np.abs(arrays[3])
    if op_type.startswith("clipped"):
        arrays[-1] = np.asarray(0.3712, dtype=dtype)
    want = run(op_type, [a.copy() for a in arrays], attrs, 2, frozenset())
    param = arrays[0]
    metas = tuple(None for _ in arrays)
    ctx = Lending(np, op.normalize_attrs(attrs), metas, metas, (), (), 0, 2, out_buffers=(param,))  # type: ignore[arg-type]
    got = op.run_kernel(ctx, arrays)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert (got[0] is param) == (len(shape) > 0)  # a 0-d parameter takes the numpy passes, into a new array


def test_a_clipped_update_refuses_a_clip_that_is_not_one_value_of_the_parameters_dtype() -> None:
    op, meta = get_op("clipped_adamw_update"), TensorMeta((4, 3), DType.float32)
    attrs = op.normalize_attrs({"lr": 1e-3})
    with pytest.raises(ShapeError, match="needs 'clip' as one value of the parameter's dtype"):
        op.run_infer((meta,) * 4 + (TensorMeta((2,), DType.float32),), attrs)
    with pytest.raises(ShapeError, match="cast to the gradient's dtype"):
        op.run_infer((meta,) * 4 + (TensorMeta((1,), DType.float64),), attrs)
    assert op.run_infer((meta,) * 4 + (TensorMeta((), DType.float32),), attrs) == (meta,) * 3


def test_a_read_only_donated_buffer_is_not_written() -> None:
    param, grad, buf = (np.ones(4, np.float32) for _ in range(3))
    buf.flags.writeable = False
    new_param, new_buf = run("sgd_update", [param, grad, buf], SGD_ATTRS[2], 0, frozenset({2}))
    assert new_buf is not buf
    np.testing.assert_array_equal(buf, np.ones(4, np.float32))
