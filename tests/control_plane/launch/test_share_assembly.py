"""Shares folded in as they come give ``assemble_value``'s value bit for bit, in any arrival order, and a
wrong share raises ``assemble_value``'s error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbpflow.control_plane.launch.share_assembly import ShareAssembly, ShareLayout
from sbpflow.control_plane.launch.step_tracker import StepTracker
from sbpflow.dtype import DType
from sbpflow.errors import SbpError
from sbpflow.graph import TensorDecl
from sbpflow.placement import placement
from sbpflow.sbp import B, NdSbp, P, S, Sbp
from sbpflow.sharding import assemble_value, shard
from sbpflow.tensor_meta import TensorMeta
from sbpflow.v1 import service_pb2 as sp

MESHES: list[Any] = [[0], [3, 1], [0, 1, 2], [[0, 1], [2, 3]], [[5, 4, 3], [2, 1, 0]]]
SBPS_1D: list[Sbp] = [P, B, S(0)]


def _decl(mesh: list, nd: tuple, shape: tuple[int, ...], dtype: DType) -> TensorDecl:
    return TensorDecl("t", TensorMeta(shape, dtype), placement=placement("cpu", mesh), sbp=nd)


def _fold(decl: TensorDecl, shares: dict[int, np.ndarray], order: list[int]) -> np.ndarray:
    a = ShareAssembly(ShareLayout(decl))
    done = [a.add(rank, shares[rank]) for rank in order]
    assert done == [False] * (len(order) - 1) + [True]  # complete exactly at the last share
    return a.value()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_folding_shares_in_any_order_equals_the_whole_assembly_bit_for_bit(data: st.DataObject) -> None:
    mesh = data.draw(st.sampled_from(MESHES))
    ndim = 2 if isinstance(mesh[0], list) else 1
    nd: NdSbp = tuple(data.draw(st.sampled_from(SBPS_1D)) for _ in range(ndim))
    shape = data.draw(st.sampled_from([(), (7,), (5, 3)]))
    if shape == () and any(s == S(0) for s in nd):
        shape = (7,)  # a 0-d tensor cannot be split
    dtype = data.draw(st.sampled_from([DType.float32, DType.float64]))
    decl = _decl(mesh, nd, shape, dtype)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    value = rng.standard_normal(shape).astype(dtype.name) * np.float32(1e3)
    assert decl.placement is not None
    shares = shard(value, decl.placement, nd)
    order = data.draw(st.permutations(sorted(shares)))
    got, want = _fold(decl, shares, order), assemble_value(decl, shares)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_a_1024_rank_partial_sum_loss_is_the_same_double() -> None:
    decl = _decl(list(range(1024)), (P,), (), DType.float64)
    rng = np.random.default_rng(0)
    shares = {r: np.asarray(rng.standard_normal() / 1024) for r in range(1024)}
    order = [int(r) for r in rng.permutation(1024)]
    assert _fold(decl, shares, order).tobytes() == assemble_value(decl, shares).tobytes()


def test_a_share_of_the_wrong_shape_raises_what_assemble_value_raises() -> None:
    decl = _decl([0, 1], (S(0),), (4,), DType.float32)
    shares = {0: np.ones(2, np.float32), 1: np.ones(3, np.float32)}
    with pytest.raises(SbpError) as whole:
        assemble_value(decl, shares)
    a = ShareAssembly(ShareLayout(decl))
    a.add(0, shares[0])
    with pytest.raises(SbpError) as folded:
        a.add(1, shares[1])
    assert str(folded.value) == str(whole.value) and "rank 1 holds shape (3,)" in str(folded.value)


def test_broadcast_copies_that_differ_raise_what_assemble_value_raises() -> None:
    decl = _decl([0, 1], (B,), (), DType.float64)
    shares = {0: np.asarray(1.0), 1: np.asarray(2.0)}
    with pytest.raises(SbpError) as whole:
        assemble_value(decl, shares)
    a = ShareAssembly(ShareLayout(decl))
    a.add(1, shares[1])  # waits for rank 0: nothing to compare yet
    with pytest.raises(SbpError) as folded:
        a.add(0, shares[0])
    assert str(folded.value) == str(whole.value)


def test_a_value_asked_for_before_every_share_is_in_names_the_missing_ranks() -> None:
    a = ShareAssembly(ShareLayout(_decl([0, 1, 2], (P,), (), DType.float32)))
    a.add(1, np.float32(1.0))
    with pytest.raises(SbpError, match=r"ranks \[0, 2\] are missing"):
        a.value()


def test_a_loss_without_sbp_is_refused_by_name() -> None:
    decl = TensorDecl("loss", TensorMeta((), DType.float32), placement=placement("cpu", [0, 1]))
    with pytest.raises(SbpError, match="'loss' has no placement or SBP"):
        ShareLayout(decl)


def test_the_tracker_completes_interleaved_steps_with_the_whole_assemblys_losses() -> None:
    decl = _decl([[0, 1], [2, 3]], (P, B), (), DType.float64)
    seen: list[sp.StepMetrics] = []
    t = StepTracker(decl, 4, seen.append)
    rng = np.random.default_rng(1)
    pl, nd = decl.placement, decl.sbp
    assert pl is not None and nd is not None
    steps = [shard(np.asarray(rng.standard_normal()), pl, nd) for _ in range(5)]
    arrivals = [(s, r) for s in range(5) for r in range(4)]
    for i in rng.permutation(len(arrivals)):  # shares of later steps come before earlier ones end
        s, r = arrivals[i]
        t.add(r, s, steps[s][r])
    assert t.losses == [float(assemble_value(decl, shares)) for shares in steps]
    assert [m.step for m in seen] == [1, 2, 3, 4, 5]
