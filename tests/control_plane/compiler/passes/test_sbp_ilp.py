"""The whole-graph program against exhaustive search, on graphs small enough to enumerate.

The price of an assignment (every op's signature, every free source's layout) is written here from the
module's docstring, independently of the program's rows: each op's work, and per tensor, per distinct
layout its readers take it as, one boxing from the layout it has (a goal's boxing first, its readers
reading the goal). The program's optimum must equal the least price over every assignment.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.control_plane.compiler.passes import sbp_ilp
from sbpflow.control_plane.compiler.passes.sbp_cost import (
    attrs_key,
    boxing_bytes_collectives,
    flops_per_rank,
    signatures,
    store,
)
from sbpflow.dtype import DType
from sbpflow.ops.base import NdSignature, get_op
from sbpflow.placement import placement
from sbpflow.sbp import B, S
from sbpflow.tensor_meta import TensorMeta

MESH = placement("cpu", [0, 1])


def _call(name: str, op: str, ins: tuple[str, ...], outs: tuple[str, ...], metas: Mapping[str, TensorMeta]):
    attrs = attrs_key(get_op(op).normalize_attrs({}))
    out_metas, sigs = signatures(op, attrs, tuple(metas[t] for t in ins), MESH.shape)
    return sbp_ilp.OpCall(name, op, attrs, ins, outs, MESH, sigs, out_metas), dict(
        zip(outs, out_metas, strict=True)
    )


def _mlp(goal_y: bool) -> sbp_ilp.Problem:
    """x [8, 16] @ w1 [16, 32] -> relu -> @ w2 [32, 4] -> two relus: x annotated S(0), w1 S(1), w2 free."""
    f32 = DType.float32
    metas = {"x": TensorMeta((8, 16), f32), "w1": TensorMeta((16, 32), f32), "w2": TensorMeta((32, 4), f32)}
    ops = []
    for name, op, ins, outs in (
        ("mm1", "matmul", ("x", "w1"), ("h",)),
        ("act", "relu", ("h",), ("r",)),
        ("mm2", "matmul", ("r", "w2"), ("y",)),
        ("out", "relu", ("y",), ("z",)),
        ("out2", "relu", ("y",), ("z2",)),  # a second reader of y: one boxing serves both
    ):
        call, made = _call(name, op, ins, outs, metas)
        ops.append(call)
        metas.update(made)
    fixed = {"x": (MESH, (S(0),)), "w1": (MESH, (S(1),))}
    goal = {"z": (MESH, (B,))} if goal_y else {}
    return sbp_ilp.Problem(tuple(ops), metas, fixed, {"w2": None}, goal)


def _price(
    p: sbp_ilp.Problem, sigs: Mapping[str, NdSignature], stored: Mapping[str, sbp_ilp.Layout]
) -> float:
    total = sum(
        sbp_ilp._work(p, op, sigs[op.name]) for op in p.ops
    )  # the same work term: unary, not under test
    have: dict[str, sbp_ilp.Layout] = {**p.fixed, **stored}
    for op in p.ops:
        for k, t in enumerate(op.outputs):
            made = (op.placement, sigs[op.name].outs[k])
            goal = p.goal.get(t)
            if isinstance(goal, tuple):
                total += _box(p, t, made, goal)
                have[t] = goal
            else:
                have[t] = made
    for t in have:
        wants = {
            (op.placement, w)
            for op in p.ops
            for u, w in zip(op.inputs, sigs[op.name].ins, strict=True)
            if u == t
        }
        total += sum(_box(p, t, have[t], w) for w in wants)
    return total


def _box(p: sbp_ilp.Problem, t: str, src: sbp_ilp.Layout, dst: sbp_ilp.Layout) -> float:
    b, n = boxing_bytes_collectives(p.metas[t], src[0], src[1], dst[0], dst[1])
    return b + sbp_ilp.STEP * n


@pytest.mark.parametrize("goal", [False, True])
def test_the_program_finds_the_least_price_of_every_assignment(goal: bool) -> None:
    p = _mlp(goal)
    found = sbp_ilp.solve(p)
    assert found is not None
    w2_layouts = list(
        dict.fromkeys(
            store(None, op.placement, s.ins[1]) for op in p.ops if op.name == "mm2" for s in op.signatures
        )
    )
    best = min(
        _price(p, dict(zip((op.name for op in p.ops), combo, strict=True)), {"w2": w2})
        for combo in itertools.product(*(op.signatures for op in p.ops))
        for w2 in w2_layouts
    )
    # the program's price carries the row-order tie-breaker, far below one byte
    assert found.price == pytest.approx(best, abs=1e-3)
    assert _price(p, found.signatures, found.stored) == pytest.approx(best, abs=1e-3)


def test_a_program_over_budget_is_declined() -> None:
    p = _mlp(True)
    budget = sbp_ilp.MAX_CHOICES
    try:
        sbp_ilp.MAX_CHOICES = 10
        assert sbp_ilp.solve(p) is None
    finally:
        sbp_ilp.MAX_CHOICES = budget


def test_attention_is_priced_by_its_flops_split_by_its_heads() -> None:
    # the one-op attention (and its backward) carries the GEMMs the batch_matmuls carried: its work per
    # rank counts, or the program would see no gain in splitting it
    q = TensorMeta((2, 4, 8, 16), DType.float32)
    probs = TensorMeta((2, 4, 8, 8), DType.float32)
    two = placement("cpu", [0, 1])
    whole = 2 * (2 * 4 * 8 * 8 * 16)  # q k^T and probs v
    for op, ins, outs in (
        ("attention", (q, q, q), (q, probs)),
        ("attention_grad", (q, q, q, probs, q), (q, q, q)),
    ):
        attrs = attrs_key(get_op(op).normalize_attrs({"scale": 0.25}))
        replicated = NdSignature(tuple((B,) for _ in ins), tuple((B,) for _ in outs))
        heads = NdSignature(tuple((S(1),) for _ in ins), tuple((S(1),) for _ in outs))
        full = flops_per_rank(op, attrs, ins, outs, two, replicated)
        assert full >= whole and flops_per_rank(op, attrs, ins, outs, two, heads) == full // 2
