"""``sf.run(job)``: compile a job and train it on the actor runtime, returning what the reference returns.

    result = sf.run(job, return_parameters=True)
    result.losses        # one float per step (the loss averaged over the step's micro-batches)
    result.parameters    # logical (gathered) parameter values after the last step, by name
    result.outputs       # per step, the value of each tensor build() returned (a forward-only job)

Backends (:data:`BACKENDS`):

- ``"ray"`` (the default): one Ray worker process per rank of the job's placement, on a local Ray
  started on demand or on the cluster at ``ray_address``; registers move through the CPU data plane and
  every worker reports to the control plane in ``WorkerReport`` protobufs over gRPC
  (:mod:`sbpflow.control_plane.launch.ray_backend`).
- ``"inprocess"``: every rank is threads of this process over the in-process transport; the test vehicle
  and the fastest embedded mode.

Both call the same listeners as the run gets on: ``on_state(JobState.COMPILING | STARTING | RUNNING)``,
``on_step(StepMetrics)`` once per completed step, ``on_report(WorkerReport)`` for every worker report,
and ``on_attempt(attempt, first_step, reason, message)`` when a restart begins attempt ``attempt`` from
the checkpoint at ``first_step`` (then ``on_state`` says ``"STARTING"`` and ``"RUNNING"`` again), with
``on_resize(slots)`` the device slots that attempt holds (fewer after an elastic re-plan).
Setting ``cancel`` stops every rank promptly and raises :class:`RunCancelled`. A NaN or infinite loss
stops every rank the same way and raises :class:`~sbpflow.runs.numerics.NonFiniteLoss` naming the step (the
step tracker checks each assembled loss); finite losses but non-finite final parameters (each rank checks
its shards) raise :class:`~sbpflow.runs.numerics.NonFiniteParameters` naming them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

from sbpflow.actor_workers import snapshots as checkpointing
from sbpflow.actor_workers.execution import executor, segments
from sbpflow.actor_workers.runtime import heap, threads
from sbpflow.actor_workers.runtime.errors import RunCancelled, RuntimeFailure
from sbpflow.actor_workers.step_reports import Scaling, StepDone, step_report, watch_steps
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.checkpoint.read import CheckpointReader, CorruptCheckpoint, corrupt_note, resolve
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.launch.evaluation import HeldOut, evaluates, whole_plan
from sbpflow.control_plane.launch.ray_backend import run_on_ray
from sbpflow.control_plane.launch.run_context import (
    LaunchContext,
    RunRequest,
    RunResult,
    assemble_outputs,
    loss_scaling_fields,
    output_names,
)
from sbpflow.control_plane.launch.start_values import start_file
from sbpflow.control_plane.launch.step_tracker import (
    StepListener,
    StepTracker,
    fail_on_non_finite,
    skip_overflow,
)
from sbpflow.control_plane.launch.tensorboard_scalars import open_board
from sbpflow.device import array_module
from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.limits import LIMITS, CompileBudget, CompileCancelled
from sbpflow.ops.training.loss_scaling import VARIABLES
from sbpflow.runs.numerics import NonFiniteParameters, non_finite_parameters
from sbpflow.runs.options import RunOptions
from sbpflow.runs.states import JobState
from sbpflow.v1 import job_pb2 as jp
from sbpflow.v1 import plan_pb2 as pp
from sbpflow.v1 import service_pb2 as sp

__all__ = ["BACKENDS", "RunCancelled", "launch", "run"]

Backend = Callable[[Compiled, LaunchContext, StepTracker], RunResult]
log = logging.getLogger(__name__)


# the in-process transport's own timeout, past the run's: the run's timeout (and its stall report) ends a
# run that outlives it, not a collective timing out first on a loaded machine (a race of the two)
HANG_GRACE = 10.0


def run(job: Job | Compiled, request: RunRequest | None = None, /, **keywords: Any) -> RunResult:
    """Compile ``job`` and train it as ``request`` asks (:class:`~.run_context.RunRequest`: one value), with
    any of its fields, or of its :class:`~sbpflow.runs.options.RunOptions`', given as keywords on top
    (``sf.run(job, backend="inprocess", timeout=60, return_parameters=True, steps=10)``). A ``job``
    compiled already (:func:`launch`) is only lowered, on its own state.

    A failing kernel, a shape error, a transport failure or a lost worker on any rank stops every rank and
    raises :class:`~sbpflow.actor_workers.runtime.RuntimeFailure` (rank, op, cause); a run past ``timeout``
    raises its RuntimeTimeout naming the stalled actors; a set ``cancel`` raises :class:`RunCancelled`.

    Checkpoints (:mod:`sbpflow.checkpoint`): with ``checkpoint_dir`` and ``job.config.checkpoint_every``
    each rank saves its shards every that many steps; ``resume_from`` (a checkpoint, or a directory of
    them: the latest) starts every variable from it and trains the steps left of ``steps``; ``init_from``
    starts the parameters from a safetensors/.npz file or a checkpoint that holds every parameter in its
    shape and dtype, and nothing else unless ``strict=False`` (``layout="torch"``: a PyTorch state dict,
    :mod:`sbpflow.client.torch_layout`). A job traced in this process starts from its modules' values and
    gives them the trained ones (:mod:`sbpflow.runs.bound_values`). On Ray, a lost worker restarts the job from
    its last checkpoint up to ``max_restarts`` times. ``config.eval_every``: the ranks evaluate the
    held-out split at those steps (:mod:`~sbpflow.control_plane.launch.evaluation`: ``on_eval(step, loss)``,
    ``RunResult.evals``). ``tensorboard_dir``: TensorBoard scalars (``tensorboard_scalars``).
    """
    r = (request or RunRequest()).replace(**keywords)
    how = r.options
    job_ = job.state.job if isinstance(job, Compiled) else job
    bound, steps = (
        job_.bound,
        job_.config.steps if r.steps is None else r.steps,
    )  # bound: wants trained values
    if steps < 1:
        raise SbpflowError(f"steps={steps}: a run trains for at least one step")
    resume_from, first_step = _resume_point(r.resume_from, steps)
    starts = (
        nullcontext(None) if resume_from is not None else start_file(job_, r.init_from, r.layout, r.strict)
    )
    board = open_board(r.tensorboard_dir, job_, r.job_id, first_step, r.on_step, r.on_eval, r.on_report)
    held_out = HeldOut(job_, board.on_eval) if evaluates(job_) else None
    with board, starts as init_path:
        result = _run(
            job,
            how.replace(return_parameters=True) if bound is not None else how,
            LaunchContext(
                steps=steps - first_step,
                run=how,
                on_state=r.on_state,
                on_report=board.on_report,
                on_attempt=r.on_attempt,
                on_resize=r.on_resize,
                cancel=_Stop(r.cancel),  # set by a cancel, or by the tracker at a non-finite loss
                report_hub=r.report_hub,
                job_id=r.job_id,
                attempt=r.attempt,
                first_step=first_step,
                checkpoint_dir=r.checkpoint_dir,
                resume_from=resume_from,
                init_from=init_path,
                held_out=held_out,
            ),
            board.on_step,
            r.cancel,
        )
    if held_out is not None:
        result = dataclasses.replace(result, evals=tuple(held_out.results))
    if bound is not None and result.parameters is not None:
        bound.write_back(result.parameters)
    return result if how.return_parameters else dataclasses.replace(result, parameters=None)


def _run(
    job: Job | Compiled,
    how: RunOptions,
    context: LaunchContext,
    on_step: StepListener | None,
    cancel: threading.Event | None,
) -> RunResult:
    """Compile and run under ``context`` (its run options replaced by ``how``); raise what stopped it."""
    runner = BACKENDS[how.backend]
    context = dataclasses.replace(context, run=how)
    given = job if isinstance(job, Compiled) else None
    job = job.state.job if isinstance(job, Compiled) else job
    first_step, stop = context.first_step, context.cancel
    assert isinstance(stop, _Stop)
    context.state(JobState.COMPILING)
    try:
        compiled = compile_for_run(given or job, cancel)
    except CompileCancelled as e:
        raise RunCancelled(f"job {job.name!r} was cancelled while it was compiled") from e
    graph = compiled.state.graph
    loss = graph.tensors[job.loss] if job.loss else None
    samples = job.data.batch_size if job.data is not None else 0
    policy = skip_overflow if job.config.dynamic_loss_scaling else fail_on_non_finite
    tracker = StepTracker(
        loss, samples, on_step, job=job.name, first_step=first_step, stop=stop.set, on_non_finite=policy
    )
    try:
        result = runner(compiled, context, tracker)
    except CompileCancelled as e:  # a rank's plan lowered as the backend ships it (a big job, on Ray)
        raise RunCancelled(f"job {job.name!r} was cancelled while its ranks' plans were lowered") from e
    except RuntimeFailure as failure:
        if tracker.non_finite is not None:
            raise tracker.non_finite from failure
        if cancel is not None and cancel.is_set():
            raise RunCancelled(f"job {job.name!r} was cancelled at step {len(tracker.losses)}") from failure
        raise
    if tracker.non_finite is not None:  # at the last step, or found only in the outcome
        raise tracker.non_finite
    if result.non_finite:
        raise NonFiniteParameters(job.name, result.first_step + len(result.losses), result.non_finite)
    return result


class _Stop(threading.Event):
    """The run's stop event: set by the tracker (a non-finite loss), or read as set once ``cancel`` is."""

    def __init__(self, cancel: threading.Event | None) -> None:
        super().__init__()
        self._cancel = cancel

    def is_set(self) -> bool:
        return super().is_set() or (self._cancel is not None and self._cancel.is_set())


