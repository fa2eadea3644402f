"""Boxing plans: bytes equal the cost table (even and uneven), nd paths are valid, transfers cover."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbpflow.boxing import Collective, plan_boxing
from sbpflow.dtype import DType
from sbpflow.placement import Placement, placement
from sbpflow.sbp import B, P, S, Sbp
from sbpflow.sharding import assemble, shard, shard_index
from sbpflow.tensor_meta import TensorMeta

F32 = DType.float32


def line(p: int, first: int = 0) -> Placement:
    return placement("cpu", list(range(first, first + p)))


# (from, to) -> (collective, bytes as a function of p and |T|): the table in ARCHITECTURE.md
TABLE = {
    (P, B): (Collective.all_reduce, lambda p, t: 2 * (p - 1) * t),
    (P, S(0)): (Collective.reduce_scatter, lambda p, t: (p - 1) * t),
    (S(0), B): (Collective.all_gather, lambda p, t: (p - 1) * t),
    (S(0), S(1)): (Collective.all_to_all, lambda p, t: (p - 1) * t // p),
    (B, S(1)): (Collective.local_slice, lambda p, t: 0),
    (B, P): (Collective.zero_fill, lambda p, t: 0),
}


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("pair", list(TABLE), ids=lambda x: f"{x[0]}->{x[1]}")
def test_even_bytes_equal_the_cost_table(p: int, pair: tuple[Sbp, Sbp]) -> None:
    meta = TensorMeta((12 * p, 12 * p), F32)  # divisible, and p^2 divides the all-to-all size
    plan = plan_boxing(meta, line(p), (pair[0],), line(p), (pair[1],))
    collective, formula = TABLE[pair]
    assert [s.collective for s in plan.steps] == [collective]
    assert plan.bytes == formula(p, meta.nbytes)


@pytest.mark.parametrize("p", [3, 4])
@pytest.mark.parametrize("pair", [(P, B), (P, S(0)), (S(0), B)], ids=str)
def test_uneven_collectives_move_p_minus_one_times_t(p: int, pair: tuple[Sbp, Sbp]) -> None:
    meta = TensorMeta((10, 7), F32)
    _, formula = TABLE[pair]
    assert plan_boxing(meta, line(p), (pair[0],), line(p), (pair[1],)).bytes == formula(p, meta.nbytes)


@settings(max_examples=30, deadline=None)
@given(d0=st.integers(1, 11), d1=st.integers(1, 11), p=st.integers(2, 5))
def test_all_to_all_bytes_are_what_changes_owner(d0: int, d1: int, p: int) -> None:
    meta = TensorMeta((d0, d1), DType.float64)
    plan = plan_boxing(meta, line(p), (S(0),), line(p), (S(1),))
    owner_src = np.zeros((d0, d1), int)
    owner_dst = np.zeros((d0, d1), int)
    for r in range(p):
        owner_src[shard_index(meta.shape, (p,), (S(0),), (r,))] = r
        owner_dst[shard_index(meta.shape, (p,), (S(1),), (r,))] = r
    assert plan.bytes == int((owner_src != owner_dst).sum()) * 8


def _simulate_p2p(plan, x: np.ndarray) -> dict[int, np.ndarray]:
    step = plan.steps[-1]
    src_shards = shard(x, plan.src, step.from_sbp)
    out = {}
    for c in plan.dst.coords():
        d = plan.dst.rank_at(c)
        index = shard_index(x.shape, plan.dst.shape, plan.dst_sbp, c)
        out[d] = np.zeros([s.stop - s.start for s in index])
    for t in step.transfers:
        src_index = shard_index(x.shape, plan.src.shape, step.from_sbp, plan.src.coord_of(t.src))
        dst_index = shard_index(x.shape, plan.dst.shape, plan.dst_sbp, plan.dst.coord_of(t.dst))
        src_local = tuple(
            slice(r.start - s.start, r.stop - s.start) for r, s in zip(t.region, src_index, strict=True)
        )
        dst_local = tuple(
            slice(r.start - s.start, r.stop - s.start) for r, s in zip(t.region, dst_index, strict=True)
        )
        out[t.dst][dst_local] = src_shards[t.src][src_local]
    return out


SBPS_1D = [S(0), S(1), B]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(st.integers(4, 9), st.integers(4, 9)),
    src_p=st.integers(1, 4),
    dst_p=st.integers(1, 4),
    offset=st.integers(0, 3),
    src_sbp=st.sampled_from(SBPS_1D),
    dst_sbp=st.sampled_from([*SBPS_1D, P]),
)
def test_transfers_between_placements_rebuild_the_tensor(
    shape, src_p, dst_p, offset, src_sbp, dst_sbp
) -> None:
    src, dst = line(src_p), line(dst_p, first=offset)
    x = np.random.default_rng(0).normal(size=shape)
    meta = TensorMeta(shape, DType.float64)
    plan = plan_boxing(meta, src, (src_sbp,), dst, (dst_sbp,))
    if src == dst:
        return
    got = _simulate_p2p(plan, x)
    np.testing.assert_array_equal(assemble(got, shape, dst, (dst_sbp,)), x)
    remote = sum(t.numel for t in plan.steps[-1].transfers if t.src != t.dst)
    assert plan.bytes == remote * 8


MESH = placement("cpu", [[0, 1], [2, 3]])
ND = [(a, b) for a in (S(0), S(1), B, P) for b in (S(0), S(1), B, P)]


@pytest.mark.parametrize("src", ND, ids=str)
@pytest.mark.parametrize("dst", [n for n in ND if P not in n], ids=str)
def test_nd_paths_change_one_axis_per_step_and_end_at_the_target(src, dst) -> None:
    meta = TensorMeta((8, 6), F32)
    plan = plan_boxing(meta, MESH, src, MESH, dst)
    cur = src
    for step in plan.steps:
        assert step.from_sbp == cur
        changed = [k for k in range(2) if step.from_sbp[k] != step.to_sbp[k]]
        assert changed == [step.mesh_axis]
        cur = step.to_sbp
    assert cur == dst
    # no step ever reads a hierarchical split as if it were a per-axis one
    if src == dst:
        assert plan.is_identity and plan.bytes == 0


def test_plans_are_cached_values_that_print() -> None:
    meta = TensorMeta((8, 4), F32)
    a = plan_boxing(meta, line(4), (P,), line(4), (S(0),))
    assert a is plan_boxing(meta, line(4), (P,), line(4), (S(0),))
    assert repr(a) == "P -> S(0): reduce-scatter on mesh axis 0, 384 B"
    assert hash(a) == hash(plan_boxing(meta, line(4), (P,), line(4), (S(0),)))


@pytest.mark.parametrize(
    "src, src_sbp, dst, dst_sbp",
    [
        ([0, 1], (S(0),), [2, 3, 4, 5], (S(1),)),
        ([0, 1], (P,), [2, 3, 4], (S(0),)),
        ([0, 1, 2, 3], (S(1),), [2, 3], (B,)),  # overlapping ranks keep what they hold
        ([[0, 1], [2, 3]], (S(0), P), [[4, 5], [6, 7]], (P, S(1))),
        ([[0, 1], [2, 3]], (S(0), S(0)), [0, 1, 2], (S(0),)),
    ],
)
def test_boxing_cost_equals_the_plan_across_placements(src, src_sbp, dst, dst_sbp) -> None:
    from sbpflow.boxing import boxing_cost

    meta = TensorMeta((10, 7), DType.float32)
    a, b = placement("cpu", src), placement("cpu", dst)
    plan = plan_boxing(meta, a, src_sbp, b, dst_sbp)
    assert boxing_cost(meta, a, src_sbp, b, dst_sbp) == (plan.bytes, len(plan.steps))
