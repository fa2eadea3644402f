"""The compiled-graph verifier: passes on every configuration, and names the first bad node otherwise."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sbpflow.boxing import plan_boxing
from sbpflow.control_plane.compiler.passes import boxing_pass, sbp_inference
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.compiler.verify import verify_compiled
from sbpflow.errors import GraphError
from sbpflow.graph import BOXING
from sbpflow.sbp import B
from tests.control_plane.compiler.passes.test_sbp_inference import CONFIGS, start


def compiled(config: str = "mlp-tp4") -> CompileState:
    state = start(config)
    sbp_inference.run(state)
    boxing_pass.run(state)
    return state


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_configuration_verifies(config: str) -> None:
    verify_compiled(compiled(config))


def test_inference_alone_leaves_mismatches_the_verifier_finds() -> None:
    state = start("mlp-tp4")
    sbp_inference.run(state)
    with pytest.raises(GraphError, match="is not a signature of"):
        verify_compiled(state)


def test_a_missing_boxing_is_named() -> None:
    state = compiled()
    g = state.graph
    box = next(o for o in g.ops if o.op_type == BOXING and state.boxings[o.name].bytes)
    # rewire its readers to the unboxed tensor and drop the node
    g.ops = [
        replace(o, inputs=tuple(box.inputs[0] if i == box.outputs[0] else i for i in o.inputs))
        for o in g.ops
        if o is not box
    ]
    del g.tensors[box.outputs[0]]
    del state.boxings[box.name]
    with pytest.raises(GraphError, match=r"op '.*' \(\w+\) reads and writes"):
        verify_compiled(state)


def test_a_wrong_plan_is_named() -> None:
    state = compiled()
    name, plan = next((n, p) for n, p in state.boxings.items() if p.bytes)
    state.boxings[name] = plan_boxing(plan.meta, plan.src, (B,), plan.dst, plan.dst_sbp)
    with pytest.raises(GraphError, match=f"boxing node '{name}' records plan"):
        verify_compiled(state)


def test_recorded_bytes_must_match_the_nodes() -> None:
    state = compiled()
    name, plan = next(iter(state.boxings.items()))
    state.boxings["ghost"] = plan
    with pytest.raises(GraphError, match="ghost"):
        verify_compiled(state)


def test_a_tensor_without_sbp_is_named() -> None:
    state = compiled()
    t = state.graph.tensors["model.net.0.add_0"]
    state.graph.set_tensor(replace(t, sbp=None))
    with pytest.raises(GraphError, match="model.net.0.add_0.* has no SBP"):
        verify_compiled(state)
