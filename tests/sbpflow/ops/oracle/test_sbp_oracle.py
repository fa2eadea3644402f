"""Every SBP row of every op, checked against the unsharded result.

For a drawn example and mesh, each valid n-d signature is run per rank on shards, the per-rank outputs
are reassembled by the output SBP, and the result must equal the op run on whole arrays. ``B`` outputs
must be equal on every rank.

Partial inputs are cut into unequal shares (0.6/0.4-like weights from ``sharding.shard``) *plus* random
noise that sums to zero over the ranks: with proportional shares alone, a positively homogeneous op
(relu, max, abs·x) would pass ``P -> P`` by coincidence, since relu(0.6x) + relu(0.4x) = relu(x).

The helpers here (:func:`run_signature`, :func:`outputs_match`, :func:`shard_noisy`) are the shared
harness; ``test_missed_signatures.py`` reuses them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.base import NdSignature, NoGrad, OpDef, Signature, get_op
from sbpflow.ops.eager import EagerBuilder, meta_of, run_local
from sbpflow.placement import Placement, placement
from sbpflow.sbp import Broadcast, NdSbp, P, PartialSum
from sbpflow.sharding import assemble, shard
from tests.sbpflow.ops import all_cases
from tests.sbpflow.ops.cases import CASES, Example

MESHES = [
    placement("cpu", [0, 1]),
    placement("cpu", [0, 1, 2]),
    placement("cpu", [0, 1, 2, 3]),
    placement("cpu", [[0, 1], [2, 3]]),
]
RTOL, ATOL = 1e-9, 1e-12

all_cases.load()


# ---- the harness ---------------------------------------------------------------------------------


def shard_noisy(
    value: np.ndarray, mesh: Placement, nd_sbp: NdSbp, rng: np.random.Generator
) -> dict[int, Any]:
    """``sharding.shard``, with zero-sum noise added to the partial shares along every ``P`` mesh axis."""
    shards = shard(value, mesh, nd_sbp)  # refuses a bool P, which sbpflow never makes
    floating = np.issubdtype(value.dtype, np.floating)

    def draw(share: np.ndarray) -> np.ndarray:
        # noise of the share's own size, element by element: large enough to flip signs, small enough
        # that summing the shares back loses nothing next to a huge fill value elsewhere in the tensor
        if floating:
            return rng.standard_normal(share.shape) * (np.abs(share) + 0.5)
        return rng.integers(-3, 4, share.shape)

    for axis, s in enumerate(nd_sbp):
        if not isinstance(s, PartialSum) or mesh.shape[axis] == 1:
            continue
        # ranks that differ only along this P axis hold shares of one value; ranks that differ along a
        # B axis hold equal copies, so they get the same noise
        noise: dict[tuple[int, ...], list[np.ndarray]] = {}
        for coord in mesh.coords():
            rank = mesh.rank_at(coord)
            key = tuple(
                0 if isinstance(t, Broadcast) or k == axis else c
                for k, (c, t) in enumerate(zip(coord, nd_sbp, strict=True))
            )
            if key not in noise:
                parts = [draw(shards[rank]) for _ in range(mesh.shape[axis] - 1)]
                noise[key] = [-np.sum(parts, axis=0), *parts]
            shards[rank] = shards[rank] + noise[key][coord[axis]].astype(value.dtype)
    return shards


def run_signature(
    op: OpDef, example: Example, mesh: Placement, nd: NdSignature, rng: np.random.Generator
) -> list[Any]:
    """Run ``op`` per rank under ``nd`` and reassemble each output (raises if ``B`` copies differ)."""
    metas = tuple(meta_of(x) for x in example.inputs)
    outs = op.run_infer(metas, op.normalize_attrs(example.attrs))
    shards = [shard_noisy(x, mesh, s, rng) for x, s in zip(example.inputs, nd.ins, strict=True)]
    per_rank = {
        r: run_local(op, example.attrs, metas, [s[r] for s in shards], mesh, nd, r) for r in mesh.ranks
    }
    return [
        assemble({r: o[i] for r, o in per_rank.items()}, m.shape, mesh, nd.outs[i], rtol=RTOL, atol=ATOL)
        for i, m in enumerate(outs)
    ]


def outputs_match(got: Any, want: Any) -> bool:
    """Float outputs to ``RTOL``/``ATOL``; int and bool outputs exactly (and the dtype must agree)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype.kind in "fc":
        return bool(np.allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True))
    return bool(np.array_equal(got, want))


