"""GraphBuilder: the Builder protocol on tensor names, with readable unique names and stamped ops."""

from __future__ import annotations

import numpy as np
import pytest

from sbpflow.control_plane.compiler.builder import GraphBuilder
from sbpflow.dtype import DType
from sbpflow.errors import GraphError
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.ops.base import GradContext, get_op
from sbpflow.ops.eager import EagerBuilder, vjp
from sbpflow.placement import placement
from sbpflow.tensor_meta import TensorMeta

F32 = DType.float32
WHERE = placement("cpu", [0, 1])


def graph() -> Graph:
    g = Graph()
    g.add_tensor(TensorDecl("x", TensorMeta((4, 3), F32), TensorKind.input, WHERE))
    g.add_tensor(TensorDecl("w", TensorMeta((3, 5), F32), TensorKind.parameter, WHERE))
    return g


def test_call_declares_outputs_and_stamps_the_op() -> None:
    g = graph()
    b = GraphBuilder(g, "grad/fc", stage=2, placement=WHERE, scope="model.fc", kind=TensorKind.gradient)
    (y,) = b.call("matmul", "x", "w")
    (z,) = b.call("matmul", "x", "w", transpose_a=False)
    assert (y, z) == ("grad/fc/matmul_0", "grad/fc/matmul_1")
    assert b.meta(y) == TensorMeta((4, 5), F32)
    decl = g.tensors[y]
    assert decl.kind == TensorKind.gradient and decl.placement == WHERE and decl.sbp is None
    node = g.ops[0]
    assert (node.name, node.stage, node.placement, node.scope, node.checkpoint) == (
        y,
        2,
        WHERE,
        "model.fc",
        False,
    )
    assert node.attrs == get_op("matmul").normalize_attrs({})  # attrs complete, as the tracer stores them
    g.verify()


def test_several_outputs_take_indexed_names() -> None:
    g = graph()
    parts = GraphBuilder(g, "p").call("split", "x", axis=0, sizes=(1, 3))
    assert parts == ("p/split_0:0", "p/split_0:1")
    assert [g.tensors[n].meta.shape for n in parts] == [(1, 3), (3, 3)]
    g.verify()


def test_names_stay_unique_across_builders_and_existing_names() -> None:
    g = graph()
    g.add_tensor(TensorDecl("q/neg_0", TensorMeta((4, 3), F32)))
    g.add_op(OpNode("q/neg_0", "neg", ("x",), ("q/neg_0",)))
    first = GraphBuilder(g, "q")
    second = first.at("q", stage=1)  # shares the bookkeeping: no counter restarts at 0
    names = [first.call("neg", "x")[0], second.call("neg", "x")[0], first.call("neg", "x")[0]]
    assert names == ["q/neg_1", "q/neg_2", "q/neg_3"]
    assert [o.stage for o in g.ops[1:]] == [0, 1, 0]
    assert first.emitted == ("q/neg_1", "q/neg_2", "q/neg_3")
    with pytest.raises(GraphError, match="already used"):
        first.emit("neg", ("x",), {}, name="q/neg_2")


def test_rename_only_a_fresh_unread_result() -> None:
    g = graph()
    b = GraphBuilder(g, "r")
    (y,) = b.call("neg", "x")
    (z,) = b.call("neg", y)
    assert not b.rename(y, "grad/x")  # read by z
    assert not b.rename("x", "grad/x")  # not emitted here
    assert not b.rename(z, "w")  # taken
    assert b.rename(z, "grad/x", TensorKind.gradient)
    assert g.ops[-1].outputs == ("grad/x",) and z not in g.tensors
    assert g.tensors["grad/x"].kind == TensorKind.gradient
    g.verify()


def test_an_emitting_rule_that_breaks_inference_names_the_call() -> None:
    with pytest.raises(GraphError, match=r"grad/fc: emitting matmul\(w: \[3, 5\] float32, x: .*fix the rule"):
        GraphBuilder(graph(), "grad/fc").call("matmul", "w", "x")


def test_a_gradient_rule_runs_the_same_symbolically_and_eagerly() -> None:
    """The rule emits through either builder; the graph it builds, run, equals the eager vjp."""
    rng = np.random.default_rng(0)
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((4, 3), (3, 5), (4, 5)))
    g = graph()
    g.add_tensor(TensorDecl("dy", TensorMeta((4, 5), F32), TensorKind.input, WHERE))
    b = GraphBuilder(g, "grad/mm")
    op = get_op("matmul")
    ctx = GradContext(
        b,
        ("x", "w"),
        ("y",),
        ("dy",),
        (b.meta("x"), b.meta("w")),
        (TensorMeta((4, 5), F32),),
        op.normalize_attrs({}),
    )
    dx, dw = op.grad(ctx)  # type: ignore[operator]
    values = {"x": x, "w": w, "dy": dy}
    eager = EagerBuilder()
    for node in g.ops:
        outs = eager.call(node.op_type, *(values[i] for i in node.inputs), **node.attrs)
        values.update(zip(node.outputs, outs, strict=True))
    want = vjp("matmul", [x, w], [dy])
    np.testing.assert_allclose(values[dx], want[0], rtol=1e-6)
    np.testing.assert_allclose(values[dw], want[1], rtol=1e-6)
