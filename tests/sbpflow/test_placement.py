"""Placements: 1-d and n-d rank grids, mesh coordinates, printing, equality."""

from __future__ import annotations

import numpy as np
import pytest

from sbpflow.errors import PlacementError
from sbpflow.placement import Placement, placement


def test_one_d() -> None:
    p = placement("cpu", [0, 1, 2, 3])
    assert (p.device_type, p.ranks, p.shape, p.ndim, p.size) == ("cpu", (0, 1, 2, 3), (4,), 1, 4)
    assert p.coords() == [(0,), (1,), (2,), (3,)]
    assert repr(p) == "placement(type='cpu', ranks=[0, 1, 2, 3])"


def test_two_by_two_is_row_major() -> None:
    p = placement("cuda", [[0, 1], [2, 3]])
    assert (p.shape, p.ndim, p.size) == ((2, 2), 2, 4)
    assert [p.coord_of(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.rank_at(c) for c in p.coords()] == [0, 1, 2, 3]
    assert repr(p) == "placement(type='cuda', ranks=[[0, 1], [2, 3]])"
    assert p.grid() == [[0, 1], [2, 3]]


def test_coordinates_follow_the_ranks_not_their_values() -> None:
    p = placement("cpu", [[7, 5, 3], [6, 4, 2]])
    assert p.coord_of(7) == (0, 0) and p.coord_of(4) == (1, 1) and p.coord_of(2) == (1, 2)
    for rank in p.ranks:
        assert p.rank_at(p.coord_of(rank)) == rank
    with pytest.raises(PlacementError, match="rank 0 is not in placement"):
        p.coord_of(0)


def test_three_d_grid_round_trips() -> None:
    ranks = np.arange(8).reshape(2, 2, 2).tolist()
    p = placement("cpu", ranks)
    assert p.shape == (2, 2, 2) and p.grid() == ranks and p.coord_of(5) == (1, 0, 1)


def test_single_rank_and_range() -> None:
    assert placement("cpu", 3) == Placement("cpu", (3,), (1,))
    assert placement("cpu", range(3)) == placement("cpu", [0, 1, 2])
    assert placement().ranks == (0,)


def test_equality_and_hash() -> None:
    a, b = placement("cpu", [[0, 1], [2, 3]]), placement("cpu", [[0, 1], [2, 3]])
    assert a == b and hash(a) == hash(b)
    assert a != placement("cpu", [0, 1, 2, 3]), "same ranks, different mesh"
    assert a != placement("cuda", [[0, 1], [2, 3]])
    assert a != placement("cpu", [[0, 2], [1, 3]])
    assert len({a, b, placement("cpu", [0, 1, 2, 3])}) == 2


def test_direct_construction_checks_the_mesh_size() -> None:
    with pytest.raises(PlacementError, match=r"mesh shape \(2, 2\) holds 4 ranks but 3 were given"):
        Placement("cpu", (0, 1, 2), (2, 2))
    with pytest.raises(PlacementError, match="non-empty with positive sizes"):
        Placement("cpu", (), ())


def test_rank_at_refuses_coordinates_outside_the_mesh() -> None:
    p = placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(PlacementError):
        p.rank_at((0, 2))  # today: 2, the rank at (1, 0)
    with pytest.raises(PlacementError):
        p.rank_at((1, -1))  # today: 1


def test_numpy_integer_ranks_are_accepted() -> None:
    assert placement("cpu", list(np.arange(2))).ranks == (0, 1)
