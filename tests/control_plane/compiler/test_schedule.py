"""The pipeline schedule value: exact 1F1B and GPipe orders, micro-batches in flight, the buffer rule,
and a global timeline that respects every stage's order and the data dependencies."""

from __future__ import annotations

import pytest

from sbpflow.control_plane.compiler.schedule import Action, Phase, build
from sbpflow.job import PipelineSchedule

ONE_F_ONE_B, GPIPE = PipelineSchedule.one_f_one_b, PipelineSchedule.gpipe


def acts(text: str) -> tuple[Action, ...]:
    return tuple(Action(Phase(a[0]), int(a[1:])) for a in text.split())


def test_1f1b_two_stages_four_micro_batches() -> None:
    s = build(ONE_F_ONE_B, 2, 4)
    assert s.per_stage == (acts("F0 F1 B0 F2 B1 F3 B2 B3"), acts("F0 B0 F1 B1 F2 B2 F3 B3"))
    assert str(s).splitlines() == [
        "1f1b schedule, 2 stage(s) x 4 micro-batch(es)",
        "  stage 0: F0 F1 B0 F2 B1 F3 B2 B3",
        "  stage 1: F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_gpipe_two_stages_four_micro_batches() -> None:
    s = build(GPIPE, 2, 4)
    assert s.per_stage == (acts("F0 F1 F2 F3 B0 B1 B2 B3"),) * 2


@pytest.mark.parametrize("stages, m", [(1, 1), (1, 4), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_in_flight_is_stages_minus_index_under_1f1b_and_all_under_gpipe(stages: int, m: int) -> None:
    one, gp = build(ONE_F_ONE_B, stages, m), build(GPIPE, stages, m)
    assert [one.in_flight(s) for s in range(stages)] == [min(stages - s, m) for s in range(stages)]
    assert [gp.in_flight(s) for s in range(stages)] == [m] * stages
    for sched in (one, gp):  # every stage runs every micro-batch once each way, F before B
        for row in sched.per_stage:
            assert sorted(row) == sorted(acts(" ".join(f"F{k} B{k}" for k in range(m))))
            assert all(row.index(Action(Phase.F, k)) < row.index(Action(Phase.B, k)) for k in range(m))


@pytest.mark.parametrize("kind", [ONE_F_ONE_B, GPIPE])
@pytest.mark.parametrize("stages, m", [(2, 4), (4, 8), (3, 3)])
def test_timeline_respects_each_stage_and_the_data_flow(kind: PipelineSchedule, stages: int, m: int) -> None:
    s = build(kind, stages, m)
    line = s.timeline()
    assert len(line) == 2 * stages * m
    for st in range(stages):
        assert tuple(a for x, a in line if x == st) == s.per_stage[st]
    at = {x: i for i, x in enumerate(line)}
    for st in range(stages):
        for k in range(m):
            f, b = Action(Phase.F, k), Action(Phase.B, k)
            if st:
                assert at[(st - 1, f)] < at[(st, f)]
            if st < stages - 1:
                assert at[(st + 1, b)] < at[(st, b)]


def test_buffer_rule() -> None:
    s = build(ONE_F_ONE_B, 4, 8)
    assert s.buffers(0, 1, Phase.F) == 1 and s.buffers(0, 3, Phase.F) == 3  # b - a across stages
    assert [s.buffers(k, k, Phase.F) for k in range(4)] == [4, 3, 2, 1]  # kept for backward: S - s
    assert s.buffers(3, 2, Phase.B) == 1
    assert build(GPIPE, 4, 8).buffers(1, 1, Phase.F) == 8


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least|>= 1"):
        build(ONE_F_ONE_B, 0, 4)
