"""Conversion between the core's value types and the wire protobufs (``sbpflow.v1``), both ways.

Protobufs stop here: the rest of the code works on frozen dataclasses. ``job_from_proto`` is strict —
a field the core cannot represent is an error naming the field — because the control plane calls it
on untrusted input at Submit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sbpflow.codec.data_wire import data_from_proto, data_to_proto
from sbpflow.codec.scaling import loss_scaling_from_proto, loss_scaling_to_proto
from sbpflow.codec.values import (  # WireError and dtype_*: many callers import them from here
    WireError,
    dtype_from_proto,
    dtype_to_proto,
    inverse,
)
from sbpflow.dtype import DType
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import (
    ELASTIC_GRACE,
    FUSION,
    GRAD_BUCKET_BYTES,
    SGD,
    AdamW,
    ConstantLR,
    Job,
    JobConfig,
    OptimizerSpec,
    ParameterSpec,
    ParamGroup,
    PipelineSchedule,
    Precision,
    WarmupCosine,
)
from sbpflow.ops.base import AttrValue
from sbpflow.placement import Placement
from sbpflow.random import Initializer, make_initializer
from sbpflow.sbp import B, NdSbp, P, Sbp, Split
from sbpflow.tensor_meta import TensorMeta
from sbpflow.v1 import job_pb2 as pb

# ---- enums: one table each way ------------------------------------------------------------------

_DEVICE = {"cpu": pb.DEVICE_TYPE_CPU, "cuda": pb.DEVICE_TYPE_CUDA}
_KIND = {k: getattr(pb, f"TENSOR_KIND_{k.name.upper()}") for k in TensorKind}
_PRECISION = {p: getattr(pb, f"PRECISION_{p.name.upper()}") for p in Precision}
_SCHEDULE = {s: getattr(pb, f"PIPELINE_SCHEDULE_{s.name.upper()}") for s in PipelineSchedule}


_device_from_proto = inverse(_DEVICE, "DeviceType")
_kind_from_proto = inverse(_KIND, "TensorKind")
_precision_from_proto = inverse(_PRECISION, "Precision")
_schedule_from_proto = inverse(_SCHEDULE, "PipelineSchedule")


# ---- placement and SBP ----------------------------------------------------------------------------


def placement_to_proto(p: Placement) -> pb.Placement:
    return pb.Placement(device_type=_DEVICE[p.device_type], mesh_shape=p.shape, ranks=p.ranks)


def placement_from_proto(m: pb.Placement) -> Placement:
    return Placement(_device_from_proto(m.device_type), tuple(m.ranks), tuple(m.mesh_shape))


def sbp_to_proto(s: Sbp) -> pb.Sbp:
    if isinstance(s, Split):
        return pb.Sbp(split=pb.Split(axis=s.axis))
    return pb.Sbp(broadcast=pb.Broadcast()) if s == B else pb.Sbp(partial_sum=pb.PartialSum())


def sbp_from_proto(m: pb.Sbp) -> Sbp:
    kind = m.WhichOneof("kind")
    table: dict[str | None, Any] = {
        "split": lambda: Split(m.split.axis),
        "broadcast": lambda: B,
        "partial_sum": lambda: P,
    }
    if kind not in table:
        raise WireError("an Sbp message sets none of split, broadcast, partial_sum")
    return table[kind]()


def nd_sbp_to_proto(nd: NdSbp) -> pb.NdSbp:
    return pb.NdSbp(sbp=[sbp_to_proto(s) for s in nd])


def nd_sbp_from_proto(m: pb.NdSbp) -> NdSbp:
    return tuple(sbp_from_proto(s) for s in m.sbp)


# ---- attributes -------------------------------------------------------------------------------------


def attr_to_proto(v: AttrValue) -> pb.AttrValue:
    if v is None:
        return pb.AttrValue(none=True)
    if isinstance(v, DType):
        return pb.AttrValue(dtype=dtype_to_proto(v))
    if isinstance(v, bool):
        return pb.AttrValue(b=v)
    if isinstance(v, int):
        return pb.AttrValue(i=v)
    if isinstance(v, float):
        return pb.AttrValue(f=v)
    if isinstance(v, str):
        return pb.AttrValue(s=v)
    if isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return pb.AttrValue(ints=pb.Int64List(values=v))  # type: ignore[arg-type]
    if isinstance(v, tuple) and all(isinstance(x, float) for x in v):
        return pb.AttrValue(floats=pb.DoubleList(values=v))
    raise WireError(
        f"attribute value {v!r} has no wire form; use int, float, str, bool, a tuple of ints or floats"
    )


def attr_from_proto(m: pb.AttrValue) -> AttrValue:
    table: dict[str | None, Any] = {
        "i": lambda: m.i,
        "f": lambda: m.f,
        "s": lambda: m.s,
        "b": lambda: m.b,
        "ints": lambda: tuple(m.ints.values),
        "floats": lambda: tuple(m.floats.values),
        "dtype": lambda: dtype_from_proto(m.dtype),
        "none": lambda: None,
    }
    kind = m.WhichOneof("value")
    if kind not in table:
        raise WireError("an AttrValue sets no value")
    return table[kind]()


# ---- graph ----------------------------------------------------------------------------------------


def tensor_to_proto(t: TensorDecl) -> pb.Tensor:
    m = pb.Tensor(
        name=t.name,
        shape=t.meta.shape,
        dtype=dtype_to_proto(t.meta.dtype),
        kind=_KIND[t.kind],
        requires_grad=t.requires_grad,
    )
    if t.placement is not None:
        m.placement.CopyFrom(placement_to_proto(t.placement))
    if t.sbp is not None:
        m.sbp.CopyFrom(nd_sbp_to_proto(t.sbp))
    return m


def tensor_from_proto(m: pb.Tensor) -> TensorDecl:
    return TensorDecl(
        m.name,
        TensorMeta(tuple(m.shape), dtype_from_proto(m.dtype)),
        _kind_from_proto(m.kind),
        placement_from_proto(m.placement) if m.HasField("placement") else None,
        nd_sbp_from_proto(m.sbp) if m.HasField("sbp") else None,
        m.requires_grad,
    )


def op_to_proto(o: OpNode) -> pb.Op:
    m = pb.Op(
        name=o.name,
        op_type=o.op_type,
        inputs=o.inputs,
        outputs=o.outputs,
        stage=o.stage,
        checkpoint=o.checkpoint,
        scope=o.scope,
    )
    for k, v in o.attrs.items():
        m.attrs[k].CopyFrom(attr_to_proto(v))
    if o.placement is not None:
        m.placement.CopyFrom(placement_to_proto(o.placement))
    return m


def op_from_proto(m: pb.Op) -> OpNode:
    return OpNode(
        m.name,
        m.op_type,
        tuple(m.inputs),
        tuple(m.outputs),
        {k: attr_from_proto(m.attrs[k]) for k in sorted(m.attrs)},
        placement_from_proto(m.placement) if m.HasField("placement") else None,
        m.stage,
        m.checkpoint,
        m.scope,
    )


def graph_to_proto(g: Graph) -> pb.Graph:
    return pb.Graph(
        tensors=[tensor_to_proto(t) for t in g.tensors.values()], ops=[op_to_proto(o) for o in g.ops]
    )


def graph_from_proto(m: pb.Graph) -> Graph:
    g = Graph()
    for t in m.tensors:
        g.add_tensor(tensor_from_proto(t))
    for o in m.ops:
        g.add_op(op_from_proto(o))
    return g


# ---- parameters, arrays, data ---------------------------------------------------------------------


def initializer_to_proto(init: Initializer) -> pb.Initializer:
    return pb.Initializer(
        kind=init.name,
        params={f.name: float(getattr(init, f.name)) for f in dataclasses.fields(init)},  # type: ignore[arg-type]
    )  # type: ignore[arg-type]


def initializer_from_proto(m: pb.Initializer) -> Initializer:
    try:
        return make_initializer(m.kind, **dict(m.params))
    except (TypeError, ValueError) as e:
        raise WireError(f"initializer {m.kind!r} with params {dict(m.params)}: {e}") from None


# ---- optimizer and config -------------------------------------------------------------------------


def optimizer_to_proto(o: OptimizerSpec) -> pb.Optimizer:
    m = pb.Optimizer(clip_grad_norm=o.clip_grad_norm, parameters=o.parameters)
    a = o.algorithm
    if isinstance(a, SGD):
        m.sgd.CopyFrom(pb.Sgd(lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay, nesterov=a.nesterov))
    else:
        m.adamw.CopyFrom(
            pb.AdamW(lr=a.lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay)
        )
    if isinstance(o.schedule, WarmupCosine):
        s = o.schedule
        m.schedule.warmup_cosine.CopyFrom(
            pb.WarmupCosine(
                warmup_steps=s.warmup_steps, total_steps=s.total_steps, min_lr_ratio=s.min_lr_ratio
            )
        )
    else:
        m.schedule.constant.SetInParent()
    for g in o.groups:
        m.groups.add(parameters=g.parameters, lr=g.lr, weight_decay=g.weight_decay)
    return m


def optimizer_from_proto(m: pb.Optimizer) -> OptimizerSpec:
    kind = m.WhichOneof("kind")
    algo: SGD | AdamW
    if kind == "sgd":
        algo = SGD(m.sgd.lr, m.sgd.momentum, m.sgd.weight_decay, m.sgd.nesterov)
    elif kind == "adamw":
        a = m.adamw
        algo = AdamW(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay)
    else:
        raise WireError("the Optimizer sets no algorithm; give sgd or adamw")
    schedule: ConstantLR | WarmupCosine = ConstantLR()
    if m.schedule.WhichOneof("kind") == "warmup_cosine":
        w = m.schedule.warmup_cosine
        schedule = WarmupCosine(w.warmup_steps, w.total_steps, w.min_lr_ratio)
    groups = tuple(
        ParamGroup(
            tuple(g.parameters),
            g.lr if g.HasField("lr") else None,
            g.weight_decay if g.HasField("weight_decay") else None,
        )
        for g in m.groups
    )
    return OptimizerSpec(algo, tuple(m.parameters), m.clip_grad_norm, schedule, groups)


def config_to_proto(c: JobConfig) -> pb.JobConfig:
    return pb.JobConfig(
        steps=c.steps,
        gradient_accumulation_steps=c.gradient_accumulation_steps,
        micro_batches=c.micro_batches,
        pipeline_schedule=_SCHEDULE[c.pipeline_schedule],
        zero_stage=c.zero_stage,
        activation_checkpointing=c.activation_checkpointing,
        precision=_PRECISION[c.precision],
        loss_scale=c.loss_scale,
        seed=c.seed,
        checkpoint_every=c.checkpoint_every,
        grad_bucket_bytes=c.grad_bucket_bytes,
        fusion=c.fusion,
        eval_every=c.eval_every,
        eval_batches=c.eval_batches,
        elastic=c.elastic,
        elastic_grace=c.elastic_grace,
        loss_scaling=loss_scaling_to_proto(c.loss_scaling),
    )


def config_from_proto(m: pb.JobConfig) -> JobConfig:
    return JobConfig(
        m.steps,
        m.gradient_accumulation_steps,
        m.micro_batches,
        _schedule_from_proto(m.pipeline_schedule),
        m.zero_stage,
        m.activation_checkpointing,
        _precision_from_proto(m.precision),
        m.loss_scale,
        m.seed,
        m.checkpoint_every,
        m.grad_bucket_bytes if m.HasField("grad_bucket_bytes") else GRAD_BUCKET_BYTES,
        m.fusion if m.HasField("fusion") else FUSION,
        m.eval_every,
        m.eval_batches or 1,
        tuple(m.elastic),
        m.elastic_grace if m.HasField("elastic_grace") else ELASTIC_GRACE,
        loss_scaling_from_proto(m),
    )


# ---- job ------------------------------------------------------------------------------------------


def job_to_proto(job: Job) -> pb.Job:
    m = pb.Job(
        format_version=job.format_version,
        name=job.name,
        graph=graph_to_proto(job.graph),
        parameters=[
            pb.Parameter(tensor=p.tensor, init=initializer_to_proto(p.init), trainable=p.trainable)
            for p in job.parameters
        ],
        config=config_to_proto(job.config),
        loss=job.loss,
        fetches=job.fetches,
    )
    if job.data is not None:
        m.data.CopyFrom(data_to_proto(job.data))
    if job.optimizer is not None:
        m.optimizer.CopyFrom(optimizer_to_proto(job.optimizer))
    if job.eval_data is not None:
        m.eval_data.CopyFrom(data_to_proto(job.eval_data))
    return m


def job_from_proto(m: pb.Job) -> Job:
    from sbpflow.job import FORMAT_VERSION

    if m.format_version != FORMAT_VERSION:
        raise WireError(
            f"job format version {m.format_version} is not supported (this sbpflow reads {FORMAT_VERSION}); "
            "trace the job again with a matching client"
        )
    return Job(
        name=m.name,
        graph=graph_from_proto(m.graph),
        parameters=[
            ParameterSpec(p.tensor, initializer_from_proto(p.init), p.trainable) for p in m.parameters
        ],
        data=data_from_proto(m.data) if m.HasField("data") else None,
        optimizer=optimizer_from_proto(m.optimizer) if m.HasField("optimizer") else None,
        config=config_from_proto(m.config),
        loss=m.loss,
        fetches=tuple(m.fetches),
        format_version=m.format_version,
        eval_data=data_from_proto(m.eval_data) if m.HasField("eval_data") else None,
    )
