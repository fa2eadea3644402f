"""Registers: ``count`` slots between one producer and its consumers, freed by the consumers' acks.

A produced value is offered (req) to every consumer; each consumer acks after its act has read it, and
the slot is free again once every consumer has acked. ``count`` is therefore both the memory quota of
the register and the depth of pipelining between producer and consumers: with 1 slot the producer
cannot run ahead of its slowest consumer by more than one value, with 2 it can work on the next value
while the consumers read the last.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sbpflow.actor_workers.runtime.errors import ActorGraphError

if TYPE_CHECKING:
    from sbpflow.actor_workers.runtime.actor import Actor


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
        "producer",
        "readers",
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
        self.last: Any = None
        self.producer: Actor | None = None
        self.readers: list[tuple[Actor, int]] = []  # (consumer, index of this register in its inputs)
        self.n_readers = len(spec.consumers)

    def live(self) -> int:
        return self.count - self.free
