"""Errors say what went wrong and how to fix it: the op, the tensors, their shapes and SBPs, the fix."""

from __future__ import annotations

import re

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.dtype import DType
from sbpflow.errors import PlacementError, RegistryError, SbpError, SbpflowError, ShapeError, UnknownOpError
from sbpflow.ops.base import OPS, REQUIRED, NdSignature, NoGrad, OpDef, get_op
from sbpflow.ops.eager import EagerBuilder, run_local, vjp
from sbpflow.placement import placement
from sbpflow.registry import Registry
from sbpflow.sbp import B, S, as_nd, check_axes
from sbpflow.tensor_meta import GlobalMeta, TensorMeta


def zeros(*shape: int, dtype: str = "float64") -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def test_every_error_is_an_sbpflow_error_and_a_builtin() -> None:
    """Callers can catch sbpflow's errors as a family, or as the builtin they resemble."""
    for cls, builtin in ((SbpError, ValueError), (PlacementError, ValueError), (ShapeError, ValueError)):
        assert issubclass(cls, SbpflowError) and issubclass(cls, builtin)
    assert issubclass(UnknownOpError, KeyError)


# ---- ops -----------------------------------------------------------------------------------------


def test_unknown_op_suggests_the_closest_names() -> None:
    with pytest.raises(UnknownOpError) as e:
        get_op("ad")
    msg = str(e.value)
    assert "unknown op 'ad'" in msg and "did you mean" in msg and "'add'" in msg
    assert not msg.startswith('"'), "KeyError quotes its message; UnknownOpError must read as a sentence"


def test_unknown_op_without_a_close_name_says_how_many_are_known() -> None:
    with pytest.raises(UnknownOpError, match=rf"unknown op 'zzzzqqq' \(known: {len(OPS)}\)"):
        EagerBuilder().call("zzzzqqq")


def test_shape_mismatch_names_the_op_and_both_shapes() -> None:
    with pytest.raises(ShapeError) as e:
        EagerBuilder().call("add", zeros(2, 3), zeros(4, 3))
    msg = str(e.value)
    assert "'add'" in msg and "[2, 3]" in msg and "[4, 3]" in msg and "axis 0" in msg


def test_dtype_mismatch_names_both_dtypes_and_the_fix() -> None:
    with pytest.raises(ShapeError, match=r"'add'.*float32.*float64.*cast"):
        EagerBuilder().call("add", zeros(2, dtype="float32"), zeros(2))


def test_wrong_arity_names_the_inputs() -> None:
    with pytest.raises(ShapeError, match=re.escape("op 'add' takes 2 input(s) ['a', 'b'] but got 1")):
        EagerBuilder().call("add", zeros(2))


def test_unknown_attribute_lists_the_known_ones() -> None:
    with pytest.raises(
        ShapeError, match=re.escape("op 'add' has no attribute(s) ['alpha']; its attributes are []")
    ):
        EagerBuilder().call("add", zeros(2), zeros(2), alpha=2.0)


def fake_op(**kw: object) -> OpDef:
    """An unregistered op, for errors no registered op can be made to raise."""
    fields: dict = dict(
        name="fake",
        inputs=("x",),
        outputs=("y",),
        infer=lambda metas, attrs: (metas[0],),
        rows=lambda metas, attrs: [],
        kernel=lambda ctx, x: x,
        grad=NoGrad("test op"),
        attrs={"k": REQUIRED, "alpha": 1.0},
    )
    fields.update(kw)
    return OpDef(**fields)  # type: ignore[arg-type]


def test_missing_required_attribute_is_named() -> None:
    with pytest.raises(ShapeError, match=re.escape("op 'fake' needs attribute(s) ['k']")):
        fake_op().normalize_attrs({"alpha": 2.0})
    assert fake_op().normalize_attrs({"k": [1, 2]}) == {"k": (1, 2), "alpha": 1.0}, "lists become tuples"


@pytest.mark.parametrize(
    "name", [n for n, op in OPS.items() if any(v is REQUIRED for v in op.attrs.values())]
)
def test_registered_ops_name_their_missing_required_attributes(name: str) -> None:
    missing = sorted(k for k, v in get_op(name).attrs.items() if v is REQUIRED)
    with pytest.raises(ShapeError, match=re.escape(f"op {name!r} needs attribute(s) {missing}")):
        get_op(name).normalize_attrs({})


def test_variadic_op_needs_one_input() -> None:
    with pytest.raises(ShapeError, match="op 'fake' needs at least one input 'xs'"):
        fake_op(inputs=("*xs",)).check_arity(0)


