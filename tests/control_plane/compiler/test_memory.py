"""The per-device memory estimate: local shard bytes by kind, and peak activations by liveness."""

from __future__ import annotations

import pytest

from sbpflow.control_plane.compiler import memory
from sbpflow.control_plane.compiler.lowering import lower as lowering
from sbpflow.control_plane.compiler.memory import DeviceMemory
from sbpflow.control_plane.compiler.pipeline import compile
from sbpflow.graph import TensorKind
from sbpflow.placement import placement
from sbpflow.sbp import S
from tests.control_plane.compiler.lowering.test_lower import HandGraph, mlp
from tests.examples.test_examples import load


def estimate(state) -> dict[int, DeviceMemory]:
    plan = lowering.run(state)
    out = memory.run(state, plan)
    for d in plan.devices:  # the proto carries the same figures
        assert (
            d.memory.total
            == out[d.rank].total
            == sum(
                (d.memory.parameters, d.memory.gradients, d.memory.optimizer_state, d.memory.peak_activations)
            )
        )
    return out


def test_data_parallel_replicates_parameters() -> None:
    one, four = estimate(mlp("dp", p=1)), estimate(mlp("dp", p=4))
    assert one[0].parameters == (6 * 10 + 10 * 3) * 4
    assert {m.parameters for m in four.values()} == {one[0].parameters}


def test_tensor_parallel_splits_take_their_share_exactly_even_when_uneven() -> None:
    est = estimate(mlp("tp", p=4, hidden=10))  # w1 [6,10] S(1), w2 [10,3] S(0): 3, 3, 2, 2 of the hidden dim
    assert [est[r].parameters for r in range(4)] == [(6 + 3) * c * 4 for c in (3, 3, 2, 2)]
    even = estimate(mlp("tp", p=4, hidden=12))
    assert {m.parameters for m in even.values()} == {(6 * 12 + 12 * 3) * 4 // 4}


def test_peak_activations_follow_liveness() -> None:
    h = HandGraph()
    one = placement("cpu", [0])
    x = h.tensor("x", (4, 4), TensorKind.input, one, (S(0),))
    a = h.op("a", "relu", [(x, (S(0),))], (S(0),), one)
    b = h.op("b", "relu", [(a, (S(0),))], (S(0),), one)
    c = h.op("c", "relu", [(b, (S(0),))], (S(0),), one)
    (m,) = estimate(h.state(c)).values()
    # x (64 B, two loader buffers) is live with a; later two 64 B activations at a time
    assert m.peak_activations == 2 * 64 + 64
    assert m.parameters == m.gradients == m.optimizer_state == 0


def test_gradients_and_optimizer_state_by_kind() -> None:
    h = HandGraph()
    two = placement("cpu", [0, 1])
    w = h.tensor("w", (4, 4), TensorKind.parameter, two, (S(0),))
    mom = h.tensor("w.momentum", (4, 4), TensorKind.optimizer_state, two, (S(0),))
    g = h.op("w.grad", "relu", [(w, (S(0),))], (S(0),), two)  # stands in for the backward
    new_m = h.op("w.momentum.new", "add", [(mom, (S(0),)), (g, (S(0),))], (S(0),), two)
    new_w = h.op("w.new", "sub", [(w, (S(0),)), (new_m, (S(0),))], (S(0),), two)
    state = h.state(updates={w: new_w, mom: new_m})
    state.grads = {w: g}
    est = estimate(state)
    assert est[0] == est[1]
    assert (est[0].parameters, est[0].gradients, est[0].optimizer_state) == (32, 32, 32)
    assert est[0].peak_activations == 2 * 32  # new momentum and new weight live together at the end


@pytest.mark.parametrize("ranks", [1, 4])
def test_mlp_example_dp_parameters_and_momentum_are_replicated(ranks: int) -> None:
    job = load("mlp").make_job(ranks=ranks, batch_size=8)
    c = compile(job)
    if c.plan is None:
        pytest.skip("; ".join(c.notes))
    n_params = sum(job.graph.tensors[p.tensor].meta.nbytes for p in job.parameters)
    assert {m.parameters for m in c.memory.values()} == {n_params}
    assert {m.optimizer_state for m in c.memory.values()} == {n_params}  # SGD momentum, one per weight


def test_mlp_example_tp_splits_the_hidden_weights() -> None:
    job = load("mlp").make_job(ranks=4, tp=True, hidden=10)
    c = compile(job)
    if c.plan is None:
        pytest.skip("; ".join(c.notes))
    # w0 [16,10] S(1) and b0 [10] S(0) and w2 [10,4] S(0) split the hidden dim 3,3,2,2; b2 [4] whole
    split = [(16 + 1 + 4) * h * 4 for h in (3, 3, 2, 2)]
    assert [c.memory[r].parameters - 4 * 4 for r in range(4)] == split
