"""Actors and the registers between them: the nodes and edges of an engine's graph.

An actor is a function that acts once per iteration on one value of each input register. It acts when
every input register holds an unread value for it and every output register has a free slot (the act
condition). It is the unit the plan calls a task: a kernel, a boxing step, a send or a recv, a data
loader, an accumulator. After ``iterations`` acts it is done (end of data).

A register has ``count`` slots between one producer and its consumers, freed by the consumers' acks. A
produced value is offered (req) to every consumer; each consumer acks after its act has read it, and
the slot is free again once every consumer has acked. ``count`` is therefore both the memory quota of
the register and the depth of pipelining between producer and consumers: with 1 slot the producer
cannot run ahead of its slowest consumer by more than one value, with 2 it can work on the next value
while the consumers read the last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sbpflow.actor_workers.runtime.errors import ActorGraphError

ActFn = Callable[[int, list[Any]], Any]  # (iteration, input values in order) -> one value per output


@dataclass(frozen=True, slots=True)
class ActorSpec:
    """One actor of an engine.

    ``initial`` gives, for an input register that is the tail of a loop edge (a variable store fed by
    its own update), the value read by the first act. Among ready actors of one stream the lowest
    ``(priority, iteration, id)`` acts first: priorities carry the plan's order. ``op`` names the op in
    failure reports and ``trace_args`` (e.g. the micro-batch) go into the Chrome trace.
    """

    id: int
    name: str
    stream: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    act: ActFn
    iterations: int
    initial: Mapping[int, Any] = field(default_factory=dict)
    priority: int = 0
    op: str = ""
    trace_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.iterations < 0:
            raise ActorGraphError(f"actor {self.name!r}: iterations {self.iterations} < 0")
        for kind, regs in (("inputs", self.inputs), ("outputs", self.outputs)):
            if len(set(regs)) != len(regs):
                raise ActorGraphError(f"actor {self.name!r}: {kind} {regs} repeat a register")
        extra = set(self.initial) - set(self.inputs)
        if extra:
            raise ActorGraphError(
                f"actor {self.name!r}: initial values for registers {sorted(extra)} that are not among its "
                f"inputs {self.inputs}; initial is only for the tail of a loop edge"
            )


class Actor:
    """The run-time state of an actor. Only touched under the engine's lock, except ``act``."""

    __slots__ = (
        "spec", "id", "name", "act", "iterations", "priority", "it", "missing", "busy", "inboxes",
        "in_regs", "acks", "out_regs", "n_out", "stream", "stream_name",
    )  # fmt: skip

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.id = spec.id
        self.name = spec.name
        self.act = spec.act
        self.iterations = spec.iterations
        self.priority = spec.priority
        self.it = 0  # the next iteration to act on
        # inputs without an unread value + outputs without a free slot; the actor is ready at 0
        self.missing = 0
        self.busy = False  # queued on its stream or acting
        self.inboxes: list[deque[Any]] = [deque() for _ in spec.inputs]  # req'd values, oldest first
        self.in_regs: list[Register] = []
        self.acks = [0] * len(spec.inputs)  # values acked per input: the index of the next value to read
        self.out_regs: list[Register] = []
        self.n_out = len(spec.outputs)
        self.stream: Any = None  # the engine's _Stream whose thread runs it
        self.stream_name = spec.stream  # the stream it counts and traces as (``busy``)

    def waits_for(self) -> str:
        """What keeps this actor from acting, for a stall report."""
        empty = [r.spec.id for r, box in zip(self.in_regs, self.inboxes, strict=True) if not box]
        full = [r.spec.id for r in self.out_regs if r.free == 0]
        parts = []
        if empty:
            parts.append(f"input registers {empty} (no value yet)")
        if full:
            parts.append(f"output registers {full} (all slots wait for acks)")
        return " and ".join(parts) if parts else "its turn on the stream"


@dataclass(frozen=True, slots=True)
class RegisterSpec:
    """A register: produced by actor ``producer``, read by each of ``consumers``, ``count`` slots."""

    id: int
    producer: int
    consumers: tuple[int, ...]
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ActorGraphError(f"register {self.id}: count {self.count} < 1; a register needs a slot")
        if len(set(self.consumers)) != len(self.consumers):
            raise ActorGraphError(f"register {self.id}: consumers {self.consumers} repeat an actor")


class Register:
    """The run-time state of a register. Only touched under the engine's lock."""

    __slots__ = (
        "spec",
        "count",
        "free",
        "pending",
        "freed",
        "peak",
        "last",
        "keep",
        "producer",
        "readers",
        "boxes",
        "n_readers",
    )

    def __init__(self, spec: RegisterSpec) -> None:
        self.spec = spec
        self.count = spec.count
        self.free = spec.count
        # acks still outstanding for each live value, oldest first; values are freed in order because
        # every consumer reads and acks them in order
        self.pending: deque[int] = deque()
        self.freed = 0  # values freed so far: the index of pending[0]
        self.peak = 0
        self.last: Any = None  # the newest value, only where ``keep`` (the engine's ``keep_last``)
        self.keep = False
        self.producer: Actor | None = None
        self.readers: list[tuple[Actor, int]] = []  # (consumer, index of this register in its inputs)
        self.boxes: tuple[tuple[Actor, deque[Any]], ...] = ()  # (consumer, its inbox for this register)
        self.n_readers = len(spec.consumers)

    def live(self) -> int:
        return self.count - self.free