def test_gradient_of_a_backward_op_says_why_there_is_none() -> None:
    nograd = next((n for n, op in OPS.items() if isinstance(op.grad, NoGrad)), None)
    assert nograd is not None
    op = get_op(nograd)
    with pytest.raises(ShapeError, match=re.escape(f"op {nograd!r} takes no gradient: {op.grad.reason}")):  # type: ignore[union-attr]
        vjp(nograd, [], [])


def test_kernel_returning_the_wrong_local_shape_is_caught_with_both_shapes() -> None:
    mesh = placement("cpu", [0, 1])
    op = fake_op(kernel=lambda ctx, x: x, attrs={})  # ignores that its output is split
    nd = NdSignature(((B,),), ((S(0),),))
    meta = TensorMeta((4, 3), DType.float64)
    with pytest.raises(
        ShapeError, match=re.escape("kernel of 'fake' output 'y' is [4, 3] float64, expected [2, 3] float64")
    ):
        run_local(op, {}, (meta,), [zeros(4, 3)], mesh, nd, 0)


def test_kernel_returning_the_wrong_dtype_is_caught() -> None:
    op = fake_op(name="fake32", kernel=lambda ctx, x: x.astype(np.float32), attrs={})
    nd = NdSignature(((B,),), ((B,),))
    with pytest.raises(ShapeError, match=r"'fake32' output 'y' is \[2\] float32, expected \[2\] float64"):
        run_local(op, {}, (TensorMeta((2,), DType.float64),), [zeros(2)], placement("cpu", [0]), nd, 0)


def test_a_second_registration_is_refused() -> None:
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1)
    with pytest.raises(RegistryError, match="widget 'a' is already registered"):
        reg.register("a", 2)


# ---- SBP and placement ---------------------------------------------------------------------------


def test_split_axis_out_of_range_names_the_tensor_and_the_valid_axes() -> None:
    meta = TensorMeta((4, 6), DType.float32)
    with pytest.raises(SbpError) as e:
        GlobalMeta(meta, placement("cpu", [0, 1]), (S(2),))
    msg = str(e.value)
    assert "S(2) splits axis 2" in msg and "[4, 6] float32" in msg and "only 2 axes" in msg and "0..1" in msg


def test_check_axes_on_a_scalar_suggests_broadcast() -> None:
    with pytest.raises(SbpError, match="only 0 axes.*broadcast"):
        check_axes((S(0),), 0, "loss")


def test_nd_sbp_of_the_wrong_length_says_one_per_mesh_axis() -> None:
    with pytest.raises(SbpError, match=r"\(S\(0\), B\) has 2 entries but the placement has 1 mesh axes"):
        as_nd((S(0), B), 1)


def test_negative_split_axis_is_refused() -> None:
    with pytest.raises(SbpError, match="non-negative int, got -1"):
        S(-1)


def test_duplicate_ranks_are_named() -> None:
    with pytest.raises(PlacementError, match=re.escape("repeat rank(s) [1]")):
        placement("cpu", [0, 1, 1, 2])


def test_ragged_grid_is_refused() -> None:
    with pytest.raises(PlacementError, match="ragged grid; every row needs the same length"):
        placement("cpu", [[0, 1], [2]])


def test_unknown_device_type_lists_the_known_ones() -> None:
    with pytest.raises(
        PlacementError, match=re.escape("device type 'tpu' is unknown; use one of ('cpu', 'cuda')")
    ):
        placement("tpu", [0])


@pytest.mark.parametrize("ranks", [[], [[]], ["0"], [0.5], [True]])
def test_malformed_ranks_are_refused(ranks: list) -> None:
    with pytest.raises(PlacementError):
        placement("cpu", ranks)


def test_negative_rank_is_refused() -> None:
    with pytest.raises(PlacementError, match="negative rank"):
        placement("cpu", [-1, 0])


# ---- known gaps in the core: these turn into XPASS (a failure, strict) once fixed; drop the mark then


def test_global_meta_needs_one_sbp_per_mesh_axis() -> None:
    meta = TensorMeta((4, 4), DType.float32)
    with pytest.raises(SbpError, match="mesh axes"):
        GlobalMeta(meta, placement("cpu", [[0, 1], [2, 3]]), (S(0),))
    with pytest.raises(SbpError, match="mesh axes"):
        GlobalMeta(meta, placement("cpu", [0, 1]), (S(0), S(1), B))


def test_vjp_needs_one_gradient_per_output() -> None:
    for grads in ([], [zeros(3), zeros(3)]):
        with pytest.raises(ShapeError, match="'relu'"):
            vjp("relu", [zeros(3)], grads)
