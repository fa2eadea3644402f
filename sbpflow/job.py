"""A job: the logical graph plus everything needed to train it, as plain data (never code).

Tracing a ``sf.Graph`` produces a :class:`Job`; ``sbpflow.codec.wire`` converts it to and from the protobuf
``sbpflow.v1.Job`` losslessly, so the control plane can validate and compile it without running user code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import StrEnum

from sbpflow.data.checks import check_data
from sbpflow.data.sources import DataSource
from sbpflow.errors import SbpflowError
from sbpflow.graph import Graph
from sbpflow.limits import (
    LIMITS,
    Limits,
    check_count,
    check_float,
    check_graph,
    check_int,
    check_name,
    refuse,
)
from sbpflow.random import Initializer
from sbpflow.runs.bound_values import BoundValues

FORMAT_VERSION = 1


class Precision(StrEnum):
    fp32 = "fp32"
    fp64 = "fp64"
    fp16 = "fp16"
    bf16 = "bf16"


class PipelineSchedule(StrEnum):
    one_f_one_b = "1f1b"
    gpipe = "gpipe"


@dataclass(frozen=True)
class ParameterSpec:
    tensor: str
    init: Initializer
    trainable: bool = True


@dataclass(frozen=True)
class SGD:
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass(frozen=True)
class AdamW:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass(frozen=True)
class ConstantLR:
    pass


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up to the base lr over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""

    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.0

    def factor(self, step: int) -> float:
        import math

        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


LrSchedule = ConstantLR | WarmupCosine


@dataclass(frozen=True)
class ParamGroup:
    """Parameters whose hyper-parameters differ from the algorithm's (None: the algorithm's): PyTorch's
    parameter groups, e.g. no weight decay for biases and LayerNorm weights."""

    parameters: tuple[str, ...]
    lr: float | None = None  # the schedule scales it as it scales the algorithm's lr
    weight_decay: float | None = None

    def overrides(self) -> dict[str, float]:
        return {k: v for k, v in (("lr", self.lr), ("weight_decay", self.weight_decay)) if v is not None}


@dataclass(frozen=True)
class OptimizerSpec:
    algorithm: SGD | AdamW
    parameters: tuple[str, ...]
    clip_grad_norm: float = 0.0  # 0 = no clipping; else clip by the true global norm over all shards
    schedule: LrSchedule = ConstantLR()
    groups: tuple[ParamGroup, ...] = ()  # a parameter in none has the algorithm's hyper-parameters

    def hyper(self, parameter: str) -> dict[str, float | bool]:
        """The algorithm's fields for ``parameter``, its group's overrides applied."""
        from dataclasses import asdict

        values: dict[str, float | bool] = asdict(self.algorithm)
        for g in self.groups:
            if parameter in g.parameters:
                values.update(g.overrides())
        return values


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling of an fp16 job (``JobConfig.loss_scale = 0``), torch.cuda.amp.GradScaler's
    rule: the loss gradient is seeded with the scale, a step whose gradients hold an inf or NaN is skipped
    and the scale multiplied by ``backoff_factor``; after ``growth_interval`` good steps in a row it is
    multiplied by ``growth_factor`` (control_plane/compiler/loss_scaling.py)."""

    init: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        checks = [
            (0 < self.init < 2.0**127, f"init={self.init}: give a positive initial scale, e.g. 2**16"),
            (
                1 < self.growth_factor < 2.0**64,
                f"growth_factor={self.growth_factor}: give a factor > 1, e.g. 2",
            ),
            (
                0 < self.backoff_factor < 1,
                f"backoff_factor={self.backoff_factor}: give a factor in (0, 1), e.g. 0.5",
            ),
            (
                isinstance(self.growth_interval, int) and 1 <= self.growth_interval <= 2**24,
                f"growth_interval={self.growth_interval}: give the good steps (1 to 2**24) between two growths, "
                "e.g. 2000",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise SbpflowError(f"loss scaling: {msg}")


GRAD_BUCKET_BYTES = 25 * 2**20  # JobConfig.grad_bucket_bytes's default, and a message's without the field
FUSION = True  # JobConfig.fusion's default, and a message's without the field
ELASTIC_GRACE = 30.0  # JobConfig.elastic_grace's default, and a message's without the field


@dataclass(frozen=True)
class JobConfig:
    steps: int = 1
    gradient_accumulation_steps: int = 1
    micro_batches: int = 1  # pipeline micro-batches per step
    pipeline_schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    zero_stage: int = 0
    activation_checkpointing: bool = False
    precision: Precision = Precision.fp32
    loss_scale: float = 0.0  # 0 = none (fp32/fp64/bf16) or dynamic (fp16: loss_scaling)
    seed: int = 0
    checkpoint_every: int = 0
    # gradient all-reduces packed into buckets of about this many bytes, in backward order (DDP's 25 MiB);
    # 0 = one all-reduce per gradient (control_plane/compiler/passes/grad_buckets.py)
    grad_bucket_bytes: int = GRAD_BUCKET_BYTES
    fusion: bool = FUSION  # chains of elementwise ops as one kernel (control_plane/compiler/passes/fusion.py)
    # every this many steps (0: never) the loss over ``eval_batches`` batches of ``Job.eval_data``, a
    # held-out split, from that step's checkpoint (so a multiple of checkpoint_every)
    eval_every: int = 0
    eval_batches: int = 1
    # elastic resume (control_plane/launch/elastic.py): the rank counts, largest first, the job may go on with
    # when a lost worker's capacity is not back within ``elastic_grace`` seconds; () = the same ranks only
    elastic: tuple[int, ...] = ()
    elastic_grace: float = ELASTIC_GRACE
    # how an fp16 job with loss_scale 0 scales dynamically (ignored otherwise)
    loss_scaling: LossScaling = LossScaling()

    @property
    def dynamic_loss_scaling(self) -> bool:
        """Whether the job scales its loss dynamically: fp16 without a static ``loss_scale``."""
        return self.precision == Precision.fp16 and self.loss_scale == 0

    def __post_init__(self) -> None:
        checks = [
            (self.steps >= 1, f"steps={self.steps}: a job trains for at least one step"),
            (self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1"),
            (self.micro_batches >= 1, "micro_batches must be >= 1"),
            (self.zero_stage in (0, 1, 2, 3), f"zero_stage={self.zero_stage}: use 0, 1, 2 or 3"),
            (self.checkpoint_every >= 0, "checkpoint_every must be >= 0 (0 = never)"),
            (self.eval_every >= 0, "eval_every must be >= 0 (0 = never)"),
            (self.eval_batches >= 1, "eval_batches must be >= 1"),
            (
                self.eval_every == 0
                or (self.checkpoint_every > 0 and self.eval_every % self.checkpoint_every == 0),
                f"eval_every={self.eval_every} evaluates a step's checkpoint: set checkpoint_every to it or "
                f"to a divisor of it (checkpoint_every={self.checkpoint_every})",
            ),
            (self.grad_bucket_bytes >= 0, "grad_bucket_bytes must be >= 0 (0 = one all-reduce per gradient)"),
            (
                all(n >= 1 for n in self.elastic) and len(set(self.elastic)) == len(self.elastic),
                f"elastic={self.elastic}: give distinct rank counts >= 1, e.g. elastic=(2, 1)",
            ),
            (
                0 <= self.elastic_grace < float("inf"),
                f"elastic_grace={self.elastic_grace}: give the seconds (>= 0) a lost worker's capacity has to "
                "come back before the job goes on with fewer ranks",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise SbpflowError(msg)


@dataclass
class Job:
    name: str
    graph: Graph
    parameters: list[ParameterSpec] = field(default_factory=list)
    data: DataSource | None = None
    optimizer: OptimizerSpec | None = None
    config: JobConfig = JobConfig()
    loss: str = ""
    fetches: tuple[str, ...] = ()
    format_version: int = FORMAT_VERSION
    eval_data: DataSource | None = None  # the held-out split config.eval_every evaluates on
    # the modules of a job traced in this process (sbpflow.runs.bound_values); never on the wire
    bound: BoundValues | None = field(default=None, compare=False, repr=False)

    def verify(self) -> None:
        """Check the job: every value within ``sbpflow.limits`` first (cheap, and what makes the rest
        safe on untrusted input), then the graph and the references between the job's parts, each
        parameter listed once (:func:`check_unique`)."""
        check_job(self)
        self.graph.verify()
        names = {p.tensor for p in self.parameters}
        for p in self.parameters:
            if p.tensor not in self.graph.tensors:
                raise SbpflowError(f"parameter {p.tensor!r} is not a tensor of the graph")
        check_unique(self)
        if self.loss and self.loss not in self.graph.tensors:
            raise SbpflowError(f"loss tensor {self.loss!r} is not in the graph")
        if self.optimizer:
            missing = [n for n in self.optimizer.parameters if n not in names]
            if missing:
                raise SbpflowError(f"the optimizer updates {missing}, which are not parameters of the job")
        if self.config.eval_every and (self.eval_data is None or not self.loss):
            raise SbpflowError(
                f"config.eval_every={self.config.eval_every} needs a loss and a held-out split: trace the job "
                "with graph.trace(data, eval_data=...)"
            )
        if (
            self.eval_data is not None
            and self.data is not None
            and not _opens_files(self.eval_data, self.data)
        ):
            have, want = self.eval_data.fields(), self.data.fields()
            if have != want:
                raise SbpflowError(
                    f"the held-out split's fields {[(f.name, f.sample_shape) for f in have]} differ from the "
                    f"training data's {[(f.name, f.sample_shape) for f in want]}; split the same source"
                )
        fetched = [n for n in self.fetches if n not in self.graph.tensors]
        if fetched:
            raise SbpflowError(f"the job fetches {fetched}, which are not tensors of the graph")

    def check_inputs(self) -> None:
        """Every input tensor of the graph is fed by a field of the data source with its dtype and shape
        (``[global_batch_size, *sample_shape]``). A file-backed array source declares no fields without
        opening its files, so it is checked when a worker opens them."""
        from sbpflow.graph import TensorKind

        if self.data is None or _opens_files(self.data):
            return
        given = {f.name: f for f in self.data.fields()}
        for t in self.graph.of_kind(TensorKind.input):
            f = given.get(t.name)
            if f is None:
                raise SbpflowError(
                    f"input tensor {t.name!r} is fed by no field of the data source (it has {sorted(given)}); "
                    "name the graph's inputs after the source's fields"
                )
            want = (self.data.batch_size, *f.sample_shape)
            if t.meta.shape != want or t.meta.dtype != f.dtype:
                raise SbpflowError(
                    f"input tensor {t.name!r} is {t.meta!r}, but data field {f.name!r} gives batches of "
                    f"[{', '.join(map(str, want))}] {f.dtype.value} (global_batch_size="
                    f"{self.data.batch_size}, sample_shape={list(f.sample_shape)}); make the data source "
                    "and the graph's input agree (trace the job again from the source)"
                )


def _opens_files(*sources: DataSource) -> bool:
    """Whether a source declares its fields only by opening its files (checked by the workers then)."""
    from sbpflow.data.sources import FileSource

    return any(isinstance(s, FileSource) and s.fields_need_files for s in sources)


def _first_repeat(names: Iterable[str]) -> tuple[int, int, str] | None:
    """The first name listed again: (its first index, the repeat's index, the name); None if none is."""
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            return first[name], i, name
        first[name] = i
    return None


def check_unique(job: Job) -> None:
    """Each parameter listed once in ``job.parameters`` (two specs would give it two initializers) and in
    the optimizer's list (it would be updated twice a step), and in at most one parameter group (which
    group's hyper-parameters hold would depend on their order)."""
    lists: list[tuple[str, Iterable[str], str]] = [
        ("job.parameters", (p.tensor for p in job.parameters), "give each parameter one ParameterSpec"),
    ]
    if job.optimizer is not None:
        o = job.optimizer
        lists.append(("job.optimizer.parameters", o.parameters, "list each parameter once"))
        grouped = [(i, n) for i, g in enumerate(o.groups) for n in g.parameters]
        repeat = _first_repeat(n for _, n in grouped)
        if repeat is not None:
            a, b, name = repeat
            raise SbpflowError(
                f"parameter {name!r} is in job.optimizer.groups[{grouped[a][0]}] and again in "
                f"job.optimizer.groups[{grouped[b][0]}]: put each parameter in one group at most"
            )
    for where, names, fix in lists:
        repeat = _first_repeat(names)
        if repeat is not None:
            a, b, name = repeat
            raise SbpflowError(f"{where}[{b}] names {name!r} again (as {where}[{a}] does): {fix}")


def check_job(job: Job, limits: Limits = LIMITS) -> None:
    """Raise :class:`LimitError` at the first field of ``job`` outside ``limits``."""
    check_name("job.name", job.name, limits, empty=True)
    check_graph(job.graph, limits)
    check_count("job.parameters", job.parameters, limits)
    for i, p in enumerate(job.parameters):
        check_name(f"job.parameters[{i}].tensor", p.tensor, limits)
        for f in fields(p.init):  # type: ignore[arg-type]
            check_float(f"job.parameters[{i}].init.{f.name}", getattr(p.init, f.name))
    check_count("job.fetches", job.fetches, limits)
    for i, name in enumerate(job.fetches):
        check_name(f"job.fetches[{i}]", name, limits)
    check_name("job.loss", job.loss, limits, empty=True)
    _check_config(job, limits)
    _check_optimizer(job, limits)
    if job.data is not None:
        check_data(job.data, limits)
    if job.eval_data is not None:
        check_data(job.eval_data, limits)


def _check_config(job: Job, limits: Limits) -> None:
    c = job.config
    check_int("job.config.steps", c.steps, 1, limits.steps)
    check_int(
        "job.config.checkpoint_every", c.checkpoint_every, 0, limits.steps, "give 0 (never) or a step count"
    )
    check_int("job.config.eval_every", c.eval_every, 0, limits.steps, "give 0 (never) or a step count")
    check_int("job.config.eval_batches", c.eval_batches, 1, limits.steps)
    m = limits.micro_batches
    check_int("job.config.gradient_accumulation_steps", c.gradient_accumulation_steps, 1, m)
    check_int("job.config.micro_batches", c.micro_batches, 1, m)
    total = c.gradient_accumulation_steps * c.micro_batches
    if total > m:
        raise refuse(
            "job.config.gradient_accumulation_steps x micro_batches",
            total,
            f"is over the limit of {m}",
            "cut each step's batch into fewer micro-batches",
        )
    check_float(
        "job.config.loss_scale",
        c.loss_scale,
        0.0,
        limits.magnitude,
        "give 0 (none/dynamic) or a positive scale",
    )
    check_int("job.config.seed", c.seed, 0, (1 << 64) - 1)
    check_int("job.config.grad_bucket_bytes", c.grad_bucket_bytes, 0, 1 << 40, "give 0 (off) or a byte count")
    if not isinstance(c.fusion, bool):
        raise refuse("job.config.fusion", c.fusion, "must be a bool", "give True or False")


def _check_optimizer(job: Job, limits: Limits) -> None:
    o = job.optimizer
    if o is None:
        return
    check_count("job.optimizer.parameters", o.parameters, limits)
    check_float(
        "job.optimizer.clip_grad_norm",
        o.clip_grad_norm,
        0.0,
        limits.magnitude,
        "give 0 (no clipping) or a norm",
    )
    a = o.algorithm
    name = "sgd" if isinstance(a, SGD) else "adamw"
    bounds = {"lr": (0.0, limits.magnitude), "momentum": (0.0, 1.0), "weight_decay": (0.0, limits.magnitude)}
    bounds |= {"beta1": (0.0, 1.0), "beta2": (0.0, 1.0), "eps": (0.0, limits.magnitude)}
    for f in fields(a):
        if f.name in bounds:
            check_float(f"job.optimizer.{name}.{f.name}", getattr(a, f.name), *bounds[f.name])
    check_count("job.optimizer.groups", o.groups, limits)
    for i, g in enumerate(o.groups):
        check_count(f"job.optimizer.groups[{i}].parameters", g.parameters, limits)
        for key, value in g.overrides().items():
            check_float(f"job.optimizer.groups[{i}].{key}", value, *bounds[key])
    s = o.schedule
    if isinstance(s, WarmupCosine):
        where = "job.optimizer.schedule.warmup_cosine"
        check_int(f"{where}.warmup_steps", s.warmup_steps, 0, limits.steps)
        check_int(f"{where}.total_steps", s.total_steps, 0, limits.steps)
        check_float(f"{where}.min_lr_ratio", s.min_lr_ratio, 0.0, 1.0)