def launch(compiled: Compiled, request: RunRequest | None = None, /, **keywords: Any) -> RunResult:
    """Train a job compiled already — Submit's validation compile, its graph passes done — as :func:`run`
    does: its lowering is finished on the same state (``pipeline.finish``), no pass runs again.
    ``run(job, ...)`` is ``launch(pipeline.compile(job, lower="none"), ...)``."""
    return run(compiled, request, **keywords)


def _resume_point(resume_from: str | None, steps: int) -> tuple[str | None, int]:
    """The checkpoint a run resumes from (a directory of them: its latest intact one, each corrupt one
    passed over logged) and its step (0: none)."""
    if resume_from is None:
        return None, 0
    passed: list[CorruptCheckpoint] = []
    resume_from = str(resolve(resume_from, passed.append))
    first_step = CheckpointReader(resume_from).step
    for c in passed:
        log.warning("%s", corrupt_note(c, first_step))
    if first_step >= steps:
        raise SbpflowError(
            f"the checkpoint {resume_from} is at step {first_step} and the job trains {steps} steps: "
            "nothing is left to train; pass a larger steps="
        )
    return resume_from, first_step


def compile_for_run(job: Job | Compiled, cancel: threading.Event | None = None) -> Compiled:
    """``job`` compiled (a Compiled: lowered on its own state), or a clear error when it cannot run (no
    plan, a lowering skipped). A big job is lowered on demand: ``plan`` is None, ``lazy`` is set.

    The compile runs under a fresh :class:`~sbpflow.limits.CompileBudget` (the limits Submit sized the job
    with, else the defaults; its clock starts now): over a limit it raises ``CompileLimitError`` (the job
    ends FAILED, ``COMPILE_LIMIT``), once ``cancel`` is set ``CompileCancelled``, within a few thousand
    tasks either way."""
    given = job.budget if isinstance(job, Compiled) else None
    budget = CompileBudget.start(given.limits if given is not None else LIMITS, cancel)
    if isinstance(job, Compiled):
        compiled = pipeline.finish(job, budget=budget)
    else:
        compiled = pipeline.compile(job, budget=budget)
    skipped = [n for n in compiled.notes if "lowering skipped" in n]
    if (compiled.plan is None and compiled.lazy is None) or skipped:
        raise SbpflowError(
            f"job {compiled.state.job.name!r} cannot run: "
            + "; ".join(skipped or compiled.notes or ["no plan was made"])
        )
    return compiled


