"""SBP values: how they print and parse, normalise to nd-SBPs, compare and hash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbpflow import sbp
from sbpflow.errors import SbpError
from sbpflow.sbp import B, Broadcast, P, PartialSum, S, Split, as_nd, check_axes, format_nd, parse

sbps = st.one_of(st.integers(0, 12).map(S), st.just(B), st.just(P))


def test_repr_is_the_notation() -> None:
    assert (repr(S(0)), repr(S(12)), repr(B), repr(P)) == ("S(0)", "S(12)", "B", "P")
    assert str(S(1)) == "S(1)"


def test_user_spellings_are_the_same_values() -> None:
    assert sbp.split(2) == S(2) and sbp.broadcast is B and sbp.partial_sum is P


@settings(max_examples=20, deadline=None)
@given(s=sbps)
def test_parse_inverts_repr(s: Split | Broadcast | PartialSum) -> None:
    assert parse(repr(s)) == s
    assert parse(f"  {s!r} ") == s


@pytest.mark.parametrize("text", ["", "S", "S()", "S(-1)", "S(x)", "b", "R", "S(0) B", "P()"])
def test_parse_refuses_anything_else_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(SbpError, match=r"expected one of 'S\(<axis>\)', 'B', 'P'"):
        parse(text)


def test_values_compare_and_hash_by_content() -> None:
    assert S(0) == Split(0) and S(0) != S(1) and S(0) != B and B != P
    assert Broadcast() == B and PartialSum() == P
    assert len({S(0), Split(0), S(1), B, Broadcast(), P, PartialSum()}) == 4
    assert {S(1): "x"}[Split(1)] == "x"


def test_values_are_frozen() -> None:
    with pytest.raises(AttributeError):
        S(0).axis = 1  # type: ignore[misc]


@pytest.mark.parametrize("bad", [-1, 1.0, "0", True, None])
def test_split_axis_must_be_a_non_negative_int(bad: object) -> None:
    with pytest.raises(SbpError, match="non-negative int"):
        Split(bad)  # type: ignore[arg-type]


def test_as_nd_repeats_a_single_sbp_per_mesh_axis() -> None:
    assert as_nd(S(0), 1) == (S(0),)
    assert as_nd(B, 3) == (B, B, B)
    assert as_nd([S(1), P], 2) == (S(1), P)
    assert as_nd((P, B), 2) == (P, B)


def test_as_nd_refuses_wrong_length_and_non_sbps() -> None:
    with pytest.raises(SbpError, match="has 1 entries but the placement has 2 mesh axes"):
        as_nd([S(0)], 2)
    with pytest.raises(SbpError, match="'S\\(0\\)' is not an SBP"):
        as_nd(["S(0)"], 1)  # type: ignore[list-item]


def test_format_nd() -> None:
    assert format_nd((S(0),)) == "S(0)"
    assert format_nd((S(0), B)) == "(S(0), B)"
    assert format_nd((P, P, S(2))) == "(P, P, S(2))"


def test_check_axes_accepts_axes_in_range() -> None:
    check_axes((S(0), S(2), B, P), 3)
    with pytest.raises(SbpError, match="S\\(3\\) splits axis 3 of x, which has only 3 axes"):
        check_axes((B, S(3)), 3, "x")