def is_all_broadcast(nd: NdSignature) -> bool:
    return all(isinstance(s, Broadcast) for t in (*nd.ins, *nd.outs) for s in t)


def check_all_signatures(
    op_name: str, example: Example, mesh: Placement, rng: np.random.Generator
) -> Counter:
    """Check every signature the op declares on ``mesh``; returns how many were checked, and of what kind."""
    op = get_op(op_name)
    metas = tuple(meta_of(x) for x in example.inputs)
    expected = EagerBuilder().call(op_name, *example.inputs, **example.attrs)
    tally: Counter = Counter()
    for nd in op.nd_signatures(metas, op.normalize_attrs(example.attrs), mesh.shape):
        where = f"{op_name} {nd} on mesh {list(mesh.shape)}, inputs {[list(m.shape) for m in metas]}"
        try:
            got = run_signature(op, example, mesh, nd, rng)
        except Exception as e:  # name the signature: the bare error rarely says which row broke
            raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
        for i, (g, w) in enumerate(zip(got, expected, strict=True)):
            if not outputs_match(g, w):
                err = (
                    float(np.max(np.abs(g.astype(float) - w.astype(float)), initial=0.0))
                    if g.shape == w.shape
                    else None
                )
                raise AssertionError(
                    f"{where}: output {op.output_name(i)!r} reassembled to {list(g.shape)} {g.dtype} differs "
                    f"from the unsharded {list(w.shape)} {w.dtype} (max abs diff {err}); "
                    "the row is wrong or the kernel ignores where its shard lies (ctx.in_index/out_index)"
                )
        tally["signatures"] += 1
        tally["broadcast_only" if is_all_broadcast(nd) else "sharded"] += 1
    return tally


# ---- the test ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_every_signature_matches_unsharded(name: str) -> None:
    c = CASES.get(name)
    total: Counter = Counter()

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        example = data.draw(c.examples, label="example")
        mesh = data.draw(st.sampled_from(MESHES), label="mesh")
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="noise seed"))
        total.update(check_all_signatures(c.op, example, mesh, rng))

    run()
    if get_op(c.op).inputs:
        assert total["sharded"] > 0, (
            f"case {name!r}: no drawn example admitted any signature other than all-B on the meshes "
            f"{[list(m.shape) for m in MESHES]}, so none of {c.op!r}'s sharded rows were checked; "
            "draw larger shapes (sides >= 2, or sizes that divide for even_splits ops)"
        )


def test_noisy_partial_shares_catch_a_homogeneous_op_claiming_p() -> None:
    """relu(0.6x) + relu(0.4x) == relu(x): proportional shares alone would accept relu ``P -> P``."""
    relu_p = OpDef(
        "relu_claiming_p",
        ("x",),
        ("y",),
        infer=lambda metas, attrs: (metas[0],),
        rows=lambda metas, attrs: [Signature((P,), (P,))],
        kernel=lambda ctx, x: np.maximum(x, 0.0),
        grad=NoGrad("test op"),
    )
    x = np.random.default_rng(0).standard_normal((4, 3))
    mesh, nd = MESHES[0], NdSignature(((P,),), ((P,),))
    plain = {r: relu_p.kernel(None, s) for r, s in shard(x, mesh, (P,)).items()}
    assert np.allclose(assemble(plain, x.shape, mesh, (P,)), np.maximum(x, 0.0)), "the coincidence"
    (got,) = run_signature(relu_p, Example((x,)), mesh, nd, np.random.default_rng(1))
    assert not outputs_match(got, np.maximum(x, 0.0))
    # a linear op stays exact under any decomposition
    neg = OpDef("neg_p", ("x",), ("y",), relu_p.infer, relu_p.rows, lambda ctx, x: -x, relu_p.grad)
    (got,) = run_signature(neg, Example((x,)), mesh, nd, np.random.default_rng(1))
    assert outputs_match(got, -x)
