"""Sharding: balanced uneven splits, hierarchical nd splits, unequal partial shares, and the round trip
``assemble(shard(x)) == x`` for Hypothesis-drawn shapes, meshes and nd-SBPs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbpflow.errors import SbpError
from sbpflow.placement import Placement, placement
from sbpflow.sbp import B, NdSbp, P, S
from sbpflow.sharding import (
    assemble,
    divides,
    local_shape,
    min_split_size,
    partial_weights,
    shard,
    shard_index,
    split_range,
)

MESHES = [
    placement("cpu", [0]),
    placement("cpu", [0, 1]),
    placement("cpu", [0, 1, 2]),
    placement("cpu", [3, 1, 2, 0]),
    placement("cpu", [[0, 1], [2, 3]]),
    placement("cpu", [[0, 1, 2], [3, 4, 5]]),
    placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]),
]
QUICK = settings(max_examples=40, deadline=None)


def test_split_range_uneven_gives_the_extra_to_the_first_parts() -> None:
    assert [split_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [split_range(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert [split_range(8, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@QUICK
@given(n=st.integers(0, 50), parts=st.integers(1, 9))
def test_split_range_is_contiguous_and_balanced(n: int, parts: int) -> None:
    ranges = [split_range(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_nd_split_of_one_axis_is_hierarchical_in_row_major_order() -> None:
    mesh = (2, 2)
    got = [shard_index((8, 3), mesh, (S(0), S(0)), c)[0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert got == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    # uneven: the mesh axis 0 halves first (5 | 5), then each half again (3 | 2): not 3, 3, 2, 2
    sizes = [local_shape((10,), mesh, (S(0), S(0)), c)[0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert sizes == [3, 2, 3, 2]


def test_two_axes_split_on_two_mesh_axes() -> None:
    assert shard_index((4, 6), (2, 3), (S(0), S(1)), (1, 2)) == (slice(2, 4), slice(4, 6))
    assert shard_index((4, 6), (2, 3), (S(1), B), (1, 2)) == (slice(0, 4), slice(3, 6))
    assert local_shape((4, 6), (2, 3), (P, S(0)), (1, 2)) == (1, 6)


def test_divides_and_min_split_size() -> None:
    assert divides((8, 3), (2, 2), (S(0), S(0))) and not divides((6, 3), (2, 2), (S(0), S(0)))
    assert divides((5, 3), (2,), (B,)) and divides((5, 3), (2,), (P,))
    assert min_split_size((10,), (4,), (S(0),)) == 2
    assert min_split_size((3,), (4,), (S(0),)) == 0, "a rank would hold nothing"
    assert min_split_size((5, 9), (2, 2), (S(0), S(0))) == 1


def test_partial_weights_are_unequal_and_sum_to_one() -> None:
    for parts in range(1, 9):
        w = partial_weights(parts)
        assert len(w) == parts and abs(sum(w) - 1) < 1e-12
        assert len(set(w)) == parts, "equal shares would let a rule that treats P as B pass"


@st.composite
def layouts(draw: st.DrawFn, dtypes: tuple[str, ...] = ("float64", "int64", "bool")) -> tuple:
    mesh: Placement = draw(st.sampled_from(MESHES))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=4)))
    dtype = draw(st.sampled_from(dtypes))
    options = [S(i) for i in range(len(shape))] + [B] + ([P] if dtype != "bool" else [])
    nd: NdSbp = tuple(draw(st.sampled_from(options)) for _ in range(mesh.ndim))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    value = rng.integers(-50, 50, shape).astype(dtype) if dtype != "float64" else rng.standard_normal(shape)
    return value, mesh, nd


@QUICK
@given(layout=layouts())
def test_assemble_inverts_shard(layout: tuple) -> None:
    value, mesh, nd = layout
    shards = shard(value, mesh, nd)
    assert sorted(shards) == sorted(mesh.ranks)
    for coord in mesh.coords():
        assert shards[mesh.rank_at(coord)].shape == local_shape(value.shape, mesh.shape, nd, coord)
    back = assemble(shards, value.shape, mesh, nd)
    assert back.dtype == value.dtype
    if value.dtype.kind == "f":
        np.testing.assert_allclose(back, value, rtol=1e-12, atol=1e-12)
    else:
        np.testing.assert_array_equal(back, value)  # integer shares are exact


@QUICK
@given(layout=layouts(dtypes=("float64", "int64")))
def test_partial_shares_are_unequal_and_sum_to_the_value(layout: tuple) -> None:
    value, mesh, _ = layout
    value = value + (value == 0) * 7  # a zero has only equal shares
    nd = (P,) * mesh.ndim
    shards = shard(value, mesh, nd)
    total = sum(shards[r] for r in mesh.ranks)
    if value.dtype.kind == "f":
        np.testing.assert_allclose(total, value, rtol=1e-12, atol=1e-12)
    else:
        np.testing.assert_array_equal(total, value)
    if mesh.size > 1 and value.dtype.kind == "f":
        assert not np.allclose(shards[mesh.ranks[0]], shards[mesh.ranks[1]])


def test_partial_float_shares_follow_the_weights() -> None:
    x = np.array([7.0, -3.5])
    shards = shard(x, placement("cpu", [0, 1]), (P,))
    w = partial_weights(2)
    np.testing.assert_allclose(shards[0], w[0] * x)
    np.testing.assert_allclose(shards[1], w[1] * x)


def test_bool_cannot_be_partial() -> None:
    with pytest.raises(SbpError, match="bool tensor cannot be partial-sum"):
        shard(np.ones(3, bool), placement("cpu", [0, 1]), (P,))


def test_broadcast_copies_that_differ_are_detected() -> None:
    mesh = placement("cpu", [0, 1, 2])
    x = np.arange(6.0).reshape(2, 3)
    shards = shard(x, mesh, (B,))
    shards[2] = shards[2] + 1e-6
    with pytest.raises(SbpError, match="ranks 0 and 2 should hold equal copies under B but differ"):
        assemble(shards, x.shape, mesh, (B,))
    np.testing.assert_array_equal(assemble(shards, x.shape, mesh, (B,), check_broadcast=False), x)


def test_broadcast_mismatch_inside_an_nd_layout_is_detected() -> None:
    mesh = placement("cpu", [[0, 1], [2, 3]])
    x = np.arange(12).reshape(4, 3)
    shards = shard(x, mesh, (S(0), B))
    shards[3] = shards[3].copy()
    shards[3][0, 0] += 1
    with pytest.raises(SbpError, match=r"ranks 2 and 3 should hold equal copies under \(S\(0\), B\)"):
        assemble(shards, x.shape, mesh, (S(0), B))


def test_a_shard_of_the_wrong_shape_is_named() -> None:
    mesh = placement("cpu", [0, 1])
    shards = {0: np.zeros((2, 3)), 1: np.zeros((3, 3))}
    with pytest.raises(
        SbpError, match=r"rank 0 holds shape \(2, 3\) but S\(0\) of \[5, 3\] gives it \[3, 3\]"
    ):
        assemble(shards, (5, 3), mesh, (S(0),))


def test_shards_are_copies() -> None:
    x = np.zeros((4,))
    shards = shard(x, placement("cpu", [0, 1]), (S(0),))
    shards[0][0] = 1.0
    assert x[0] == 0.0
