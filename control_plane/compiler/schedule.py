"""The pipeline schedule as a value: per stage, the ordered (F|B, micro-batch) actions of one step.

``build(kind, stages, micro_batches)`` gives

* **1F1B** (PipeDream-flush, Megatron's default): stage ``s`` of ``S`` first runs ``min(S - s, M)``
  forwards (warm-up), then alternates one backward and one forward until its forwards are done, then runs
  the remaining backwards (cool-down). At most ``S - s`` micro-batches are in flight on stage ``s``, so
  the activations it keeps for backward are bounded by the stage count, not by ``M``.
* **GPipe**: every stage runs all its forwards, then all its backwards: ``M`` micro-batches in flight.

For 2 stages x 4 micro-batches::

    1F1B   stage 0: F0 F1 B0 F2 B1 F3 B2 B3        GPipe  stage 0: F0 F1 F2 F3 B0 B1 B2 B3
           stage 1: F0 B0 F1 B1 F2 B2 F3 B3               stage 1: F0 F1 F2 F3 B0 B1 B2 B3

``Schedule.timeline()`` interleaves the stages into ONE global order that respects each stage's order and
the data dependencies (``F(s, k)`` after ``F(s-1, k)``; ``B(s, k)`` after ``B(s+1, k)``), by simulating
unit-time ticks. Lowering emits tasks and communicator steps in that order, so the order on both sides of
every stage-to-stage channel is the same by construction and ``comm_order.check`` can prove it.

The pipeline buffer rule (ARCHITECTURE.md, OneFlow's): a forward edge from stage ``a`` to ``b`` needs
``b - a`` buffers on the consumer side, an activation kept for the backward of stage ``s`` one per
micro-batch in flight there (:meth:`Schedule.in_flight`), a backward edge one. :meth:`Schedule.buffers`
states it; lowering's per-micro-batch registers realise it (tests count the live ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cache

from sbpflow.job import PipelineSchedule


class Phase(StrEnum):
    F = "F"
    B = "B"


@dataclass(frozen=True, order=True)
class Action:
    phase: Phase
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.phase.value}{self.micro_batch}"


@dataclass(frozen=True)
class Schedule:
    kind: PipelineSchedule
    stages: int
    micro_batches: int
    per_stage: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        head = f"{self.kind.value} schedule, {self.stages} stage(s) x {self.micro_batches} micro-batch(es)"
        rows = [f"  stage {s}: {' '.join(map(repr, acts))}" for s, acts in enumerate(self.per_stage)]
        return "\n".join([head, *rows])

    def in_flight(self, stage: int) -> int:
        """The most micro-batches forwarded but not yet backwarded on ``stage`` at once."""
        live = peak = 0
        for a in self.per_stage[stage]:
            live += 1 if a.phase is Phase.F else -1
            peak = max(peak, live)
        return peak

    def buffers(self, producer_stage: int, consumer_stage: int, phase: Phase) -> int:
        """Registers the buffer rule gives an edge: forward across stages ``b - a``, an activation kept
        within a stage for its backward the micro-batches in flight there, a backward edge 1."""
        if phase is Phase.B:
            return 1
        if consumer_stage > producer_stage:
            return consumer_stage - producer_stage
        return self.in_flight(producer_stage)

    def timeline(self) -> tuple[tuple[int, Action], ...]:
        return _timeline(self)


@cache
def build(kind: PipelineSchedule, stages: int, micro_batches: int) -> Schedule:
    """The schedule of ``kind``; ``micro_batches < stages`` under 1F1B degenerates to GPipe (the compiler
    pass refuses it; lowering a hand-made graph tolerates it)."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"a schedule needs >= 1 stage and micro-batch, got {stages} x {micro_batches}")
    make = _one_f_one_b if kind is PipelineSchedule.one_f_one_b else _gpipe
    return Schedule(kind, stages, micro_batches, tuple(make(s, stages, micro_batches) for s in range(stages)))


def _gpipe(stage: int, stages: int, m: int) -> tuple[Action, ...]:
    return tuple(Action(Phase.F, k) for k in range(m)) + tuple(Action(Phase.B, k) for k in range(m))


def _one_f_one_b(stage: int, stages: int, m: int) -> tuple[Action, ...]:
    warm = min(stages - stage, m)
    out = [Action(Phase.F, k) for k in range(warm)]
    for k in range(m - warm):  # steady state: free one micro-batch, admit the next
        out += [Action(Phase.B, k), Action(Phase.F, warm + k)]
    out += [Action(Phase.B, k) for k in range(m - warm, m)]
    return tuple(out)


@cache
def _timeline(s: Schedule) -> tuple[tuple[int, Action], ...]:
    """Ticks of unit time: each stage runs its next action once its inputs were made in an earlier tick;
    in a tick, backwards from the first stage up, then forwards from the last stage down."""
    done: set[tuple[int, Action]] = set()
    nxt = [0] * s.stages
    out: list[tuple[int, Action]] = []
    total = sum(len(a) for a in s.per_stage)
    while len(out) < total:
        tick = []
        for st in range(s.stages):
            if nxt[st] == len(s.per_stage[st]):
                continue
            a = s.per_stage[st][nxt[st]]
            dep = (st - 1, a) if a.phase is Phase.F else (st + 1, a)
            if 0 <= dep[0] < s.stages and dep not in done:
                continue
            tick.append((st, a))
        if not tick:  # cannot happen for the schedules above; a guard against a bad hand-made one
            raise ValueError(f"schedule deadlocks after {out[-3:]}: {s}")
        for st, _ in tick:
            nxt[st] += 1
        done.update(tick)
        # within a tick the actions are independent; this order lets a consumer take its input before the
        # producer's next micro-batch arrives, so an edge holds no more buffers than the rule gives it
        out += sorted(tick, key=lambda x: (0, x[0]) if x[1].phase is Phase.B else (1, -x[0]))
    return tuple(out)
