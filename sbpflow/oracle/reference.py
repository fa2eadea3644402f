"""The one-device reference executor: a Job's forward graph (``forward``) or its training steps (``train``:
forward, backward, update) run op by op on whole numpy arrays.

It is the oracle for distributed equivalence: every parallel configuration of a job must reproduce its
losses and its trained parameters. Parameters are drawn from their initializers keyed by (``config.seed``, ``tensor_rng_id(name)``)
— the same key the runtime uses for each shard, so the values agree whatever the layout — inputs are
batch ``step`` of the data source, and random ops draw with (seed, rng_id, step).

It shares the op library (kernels, gradient rules) and the job's data with the runtime, and nothing of
the compiler: its autodiff (:mod:`sbpflow.oracle.autodiff`), its optimizer step
(:mod:`sbpflow.oracle.optim`) and its mixed precision (:mod:`sbpflow.precision`) are its own, so that
comparing a compiled run with it checks the compiler's passes against an independent implementation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import GraphError, SbpflowError, ShapeError
from sbpflow.graph import Graph, OpNode, TensorKind
from sbpflow.job import Job
from sbpflow.ops.base import get_op
from sbpflow.ops.eager import EagerBuilder
from sbpflow.oracle import optim
from sbpflow.oracle.autodiff import Arrays, Tape, backward
from sbpflow.oracle.scaling import Scaler
from sbpflow.precision import compute_dtype, low_dtype
from sbpflow.random import RandomKey
from sbpflow.tensor_meta import TensorMeta


def init_parameters(job: Job, xp: ModuleType = np) -> Arrays:
    """Every parameter's initial value, whole, by tensor name."""
    out: Arrays = {}
    for spec in job.parameters:
        meta = job.graph.tensors[spec.tensor].meta
        key = RandomKey.for_tensor(job.config.seed, spec.tensor)
        out[spec.tensor] = spec.init.sample(xp, key, meta.shape, None, meta.dtype.to_numpy())
    return out


def read_inputs(job: Job, step: int = 0) -> Arrays:
    """Batch ``step`` of the job's data source, one array per input tensor."""
    if job.data is None:
        raise SbpflowError(f"job {job.name!r} has no data source; pass inputs= explicitly")
    batch = job.data.read(step)
    return {t.name: batch[t.name] for t in job.graph.of_kind(TensorKind.input)}


def forward(
    job: Job,
    step: int = 0,
    fetches: Iterable[str] | None = None,
    parameters: Mapping[str, Any] | None = None,
    inputs: Mapping[str, Any] | None = None,
    xp: ModuleType = np,
) -> Arrays:
    """Run the forward graph of ``job`` for ``step``; returns the ``fetches`` (default: the loss and the
    job's fetches) by name. ``parameters``/``inputs`` override the initial values and the data batch."""
    g = job.graph
    values: Arrays = dict(init_parameters(job, xp))
    values.update(parameters or {})
    values.update(inputs if inputs is not None else read_inputs(job, step))
    _check_values(job, values)
    wanted = list(fetches) if fetches is not None else [n for n in (job.loss, *job.fetches) if n]
    unknown = [n for n in wanted if n not in g.tensors]
    if unknown:
        raise SbpflowError(f"fetch {unknown} names no tensor of job {job.name!r}")
    tape = Tape(EagerBuilder(xp, seed=job.config.seed, step=step), values)
    _run_forward(job, tape, low=None)
    return {n: values[n] for n in wanted}


def _check_values(job: Job, values: Arrays) -> None:
    """Every source tensor (parameter, input, constant) has a value of its declared shape and dtype."""
    for t in job.graph.tensors.values():
        if t.kind in (TensorKind.activation, TensorKind.gradient):
            continue
        if t.name not in values:
            raise SbpflowError(
                f"{t.kind.value} {t.name!r} {t.meta} has no value; pass it in parameters/inputs"
            )
        v = values[t.name]
        if tuple(v.shape) != t.meta.shape or v.dtype != t.meta.dtype.to_numpy():
            raise ShapeError(
                f"{t.kind.value} {t.name!r} is declared {t.meta} but its value is {list(v.shape)} {v.dtype}"
            )


