"""The one-device reference executor: a Job's forward graph (``forward``) or its training steps (``train``:
forward, backward, update) run op by op on whole numpy arrays.

It is the oracle for distributed equivalence: every parallel configuration of a job must reproduce its
losses and its trained parameters. Parameters are drawn from their initializers keyed by (``config.seed``, ``tensor_rng_id(name)``)
— the same key the runtime uses for each shard, so the values agree whatever the layout — inputs are
batch ``step`` of the data source, and random ops draw with (seed, rng_id, step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow.errors import SbpflowError, ShapeError
from sbpflow.graph import Graph, OpNode, TensorKind
from sbpflow.job import Job
from sbpflow.ops.base import get_op
from sbpflow.ops.eager import EagerBuilder
from sbpflow.random import RandomKey
from sbpflow.tensor_meta import TensorMeta

Arrays = dict[str, Any]


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
    builder = EagerBuilder(xp, seed=job.config.seed, step=step)
    for node in g.ops:
        try:
            outs = builder.call(node.op_type, *(values[i] for i in node.inputs), **node.attrs)
        except ShapeError as e:
            raise ShapeError(f"op {node.name!r} ({node.op_type}): {e}") from None
        values.update(zip(node.outputs, outs, strict=True))
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
) -> TrainResult:
    """Train ``job`` on one device for ``steps`` (default ``config.steps``): the oracle every parallel
    configuration is compared against.

    The job is compiled by autodiff and optimizer insertion alone. Each step reads batch ``step``, cuts it
    into :func:`micro_batches` equal parts along axis 0, runs forward and backward per part, *averages*
    the parameter gradients (each part's loss is its own mean, so the average is the gradient of the
    whole batch's mean loss: one big-batch step), runs the optimizer ops once on the average, and moves
    every variable to its new value. ``parameters`` overrides initial values.
    """
    c = _compile(job)
    values = _initial_values(job, c, parameters, xp)
    losses: list[float] = []
    for step in range(job.config.steps if steps is None else steps):
        loss, grads = _step_gradients(job, c, values, step, xp)
        builder = EagerBuilder(xp, seed=job.config.seed, step=step)
        out = _run_ops(c.update, {**values, **grads}, builder)
        values.update({var: out[new] for var, new in c.state.updates.items()})
        losses.append(loss)
    return TrainResult(
        losses,
        {p.tensor: values[p.tensor] for p in job.parameters},
        {name: values[name] for name in c.state.state_vars},
    )


def gradients(
    job: Job, step: int = 0, parameters: Mapping[str, Any] | None = None, xp: ModuleType = np
) -> tuple[float, dict[str, Any]]:
    """The loss of ``step`` and each trainable parameter's gradient as the optimizer receives it:
    averaged over the micro-batches, unscaled, not yet clipped."""
    c = _compile(job)
    loss, grads = _step_gradients(job, c, _initial_values(job, c, parameters, xp), step, xp)
    return loss, {p: grads[g] for p, g in c.state.grads.items()}


@dataclass(frozen=True)
class _Compiled:
    state: Any  # the CompileState after autodiff and optimizer insertion
    backward: list[OpNode]  # forward and backward ops, run per micro-batch
    update: list[OpNode]  # clipping and update ops, run once per step
    n: int  # micro-batches per step


def _compile(job: Job) -> _Compiled:
    """The micro-batch job through the graph-rewriting passes, split where the optimizer begins.

    It runs the passes that change what is computed (autodiff, optimizer insertion, mixed precision,
    recompute), not those that only change where (SBP, boxing), so the oracle runs exactly the math the
    runtime runs, on one device.
    """
    # imported here: sbpflow's core does not depend on the control plane at import time
    from sbpflow.control_plane.compiler import autodiff, checkpointing, mixed_precision, optimizer
    from sbpflow.control_plane.compiler.state import CompileState

    if not job.loss:
        raise SbpflowError(f"job {job.name!r} has no loss; call loss.backward() in build() to train it")
    n = micro_batches(job)
    state = CompileState.start(micro_batch_job(job, n))
    for p in (autodiff, optimizer, mixed_precision, checkpointing):
        p.run(state)
    ops = state.graph.ops
    split = next((i for i, o in enumerate(ops) if o.name.startswith(optimizer.PREFIX)), len(ops))
    return _Compiled(state, ops[:split], ops[split:], n)


def _initial_values(job: Job, c: _Compiled, parameters: Mapping[str, Any] | None, xp: ModuleType) -> Arrays:
    values: Arrays = dict(init_parameters(job, xp))
    values.update(parameters or {})
    for name in c.state.state_vars:
        meta = c.state.graph.tensors[name].meta
        values[name] = xp.zeros(meta.shape, dtype=meta.dtype.to_numpy())
    return values


def _step_gradients(
    job: Job, c: _Compiled, values: Arrays, step: int, xp: ModuleType
) -> tuple[float, Arrays]:
    """The step's mean loss over its micro-batches, and its gradient tensors (by name) averaged over them."""
    batch = read_inputs(job, step)
    _check_values(job, {**values, **batch})
    total: Arrays = {}
    loss = 0.0
    for k, part in enumerate(_split_batch(batch, c.n)):
        builder = EagerBuilder(xp, seed=job.config.seed, step=micro_batch_step(step, k, c.n))
        out = _run_ops(c.backward, {**values, **part}, builder)
        loss += float(out[job.loss])
        for grad in c.state.grads.values():
            total[grad] = out[grad] if k == 0 else total[grad] + out[grad]
    return loss / c.n, {name: g / xp.asarray(c.n, dtype=g.dtype) for name, g in total.items()}


def _run_ops(ops: Iterable[OpNode], values: Arrays, builder: EagerBuilder) -> Arrays:
    for node in ops:
        try:
            outs = builder.call(node.op_type, *(values[i] for i in node.inputs), **node.attrs)
        except ShapeError as e:
            raise ShapeError(f"op {node.name!r} ({node.op_type}): {e}") from None
        values.update(zip(node.outputs, outs, strict=True))
    return values


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
