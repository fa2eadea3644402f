"""A job's curves as its events say them: the steps that count, where each attempt began, the held-out
losses and the learning rate.

A job restarted from a checkpoint (attempt 2, 3 ...) has the step events of every attempt in the store:
attempt 1 may have reached step 212 before it was lost, and attempt 2 resumes the checkpoint of step 200.
The steps that count are the later attempt's from its resume point on, so an attempt's start (a "state"
event with ``attempt`` and ``step`` in its data) drops every step and evaluation after that step, and the
steps it runs come in again. What is left is one point per step.

    c = counted(store.events(job_id))
    c.steps[-1].loss, [(a.attempt, a.step) for a in c.attempts]   # (2, 200): attempt 2 from step 200

The learning rate is not reported by the workers: the schedule is data of the job
(``Job.optimizer.schedule``), so :func:`learning_rates` computes it for the counted steps with
:func:`sbpflow.oracle.optim.learning_rate`, the same function the TensorBoard log uses (the algorithm's
base lr; a parameter group with an lr of its own is scaled alike).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sbpflow.control_plane.store.schema import JobEvent
from sbpflow.job import Job
from sbpflow.oracle.optim import learning_rate


@dataclass(frozen=True)
class StepPoint:
    """One counted step: its loss, throughput, wall time, and when it was recorded (unix seconds)."""

    step: int
    loss: float
    samples_per_second: float
    step_seconds: float
    time: float


@dataclass(frozen=True)
class AttemptStart:
    """Attempt ``attempt`` (2 or more) began from the checkpoint of ``step`` at ``time``."""

    attempt: int
    step: int
    time: float

    @property
    def label(self) -> str:
        return f"attempt {self.attempt} from step {self.step}"


@dataclass(frozen=True)
class Curves:
    """What a job's charts draw, each in step order."""

    steps: tuple[StepPoint, ...]
    attempts: tuple[AttemptStart, ...]  # the restarts, in order (none for a job that never restarted)
    evals: tuple[tuple[int, float], ...]  # (step, held-out loss)


def counted(events: Iterable[JobEvent]) -> Curves:
    """The counted steps, the attempts' starts and the counted evaluations of a job's ``events``."""
    steps: dict[int, StepPoint] = {}
    evals: dict[int, float] = {}
    attempts: list[AttemptStart] = []
    for e in events:
        d = e.data
        if e.kind == "step":
            step = int(d["step"])  # type: ignore[call-overload]
            steps[step] = StepPoint(
                step,
                float(d["loss"]),  # type: ignore[arg-type]
                float(d.get("samples_per_second", 0.0)),  # type: ignore[arg-type]
                float(d.get("step_seconds", 0.0)),  # type: ignore[arg-type]
                e.time,
            )
        elif e.kind == "eval":
            evals[int(d["step"])] = float(d["loss"])  # type: ignore[call-overload, arg-type]
        elif e.kind == "state" and "attempt" in d:
            start = AttemptStart(int(d["attempt"]), int(d.get("step", 0)), e.time)  # type: ignore[call-overload]
            attempts.append(start)
            for kept in (steps, evals):
                for s in [s for s in kept if s > start.step]:  # the lost attempt's, redone from here
                    del kept[s]
    return Curves(tuple(steps[s] for s in sorted(steps)), tuple(attempts), tuple(sorted(evals.items())))


def learning_rates(job: Job | None, steps: Iterable[int]) -> tuple[tuple[int, float], ...]:
    """``(step, lr)`` for each (1-based) ``step``: the rate its update applied; none without an optimizer."""
    if job is None or job.optimizer is None:
        return ()
    return tuple((s, learning_rate(job.optimizer, s - 1)) for s in steps)