# ---- training: forward, backward and update on one device ----------------------------------------------


@dataclass(frozen=True)
class TrainResult:
    """Per step, the loss (averaged over the step's micro-batches); at the end, every variable's value."""

    losses: list[float]
    parameters: dict[str, Any]
    optimizer_state: dict[str, Any] = field(default_factory=dict)
    scaler: Scaler | None = None  # dynamic loss scaling's scale per step, skipped steps and state


def micro_batches(job: Job) -> int:
    """How many micro-batches one step's batch is cut into: gradient accumulation times pipeline micro-batches
    (a pipeline averages the gradients of its micro-batches just as accumulation does)."""
    return job.config.gradient_accumulation_steps * job.config.micro_batches


def micro_batch_step(step: int, micro: int, n: int) -> int:
    """The random-stream step of micro-batch ``micro`` of ``n`` in optimizer step ``step``: each micro-batch
    draws its own dropout masks (``step`` itself when there is one micro-batch). Update ops run with
    ``step``. The runtime keys its micro-batches the same way, or its losses differ from these."""
    return step * n + micro


def train(
    job: Job,
    steps: int | None = None,
    parameters: Mapping[str, Any] | None = None,
    xp: ModuleType = np,
    scaler: Scaler | None = None,
) -> TrainResult:
    """Train ``job`` on one device for ``steps`` (default ``config.steps``): the oracle every parallel
    configuration is compared against.

    No compiler pass runs: each step reads batch ``step``, cuts it into :func:`micro_batches` equal parts
    along axis 0, runs forward (under the job's precision, :mod:`sbpflow.precision`) and backward
    (:mod:`sbpflow.oracle.autodiff`) per part, *averages* the parameter gradients (each part's loss is
    its own mean, so the average is the gradient of the whole batch's mean loss: one big-batch step), and
    updates every parameter once from the average (:mod:`sbpflow.oracle.optim`). Recomputation
    (activation checkpointing), pipeline stages, ZeRO and SBP change where and when values are computed,
    not which: the oracle ignores them. ``parameters`` overrides initial values. An fp16 job with
    ``loss_scale = 0`` scales dynamically (:mod:`sbpflow.oracle.scaling`; ``scaler``: go on from one).
    """
    plan = _plan(job)
    values = _initial_values(job, parameters, xp)
    losses: list[float] = []
    scaler = Scaler.of(job) if scaler is None else scaler
    for step in range(job.config.steps if steps is None else steps):
        carried: Arrays = {}
        loss, grads = _step_gradients(plan, values, step, xp, carried, scaler)
        skipped = scaler.skipped_steps if scaler is not None else 0
        if scaler is not None and scaler.step(grads):
            pass  # a non-finite gradient: no parameter or optimizer state moves
        elif job.optimizer is not None:
            builder = EagerBuilder(xp, seed=job.config.seed, step=step)
            values.update(optim.update(job.optimizer, values, grads, builder, step - skipped))
        values.update(carried)  # running statistics: their next values, from this step's forward
        losses.append(loss)
    return TrainResult(
        losses,
        {p.tensor: values[p.tensor] for p in job.parameters},
        {name: values[name] for name in optim.state_names(job.optimizer)},
        scaler,
    )


def gradients(
    job: Job, step: int = 0, parameters: Mapping[str, Any] | None = None, xp: ModuleType = np
) -> tuple[float, dict[str, Any]]:
    """The loss of ``step`` and each trainable parameter's gradient as the optimizer receives it:
    averaged over the micro-batches, unscaled, not yet clipped."""
    return _step_gradients(_plan(job), _initial_values(job, parameters, xp), step, xp)


