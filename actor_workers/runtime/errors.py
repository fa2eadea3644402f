"""The errors of the actor engine: a malformed actor graph, and a run that failed, was aborted or timed out."""

from __future__ import annotations

from sbpflow.errors import SbpflowError


class ActorGraphError(SbpflowError, ValueError):
    """Actors and registers that cannot run: a dangling register id, unbalanced iterations, a cycle."""


class RuntimeAborted(SbpflowError):
    """The cause of a failure that came from outside: ``Engine.abort`` or a failed peer of a group."""


class RuntimeFailure(SbpflowError):
    """A run that stopped early: the rank, the actor (its name and op) and the cause.

    ``actor`` and ``op`` are None when no actor failed (an abort from outside, a timeout). The cause is
    also chained as ``__cause__``, so the traceback of the failing act is printed with this error.
    """

    def __init__(
        self,
        rank: int | None,
        actor: str | None,
        op: str | None,
        cause: BaseException,
        iteration: int | None = None,
    ) -> None:
        super().__init__(rank, actor, op, cause, iteration)
        self.rank = rank
        self.actor = actor
        self.op = op
        self.cause = cause
        self.iteration = iteration
        self.__cause__ = cause

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "engine group"
        if self.actor is not None:
            op = f" (op {self.op})" if self.op else ""
            at = f" at iteration {self.iteration}" if self.iteration is not None else ""
            where += f": actor {self.actor!r}{op} failed{at}"
        return f"{where}: {type(self.cause).__name__}: {self.cause}"


class RuntimeTimeout(RuntimeFailure):
    """A run that did not finish within its timeout; the cause lists the stalled actors and what they wait for."""


class RunCancelled(SbpflowError):
    """A run stopped because its cancel event was set (a user's Cancel); the message is the reason."""
