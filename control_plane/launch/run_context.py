"""What a run is given and what it gives back, shared by the launcher and the backends it drives.

:class:`RunRequest` is what ``sf.run`` is asked, as one frozen value: how the job runs (a core
:class:`~sbpflow.runs.options.RunOptions`), what it trains and keeps, who listens, and under the job
manager which job and attempt it is. :class:`LaunchContext` is what a backend needs of it for one attempt,
besides the compiled job; :class:`RunResult` is what every backend returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from sbpflow.actor_workers.step_reports import report
from sbpflow.control_plane.launch.evaluation import EvalListener, HeldOut
from sbpflow.control_plane.launch.report_hub import ReportHub
from sbpflow.control_plane.launch.step_tracker import ReportListener, StateListener, StepListener
from sbpflow.graph import TensorDecl
from sbpflow.ops.training.loss_scaling import SCALE, SKIPPED
from sbpflow.runs.options import FIELD_NAMES, RunOptions
from sbpflow.runs.states import JobState
from sbpflow.sharding import assemble_value

AttemptListener = Callable[[int, int, str, str], None]  # (attempt, first step, reason, message)
ResizeListener = Callable[[int], None]  # the device slots the next attempt holds (an elastic re-plan)


@dataclass(frozen=True)
class RunResult:
    """Per step, the loss; per step, the logical value of each tensor ``build`` returned (``outputs``,
    by tensor name: what a forward-only job is run for); on request, every parameter's final logical
    value and the act trace (``sbpflow.actor_workers.runtime.chrome_trace(result.trace)`` makes it
    viewable in Perfetto)."""

    losses: list[float]
    parameters: dict[str, Any] | None = None
    trace: list[Any] | None = None
    seconds: float = 0.0  # wall time of the run, compile excluded
    first_step: int = 0  # the step the run started at (a resume's checkpoint step): losses[0] is its loss
    attempts: int = 1  # attempts it took (a restart after a lost worker makes another)
    non_finite: tuple[str, ...] = ()  # parameters that hold NaN or infinite values after the run
    # fetch -> one value per step (a fetch inside a micro-batched step: a tuple, one per micro-batch)
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    evals: tuple[tuple[int, float], ...] = ()  # (step, held-out loss) of each evaluation (config.eval_every)
    # dynamic loss scaling (fp16, loss_scale 0): the scale after the run, and the steps skipped in all
    # (a resumed run's count includes the steps before its checkpoint); None / 0 without it
    loss_scale: float | None = None
    skipped_steps: int = 0


@dataclass(frozen=True)
class RunRequest:
    """What a run is asked (``sf.run(job, request)``, or its fields as keywords: :meth:`replace`).

    ``options``: how it runs (backend, timeout, restarts, what it returns). What it trains and keeps:
    ``steps`` (default ``job.config.steps``), ``checkpoint_dir``, ``resume_from`` (a checkpoint, or a
    directory of them: the latest), ``init_from`` (a file the parameters start from, in ``layout``,
    ``strict`` by default) and ``tensorboard_dir``. Who listens: ``on_state``, ``on_step``, ``on_report``,
    ``on_attempt``, ``on_resize``, ``on_eval``. Under the job manager: ``cancel`` (set: the run stops),
    the ``report_hub`` its workers report to, and its ``job_id`` and ``attempt``.
    """

    options: RunOptions = RunOptions()
    steps: int | None = None
    checkpoint_dir: str | None = None
    resume_from: str | None = None
    init_from: str | None = None
    layout: str | None = None
    strict: bool = True
    tensorboard_dir: str | None = None
    on_state: StateListener | None = field(default=None, compare=False)
    on_step: StepListener | None = field(default=None, compare=False)
    on_report: ReportListener | None = field(default=None, compare=False)
    on_attempt: AttemptListener | None = field(default=None, compare=False)
    on_resize: ResizeListener | None = field(default=None, compare=False)
    on_eval: EvalListener | None = field(default=None, compare=False)
    cancel: threading.Event | None = field(default=None, compare=False)
    report_hub: ReportHub | None = field(default=None, compare=False)
    job_id: str = ""
    attempt: int = 1

    def replace(self, **keywords: Any) -> RunRequest:
        """This request with ``keywords`` on top: a field of :class:`RunOptions` goes into ``options``
        (``backend="inprocess"``), any other names a field of this request; an unknown name is refused
        with both lists."""
        own = {f.name for f in fields(self)}
        unknown = sorted(set(keywords) - own - set(FIELD_NAMES))
        if unknown:
            raise TypeError(
                f"run() got unexpected keyword(s) {unknown}; a run takes RunRequest's fields {sorted(own)} "
                f"and RunOptions' {list(FIELD_NAMES)}"
            )
        how = {k: v for k, v in keywords.items() if k not in own}
        mine = {k: v for k, v in keywords.items() if k in own}
        options = mine.pop("options", self.options)
        return replace(self, options=options.replace(**how) if how else options, **mine)


@dataclass(frozen=True)
class LaunchContext:
    """One attempt of a run: its options, the steps it trains from where, and who listens."""

    steps: int
    run: RunOptions = RunOptions()
    on_state: StateListener | None = None
    on_report: ReportListener | None = None
    on_attempt: AttemptListener | None = None
    on_resize: ResizeListener | None = None
    cancel: threading.Event | None = None
    report_hub: ReportHub | None = None
    job_id: str = ""
    attempt: int = 1
    first_step: int = 0  # ``steps`` steps run from here: a resume's checkpoint step
    checkpoint_dir: str | None = None  # checkpoints every job.config.checkpoint_every steps go here
    resume_from: str | None = None  # a checkpoint directory: every variable starts from it
    init_from: str | None = None  # safetensors/.npz/checkpoint: the parameters it holds start from it
    held_out: HeldOut | None = None  # config.eval_every: the eval plans the ranks run, their losses

    def state(self, state: JobState) -> None:
        if self.on_state is not None:
            self.on_state(state)

    def new_attempt(self, reason: str, message: str, slots: int | None = None) -> None:
        """Tell ``on_attempt`` that this attempt (``self.attempt`` from ``self.first_step``) begins, and
        ``on_resize`` how many device slots it holds."""
        if self.on_attempt is not None:
            self.on_attempt(self.attempt, self.first_step, reason, message)
        if slots is not None and self.on_resize is not None:
            self.on_resize(slots)

    def report(self, rank: int, **payload: Any) -> None:
        if self.on_report is not None:
            self.on_report(report(self.job_id, self.attempt, rank, **payload))


# (tensor, micro-batch) -> step -> this rank's value: what a rank's SINK fetch tasks recorded
RankFetches = Mapping[tuple[str, int], Mapping[int, Any]]


def loss_scaling_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """RunResult's ``loss_scale`` and ``skipped_steps`` from the final values of the loss-scaling
    variables (:data:`~sbpflow.ops.training.loss_scaling.VARIABLES`; none there: ``{}``)."""
    if SCALE not in values:
        return {}
    return {"loss_scale": float(values[SCALE][0]), "skipped_steps": int(values[SKIPPED][0])}


def output_names(loss: str, fetches: Iterable[str]) -> list[str]:
    """The fetches a run returns as outputs: every one but the loss (``RunResult.losses`` has it)."""
    return [n for n in dict.fromkeys(fetches) if n != loss]


def assemble_outputs(
    tensors: Mapping[str, TensorDecl], names: Iterable[str], per_rank: Mapping[int, RankFetches], steps: range
) -> dict[str, list[Any]]:
    """Each fetch's logical value per step of ``steps``, from the ranks' recorded shards."""
    out: dict[str, list[Any]] = {}
    for name in names:
        decl = tensors[name]
        assert decl.placement is not None
        ranks = decl.placement.ranks
        keys = sorted(k for (n, k) in per_rank[ranks[0]] if n == name)

        def at(step: int, mb: int, decl: TensorDecl = decl, ranks: Iterable[int] = ranks) -> Any:
            return assemble_value(decl, {r: per_rank[r][(decl.name, mb)][step] for r in ranks})

        out[name] = [at(s, -1) if keys == [-1] else tuple(at(s, k) for k in keys if k >= 0) for s in steps]
    return out
