"""Elementwise fusion: which chains fuse, which must not, and that the fused graph still verifies."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.actor_workers.execution.tasks import DonatingKernelContext
from sbpflow.codec import wire
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.passes import fusion
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.compiler.verify import verify_compiled
from sbpflow.dtype import DType
from sbpflow.errors import ShapeError
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import Job, JobConfig, LossScaling
from sbpflow.ops.base import get_op
from sbpflow.ops.eager import full_index
from sbpflow.ops.fused import encode, parse
from sbpflow.placement import placement
from sbpflow.sbp import B, P, S
from sbpflow.tensor_meta import TensorMeta
from tests.control_plane.compiler.passes.test_boxing_pass import boxed
from tests.control_plane.compiler.passes.test_sbp_inference import start
from tests.examples.test_examples import load

TWO = placement("cpu", [0, 1])
META = TensorMeta((8, 6), DType.float32)


def fused(state: CompileState) -> CompileState:
    fusion.run(state)
    verify_compiled(state)
    return state


def chain_ops(node: OpNode) -> list[str]:
    return [step[0] for step in json.loads(str(node.attrs["chain"]))]


def fused_nodes(state: CompileState) -> list[OpNode]:
    return [o for o in state.graph.ops if o.op_type == fusion.FUSED]


def job(
    ops: list[tuple[str, str, tuple[str, ...], str]],
    x_sbp: object = (S(0),),
    fuse: bool = True,
    **sbps: object,
) -> Job:
    """x (an input on two ranks) through ``ops`` (name, op_type, inputs, output), fusion on unless ``fuse``
    is False; ``sbps`` annotate outputs."""
    g = Graph()
    g.add_tensor(TensorDecl("x", META, TensorKind.input, TWO, x_sbp))  # type: ignore[arg-type]
    for name, op, ins, out in ops:
        attrs = {"value": 0.5} if op.endswith("_scalar") else {}
        g.add_tensor(TensorDecl(out, META, placement=TWO, sbp=sbps.get(out)))  # type: ignore[arg-type]
        g.add_op(OpNode(name, op, ins, (out,), attrs, TWO))
    return Job("fusion", g, config=JobConfig(fusion=fuse))


def fusing(j: Job) -> Job:
    return replace(j, config=replace(j.config, fusion=True))


def test_a_chain_fuses_into_one_op_that_keeps_the_output_name() -> None:
    state = fused(boxed(CompileState.start(job([
        ("a", "add_scalar", ("x",), "h1"), ("b", "mul", ("h1", "x"), "h2"), ("c", "relu", ("h2",), "y"),
    ]))))  # fmt: skip
    (node,) = fused_nodes(state)
    assert chain_ops(node) == ["add_scalar", "mul", "relu"]
    assert node.name == "a.fused" and node.inputs == ("x",) and node.outputs == ("y",)
    assert "h1" not in state.graph.tensors and "h2" not in state.graph.tensors
    assert state.choices[node.name].reason == "fused: add_scalar + mul + relu"


def test_on_by_default_and_off_on_request() -> None:
    assert JobConfig().fusion is True
    m = wire.config_to_proto(JobConfig())
    m.ClearField("fusion")  # a message without the field: the default
    assert wire.config_from_proto(m).fusion is True
    assert wire.config_from_proto(wire.config_to_proto(JobConfig(fusion=False))).fusion is False
    ops = [("a", "relu", ("x",), "h"), ("b", "tanh", ("h",), "y")]
    assert not fused_nodes(fused(boxed(CompileState.start(job(ops, fuse=False)))))
    assert fused_nodes(fused(boxed(CompileState.start(job(ops)))))


def test_a_chain_never_spans_a_boxing() -> None:
    # h is annotated B: relu writes h.from_S0 and a boxing all-gathers it before tanh reads it
    state = fused(
        boxed(CompileState.start(job([("a", "relu", ("x",), "h"), ("b", "tanh", ("h",), "y")], h=(B,))))
    )
    assert any(o.op_type == BOXING for o in state.graph.ops)
    assert not fused_nodes(state)


def test_an_intermediate_the_chain_alone_reads_twice_fuses_whole() -> None:
    # h is read by tanh and exp, both in the chain: one op, nothing exported
    state = fused(boxed(CompileState.start(job([
        ("a", "relu", ("x",), "h"), ("b", "tanh", ("h",), "t"), ("c", "exp", ("h",), "e"),
        ("d", "add", ("t", "e"), "y"),
    ]))))  # fmt: skip
    (node,) = fused_nodes(state)
    assert chain_ops(node) == ["relu", "tanh", "exp", "add"] and node.inputs == ("x",)
    assert node.outputs == ("y",) and "exports" not in node.attrs and "h" not in state.graph.tensors


def outside(ops: list[tuple[str, str, tuple[str, ...], str]], at: int, reads: str) -> Job:
    """``job(ops)`` with a softmax of ``reads`` (an op no chain takes) inserted at position ``at``."""
    j = job(ops)
    g = j.graph
    g.add_tensor(TensorDecl("z", META, placement=TWO))
    g.ops.insert(at, OpNode("out", "softmax", (reads,), ("z",), {"axis": 1}, TWO))
    return j


def test_an_intermediate_read_after_the_chain_is_an_extra_output() -> None:
    # softmax reads h after tanh: relu and tanh fuse, h is their op's second output, S(0) as it was
    state = fused(boxed(CompileState.start(outside([
        ("a", "relu", ("x",), "h"), ("b", "tanh", ("h",), "y"),
    ], 2, "h"))))  # fmt: skip
    (node,) = fused_nodes(state)
    assert (
        chain_ops(node) == ["relu", "tanh"] and node.outputs == ("y", "h") and node.attrs["exports"] == (0,)
    )
    assert (
        state.graph.tensors["h"].sbp == (S(0),) and state.choices[node.name].signature.outs == ((S(0),),) * 2
    )
    assert [o.name for o in state.graph.ops] == ["a.fused", "out"]  # the reader after the op that makes h
    assert fused_nodes(fused(boxed(CompileState.start(outside([
        ("a", "relu", ("x",), "h"), ("b", "tanh", ("h",), "y"),
    ], 2, "y")))))[0].outputs == ("y",)  # fmt: skip


def test_an_intermediate_read_before_the_chain_ends_closes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # softmax reads h between relu and tanh: the fused op would make h after it; so does EXPORTS off
    ops = [("a", "relu", ("x",), "h"), ("b", "tanh", ("h",), "y")]
    assert not fused_nodes(fused(boxed(CompileState.start(outside(ops, 1, "h")))))
    monkeypatch.setattr(fusion, "EXPORTS", False)
    assert not fused_nodes(fused(boxed(CompileState.start(outside(ops, 2, "h")))))


def test_small_independent_ops_go_side_by_side() -> None:
    # relu and tanh of x, each read by a softmax after both: one fused op makes both, tanh's result first
    j = outside([("a", "relu", ("x",), "h"), ("b", "tanh", ("x",), "y")], 2, "h")
    j.graph.add_tensor(TensorDecl("w", META, placement=TWO))
    j.graph.ops.append(OpNode("out2", "softmax", ("y",), ("w",), {"axis": 1}, TWO))
    state = fused(boxed(CompileState.start(j)))
    (node,) = fused_nodes(state)
    assert (
        chain_ops(node) == ["relu", "tanh"] and node.outputs == ("y", "h") and node.attrs["exports"] == (0,)
    )
    assert [o.op_type for o in state.graph.ops] == [fusion.FUSED, "softmax", "softmax"]


@pytest.mark.parametrize("reader_at", [1, 2])
def test_a_side_by_side_op_never_comes_after_a_reader_or_a_read(
    reader_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # softmax reads relu's h before tanh (1): the fused op would make h after its reader; tanh reading h
    # (2) is a chain. Over SMALL elements a result, nothing goes side by side.
    apart = [("a", "relu", ("x",), "h"), ("b", "tanh", ("x",), "y")]
    chained = [("a", "relu", ("x",), "h"), ("b", "tanh", ("h",), "y")]
    ops = apart if reader_at == 1 else chained
    nodes = fused_nodes(fused(boxed(CompileState.start(outside(ops, reader_at, "h")))))
    assert not nodes if reader_at == 1 else [chain_ops(n) for n in nodes] == [["relu", "tanh"]]
    monkeypatch.setattr(fusion, "SMALL", META.numel - 1)
    assert not fused_nodes(fused(boxed(CompileState.start(outside(apart, 2, "h")))))


SIDE_BY_SIDE = {
    "resnet-1": ("resnet", {"ranks": 1, "width": 4, "image_size": 8, "batch_size": 4}),
    "resnet-dp2": ("resnet", {"ranks": 2, "width": 4, "image_size": 8, "batch_size": 4}),
    "gpt-fp16-scaled": ("gpt", {"ranks": 1, "layers": 1, "width": 16, "vocab": 32, "seq_len": 8, "heads": 2}),
}


@pytest.mark.parametrize("layout", list(SIDE_BY_SIDE))
def test_side_by_side_ops_train_bit_identically(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # batch norm's per-channel backward on one and two ranks, a loss-scaled job's clipping: the same bits
    model, shape = SIDE_BY_SIDE[layout]
    made = load(model).make_job(steps=3, **shape)
    if layout == "gpt-fp16-scaled":  # the gated updates' clipping muls
        made = replace(made, config=replace(made.config, precision="fp16", loss_scaling=LossScaling()))
    trains_alike(made, monkeypatch, "SIBLINGS")


def test_batch_norms_per_channel_ops_go_side_by_side() -> None:
    # batch norm's running mean and variance updates and its per-channel scale (var + eps, sqrt,
    # reciprocal, * weight) are one op a layer: one update its first output (as a chain's kept result),
    # the other a further output, though only its SINK reads it. trains_alike checks the values
    # (a run's parameters hold the statistics).
    state = pipeline.compile(load("resnet").make_job(ranks=1, width=4, image_size=8, batch_size=4)).state
    updates = {new for var, new in state.updates.items() if var.endswith(("running_mean", "running_var"))}
    assert len(updates) == 40 and not [o for o in state.graph.ops if o.op_type == "running_stat"]
    with_stats = [o for o in fused_nodes(state) if "running_stat" in chain_ops(o)]
    assert len(with_stats) == 20 and all(chain_ops(o).count("running_stat") == 2 for o in with_stats)
    assert all(o.outputs[0] in updates for o in with_stats)
    assert updates <= {t for o in with_stats for t in o.outputs}
    # one micro-batch a step: the weight's gradient (of micro-batching's other class) joins its layer's
    # per-channel backward, the gradient first
    grads = {g for p, g in state.grads.items() if p.endswith(("bn1.weight", "bn2.weight", "stem_bn.weight"))}
    plain = {o.outputs[0] for o in state.graph.ops if o.op_type != fusion.FUSED}
    fused_first = {o.outputs[0] for o in fused_nodes(state)}
    assert grads and not grads & plain and grads <= fused_first


def trains_alike(made: Job, monkeypatch: pytest.MonkeyPatch, flag: str, exported: bool = False) -> None:
    """``made`` compiles to fewer ops with fusion's ``flag`` on than off and trains 3 steps to the same bits
    (``exported``: a fused op has exports exactly where the flag is on)."""
    runs, ops = {}, {}
    for on in (True, False):
        monkeypatch.setattr(fusion, flag, on)
        g = pipeline.compile(made).state.graph  # verify_compiled checks every fused op's signature
        ops[on] = len(g.ops)
        if exported:
            assert any(o.op_type == fusion.FUSED and o.attrs.get("exports") for o in g.ops) is on
        runs[on] = sf.run(made, steps=3, return_parameters=True, timeout=120, backend="inprocess")
    assert ops[True] < ops[False]
    assert runs[True].losses == runs[False].losses
    on_params, off_params = runs[True].parameters, runs[False].parameters
    assert on_params is not None and off_params is not None and set(on_params) == set(off_params)
    for name, value in off_params.items():
        np.testing.assert_array_equal(on_params[name], value, err_msg=name)


def test_a_partial_never_flows_into_a_nonlinear_step() -> None:
    # x is P: mul_scalar may run on P, tanh may not, so a boxing separates them
    state = fused(
        boxed(CompileState.start(job([("a", "mul_scalar", ("x",), "h"), ("b", "tanh", ("h",), "y")], (P,))))
    )
    for node in fused_nodes(state):
        assert state.graph.tensors[node.inputs[0]].sbp != (P,) or "tanh" not in chain_ops(node)


@pytest.mark.parametrize(
    ("steps", "partial"),
    [
        ([("mul_scalar", {"value": 2.0}, ["in0"]), ("neg", {}, ["s0"])], True),  # linear all the way
        ([("mul_scalar", {"value": 2.0}, ["in0"]), ("tanh", {}, ["s0"])], False),  # tanh is not linear
        ([("mul_scalar", {"value": 2.0}, ["in0"]), ("add_scalar", {"value": 1.0}, ["s0"])], False),  # affine
    ],
)
def test_composed_rows_pass_p_only_through_linear_chains(steps: list, partial: bool) -> None:
    op = get_op(fusion.FUSED)
    rows = op.rows((META,), {"chain": encode(steps)})
    assert any(r.ins == (P,) for r in rows) is partial
    assert {r.ins for r in rows} >= {(S(0),), (S(1),), (B,)}


def test_a_parameters_value_is_not_exported_from_a_batchs_chain() -> None:
    # relu(p) depends on no batch; add(relu(p), x) does. Fused, relu(p) would be an output of an op that
    # runs every micro-batch, and so would its other reader, the softmax: relu and add stay apart
    j = outside([("a", "relu", ("p",), "h"), ("b", "add", ("h", "x"), "y")], 2, "h")
    j.graph.add_tensor(TensorDecl("p", META, TensorKind.parameter, TWO, (B,)))
    state = fused(boxed(CompileState.start(j)))
    assert not fused_nodes(state)
    assert fusion.chains(state) == []


def test_gpt_fuses_bias_and_residual_and_exports_what_backward_reads() -> None:
    compiled = pipeline.compile(fusing(start("gpt-dp4", layers=1).job))
    g = compiled.state.graph
    chains = {o.name: chain_ops(o) for o in g.ops if o.op_type == fusion.FUSED}
    assert chains["model.blocks.0.attn.c_proj.add_0.fused"] == ["add", "add"]
    assert chains["model.blocks.0.mlp.c_proj.add_0.fused"] == ["add", "add"]
    # gelu_grad reads c_fc's bias add: the add and gelu are one op, which also outputs the add's result
    (node,) = [o for o in g.ops if o.name == "model.blocks.0.mlp.c_fc.add_0.fused"]
    assert chain_ops(node) == ["add", "gelu"] and node.outputs[1:] == ("model.blocks.0.mlp.c_fc.add_0",)
    assert any(node.outputs[1] in o.inputs for o in g.ops if o.op_type == "gelu_grad")
    assert compiled.plan is not None


def test_a_reduction_ends_a_chain() -> None:
    # the loss's token count: ne_scalar, cast and sum are one op, which nothing continues (the clipping
    # norm's squared sums are sum_squares by now: below)
    compiled = pipeline.compile(start("gpt-dp4", layers=1).job)
    chains = [chain_ops(o) for o in compiled.state.graph.ops if o.op_type == fusion.FUSED]
    assert ["ne_scalar", "cast", "sum"] in chains
    assert all("sum" not in c[:-1] for c in chains), chains
    with pytest.raises(ShapeError, match=r"step 0 \(sum\) is a reduction, which only a chain's last step"):
        get_op(fusion.FUSED).run_infer(
            (META,), {"chain": encode([("sum", {}, ["in0"]), ("neg", {}, ["s0"])])}
        )


def test_fusion_survives_micro_batching() -> None:
    j = fusing(start("gpt-dp4", layers=1, batch_size=16).job)
    compiled = pipeline.compile(replace(j, config=replace(j.config, gradient_accumulation_steps=2)))
    assert compiled.state.graph.tensors["tokens"].meta.shape[0] * 2 == j.graph.tensors["tokens"].meta.shape[0]
    assert any(o.op_type == fusion.FUSED for o in compiled.state.graph.ops)
    assert compiled.plan is not None


@pytest.mark.parametrize("layout", ["gpt-1", "dp2xtp2"])
def test_each_weight_gradient_is_one_rows_matmul(layout: str) -> None:
    # matmul's rule flattens a batched input and dy to rows (two reshapes) for the weight's gradient; the
    # pass folds them into one rows_matmul of the unflattened arrays (bit-identical: the test below)
    shape, _ = FOLDS[layout]
    made = load("gpt").make_job(layers=1, width=16, vocab=32, seq_len=8, batch_size=8, heads=2, **shape)
    ops = pipeline.compile(made).state.graph.ops  # compiled: verify_compiled checks each signature
    rows = [o for o in ops if o.op_type == "rows_matmul"]
    assert len(rows) == 5, [o.name for o in rows]  # c_attn, c_proj, c_fc, mlp c_proj, lm_head
    assert not [o for o in ops if o.op_type == "matmul" and o.attrs.get("transpose_a")]
    off = pipeline.compile(replace(made, config=replace(made.config, fusion=False))).state.graph.ops
    assert not [o for o in off if o.op_type == "rows_matmul"]
    # the attention core's own reshapes fold too (compiler/attention_core.py): 5 a layer each way
    reshapes = [sum(o.op_type == "reshape" and ".attn.reshape" not in o.name for o in g) for g in (off, ops)]
    assert reshapes[0] - reshapes[1] == 2 * len(rows)


def optimizer_ops(j: Job) -> list[str]:
    """The optimizer's ops, a fused op's steps each (small ones go side by side: fusion.siblings)."""
    out: list[str] = []
    for o in pipeline.compile(j).state.graph.ops:
        if o.name.startswith("optimizer/model."):
            out += [s.op for s in parse(str(o.attrs["chain"]))] if o.op_type == fusion.FUSED else [o.op_type]
    return out


# one rank, the 2-d mesh, ZeRO-3 on two (the update on S(0) slices, the factor B)
FOLDS = {
    "gpt-1": ({"ranks": 1}, {}),
    "dp2xtp2": ({"ranks": 4, "tp": True, "dp": 2}, {}),
    "zero3": ({"ranks": 2}, {"zero_stage": 3}),
}


@pytest.mark.parametrize("layout", list(FOLDS))
def test_each_clipping_mul_folds_into_its_update(layout: str) -> None:
    shape, config = FOLDS[layout]
    made = load("gpt").make_job(layers=1, width=16, vocab=32, seq_len=8, batch_size=8, heads=2, **shape)
    made = replace(made, config=replace(made.config, **config))
    assert made.optimizer is not None and made.optimizer.clip_grad_norm > 0
    n = len(made.optimizer.parameters)
    on = optimizer_ops(made)
    assert on.count("clipped_adamw_update") == n and "mul" not in on and "adamw_update" not in on, on
    off = optimizer_ops(replace(made, config=replace(made.config, fusion=False)))
    assert off.count("mul") == off.count("adamw_update") == n


@pytest.mark.parametrize("layout", list(FOLDS))
def test_the_clipping_norm_is_one_sum_squares(layout: str) -> None:
    # each gradient's pow_scalar and sum and the adds of the sums: one op over every gradient, B on one
    # rank, P on a mesh axis that splits every gradient (the 2-d mesh's TP axis, ZeRO's)
    shape, config = FOLDS[layout]
    made = load("gpt").make_job(layers=1, width=16, vocab=32, seq_len=8, batch_size=8, heads=2, **shape)
    made = replace(made, config=replace(made.config, **config))
    assert made.optimizer is not None
    compiled = pipeline.compile(made).state  # compiled: verify_compiled checks the signature
    (node,) = [o for o in compiled.graph.ops if o.op_type == "sum_squares"]
    assert len(node.inputs) == len(made.optimizer.parameters)  # a gradient each (boxed where boxing moved it)
    split = {"gpt-1": False, "dp2xtp2": True, "zero3": True}[layout]
    assert (P in compiled.graph.tensors[node.outputs[0]].sbp) is split  # type: ignore[operator]
    assert not [o for o in compiled.graph.ops if o.name.startswith("optimizer/") and "pow_scalar" in o.name]
    off = optimizer_ops(replace(made, config=replace(made.config, fusion=False)))
    assert off.count("pow_scalar") == len(made.optimizer.parameters)


def test_a_pipelines_norm_stays_unfolded() -> None:
    # the later stage's sums travel to the first stage, whose adds read them: a boxing between, no fold
    made = load("gpt").make_job(
        layers=2, width=16, vocab=32, seq_len=8, batch_size=8, heads=2, ranks=2, pp=2, micro_batches=2
    )
    ops = pipeline.compile(made).state.graph.ops
    assert not [o for o in ops if o.op_type == "sum_squares"]
    assert any(o.op_type == fusion.FUSED and chain_ops(o) == ["pow_scalar", "sum"] for o in ops)


def test_a_gated_update_keeps_its_clipping_mul() -> None:
    # a loss-scaled job's updates are gated on the step's non-finite count: no clipped form, nothing folds
    made = load("gpt").make_job(layers=1, width=16, vocab=32, seq_len=8, batch_size=8, heads=2, ranks=1)
    j = replace(made, config=replace(made.config, precision="fp16", loss_scaling=LossScaling()))
    ops = optimizer_ops(j)
    assert ops.count("gated_adamw_update") == ops.count("mul") == len(made.optimizer.parameters)  # type: ignore[union-attr]


# one device, the 2-d mesh and a pipeline with micro-batches: fused and unfused runs are bit-identical
BIT_FOR_BIT = {
    "gpt-1": {"ranks": 1},
    "gpt-dp2xtp2": {"ranks": 4, "tp": True, "dp": 2, "heads": 2},
    "gpt-pp2x2mb": {"ranks": 2, "pp": 2, "micro_batches": 2},
    "gpt-zero3": {"ranks": 2, "zero_stage": 3},
}


@pytest.mark.parametrize("layout", list(BIT_FOR_BIT))
def test_fused_training_is_bit_identical_to_unfused(layout: str) -> None:
    shape = {"layers": 2, "width": 16, "vocab": 32, "seq_len": 8, "batch_size": 8, "steps": 3}
    args = {"heads": 2, **shape, **BIT_FOR_BIT[layout]}
    zero = {"zero_stage": args.pop("zero_stage")} if "zero_stage" in args else {}
    made = load("gpt").make_job(**args)
    made = replace(made, config=replace(made.config, **zero))
    assert made.config.fusion, "the example's job is fused by default"
    runs = {}
    for on in (True, False):
        j = replace(made, config=replace(made.config, fusion=on))
        assert any(o.op_type == fusion.FUSED for o in pipeline.compile(j).state.graph.ops) is on
        runs[on] = sf.run(j, steps=3, return_parameters=True, timeout=60, backend="inprocess")
    assert runs[True].losses == runs[False].losses
    fused_params, plain_params = runs[True].parameters, runs[False].parameters
    assert fused_params is not None and plain_params is not None and set(fused_params) == set(plain_params)
    for name, value in plain_params.items():
        np.testing.assert_array_equal(fused_params[name], value, err_msg=name)


# an intermediate read outside its chain: ResNet's batch norms (var + eps and its sqrt and reciprocal,
# which the backward reads) on two ranks, GPT's c_fc bias add (gelu_grad reads it) checkpointed and
# accumulated over two micro-batches. Exports on and off: the same bits, fewer ops on.
EXPORTED = {
    "resnet-dp2": ("resnet", {"ranks": 2, "width": 4, "image_size": 8, "batch_size": 4}, {}),
    "gpt-ckpt-2mb": (
        "gpt",
        {"ranks": 1, "layers": 2, "width": 16, "vocab": 32, "seq_len": 8, "batch_size": 8, "heads": 2},
        {"activation_checkpointing": True, "gradient_accumulation_steps": 2},
    ),
}


@pytest.mark.parametrize("layout", list(EXPORTED))
def test_exported_intermediates_train_bit_identically(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, shape, config = EXPORTED[layout]
    made = load(model).make_job(steps=3, **shape)
    made = replace(made, config=replace(made.config, **config))
    trains_alike(made, monkeypatch, "EXPORTS", exported=True)


# s0 = x + y, s1 = s0 * 0.5 (which writes into s0 where s0 dies there), s2 = relu(s1); s0 exported
_EXPORTING = encode(
    [("add", {}, ["in0", "in1"]), ("mul_scalar", {"value": 0.5}, ["s0"]), ("relu", {}, ["s1"])]
)


@pytest.mark.parametrize("lend", [False, True])
def test_an_exported_intermediate_is_never_written_over(lend: bool) -> None:
    # the chain's later steps write into its dying intermediates, and into the runtime's lent buffers
    # where it lends them: an export is neither (its own lent buffer holds it)
    op = get_op(fusion.FUSED)
    attrs = op.normalize_attrs({"chain": _EXPORTING, "exports": (0,)})
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((4, 6)).astype(np.float32) for _ in range(2))
    metas = (TensorMeta((4, 6), DType.float32),) * 2
    outs = op.run_infer(metas, attrs)
    assert outs == metas
    where = (tuple(map(full_index, metas)), tuple(map(full_index, outs)))
    bufs = tuple(np.full((4, 6), np.nan, np.float32) for _ in outs) if lend else ()
    got = op.run_kernel(DonatingKernelContext(np, attrs, metas, outs, *where, out_buffers=bufs), [x, y])
    np.testing.assert_array_equal(got[0], np.maximum((x + y) * np.float32(0.5), 0))
    np.testing.assert_array_equal(got[1], x + y)
    if lend:
        assert got[0] is bufs[0] and got[1] is bufs[1]


@pytest.mark.parametrize("exports", [(2,), (1, 0), (0, 0), (-1,)])
def test_exports_name_earlier_steps_in_order(exports: tuple[int, ...]) -> None:
    with pytest.raises(ShapeError, match=r"give distinct steps in ascending order, each before the last"):
        get_op(fusion.FUSED).run_infer((META, META), {"chain": _EXPORTING, "exports": exports})
