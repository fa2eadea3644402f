"""Checks an actor graph and links it into run-time actors and registers.

Everything that would make a run hang for certain is rejected here, before any thread starts: a
register id no actor agrees on, a consumer that reads more values than its producer makes (or leaves
more unread than the register has slots), and a cycle of registers with no initial value on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sbpflow.actor_workers.runtime.actors import Actor, ActorSpec, Register, RegisterSpec
from sbpflow.actor_workers.runtime.errors import ActorGraphError


def link(
    actors: Sequence[ActorSpec], registers: Sequence[RegisterSpec]
) -> tuple[list[Actor], list[Register]]:
    """Validate the graph and return its run-time actors and registers, ready for the first act."""
    by_id = _unique("actor", [a.id for a in actors], actors)
    regs = _unique("register", [r.id for r in registers], registers)
    state = {a.id: Actor(a) for a in actors}
    rstate = {r.id: Register(r) for r in registers}
    for a in actors:
        for kind, ids in (("input", a.inputs), ("output", a.outputs)):
            for r in ids:
                if r not in regs:
                    raise ActorGraphError(f"actor {a.name!r}: {kind} register {r} is not among the registers")
    for spec in registers:
        reg = rstate[spec.id]
        producer = by_id.get(spec.producer)
        if producer is None or spec.id not in producer.outputs:
            raise ActorGraphError(
                f"register {spec.id}: producer {spec.producer} does not list it among its outputs"
            )
        reg.producer = state[producer.id]
        with_initial = []
        for c in spec.consumers:
            consumer = by_id.get(c)
            if consumer is None or spec.id not in consumer.inputs:
                raise ActorGraphError(f"register {spec.id}: consumer {c} does not list it among its inputs")
            reg.readers.append((state[c], consumer.inputs.index(spec.id)))
            with_initial.append(spec.id in consumer.initial)
        if any(with_initial) and not all(with_initial):
            raise ActorGraphError(
                f"register {spec.id}: only some consumers have an initial value; a loop edge needs one in "
                "every consumer, or the consumers would read different values at the same iteration"
            )
        _check_balance(spec, producer, [by_id[c] for c in spec.consumers], any(with_initial))
    for a in actors:
        for r in a.inputs:
            if a.id not in regs[r].consumers:
                raise ActorGraphError(f"actor {a.name!r}: input register {r} does not list it as a consumer")
        for r in a.outputs:
            if regs[r].producer != a.id:
                raise ActorGraphError(
                    f"actor {a.name!r}: output register {r} has producer {regs[r].producer}"
                )
            if r in a.inputs and regs[r].count < 2:
                raise ActorGraphError(
                    f"actor {a.name!r} reads and writes register {r} with 1 slot: the act would need a free "
                    "slot while its own input holds it; give the register count 2"
                )
    _check_cycles(actors, regs)
    _prime(list(state.values()), list(rstate.values()), rstate)
    return list(state.values()), list(rstate.values())


def _unique(kind: str, ids: list[int], items: Sequence) -> dict:
    out = dict(zip(ids, items, strict=True))
    if len(out) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ActorGraphError(f"{kind} ids {dup} are used twice")
    return out


def _check_balance(
    spec: RegisterSpec, producer: ActorSpec, consumers: list[ActorSpec], initial: bool
) -> None:
    made = producer.iterations + int(initial)
    for c in consumers:
        unread = made - c.iterations
        if unread < 0:
            raise ActorGraphError(
                f"register {spec.id}: consumer {c.name!r} reads {c.iterations} values but producer "
                f"{producer.name!r} makes {made}; the consumer would wait forever"
            )
        if unread > spec.count:
            raise ActorGraphError(
                f"register {spec.id}: consumer {c.name!r} leaves {unread} of {made} values unread, more "
                f"than the {spec.count} slots; producer {producer.name!r} would wait forever for a slot"
            )


def _check_cycles(actors: Sequence[ActorSpec], regs: dict[int, RegisterSpec]) -> None:
    """Kahn's algorithm over the edges without an initial value: what is left is a cycle."""
    indeg = {a.id: 0 for a in actors}
    succ: dict[int, list[int]] = {a.id: [] for a in actors}
    for a in actors:
        for r in a.inputs:
            if r not in a.initial:
                indeg[a.id] += 1
                succ[regs[r].producer].append(a.id)
    todo = [a for a, d in indeg.items() if d == 0]
    while todo:
        for b in succ[todo.pop()]:
            indeg[b] -= 1
            if indeg[b] == 0:
                todo.append(b)
    stuck = [a.name for a in actors if indeg[a.id] > 0 and a.iterations > 0]
    if stuck:
        raise ActorGraphError(
            f"actors {stuck[:8]} wait on each other in a cycle of registers with no initial value; give the "
            "register at the loop's tail an initial value in its consumer"
        )


def _prime(actors: list[Actor], registers: list[Register], by_id: dict[int, Register]) -> None:
    for a in actors:
        a.in_regs = [by_id[r] for r in a.spec.inputs]
        a.out_regs = [by_id[r] for r in a.spec.outputs]
    for reg in registers:
        reg.boxes = tuple((c, c.inboxes[i]) for c, i in reg.readers)
        initial = [(c, i) for c, i in reg.readers if reg.spec.id in c.spec.initial]
        if initial:  # the initial value occupies a slot until every consumer has read it
            reg.free -= 1
            reg.peak = 1
            reg.pending.append(len(initial))
            for c, i in initial:
                c.inboxes[i].append(c.spec.initial[reg.spec.id])
                reg.last = c.spec.initial[reg.spec.id]
    for a in actors:
        a.missing = sum(1 for box in a.inboxes if not box) + sum(1 for r in a.out_regs if r.free == 0)
