"""Actors: a function that acts once per iteration on one value of each input register.

An actor acts when every input register holds an unread value for it and every output register has a
free slot (the act condition). It is the unit the plan calls a task: a kernel, a boxing step, a send
or a recv, a data loader, an accumulator. After ``iterations`` acts it is done (end of data).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sbpflow.actor_workers.runtime.errors import ActorGraphError

if TYPE_CHECKING:
    from sbpflow.actor_workers.runtime.register import Register

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
        "in_regs", "acks", "out_regs", "n_out", "stream",
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
        self.stream: Any = None

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
