"""Boxing insertion: which collectives each configuration gets, reuse, outputs, stages, training graphs."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from sbpflow.boxing import Collective
from sbpflow.control_plane.compiler.passes import boxing_pass, sbp_inference
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.compiler.verify import verify_compiled
from sbpflow.dtype import DType
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import Job
from sbpflow.placement import placement
from sbpflow.sbp import B, S
from sbpflow.tensor_meta import TensorMeta
from tests.control_plane.compiler.passes.test_sbp_inference import start


def boxed(state: CompileState) -> CompileState:
    sbp_inference.run(state)
    boxing_pass.run(state)
    state.graph.verify()
    verify_compiled(state)
    return state


def kinds(state: CompileState) -> Counter[Collective]:
    return Counter(step.collective for plan in state.boxings.values() for step in plan.steps)


@pytest.mark.parametrize("config", ["mlp-dp4", "gpt-dp4"])
def test_data_parallel_forward_boxes_only_the_loss_scalars(config: str) -> None:
    state = boxed(start(config))
    assert state.boxings
    for plan in state.boxings.values():
        assert plan.meta.shape == (), plan
    assert set(kinds(state)) <= {Collective.all_reduce, Collective.zero_fill}


def test_megatron_mlp_reduces_the_partial_sum_once() -> None:
    # column split -> relu -> row split gives a partial [32, 4]; the whole-graph program (sbp_ilp.py)
    # carries it through the bias (replicated, zero-filled into the partial) and all-reduces it once, so
    # that the loss runs whole: one collective where a reduce-scatter and the loss scalar's all-reduce
    # would move fewer bytes in two (a step's latency is priced)
    state = boxed(start("mlp-tp4"))
    assert kinds(state) == Counter({Collective.all_reduce: 1, Collective.zero_fill: 1})
    (reduce,) = [p for p in state.boxings.values() if p.steps[0].collective is Collective.all_reduce]
    assert reduce.meta.shape == (32, 4)
    # no weight is ever moved (the bias's zero fill moves nothing)
    moved = {p.src_sbp for n, p in state.boxings.items() if (".weight" in n or ".bias" in n) and p.bytes}
    assert not moved


def test_megatron_gpt_reduces_each_block_output_once_and_never_moves_a_weight() -> None:
    state = boxed(start("gpt-tp4", layers=2))
    width = 64
    reductions = [
        p
        for p in state.boxings.values()
        if p.meta.shape[-1:] == (width,)
        and p.steps[0].collective in (Collective.all_reduce, Collective.reduce_scatter)
    ]
    assert len(reductions) == 2 * 2  # attention and MLP output of each of the 2 blocks
    for name, plan in state.boxings.items():
        src = name.removesuffix(".box").rsplit(".to_", 1)[0]
        if state.graph.tensors.get(src) is not None and state.graph.tensors[src].kind == TensorKind.parameter:
            assert plan.bytes == 0, name  # only zero fills of replicated biases


def test_dp2xtp2_boxes_only_along_the_tensor_parallel_axis_in_the_blocks() -> None:
    state = boxed(start("gpt-dp2xtp2"))
    for name, plan in state.boxings.items():
        if ".blocks." in name and plan.bytes:
            assert all(step.mesh_axis == 1 for step in plan.steps), (name, plan)


def test_one_boxing_serves_every_reader_of_the_same_target() -> None:
    state = boxed(start("gpt-dp4"))
    ends = [
        (o.inputs[0], o.placement, state.graph.tensors[o.outputs[0]].sbp)
        for o in state.graph.ops
        if o.op_type == BOXING
    ]
    assert len(ends) == len(set(ends))


def test_an_annotated_activation_is_boxed_after_its_producer() -> None:
    state = start("mlp-dp4")
    h = state.graph.tensors["model.net.1.relu_0"]
    state.graph.set_tensor(replace(h, sbp=(B,), placement=h.placement))
    boxed(state)
    relu = next(o for o in state.graph.ops if o.name == "model.net.1.relu_0")
    assert relu.outputs == ("model.net.1.relu_0.from_S0",)
    assert state.graph.tensors["model.net.1.relu_0"].sbp == (B,)
    assert repr(state.boxings["model.net.1.relu_0.box"]).startswith("S(0) -> B: all-gather")


def test_stage_to_stage_goes_point_to_point() -> None:
    first, second = placement("cpu", [0, 1]), placement("cpu", [2, 3, 4, 5])
    meta = TensorMeta((8, 6), DType.float32)
    g = Graph()
    g.add_tensor(TensorDecl("x", meta, TensorKind.input, first, (S(0),)))
    g.add_tensor(TensorDecl("h", meta, placement=first))
    g.add_tensor(TensorDecl("y", meta, placement=second))
    g.add_op(OpNode("a", "relu", ("x",), ("h",), placement=first))
    g.add_op(OpNode("b", "relu", ("h",), ("y",), placement=second, stage=1))
    state = boxed(CompileState.start(Job("pp", g)))
    (plan,) = state.boxings.values()
    assert plan.src == first and plan.dst == second
    assert [s.collective for s in plan.steps] == [Collective.p2p]
    (node,) = [o for o in state.graph.ops if o.op_type == BOXING]
    assert node.stage == 1 and node.placement == second


def _training(config: str) -> CompileState:
    autodiff = pytest.importorskip("sbpflow.control_plane.compiler.passes.autodiff")
    optimizer = pytest.importorskip("sbpflow.control_plane.compiler.passes.optimizer")
    state = start(config, layers=1)
    autodiff.run(state)
    optimizer.run(state)
    return boxed(state)


@pytest.mark.parametrize("config", ["mlp-dp4", "mlp-tp4", "gpt-dp2xtp2"])
def test_training_graphs_keep_each_variable_layout_across_its_update(config: str) -> None:
    state = _training(config)
    assert state.updates
    for var, new in state.updates.items():
        assert state.graph.tensors[var].sbp == state.graph.tensors[new].sbp, var


def test_data_parallel_gradients_are_all_reduced() -> None:
    # a gradient is laid out like its parameter: the partial sum is all-reduced right where it is made
    state = _training("mlp-dp4")
    for param, g in state.grads.items():
        assert state.graph.tensors[g].sbp == state.graph.tensors[param].sbp == (B,)
        plans = [p for n, p in state.boxings.items() if n == f"{g}.box" or n.startswith(f"{g}.to_")]
        assert [s.collective for p in plans for s in p.steps] == [Collective.all_reduce], g
