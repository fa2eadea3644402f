"""``sf.Graph``: a training step written as ``build``, traced into a ``Job`` (OneFlow's ``nn.Graph``).

    class TrainGraph(sf.Graph):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.add_optimizer(sf.optim.AdamW(model.parameters(), lr=3e-4))
            self.config.gradient_accumulation_steps = 4

        def build(self, tokens, targets):      # parameter names = the data source's fields
            loss = self.model(tokens, targets)
            loss.backward()
            return loss

    job = TrainGraph(model).trace(data, placement=sf.placement("cpu", ranks=[0, 1]))

Parameters are named by their path from the graph (``model.blocks.0.attn.c_attn.weight``), inputs by
the data source's fields; ``build`` runs once, on symbolic tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from sbpflow.client.context import TracingError, activate
from sbpflow.client.functional import cast
from sbpflow.client.graph_values import GraphValues
from sbpflow.client.nn.module import Module
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.optim import Optimizer
from sbpflow.client.tensor import Tensor
from sbpflow.client.tracing import Tracer
from sbpflow.data.sources import DataSource
from sbpflow.dtype import DType
from sbpflow.graph import TensorKind
from sbpflow.job import (
    FUSION,
    GRAD_BUCKET_BYTES,
    Job,
    JobConfig,
    LossScaling,
    ParameterSpec,
    PipelineSchedule,
    Precision,
)
from sbpflow.placement import Placement
from sbpflow.placement import placement as make_placement
from sbpflow.sbp import NdSbp, as_nd, check_axes
from sbpflow.tensor_meta import TensorMeta


@dataclass
class GraphConfig:
    """The job's training settings, set in ``__init__`` (``self.config.zero_stage = 2``)."""

    steps: int = 1
    gradient_accumulation_steps: int = 1
    micro_batches: int = 1
    pipeline_schedule: str = "1f1b"  # or "gpipe"
    zero_stage: int = 0
    activation_checkpointing: bool = False
    precision: str = "fp32"  # fp32, fp64, fp16, bf16
    loss_scale: float = 0.0  # 0 with fp16: dynamic, as loss_scaling says (torch's GradScaler defaults)
    loss_scaling: LossScaling = LossScaling()
    seed: int = 0
    checkpoint_every: int = 0
    grad_bucket_bytes: int = GRAD_BUCKET_BYTES  # gradient all-reduce buckets, in backward order; 0 = off
    fusion: bool = FUSION  # elementwise chains as one kernel each (False: one act an op)
    eval_every: int = 0  # the held-out loss every this many steps (trace(..., eval_data=...)); 0 = never
    eval_batches: int = 1  # batches of the held-out split per evaluation
    # trace() lays the job out as the automatic plan search's winner on its placement's ranks
    # (control_plane/compiler/search/auto_plan.py), within memory_per_device bytes (0: the profile's device)
    auto_parallel: bool = False
    memory_per_device: int = 0
    auto_profile: str = "cpu"  # the cost model's device profile: cpu (measured), h200 or a file

    def to_job_config(self, steps: int | None = None) -> JobConfig:
        values = asdict(self)
        for key in ("auto_parallel", "memory_per_device", "auto_profile"):  # the trace's, not the job's
            del values[key]
        if steps is not None:
            values["steps"] = steps
        values["precision"] = Precision(values["precision"])
        if values["eval_every"] and not values["checkpoint_every"]:  # an evaluation reads its checkpoint
            values["checkpoint_every"] = values["eval_every"]
        values["pipeline_schedule"] = PipelineSchedule(values["pipeline_schedule"])
        values["loss_scaling"] = self.loss_scaling  # a value of its own, not asdict's dict
        return JobConfig(**values)