@dataclass(frozen=True)
class _Plan:
    """What one training step runs: the job, its micro-batch job and the parameters it differentiates."""

    job: Job
    micro: Job  # the job cut to one micro-batch
    n: int  # micro-batches per step
    trainable: tuple[str, ...]  # in the optimizer's order
    low: DType | None  # the compute dtype of mixed precision, or None
    scale: float  # the static loss scale, or 1
    running: tuple[OpNode, ...] = ()  # the running_stat ops: each gives its first input's next value


def _plan(job: Job) -> _Plan:
    if not job.loss:
        raise SbpflowError(f"job {job.name!r} has no loss; call loss.backward() in build() to train it")
    loss = job.graph.tensors[job.loss].meta
    if loss.numel != 1 or not loss.dtype.is_floating:
        raise GraphError(
            f"loss {job.loss!r} is {loss}; training needs a floating scalar: reduce it with mean() or sum()"
        )
    marked = {p.tensor for p in job.parameters if p.trainable}
    spec = job.optimizer
    order = spec.parameters if spec is not None else tuple(p.tensor for p in job.parameters)
    if spec is not None and not set(spec.parameters) <= marked:
        raise GraphError(
            f"job {job.name!r}: the optimizer updates {sorted(set(spec.parameters) - marked)}, which are "
            "not trainable parameters; mark them trainable or leave them out of the optimizer"
        )
    n = micro_batches(job)
    scale = job.config.loss_scale if job.config.loss_scale > 0 else 1.0
    trainable = tuple(p for p in order if p in marked)
    running = tuple(o for o in job.graph.ops if o.op_type == "running_stat")
    if running and n > 1:
        raise SbpflowError(
            f"job {job.name!r}: {running[0].name!r} updates a running statistic once per forward, and a "
            f"step of {n} micro-batches runs {n}; use one micro-batch or eval mode"
        )
    low = low_dtype(job.config.precision)
    return _Plan(job, micro_batch_job(job, n), n, trainable, low, scale, running)


def _initial_values(job: Job, parameters: Mapping[str, Any] | None, xp: ModuleType) -> Arrays:
    values: Arrays = dict(init_parameters(job, xp))
    values.update(parameters or {})
    values.update(optim.initial_state(job, xp))
    return values


def _step_gradients(
    plan: _Plan,
    values: Arrays,
    step: int,
    xp: ModuleType,
    carried: Arrays | None = None,
    scaler: Scaler | None = None,
) -> tuple[float, Arrays]:
    """The step's mean loss over its micro-batches, and each trainable parameter's gradient averaged
    over them (summed in micro-batch order, ``((g0 + g1) + g2) + g3``, then divided). ``carried`` gets
    the next value of each variable a ``running_stat`` op updates (its first input)."""
    job = plan.job
    batch = read_inputs(job, step)
    _check_values(job, {**values, **batch})
    total: Arrays = {}
    loss = 0.0
    for k, part in enumerate(_split_batch(batch, plan.n)):
        builder = EagerBuilder(xp, seed=job.config.seed, step=micro_batch_step(step, k, plan.n))
        tape = Tape(builder, {**values, **part})
        _run_forward(plan.micro, tape, plan.low)
        loss += float(tape.values[job.loss])
        if carried is not None:
            carried.update({o.inputs[0]: tape.values[o.outputs[0]] for o in plan.running})
        if not plan.trainable:
            continue
        seed = plan.scale if scaler is None else float(scaler.scale)
        grads = backward(tape, job.loss, plan.trainable, seed=seed)
        for p, g in grads.items():
            if scaler is not None:
                g = scaler.unscale(g)
            elif plan.scale != 1.0:
                g = g * g.dtype.type(1.0 / plan.scale)
            total[p] = g if k == 0 else total[p] + g
    return loss / plan.n, {p: g / xp.asarray(plan.n, dtype=g.dtype) for p, g in total.items()}