def _run_inprocess(compiled: Compiled, ctx: LaunchContext, tracker: StepTracker) -> RunResult:
    """Train on threads of this process. The heap is frozen from the build on (``heap.frozen``): the
    collection as the run ends walks the run's own objects (its engines, transports and closures form
    cycles that hold every register and the store) and frees them, not the whole process's heap."""
    with heap.frozen():
        return _train_inprocess(compiled, ctx, tracker)


def _train_inprocess(compiled: Compiled, ctx: LaunchContext, tracker: StepTracker) -> RunResult:
    job, plan = compiled.state.job, compiled.plan or whole_plan(compiled)
    evaluation = ctx.held_out.evaluation(compiled) if ctx.held_out is not None else None
    loss = job.loss

    def on_step(rank: int) -> StepDone:
        def done(step: int, value: float | None, times: Mapping[str, float], scale: Scaling | None) -> None:
            if value is not None:
                tracker.add(rank, step - ctx.first_step, value, scaling=scale)
            ctx.report(rank, step=step_report(step, value, times, scale))

        return done

    devices = {d.rank: d for d in plan.devices}
    ranks = list(devices)
    xp = _array_module(plan)
    ctx.state(JobState.STARTING)
    with InProcessWorld(ranks, timeout=ctx.run.timeout + HANG_GRACE) as world:
        program = executor.build(
            plan,
            segments.first_steps(ctx.first_step, ctx.steps, evaluation),
            {r: world.transport(r) for r in ranks},
            xp=xp,
            first_step=ctx.first_step,
            source=checkpointing.source_for(ctx.resume_from, ctx.init_from),
            data_roots=ctx.run.data_roots,
            data=job.data,  # the plan's source, not decoded into one more copy of in-memory arrays
        )
        for rank, rp in program.ranks.items():
            watch_steps(rp.context, devices[rank], loss, on_step(rank))
        writers = checkpointing.attach_all(
            checkpointing.options_for(job, ctx.checkpoint_dir, plan, ctx.attempt),
            program,
            plan,
            range(ctx.first_step, ctx.first_step + ctx.steps),
        )
        ctx.state(JobState.RUNNING)
        tracker.restart_clock()
        try:
            with threads.limited(ctx.run.threads):
                results = _segments(program, plan, ctx, evaluation, world)
            checkpointing.close_all(writers)
        except RuntimeFailure as failure:
            checkpointing.close_all(writers, raise_errors=False)
            cause = f"{type(failure.cause).__name__}: {failure.cause}"
            ctx.report(
                failure.rank if failure.rank is not None else -1,
                error=sp.ErrorReport(op_name=failure.actor or "", op_type=failure.op or "", cause=cause),
            )
            raise
    for rank in ranks:
        ctx.report(rank, done=sp.Done())
    first = ctx.first_step
    losses = [float(x) for x in executor.fetched(program, loss, ctx.steps, first_step=first)] if loss else []
    bad = {
        n
        for rp in program.ranks.values()
        for n in non_finite_parameters(rp.context.tables.tensors, rp.context.store)
    }
    names = [p.tensor for p in job.parameters] if ctx.run.return_parameters else None
    parameters = executor.variables(program, names) if names is not None else None
    scaling = executor.variables(program, [n for n in VARIABLES if n in program.tensors])
    events = None
    if ctx.run.trace:
        events = sorted((e for r in results.values() for e in r.trace), key=lambda e: e.start)
    seconds = max((r.seconds for r in results.values()), default=0.0)
    outputs = assemble_outputs(
        program.tensors,
        output_names(loss, job.fetches),
        {r: rp.context.fetched for r, rp in program.ranks.items()},
        range(first, first + ctx.steps),
    )
    del program, results, world  # their cycles: freed as _run_inprocess's hold of the heap ends
    result = RunResult(
        losses, parameters, events, seconds, first_step=first, non_finite=tuple(sorted(bad)), outputs=outputs
    )
    return dataclasses.replace(result, **loss_scaling_fields(scaling))


