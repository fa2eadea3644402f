"""What only the in-process transport has: its rendezvous (a missing peer makes the round give up, and a
late peer learns so at once; a member's failing kernel fails the round for all) and the world's lifecycle.
The contract itself, which this transport keeps like every other, is tests/.../test_conformance.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sbpflow.actor_workers.transport.base import Transport, TransportError
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.errors import SbpflowError
from tests.actor_workers.transport.worlds import spmd, values

pytestmark = pytest.mark.usefixtures("no_leftover_threads")


def test_a_round_a_peer_missed_gives_up_and_the_late_peer_learns_it_at_once() -> None:
    world = InProcessWorld(range(3), timeout=0.2)
    ts = {r: world.transport(r) for r in world.ranks}
    out = spmd(ts, lambda t: t.all_reduce(np.zeros(2), (0, 1, 2), "task-17"), ranks=[0, 1])
    messages = [str(out[r]) for r in (0, 1)]
    assert any("rank(s) [2] did not reach" in m and "'task-17'" in m for m in messages), messages
    start = time.monotonic()
    with pytest.raises(TransportError, match="gave up"):
        ts[2].all_reduce(np.zeros(2), (0, 1, 2), "task-17")
    # "gave up" is the failed round's word (its own timeout would say "did not reach"); the bound is slack
    assert time.monotonic() - start < 5


def test_a_failing_kernel_of_one_member_fails_the_round_for_all() -> None:
    world = InProcessWorld([0, 1], timeout=5)
    ts = {r: world.transport(r) for r in world.ranks}
    arrays = {0: np.zeros((4, 2)), 1: np.zeros((3, 2))}  # the gather axis differs, the other axis agrees
    out = values(spmd(ts, lambda t: t.all_gather(arrays[t.rank], (0, 1), 0, "ok")))
    assert out[0].shape == (7, 2)
    out = spmd(ts, lambda t: t.all_gather(arrays[t.rank], (0, 1), 1, "bad"))
    assert all(isinstance(out[r], TransportError) and "does not match" in str(out[r]) for r in (0, 1))


def test_world_and_transport_lifecycle() -> None:
    with pytest.raises(TransportError, match="distinct"):
        InProcessWorld([0, 0])
    with pytest.raises(TransportError, match="not in this world"):
        InProcessWorld([0, 1]).transport(2)
    with InProcessWorld([0, 1]) as world:
        t = world.transport(0)
        assert isinstance(t, Transport) and t.rank == 0 and world.transport(0) is t
        single = t.all_reduce(np.arange(3), (0,), "alone")  # a group of one is a copy
        np.testing.assert_array_equal(single, np.arange(3))
    with pytest.raises(TransportError, match="closed"):
        t.send(np.zeros(1), 1, "x")
    assert issubclass(TransportError, SbpflowError)