class Graph:
    _modules: dict[str, Module]
    _optimizer: Optimizer | None
    _schedule: Any
    config: GraphConfig

    def __init__(self) -> None:
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_optimizer", None)
        object.__setattr__(self, "_schedule", None)
        object.__setattr__(self, "config", GraphConfig())

    def __setattr__(self, name: str, value: Any) -> None:
        if "_modules" not in self.__dict__:
            raise TracingError(f"set {type(self).__name__}.{name} after super().__init__() in __init__")
        self._modules.pop(name, None)
        if isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def add_optimizer(self, optimizer: Optimizer, lr_scheduler: Any = None) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TracingError(f"add_optimizer needs an sf.optim optimizer, got {optimizer!r}")
        if self._optimizer is not None:
            raise TracingError(
                "a graph has one optimizer; give it all the parameters (model.parameters()) instead"
            )
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_schedule", lr_scheduler)

    def build(self, *inputs: Tensor) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define build(self, <one argument per field>)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TracingError(
            f"{type(self).__name__} is not run by calling it: trace it with graph.trace(data, placement=...) "
            "into a Job and submit the job"
        )

    # ---- tracing ------------------------------------------------------------------------------------

    def trace(
        self,
        data: DataSource,
        steps: int | None = None,
        placement: Placement | None = None,
        input_sbp: Any = None,
        name: str | None = None,
        eval_data: DataSource | None = None,
    ) -> Job:
        """Run ``build`` once on symbolic inputs and return the verified Job.

        ``placement`` (default one CPU rank) holds the inputs and every parameter not placed otherwise;
        ``input_sbp`` annotates the inputs (one SBP or nd-SBP for all, or a dict by field name) and
        ``None`` leaves their layout to the compiler. ``eval_data``, a held-out split of ``data``'s kind,
        is what ``config.eval_every`` evaluates the loss on (from that step's checkpoint). Under ``config.precision = "fp64"`` the graph's
        modules are switched to float64 first (``Module.to``) and float inputs are cast as they enter.
        """
        where = placement or make_placement("cpu", [0])
        if self.config.precision == Precision.fp64:
            for mod in self._modules.values():
                mod.to(DType.float64)
        tracer = Tracer(where, self._module_paths())
        declared: dict[str, Parameter] = {}
        params = self._declare_parameters(tracer, where, declared)
        inputs = self._declare_inputs(tracer, data, where, input_sbp)
        with activate(tracer):
            if self.config.precision == Precision.fp64:
                inputs = [_widened(t) for t in inputs]
            result = self.build(*inputs)
        fetches = tuple(t.name for t in _tensors(result))
        if self._optimizer is not None and tracer.loss is None:
            raise TracingError(
                f"{type(self).__name__} has an optimizer but build() never called loss.backward(); "
                "call it on the scalar loss"
            )
        optimizer = None
        if self._optimizer is not None:
            optimizer = self._optimizer.spec(tracer.parameter_names(), self._schedule)
        job = Job(
            name or type(self).__name__,
            tracer.graph,
            params,
            data,
            optimizer,
            self.config.to_job_config(steps),
            tracer.loss.name if tracer.loss is not None else "",
            fetches,
            bound=GraphValues(self._modules, declared),
            eval_data=eval_data,
        )
        job.verify()
        if self.config.auto_parallel:
            from sbpflow.control_plane.profiling.pricing import choose

            job = choose(job, self.config.memory_per_device or None, self.config.auto_profile)
        return job

    def _module_paths(self) -> dict[int, str]:
        paths: dict[int, str] = {}
        for attr, mod in self._modules.items():
            for path, sub in mod.named_modules(attr):
                paths.setdefault(id(sub), path)
        return paths

    def _declare_parameters(
        self, tracer: Tracer, default: Placement, declared: dict[str, Parameter]
    ) -> list[ParameterSpec]:
        """Every parameter of every module, on its own placement, else its stage's, else the default;
        ``declared`` gets each by its tensor name."""
        specs: list[ParameterSpec] = []
        stage_of: dict[str, Placement | None] = {}
        for attr, mod in self._modules.items():
            for path, sub in mod.named_modules(attr):
                parent = stage_of.get(path.rpartition(".")[0])
                stage_of[path] = sub.stage[1] if sub.stage is not None else parent
                for pname, p in sub.__dict__["_parameters"].items():
                    if tracer.tensor_of(p) is not None:
                        continue  # shared (tied) parameter, declared at its first path
                    full = f"{path}.{pname}"
                    tracer.bind_parameter(p, full, p.placement or stage_of[path] or default)
                    specs.append(ParameterSpec(full, p.init, p.requires_grad))
                    declared[full] = p
                    p.key = (full, self.config.seed)  # what this job's run draws, state_dict too
        return specs

    def _declare_inputs(
        self, tracer: Tracer, data: DataSource, where: Placement, input_sbp: Any
    ) -> list[Tensor]:
        fields = {f.name: f for f in data.fields()}
        names = _build_params(self.build, list(fields))
        if set(names) != set(fields):
            raise TracingError(
                f"{type(self).__name__}.build{tuple(names)} does not match the data source's fields "
                f"{tuple(fields)}; name build's parameters after the fields (one per field)"
            )
        batch = data.batch_size
        return [
            tracer.declare(
                n,
                TensorMeta((batch, *fields[n].sample_shape), fields[n].dtype),
                TensorKind.input,
                where,
                _input_sbp(input_sbp, n, where, len(fields[n].sample_shape) + 1),
            )
            for n in names
        ]


def _widened(t: Tensor) -> Tensor:
    """A float input as float64 (an fp64 job computes in float64 from its inputs on)."""
    floats = (DType.float16, DType.bfloat16, DType.float32)
    return cast(t, DType.float64) if t.meta.dtype in floats else t


def _build_params(build: Any, fields: list[str]) -> list[str]:
    params = list(inspect.signature(build).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return fields  # build(self, *inputs): the fields in the source's order
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _input_sbp(spec: Any, name: str, where: Placement, ndim: int) -> NdSbp | None:
    if isinstance(spec, Mapping):
        spec = spec.get(name)
    if spec is None:
        return None
    nd = as_nd(spec, where.ndim)
    check_axes(nd, ndim, f"input {name!r}")
    return nd


def _tensors(result: Any) -> list[Tensor]:
    """The tensors ``build`` returned: one, a tuple/list of them, a dict of them, or None."""
    if result is None:
        return []
    if isinstance(result, Tensor):
        return [result]
    items = result.values() if isinstance(result, Mapping) else result
    if isinstance(items, (list, tuple, type({}.values()))):
        out = list(items)
        if all(isinstance(t, Tensor) for t in out):
            return out
    raise TracingError(
        f"build() returned {type(result).__name__}; return a tensor (the loss), a tuple or dict of tensors, "
        "or None"
    )
