"""``Graph.verify`` (sbpflow/graph.py): a degenerate graph is refused at its first bad tensor or op,
naming it and the fix — a size-0 axis (a zero-width layer), an op name used twice, a tensor produced
twice — while a tensor that no op reads stays legal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbpflow.dtype import DType
from sbpflow.errors import GraphError
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.tensor_meta import TensorMeta

F32 = DType.float32


def _relu_chain(shape: tuple[int, ...], kind: TensorKind = TensorKind.input) -> Graph:
    """x -> relu -> y -> relu -> z, x of ``kind``."""
    g = Graph()
    g.add_tensor(TensorDecl("x", TensorMeta(shape, F32), kind))
    for name in ("y", "z"):
        g.add_tensor(TensorDecl(name, TensorMeta(shape, F32)))
    g.add_op(OpNode("relu_1", "relu", ("x",), ("y",)))
    g.add_op(OpNode("relu_2", "relu", ("y",), ("z",)))
    return g


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        (TensorKind.parameter, "zero-width layer"),
        (TensorKind.input, "an input with no values"),
        (TensorKind.constant, "a tensor with no values"),
    ],
)
def test_a_size_0_axis_is_refused_naming_the_tensor_and_axis(kind: TensorKind, words: str) -> None:
    g = _relu_chain((4, 0, 3), kind)
    with pytest.raises(
        GraphError, match=f"{kind.value} tensor 'x' \\[4, 0, 3\\] float32 has size 0 on axis 1: "
    ):
        g.verify()
    with pytest.raises(GraphError, match=f"{words}.*give every axis a size of at least 1"):
        g.verify()


@given(shape=st.lists(st.integers(0, 3), min_size=0, max_size=4).map(tuple))
def test_verify_refuses_exactly_the_shapes_with_a_size_0_axis(shape: tuple[int, ...]) -> None:
    g = _relu_chain(shape)
    if 0 in shape:
        with pytest.raises(GraphError, match="has size 0 on axis"):
            g.verify()
    else:
        g.verify()  # a scalar, and any positive shape, are fine


def test_an_op_name_used_twice_is_refused() -> None:
    g = _relu_chain((2, 2))
    g.ops[1] = OpNode("relu_1", "relu", ("y",), ("z",))  # as a wire Job or a pass could have it
    with pytest.raises(GraphError, match="op name 'relu_1' is used twice; op names must be unique"):
        g.verify()
    with pytest.raises(GraphError, match="used twice"):
        g.add_op(OpNode("relu_2", "relu", ("x",), ("z",)))


def test_a_tensor_produced_twice_is_refused() -> None:
    g = _relu_chain((2, 2))
    g.ops[1] = OpNode("relu_2", "relu", ("x",), ("y",))
    with pytest.raises(GraphError, match="tensor 'y' is produced twice \\(again by op 'relu_2'\\)"):
        g.verify()


def test_a_tensor_no_op_reads_is_legal() -> None:
    g = _relu_chain((2, 2))
    g.add_tensor(TensorDecl("side", TensorMeta((2, 2), F32)))
    g.add_op(OpNode("relu_side", "relu", ("x",), ("side",)))  # read by nobody, as a fetched activation is
    g.verify()
