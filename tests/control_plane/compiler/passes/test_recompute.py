"""Activation checkpointing: segments recomputed before their backward readers, same training, less memory."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.passes import autodiff, optimizer
from sbpflow.control_plane.compiler.passes import recompute as checkpointing
from sbpflow.control_plane.compiler.passes.recompute import PREFIX, forward_end, segment
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.job import Job
from sbpflow.oracle import reference
from tests.examples.test_examples import load


def with_config(job: Job, **config: object) -> Job:
    return replace(job, config=replace(job.config, **config))


def through_checkpointing(job: Job) -> CompileState:
    state = CompileState.start(job)
    for p in (autodiff, optimizer, checkpointing):
        p.run(state)
        state.graph.verify()
    return state


def gpt(**kw: object) -> Job:
    return load("gpt").make_job(**{"ranks": 1, "layers": 2, "dropout": 0.1, "steps": 2, **kw})


def test_segments_are_scopes_cut_after_their_first_index() -> None:
    assert segment("model.blocks.3.attn.c_attn") == "model.blocks.3"
    assert segment("model.net.0") == "model.net.0"
    assert segment("model.wte") == "model.wte"
    assert segment("") == ""


def test_every_block_is_checkpointed_and_its_backward_reads_only_recomputed_tensors() -> None:
    state = through_checkpointing(with_config(gpt(), activation_checkpointing=True))
    g = state.graph
    segs = set(checkpointing.checkpointed(state).values())
    assert {"model.blocks.0", "model.blocks.1", "model.wte", "model.lm_head"} <= segs
    assert "model" not in segs  # glue outside modules with parameters is kept
    marked = checkpointing.checkpointed(state)
    made_in = {o: marked[n.name] for n in g.ops if n.name in marked for o in n.outputs}
    end = forward_end(g)
    for node in g.ops[end:]:
        if not node.name.startswith(PREFIX):
            assert not set(made_in) & set(node.inputs), f"{node.name} reads a checkpointed op's own output"
        else:  # a recomputation reads outputs of other segments only: the checkpoints that are kept
            seg = marked[node.name.removeprefix(PREFIX)]
            assert all(made_in.get(i, seg + "?") != seg for i in node.inputs), node.name
    copies = [o for o in g.ops if o.name.startswith(PREFIX)]
    assert copies and all(not o.checkpoint for o in copies)
    originals = {o.name: o for o in g.ops[:end]}
    for c in copies:
        first_reader = next(o for o in g.ops if set(c.outputs) & set(o.inputs))
        assert g.ops.index(first_reader) > g.ops.index(c) >= end  # recomputed in backward, before its use
        orig = originals[c.name.removeprefix(PREFIX)]
        assert (c.op_type, dict(c.attrs), c.stage, c.scope) == (
            orig.op_type,
            dict(orig.attrs),
            orig.stage,
            orig.scope,
        )
    assert any(c.op_type == "dropout" for c in copies)  # the same rng_id: the same mask


def test_user_flag_checkpoints_only_that_module() -> None:
    job = gpt()
    g = job.graph
    ops = [replace(o, checkpoint=segment(o.scope) == "model.blocks.1") for o in g.ops]
    state = through_checkpointing(replace(job, graph=replace(g, ops=ops)))
    assert set(checkpointing.checkpointed(state).values()) == {"model.blocks.1"}
    assert all(o.scope.startswith("model.blocks.1") for o in state.graph.ops if o.name.startswith(PREFIX))


def test_training_is_unchanged() -> None:
    # Recomputation runs the very same ops on the very same inputs, so it is exact, not merely close:
    # fp32 results must match bit for bit (a stronger check than float64 closeness), and equal the
    # independent one-device oracle's.
    job = gpt()
    want = sf.run(job, backend="inprocess", return_parameters=True)
    got = sf.run(with_config(job, activation_checkpointing=True), backend="inprocess", return_parameters=True)
    assert got.losses == want.losses == reference.train(job).losses
    assert got.parameters is not None and want.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_array_equal(got.parameters[name], value, err_msg=name)


@pytest.mark.parametrize("kw", [{"ranks": 2, "batch_size": 32}, {"ranks": 1, "batch_size": 16, "layers": 4}])
def test_peak_activations_drop(kw: dict) -> None:
    job = gpt(**kw)
    peak: list[int] = []
    for on in (False, True):
        c = pipeline.compile(with_config(job, activation_checkpointing=on))
        assert c.plan is not None
        peak.append(max(m.peak_activations for m in c.memory.values()))
    assert peak[1] < 0.75 * peak[0], peak


def test_checkpointing_composes_with_zero_3() -> None:
    job = with_config(
        load("gpt").make_job(ranks=4, batch_size=8), activation_checkpointing=True, zero_stage=3
    )
    c = pipeline.compile(job)  # verify_compiled runs inside
    assert c.plan is not None
    ops = c.state.graph.ops
    # a recomputed matmul re-gathers its weight rather than keeping the forward's gathered copy
    regathered = [o for o in ops if o.name.startswith(PREFIX) and o.op_type == "boxing"]
    assert regathered and all(c.state.boxings[o.name].bytes > 0 for o in regathered)
