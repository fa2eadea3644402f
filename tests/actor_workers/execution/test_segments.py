"""A run in segments: cut after every multiple of ``eval_every`` (counted from the job's start, so a
resumed run cuts where the whole run would), one segment without an evaluation; bad settings refused."""

from __future__ import annotations

import time

import pytest

from sbpflow.actor_workers.execution.segments import Clock, Evaluation, first_steps, segments
from sbpflow.v1 import plan_pb2 as pp


def every(n: int) -> Evaluation:
    return Evaluation(pp.Plan(), n, 1)


@pytest.mark.parametrize(
    ("first", "steps", "ev", "want"),
    [
        (0, 4, None, [(0, 4, False)]),
        (0, 4, every(2), [(0, 2, True), (2, 2, True)]),
        (0, 5, every(2), [(0, 2, True), (2, 2, True), (4, 1, False)]),
        (3, 4, every(2), [(3, 1, True), (4, 2, True), (6, 1, False)]),  # resumed at step 3
        (0, 3, every(5), [(0, 3, False)]),
        (0, 3, every(1), [(0, 1, True), (1, 1, True), (2, 1, True)]),
    ],
)
def test_segments_end_at_the_evaluated_steps(
    first: int, steps: int, ev: Evaluation | None, want: list[tuple[int, int, bool]]
) -> None:
    assert segments(first, steps, ev) == want
    assert sum(n for _, n, _ in want) == steps and first_steps(first, steps, ev) == want[0][1]


def test_an_evaluation_needs_a_period_and_batches() -> None:
    with pytest.raises(ValueError, match="give both >= 1"):
        Evaluation(pp.Plan(), 0, 1)
    with pytest.raises(ValueError, match="give both >= 1"):
        Evaluation(pp.Plan(), 2, 0)


def test_the_clock_gives_the_first_segment_the_whole_timeout_and_later_ones_what_is_left() -> None:
    left = Clock(5.0)
    assert left() == 5.0
    time.sleep(0.05)
    assert 4.0 < left() < 4.96