def _segments(
    program: executor.Program,
    plan: pp.Plan,
    ctx: LaunchContext,
    evaluation: segments.Evaluation | None,
    world: InProcessWorld,
) -> dict[int, Any]:
    """Every rank's training, paused at each evaluation for the eval plan on the same ranks (the rank
    threads: this process's, as a worker's are the worker's); the held-out losses go the report path."""
    left = segments.Clock(ctx.run.timeout)

    def run_engines(ranks: Sequence[executor.RankProgram]) -> dict[int, Any]:
        return executor.execute_ranks(ranks, left(), ctx.run.trace, [world.abort], ctx.cancel)

    def on_eval(rank: int, step: int, shares: list[float]) -> None:
        ctx.report(rank, eval=sp.EvalReport(step=step, losses=shares))
        if ctx.held_out is not None:
            ctx.held_out.add(rank, step, shares)

    return segments.run(
        program, plan, ctx.steps, ctx.first_step, evaluation, run_engines, on_eval, ctx.run.data_roots
    )


def _array_module(plan: Any) -> Any:
    """numpy for cpu placements; cupy for cuda ones (a clear error without it). The in-process
    transport moves numpy arrays, so a cuda job on it has one rank; more run on Ray, a GPU per worker."""
    kinds = {d.device_type for d in plan.devices}
    if jp.DEVICE_TYPE_CUDA not in kinds:
        return array_module("cpu")
    if len(plan.devices) > 1:
        raise SbpflowError(
            f"a cuda job on {len(plan.devices)} ranks runs on backend='ray' (one GPU per worker process, NCCL "
            "between them); the in-process backend runs a cuda job on one rank only"
        )
    return array_module("cuda")


BACKENDS: dict[str, Backend] = {"ray": run_on_ray, "inprocess": _run_inprocess}
