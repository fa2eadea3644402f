"""Pass-through actors bypassed: same values at the consumers, fewer acts, loop edges keep one slot."""

from __future__ import annotations

from sbpflow.actor_workers.execution.bypass import bypass
from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine

STEPS = 5


def _graph() -> tuple[list[ActorSpec], list[RegisterSpec], dict[int, list]]:
    """A variable loop (update 2 -> sink 3 -> source 0) with a pass-through (1) between source and update:
    0 source --r0--> 1 pass --r1--> 2 update --r2--> 3 sink --r3 (loop, initial 10)--> 0."""
    seen: dict[int, list] = {2: [], 3: []}

    def record(i: int):  # type: ignore[no-untyped-def]
        def act(step: int, values: list) -> list:
            seen[i].append(values[0])
            return [values[0] + 1]

        return act

    actors = [
        ActorSpec(0, "source", "compute", (3,), (0,), lambda s, v: [v[0]], STEPS, initial={3: 10}),
        ActorSpec(1, "pass", "compute", (0,), (1,), lambda s, v: [v[0]], STEPS, priority=1),
        ActorSpec(2, "update", "compute", (1,), (2,), record(2), STEPS, priority=2),
        ActorSpec(
            3,
            "sink",
            "compute",
            (2,),
            (3,),
            lambda s, v: (seen[3].append(v[0]), [v[0]])[1],
            STEPS,
            priority=3,
        ),
    ]
    registers = [
        RegisterSpec(0, 0, (1,), 1),
        RegisterSpec(1, 1, (2,), 1),
        RegisterSpec(2, 2, (3,), 1),
        RegisterSpec(3, 3, (0,), 1),
    ]
    return actors, registers, seen


def test_bypassed_actors_hand_the_same_values_on() -> None:
    actors, registers, seen = _graph()
    Engine(actors, registers).run(30)
    want = {k: list(v) for k, v in seen.items()}
    actors, registers, seen = _graph()
    actors, registers = bypass(actors, registers, {0, 1})
    assert sorted(a.id for a in actors) == [2, 3]
    (edge,) = [r for r in registers if r.id == 3]
    assert edge.consumers == (2,) and edge.count == 1  # a loop edge keeps its one slot
    assert dict(next(a for a in actors if a.id == 2).initial) == {3: 10}
    result = Engine(actors, registers).run(30)
    assert seen == want == {2: [10, 11, 12, 13, 14], 3: [11, 12, 13, 14, 15]}
    assert result.acts == 2 * STEPS


def test_a_consumer_that_would_read_one_register_twice_keeps_the_pass_through() -> None:
    actors = [
        ActorSpec(0, "make", "compute", (), (0,), lambda s, v: [s], 3),
        ActorSpec(1, "pass", "compute", (0,), (1,), lambda s, v: [v[0]], 3),
        ActorSpec(2, "both", "compute", (0, 1), (), lambda s, v: [], 3),
    ]
    registers = [RegisterSpec(0, 0, (1, 2), 1), RegisterSpec(1, 1, (2,), 1)]
    kept, regs = bypass(actors, registers, {1})
    assert [a.id for a in kept] == [0, 1, 2] and regs == registers


def test_a_plain_pass_through_adds_its_slots_to_the_input_register() -> None:
    got: list[int] = []
    actors = [
        ActorSpec(0, "make", "compute", (), (0,), lambda s, v: [s], 4),
        ActorSpec(1, "pass", "compute", (0,), (1,), lambda s, v: [v[0]], 4),
        ActorSpec(2, "take", "compute", (1,), (), lambda s, v: got.append(v[0]) or [], 4),
    ]
    registers = [RegisterSpec(0, 0, (1,), 1), RegisterSpec(1, 1, (2,), 2)]
    actors, registers = bypass(actors, registers, {1})
    assert registers == [RegisterSpec(0, 0, (2,), 3)]
    Engine(actors, registers).run(30)
    assert got == [0, 1, 2, 3]


def test_a_source_whose_loop_edge_its_own_reader_writes_is_bypassed_with_two_slots() -> None:
    """A SINK folded into the update (executor_analysis.folded_assigns): the update writes the loop edge
    and, once the source is bypassed, reads it too; the edge takes a second slot (one slot: the act would
    wait for itself) and the update sees each step's value once, in order."""
    seen: list[int] = []
    other: list[int] = []

    def update(step: int, values: list) -> list:
        seen.append(values[0])
        return [values[0] + 1]

    actors = [
        ActorSpec(0, "source", "compute", (1,), (0,), lambda s, v: [v[0]], STEPS, initial={1: 10}),
        ActorSpec(2, "reader", "compute", (0,), (), lambda s, v: other.append(v[0]) or [], STEPS),
        ActorSpec(1, "update", "compute", (0,), (1,), update, STEPS, priority=1),
    ]
    registers = [RegisterSpec(0, 0, (2, 1), 1), RegisterSpec(1, 1, (0,), 1)]
    kept, regs = bypass(actors, registers, {0})
    assert sorted(a.id for a in kept) == [1, 2]
    assert regs == [RegisterSpec(1, 1, (2, 1), 2)]
    result = Engine(kept, regs).run(30)
    assert seen == other == [10, 11, 12, 13, 14] and result.acts == 2 * STEPS
