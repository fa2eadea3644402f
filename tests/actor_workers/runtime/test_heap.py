"""The heap left out of the cycle collector's walks while a run's steps go (heap.py)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

import sbpflow as sf
from sbpflow.actor_workers.runtime import heap
from tests.examples.test_examples import load


class _Node:
    def __init__(self) -> None:
        self.other: object = self  # a cycle: only the collector frees it


def test_what_is_alive_at_the_start_is_frozen_and_thawed_after() -> None:
    assert heap.holders() == 0 and gc.get_freeze_count() == 0
    before = _Node()
    with heap.frozen():
        assert heap.holders() == 1
        assert gc.get_freeze_count() > 0
        assert gc.is_tracked(before)
    assert heap.holders() == 0 and gc.get_freeze_count() == 0


def test_a_cycle_the_run_makes_and_drops_is_freed_by_its_end() -> None:
    with heap.frozen():
        made = _Node()
        gone = weakref.ref(made)
        del made
    assert gone() is None


def test_a_cycle_alive_at_the_freeze_is_freed_after_the_last_holder_leaves() -> None:
    old = _Node()
    gone = weakref.ref(old)
    with heap.frozen():
        del old
        gc.collect()
        assert gone() is not None  # frozen: no walk sees it
    gc.collect()
    assert gone() is None


def test_overlapping_holders_keep_the_freeze_until_the_last_one_leaves() -> None:
    entered, release = threading.Barrier(2), threading.Event()
    seen: list[int] = []

    def hold() -> None:
        with heap.frozen():
            entered.wait(10)
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    with heap.frozen():
        entered.wait(10)
        seen.append(heap.holders())
    seen.append(gc.get_freeze_count())  # the other still holds
    release.set()
    t.join(10)
    assert seen[0] == 2 and seen[1] > 0
    assert heap.holders() == 0 and gc.get_freeze_count() == 0


def test_a_failing_block_still_thaws_the_heap() -> None:
    with pytest.raises(RuntimeError, match="boom"), heap.frozen():
        raise RuntimeError("boom")
    assert heap.holders() == 0 and gc.get_freeze_count() == 0


def test_an_in_process_run_holds_the_freeze_during_its_steps_only() -> None:
    job = load("mlp").make_job(ranks=2, steps=3)
    during: list[tuple[int, bool]] = []
    sf.run(
        job,
        backend="inprocess",
        steps=3,
        on_step=lambda m: during.append((heap.holders(), gc.get_freeze_count() > 0)),
    )
    assert during and all(h == 1 and f for h, f in during), during
    assert heap.holders() == 0 and gc.get_freeze_count() == 0
