"""Sequence-parallel GPT (``megatron(sequence_parallel=True)``) trains exactly as one device does.

The residual stream between sub-layers is annotated ``S(1)`` (split by sequence) over the tensor axis,
so layer norms and dropout run on shards; float64 losses and final parameters within 1e-9 of the
one-device oracle, on TP 4 and on DP2 x TP2 (there ``(S(0), S(1))``). And its forward moves each
sub-layer's all-reduce as a reduce-scatter and an all-gather: no [B, T, D] all-reduce.
"""

from __future__ import annotations

import pytest

from sbpflow.boxing import Collective
from sbpflow.control_plane.compiler import pipeline
from tests.actor_workers.test_equivalence import STEPS, assert_trains_like_one_device, gpt_job
from tests.control_plane.compiler.passes.test_autodiff import as_float64

LAYOUTS = {
    "gpt-tp4-sp": {"ranks": 4, "tp": True, "heads": 4, "sequence_parallel": True},
    "gpt-dp2xtp2-sp": {"ranks": 4, "tp": True, "dp": 2, "sequence_parallel": True},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sequence_parallel_training_equals_one_device(name: str) -> None:
    assert_trains_like_one_device(as_float64(gpt_job(**LAYOUTS[name]), batches=STEPS), tol=1e-9)


def test_forward_reduce_scatters_and_gathers_instead_of_all_reducing() -> None:
    state = pipeline.compile(gpt_job(**LAYOUTS["gpt-tp4-sp"], width=64)).state
    first_backward = next(i for i, o in enumerate(state.graph.ops) if o.name.startswith("grad/"))
    forward = {o.name for o in state.graph.ops[:first_backward]}
    kinds = [
        s.collective
        for n, p in state.boxings.items()
        if n in forward and p.meta.ndim == 3
        for s in p.steps
        if s.bytes
    ]
    assert Collective.all_reduce not in kinds
    assert kinds.count(Collective.reduce_scatter) == 2 * 2  # two sub-layers a block, 2 blocks
