"""``sf.run(job)``: compile a job and train it on the actor runtime, returning what the reference returns.

    result = sf.run(job, backend="inprocess", return_parameters=True)
    result.losses        # one float per step (the loss averaged over the step's micro-batches)
    result.parameters    # logical (gathered) parameter values after the last step, by name

``backend="inprocess"`` runs every rank as threads of this process over the in-process transport: the
test vehicle and the fastest embedded mode. ``backend="ray"`` (one Ray worker actor per device) is
issue 5.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any

from sbpflow.errors import SbpflowError
from sbpflow.job import Job

BACKENDS = ("inprocess", "ray")


@dataclass(frozen=True)
class RunResult:
    """Per step, the loss; on request, every parameter's final logical value and the act trace
    (``sbpflow.actor_workers.runtime.chrome_trace(result.trace)`` makes it viewable in Perfetto)."""

    losses: list[float]
    parameters: dict[str, Any] | None = None
    trace: list[Any] | None = None
    seconds: float = 0.0  # wall time of the run, compile excluded


def run(
    job: Job,
    backend: str = "inprocess",
    steps: int | None = None,
    return_parameters: bool = False,
    trace: bool = False,
    timeout: float = 600.0,
) -> RunResult:
    """Compile ``job`` and train it for ``steps`` (default ``job.config.steps``).

    A failing kernel, a shape error or a transport failure on any rank stops every rank and raises
    :class:`~sbpflow.actor_workers.runtime.RuntimeFailure` naming the rank, the op and the cause; a run
    that does not finish within ``timeout`` seconds raises its RuntimeTimeout subclass with the actors
    that stalled.
    """
    if backend == "ray":
        raise NotImplementedError(
            "backend='ray' (one Ray worker actor per device) is issue 5 and not implemented yet; "
            "use backend='inprocess'"
        )
    if backend != "inprocess":
        raise SbpflowError(f"backend={backend!r} is unknown; use one of {BACKENDS}")
    from sbpflow.actor_workers.runtime import executor
    from sbpflow.actor_workers.transport import InProcessWorld
    from sbpflow.control_plane.compiler import pipeline

    steps = job.config.steps if steps is None else steps
    if steps < 1:
        raise SbpflowError(f"steps={steps}: a run trains for at least one step")
    compiled = pipeline.compile(job)
    skipped = [n for n in compiled.notes if "asks for it" in n or "lowering skipped" in n]
    if compiled.plan is None or skipped:
        raise SbpflowError(
            f"job {job.name!r} cannot run: " + "; ".join(skipped or compiled.notes or ["no plan was made"])
        )
    ranks = [d.rank for d in compiled.plan.devices]
    with InProcessWorld(ranks, timeout=timeout) as world:
        program = executor.build(
            compiled.plan,
            steps,
            {r: world.transport(r) for r in ranks},
            job=dataclasses.replace(compiled.state.job, graph=compiled.state.graph),
            boxings=compiled.state.boxings,
        )
        results = executor.execute(program, timeout, trace, [world.abort])
    losses = [float(x) for x in executor.fetched(program, job.loss, steps)] if job.loss else []
    parameters = None
    if return_parameters:
        parameters = executor.variables(program, [p.tensor for p in job.parameters])
    events = sorted((e for r in results.values() for e in r.trace), key=lambda e: e.start) if trace else None
    seconds = max((r.seconds for r in results.values()), default=0.0)
    # Engines, transports and their closures form reference cycles that hold every register and the
    # store; free a finished run's memory now rather than whenever the cycle collector next runs.
    del program, results, world
    gc.collect()
    return RunResult(losses, parameters, events, seconds)
