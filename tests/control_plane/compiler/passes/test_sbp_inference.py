"""SBP inference on the examples' forward graphs: DP 4, Megatron TP 4, DP2xTP2 on a 2x2 mesh."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from sbpflow.control_plane.compiler.passes import sbp_inference
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import TensorKind
from sbpflow.sbp import B, P, S
from tests.examples.test_examples import load

# small enough to be fast; GPT TP configs have weights larger than activations, the regime TP is for
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp-dp4": ("mlp", {"ranks": 4}),
    "mlp-tp4": ("mlp", {"ranks": 4, "tp": True}),
    "gpt-dp4": ("gpt", {"ranks": 4}),
    "gpt-tp4": ("gpt", {"ranks": 4, "tp": True, "heads": 4, "width": 64, "batch_size": 2, "seq_len": 8}),
    "gpt-dp2xtp2": (
        "gpt",
        {"ranks": 4, "tp": True, "dp": 2, "heads": 4, "width": 64, "batch_size": 2, "seq_len": 8},
    ),
}


def start(config: str, **overrides: Any) -> CompileState:
    name, kwargs = CONFIGS[config]
    return CompileState.start(load(name).make_job(**{**kwargs, **overrides}))


def inferred(config: str, **overrides: Any) -> CompileState:
    state = start(config, **overrides)
    sbp_inference.run(state)
    state.graph.verify()
    return state


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_tensor_and_op_gets_a_layout(config: str) -> None:
    state = inferred(config)
    assert all(t.placement is not None and t.sbp is not None for t in state.graph.tensors.values())
    assert all(o.placement is not None for o in state.graph.ops)
    assert set(state.choices) == {o.name for o in state.graph.ops}


@pytest.mark.parametrize("config", ["mlp-dp4", "gpt-dp4"])
def test_data_parallel_splits_inputs_and_replicates_parameters(config: str) -> None:
    state = inferred(config)
    for t in state.graph.tensors.values():
        if t.kind == TensorKind.input:
            assert t.sbp == (S(0),), t
        if t.kind == TensorKind.parameter:
            assert t.sbp == (B,), t
    # no boxing cost anywhere but the loss reduction (scalars)
    for op in state.graph.ops:
        if state.choices[op.name].cost:
            assert all(state.graph.tensors[o].meta.shape == () for o in op.outputs), op


@pytest.mark.parametrize("config", list(CONFIGS))
def test_annotations_are_kept(config: str) -> None:
    before = {t.name: t.sbp for t in start(config).graph.tensors.values() if t.sbp is not None}
    after = inferred(config).graph.tensors
    assert before and all(after[n].sbp == sbp for n, sbp in before.items())


@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiling_twice_gives_identical_choices(config: str) -> None:
    a, b = inferred(config), inferred(config)
    assert a.choices == b.choices
    assert a.graph.dump() == b.graph.dump()


def test_megatron_mlp_keeps_the_column_then_row_split() -> None:
    state = inferred("mlp-tp4")
    sig = {n: repr(c.signature) for n, c in state.choices.items()}
    assert sig["model.net.0.matmul_0"] == "B, S(1) -> S(1)"  # column split, x read whole
    assert sig["model.net.2.matmul_0"] == "S(1), S(0) -> P"  # row split: a partial sum
    t = state.graph.tensors
    assert t["x"].sbp == (B,)  # a free data input comes out whole, no gather
    # an unannotated variable is replicated (the whole-graph program's rule, sbp_inference.py)
    assert t["model.net.2.bias"].sbp == (B,)


def test_dp2xtp2_reads_batch_over_dp_and_weights_over_tp() -> None:
    state = inferred("gpt-dp2xtp2")
    t = state.graph.tensors
    assert t["tokens"].sbp == (S(0), B)
    assert t["model.blocks.0.mlp.c_fc.weight"].sbp == (B, S(1))
    fc = state.choices["model.blocks.0.mlp.c_fc.matmul_0"].signature
    assert fc.ins[1] == (B, S(1)) and fc.outs[0][1] == S(2)
    proj = state.choices["model.blocks.0.mlp.c_proj.matmul_0"].signature
    assert proj.outs[0] == (S(0), P)


def test_loss_is_made_whole() -> None:
    for config in ("mlp-dp4", "mlp-tp4"):
        state = inferred(config)
        assert state.graph.tensors[state.job.loss].sbp == (B,)


def test_an_empty_shard_annotation_is_rejected_with_the_fix() -> None:
    state = start("mlp-dp4", n_out=1)
    w = state.graph.tensors["model.net.2.weight"]  # [32, 1]
    state.graph.set_tensor(replace(w, sbp=(S(1),)))
    with pytest.raises(GraphError) as e:
        sbp_inference.run(state)
    msg = str(e.value)
    for part in ("model.net.2.weight", "[32, 1]", "S(1)", "axis 1 of size 1", "4 ranks", "broadcast"):
        assert part in msg


def test_dump_reads_one_line_per_op() -> None:
    state = inferred("mlp-dp4")
    lines = sbp_inference.dump(state).splitlines()
    assert len(lines) == len(state.graph.ops)
    assert lines[0].startswith("model.net.0.matmul_0 (matmul) on ranks [0, 1, 2, 3]: S(0), B -> S(0)  [0 B]")
    assert "cheapest boxing" in lines[0]
    assert lines[-1].startswith("model.mean_0 (mean) on ranks [0, 1, 2, 3]: S(0) -> P  [24 B]")


def test_tensors_on_another_mesh_of_the_same_ranks_train_as_on_their_ops_mesh() -> None:
    """A weight placed on a 2 x 1 mesh of the ranks its 1-d readers run on (a mutated Submit found this):
    its gradient and new value are not given the weight's 2-d SBP as goals on the readers' 1-d mesh (an
    internal error in the boxing cost); the job trains as with the weight on the readers' mesh."""
    import sbpflow as sf
    from sbpflow.placement import Placement

    job = load("mlp").make_job(steps=2)
    w = job.graph.tensors["model.net.0.weight"]
    assert w.placement is not None and w.placement.ndim == 1
    want = sf.run(job, backend="inprocess", timeout=120).losses
    job.graph.set_tensor(replace(w, placement=Placement(w.placement.device_type, w.placement.ranks, (2, 1))))
    assert sf.run(job, backend="inprocess", timeout=120).losses == want
    # an op's output placed on that other mesh too: boxed there whole, then read from there
    h = job.graph.tensors["model.net.0.add_0"]
    job.graph.set_tensor(replace(h, placement=Placement(w.placement.device_type, w.placement.ranks, (2, 1))))
    assert sf.run(job, backend="inprocess", timeout=120).losses == pytest.approx(want, rel=1e-6)
