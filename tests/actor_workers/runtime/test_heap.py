"""The heap left out of the cycle collector's walks while a run goes (heap.py)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

import sbpflow as sf
from sbpflow.actor_workers.runtime import heap
from sbpflow.actor_workers.runtime.engine import Engine
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


def test_a_later_holder_freezes_nothing_more_so_the_last_one_out_frees_what_the_hold_made() -> None:
    with heap.frozen():
        made = _Node()  # made under the hold, alive as the next holder comes
        gone = weakref.ref(made)
        with heap.frozen():
            del made
        assert gone() is not None
    assert gone() is None  # freed by the last holder's collection, no other


def test_an_in_process_run_holds_the_freeze_from_its_build_and_frees_its_cycles_without_a_full_walk() -> None:
    """The launcher holds the heap around the run (its engines inside): the collection as the run ends
    walks only what the run made (the heap before it frozen) and leaves no engine behind."""
    job = load("mlp").make_job(ranks=2, steps=3)
    during: list[tuple[int, bool]] = []
    full_walks: list[int] = []  # generation-2 collections from the first step on, with nothing frozen

    def walked(phase: str, info: dict[str, int]) -> None:
        if during and phase == "start" and info["generation"] == 2 and gc.get_freeze_count() == 0:
            full_walks.append(1)

    gc.callbacks.append(walked)
    try:
        sf.run(
            job,
            backend="inprocess",
            steps=3,
            on_step=lambda m: during.append((heap.holders(), gc.get_freeze_count() > 0)),
        )
        engines = [o for o in gc.get_objects() if type(o) is Engine]
    finally:
        gc.callbacks.remove(walked)
    assert during and all(h == 2 and f for h, f in during), during  # the launcher's hold and the engines'
    assert heap.holders() == 0 and gc.get_freeze_count() == 0
    assert not full_walks and not engines
