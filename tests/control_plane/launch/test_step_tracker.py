"""The step tracker times steps by when the ranks ended them, not by when their reports arrived."""

from __future__ import annotations

import time

import pytest

from sbpflow.control_plane.launch.step_tracker import StepTracker
from sbpflow.dtype import DType
from sbpflow.graph import TensorDecl
from sbpflow.placement import placement
from sbpflow.sbp import P
from sbpflow.tensor_meta import TensorMeta
from sbpflow.v1 import service_pb2 as sp

LOSS = TensorDecl("loss", TensorMeta((), DType.float32), placement=placement("cpu", [0, 1]), sbp=(P,))


def test_a_batch_of_reports_arriving_at_once_keeps_each_steps_own_duration() -> None:
    seen: list[sp.StepMetrics] = []
    t = StepTracker(LOSS, 8, seen.append)
    t.restart_clock()
    start = time.time()
    ended = [start + 0.5, start + 0.75, start + 1.75]  # the ranks' clocks: 0.5 s, 0.25 s, 1 s a step
    for rank in (0, 1):  # a whole second's batch from each rank, delivered now
        for step, at in enumerate(ended):
            t.add(rank, step, 0.25, at=at - 0.01 * rank)  # the step ends when its last rank does
    assert [m.step for m in seen] == [1, 2, 3] and t.losses == [0.5, 0.5, 0.5]
    assert [m.step_seconds for m in seen] == pytest.approx([0.5, 0.25, 1.0], abs=0.05)
    assert seen[-1].samples_per_second == pytest.approx(8 * 3 / 1.75, rel=0.05)


def test_a_rank_clock_behind_the_last_step_never_gives_a_negative_duration() -> None:
    seen: list[sp.StepMetrics] = []
    t = StepTracker(LOSS, 8, seen.append)
    now = time.time()
    for rank in (0, 1):
        t.add(rank, 0, 1.0, at=now + 1.0)
    for rank in (0, 1):
        t.add(rank, 1, 1.0, at=now + 0.5)  # skewed clocks
    assert [m.step_seconds >= 0 for m in seen] == [True, True]
