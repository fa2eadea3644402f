"""ZeRO 1/2/3 on DP 4: the boxing each stage inserts, the per-device memory it saves, a verified plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sbpflow.boxing import Collective
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.passes import autodiff, optimizer, zero
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import BOXING, Graph
from sbpflow.job import Job
from sbpflow.ops.training.optim import CLIPPED
from sbpflow.sbp import B, S
from tests.examples.test_examples import load

MODELS = {"mlp": {"ranks": 4}, "gpt": {"ranks": 4, "batch_size": 8}}


def with_stage(job: Job, stage: int) -> Job:
    return replace(job, config=replace(job.config, zero_stage=stage))


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, int], pipeline.Compiled]:
    # compile() runs Graph.verify after every pass and verify_compiled after boxing
    return {
        (name, stage): pipeline.compile(with_stage(load(name).make_job(**kw), stage))
        for name, kw in MODELS.items()
        for stage in range(4)
    }


def collective(c: pipeline.Compiled, node: str) -> Collective:
    (step,) = c.state.boxings[node].steps
    return step.collective


def boxing_of(g: Graph, tensor: str) -> str:
    node = g.producer(tensor)
    if node is not None and node.op_type == "unpack":  # a gradient bucket's: its one all-reduce
        node = g.producer(node.inputs[0])
    assert node is not None and node.op_type == BOXING, tensor
    return node.name


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_boxes_as_the_table_says(compiled, name: str, stage: int) -> None:
    c = compiled[(name, stage)]
    assert c.plan is not None
    g, job = c.state.graph, c.state.job
    assert job.optimizer is not None
    for p in job.optimizer.parameters:
        update = next(o for o in g.ops if o.name == optimizer.PREFIX + p)
        grad = c.state.grads[p]
        new = c.state.updates[p]
        # the update runs on S(0) slices of everything; the clipping factor folded into it is one value, B
        sliced = update.inputs[:-1] if update.op_type in CLIPPED.values() else update.inputs
        assert all(g.tensors[t].sbp == (S(0),) for t in (*sliced, *update.outputs)), update
        assert update.op_type in CLIPPED.values() or job.optimizer.clip_grad_norm == 0, update
        assert g.tensors[grad].sbp == ((B,) if stage == 1 else (S(0),))
        # the sum over the data-parallel ranks: whole (stage 1) or scattered; a gradient that a model-
        # parallel backward op (an embedding's) made split already is moved by an all-to-all instead
        reduce = collective(c, boxing_of(g, grad))
        whole, scattered = (
            {Collective.all_reduce, Collective.all_gather},
            {Collective.reduce_scatter, Collective.all_to_all},
        )
        assert reduce in (whole if stage == 1 else scattered), (p, reduce)
        if name == "mlp":
            assert reduce == (Collective.all_reduce if stage == 1 else Collective.reduce_scatter)
        if stage < 3:
            assert g.tensors[p].sbp == (B,)
            assert collective(c, boxing_of(g, new)) == Collective.all_gather
        else:
            assert g.tensors[p].sbp == g.tensors[new].sbp == (S(0),)
            readers = [o for o in g.ops if p in o.inputs and o.name != update.name]
            assert readers and all(o.op_type == BOXING for o in readers)
            for box in readers:  # each use has its own gather, right before its one reader
                (copy,) = box.outputs
                (reader,) = g.consumers(copy)
                assert collective(c, box.name) == Collective.all_gather
                between = g.ops[g.ops.index(box) + 1 : g.ops.index(reader)]
                assert all(o.op_type == BOXING for o in between)  # at most its other inputs' boxing


@pytest.mark.parametrize("name", MODELS)
def test_memory_per_device_drops_four_times(compiled, name: str) -> None:
    def most(stage: int, field: str) -> int:
        return max(getattr(m, field) for m in compiled[(name, stage)].memory.values())

    for field, first in (("optimizer_state", 1), ("gradients", 2), ("parameters", 3)):
        for stage in range(4):
            ratio = most(0, field) / most(stage, field)
            if stage >= first:
                assert ratio > 3.5, (field, stage, ratio)
            else:
                assert ratio < 1.2, (field, stage, ratio)


def test_two_d_mesh_shards_along_the_data_parallel_axis_only() -> None:
    job = with_stage(load("gpt").make_job(ranks=4, tp=True, dp=2, heads=4), 3)
    c = pipeline.compile(job)
    assert c.plan is not None
    t = c.state.graph.tensors
    assert t["model.blocks.0.attn.c_attn.weight"].sbp == (S(0), S(1))
    assert t["model.blocks.0.attn.c_attn.weight/adam_m"].sbp == (S(0), S(1))
    assert t["model.blocks.0.ln_1.weight"].sbp == (S(0), B)
    # a bias split over the tensor-parallel axis has no axis left to cut: it keeps its layout
    assert t["model.blocks.0.attn.c_attn.bias"].sbp == (B, S(0))


def optimized(job: Job) -> CompileState:
    state = CompileState.start(job)
    autodiff.run(state)
    optimizer.run(state)
    return state


def test_split_axis_is_the_first_one_as_large_as_the_group() -> None:
    state = optimized(load("mlp").make_job(ranks=4, n_out=2))
    g = state.graph
    assert zero.layout(g, "model.net.0.weight").shard == (S(0),)
    assert zero.layout(g, "model.net.2.weight").shard == (S(0),)  # [32, 2]: axis 0
    assert zero.layout(g, "model.net.2.bias").shard is None  # [2] over 4 ranks: too small, stays B
    state.job = with_stage(state.job, 2)
    zero.run(state)
    assert g.tensors["model.net.2.bias/momentum"].sbp is None  # left to inference: replicated with its bias
    assert g.tensors["model.net.2.weight/momentum"].sbp == (S(0),)


def test_tensor_parallel_only_job_has_no_data_parallel_axis() -> None:
    state = optimized(load("mlp").make_job(ranks=4, tp=True))
    lay = zero.layout(state.graph, "model.net.0.bias")
    assert lay.axis is None and lay.shard is None


def test_a_conflicting_annotation_is_an_error_naming_the_tensor() -> None:
    state = optimized(with_stage(load("mlp").make_job(ranks=4), 2))
    g = state.graph
    grad = state.grads["model.net.0.weight"]
    g.set_tensor(replace(g.tensors[grad], placement=g.tensors["model.net.0.weight"].placement, sbp=(S(1),)))
    with pytest.raises(GraphError, match=r"grad/model.net.0.weight.*S\(1\).*zero_stage=0"):
        zero.run(state)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_pipeline_stages_trains_as_without_it(stage: int) -> None:
    """PP 2 x DP 2 with micro-batches: each stage's replicas shard their optimizer state (the micro-batch
    twin of the graph that SBP inference reads has ZeRO's boxing nodes, which it used to look up as ops)."""
    import sbpflow as sf

    job = load("gpt").make_job(ranks=4, dp=2, pp=2, micro_batches=2, steps=3)
    want = sf.run(job, backend="inprocess", timeout=300).losses
    got = sf.run(with_stage(job, stage), backend="inprocess", timeout=300).losses
    assert got == pytest.approx(want, rel=1e-6)
