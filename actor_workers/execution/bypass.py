"""Pass-through actors taken out of a rank's graph: their consumers read their input register instead.

A pass-through act hands its one input on unchanged: a boxing step that moves nothing (``P -> B`` on one
device) or the SOURCE of a variable fed by its loop edge (it passes on last step's assign). In the
engine each still costs an act — req, ack, a turn on its stream, ~4 us — for no work; a GPT step has a
hundred of them. Bypassing actor ``p`` (input register ``i``, output registers ``o1..ok``):

* every consumer of an ``oj`` reads ``i`` at the same input position (with ``i``'s initial value, when
  ``i`` is a loop edge), and ``i`` lists them as its consumers in place of ``p``;
* ``i`` keeps the slots that were in flight: its count plus the largest ``oj``'s, except on a loop edge,
  which keeps its one slot — the one-slot edge is what tells a variable's recycler that every reader of
  the value two steps back has acked (:class:`~.tasks.Recycler`). A loop edge written by one of its own
  readers (an update that assigns the variable it reads: :func:`~.executor_analysis.folded_assigns`)
  takes two: the one its act reads and the one it writes; it can only write once the value before the
  one it reads is free, so the recycler's guarantee holds.

An actor is kept when bypassing it would make a consumer read one register twice (it reads ``i`` and
an ``oj``, or two ``oj``) or read what it writes (off a loop edge), or when it has no consumer to hand
on to. The choice is made per rank from
the plan's graph, and only for actors off the ordered (communication) stream, so the collectives keep
their order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec


def bypass(
    actors: Sequence[ActorSpec], registers: Sequence[RegisterSpec], passing: Collection[int]
) -> tuple[list[ActorSpec], list[RegisterSpec]]:
    """``actors`` and ``registers`` without the pass-through actors ``passing`` that can be bypassed."""
    acts = {a.id: a for a in actors}
    regs = {r.id: r for r in registers}
    for pid in passing:
        p = acts.get(pid)
        if p is None or len(p.inputs) != 1 or not p.outputs:
            continue
        i = regs[p.inputs[0]]
        outs = [regs[o] for o in p.outputs]
        readers = [c for o in outs for c in o.consumers]
        others = [c for c in i.consumers if c != pid]
        initial = p.initial.get(i.id)
        looped = i.id in p.initial
        mine = i.producer in readers  # the producer reads what it writes: a loop edge, with 2 slots
        if (
            not readers
            or len(set(readers)) != len(readers)
            or set(readers) & set(others)
            or mine
            and not looped
        ):
            continue
        for o in outs:
            for cid in o.consumers:
                c = acts[cid]
                inputs = tuple(i.id if r == o.id else r for r in c.inputs)
                init = dict(c.initial)
                if looped:
                    init[i.id] = initial
                acts[cid] = dataclasses.replace(c, inputs=inputs, initial=init)
            del regs[o.id]
        count = (max(i.count, 2) if mine else i.count) if looped else i.count + max(o.count for o in outs)
        regs[i.id] = RegisterSpec(i.id, i.producer, (*others, *readers), count)
        del acts[pid]
    return list(acts.values()), list(regs.values())