def _run_forward(job: Job, tape: Tape, low: DType | None) -> None:
    """The forward graph op by op on ``tape``; under mixed precision (``low``), each op's floating inputs
    are first cast to the dtype it computes in (one cast per tensor and dtype, before its first reader)."""
    decls = job.graph.tensors
    casts: dict[tuple[str, DType], str] = {}

    def read(t: str, dtype: DType) -> str:
        have = as_dtype(tape.values[t].dtype)
        if not have.is_floating or have == dtype:
            return t
        if (t, dtype) not in casts:
            name = f"{t}.{dtype.value}"
            if name in tape.values:
                raise SbpflowError(
                    f"mixed precision: the cast of {t!r} would be named {name!r}, which is taken"
                )
            tape.apply(name, "cast", (t,), (name,), {"dtype": dtype})
            casts[t, dtype] = name
        return casts[t, dtype]

    for node in job.graph.ops:
        inputs = node.inputs
        if low is not None:
            floats = [i for i in inputs if as_dtype(tape.values[i].dtype).is_floating]
            reads_parameter = any(decls[i].kind == TensorKind.parameter for i in floats if i in decls)
            dtype = compute_dtype(
                node.op_type, [as_dtype(tape.values[i].dtype) for i in floats], reads_parameter, low
            )
            if dtype is not None:
                inputs = tuple(read(i, dtype) for i in inputs)
        tape.apply(node.name, node.op_type, inputs, node.outputs, node.attrs)


def _split_batch(batch: Arrays, n: int) -> list[Arrays]:
    size = next(iter(batch.values())).shape[0]
    return [{k: v[i * size // n : (i + 1) * size // n] for k, v in batch.items()} for i in range(n)]


def micro_batch_job(job: Job, n: int) -> Job:
    """``job`` with every input cut to ``1/n`` of its batch (axis 0), shapes re-inferred op by op.

    Ops whose attrs fix a batch-sized shape (``reshape(shape=(B, T, ...))``, ``broadcast_to``, ``sum_to``)
    follow their input: a leading ``B`` in a ``shape`` attr becomes ``B/n`` where the op's first input
    shrank from ``B`` to ``B/n``. Anything else that depends on the batch size is an error naming the op.
    """
    if n == 1:
        return job
    g = job.graph
    sizes = {t.meta.shape[0] for t in g.of_kind(TensorKind.input) if t.meta.ndim}
    if len(sizes) != 1 or next(iter(sizes)) % n:
        raise SbpflowError(
            f"job {job.name!r}: cutting the batch into {n} micro-batches (gradient_accumulation_steps x "
            f"micro_batches) needs every input to have one batch size divisible by {n}; the inputs have "
            f"batch sizes {sorted(sizes)}. Change the batch size or the number of micro-batches"
        )
    (big,) = sizes
    small = big // n
    tensors = {
        t.name: replace(t, meta=TensorMeta((small, *t.meta.shape[1:]), t.meta.dtype))
        if t.kind == TensorKind.input and t.meta.ndim
        else t
        for t in g.tensors.values()
    }
    ops: list[OpNode] = []
    for node in g.ops:
        ins = [tensors[i].meta for i in node.inputs]
        attrs = dict(node.attrs)
        shrunk = (
            bool(ins)
            and ins[0].ndim > 0
            and ins[0].shape[0] == small
            and g.tensors[node.inputs[0]].meta.shape[0] == big
        )
        shape = attrs.get("shape")
        if shrunk and isinstance(shape, tuple) and shape and shape[0] == big:
            attrs["shape"] = (small, *shape[1:])
        op = get_op(node.op_type)
        try:
            metas = op.run_infer(tuple(ins), op.normalize_attrs(attrs))
        except ShapeError as e:
            raise SbpflowError(
                f"op {node.name!r} ({node.op_type}) cannot run on a micro-batch of {small} of the batch's {big} "
                f"samples: {e}. Its attrs depend on the batch size in a way the reference cannot follow"
            ) from None
        for name, meta in zip(node.outputs, metas, strict=True):
            tensors[name] = replace(tensors[name], meta=meta)
        ops.append(replace(node, attrs=attrs))
    return replace(
        job,
        graph=Graph(tensors, ops),
        config=replace(job.config, gradient_accumulation_steps=1, micro_batches=1),
    )
