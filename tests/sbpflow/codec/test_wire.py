"""Job <-> protobuf conversion is lossless, and malformed messages are refused with clear errors."""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401
from sbpflow.codec import values, wire
from sbpflow.data.sources import ArrayFileSource, ArraySource, DataField, SyntheticSource, TokenFileSource
from sbpflow.dtype import DType
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import (
    SGD,
    AdamW,
    Job,
    JobConfig,
    OptimizerSpec,
    ParameterSpec,
    PipelineSchedule,
    Precision,
    WarmupCosine,
)
from sbpflow.placement import placement
from sbpflow.random import Normal, TruncatedNormal, Zeros
from sbpflow.sbp import B, P, S
from sbpflow.tensor_meta import TensorMeta
from sbpflow.v1 import job_pb2 as pb

MESH = placement("cpu", [[0, 1], [2, 3]])


def small_job(data) -> Job:
    g = Graph()
    f32 = DType.float32
    g.add_tensor(TensorDecl("x", TensorMeta((8, 4), f32), TensorKind.input, MESH, (S(0), B)))
    g.add_tensor(
        TensorDecl("w", TensorMeta((4, 3), f32), TensorKind.parameter, MESH, (B, S(1)), requires_grad=True)
    )
    g.add_tensor(TensorDecl("y", TensorMeta((8, 3), f32)))
    g.add_tensor(TensorDecl("z", TensorMeta((8, 3), f32), placement=MESH, sbp=(P, S(1))))
    g.add_op(OpNode("mm", "matmul", ("x", "w"), ("y",), {"transpose_a": False, "transpose_b": False}, MESH))
    g.add_op(
        OpNode(
            "sc", "mul_scalar", ("y",), ("z",), {"value": 2.5}, MESH, stage=1, checkpoint=True, scope="a.b"
        )
    )
    return Job(
        name="tiny",
        graph=g,
        parameters=[ParameterSpec("w", TruncatedNormal(0.0, 0.02))],
        data=data,
        optimizer=OptimizerSpec(
            AdamW(lr=3e-4), ("w",), clip_grad_norm=1.0, schedule=WarmupCosine(10, 100, 0.1)
        ),
        config=JobConfig(
            steps=5,
            gradient_accumulation_steps=2,
            micro_batches=4,
            pipeline_schedule=PipelineSchedule.gpipe,
            zero_stage=2,
            activation_checkpointing=True,
            precision=Precision.bf16,
            seed=7,
        ),
        loss="z",
        fetches=("y",),
    )


DATA = [
    ArraySource(
        batch_size=2, arrays={"x": np.arange(32, dtype=np.float32).reshape(8, 4), "id": np.arange(8)}
    ),
    ArrayFileSource(batch_size=4, paths={"x": "/data/x.npy"}, shuffle=True, seed=3),
    TokenFileSource(batch_size=4, path="/data/tokens.bin", dtype=DType.int32, seq_len=16),
    SyntheticSource(
        batch_size=8, kind="normal", sample_fields=(DataField("x", (4,), DType.float32),), num_samples=64
    ),
    None,
]


@pytest.mark.parametrize("data", DATA, ids=lambda d: type(d).__name__)
def test_job_round_trips_through_protobuf_bytes(data) -> None:
    job = small_job(data)
    job.verify()
    blob = wire.job_to_proto(job).SerializeToString()
    back = wire.job_from_proto(pb.Job.FromString(blob))
    assert back == job
    assert back.graph.tensors["x"].sbp == (S(0), B)
    assert back.graph.tensors["y"].sbp is None and back.graph.tensors["y"].placement is None
    assert wire.job_to_proto(back).SerializeToString(deterministic=True) == wire.job_to_proto(
        job
    ).SerializeToString(deterministic=True)


@pytest.mark.parametrize(
    "value", [1, -3, 2.5, "tanh", True, False, (1, -1, 3), (0.5, 1.5), DType.int64, None, ()]
)
def test_attr_values_round_trip(value) -> None:
    back = wire.attr_from_proto(wire.attr_to_proto(value))
    assert back == value and type(back) is type(value)


def test_sgd_and_initializers_round_trip() -> None:
    opt = OptimizerSpec(SGD(0.1, 0.9, 1e-4, True), ("a", "b"))
    assert wire.optimizer_from_proto(wire.optimizer_to_proto(opt)) == opt
    for init in (Normal(0.0, 0.02), Zeros(), TruncatedNormal(1.0, 2.0, -1.0, 3.0)):
        assert wire.initializer_from_proto(wire.initializer_to_proto(init)) == init


def test_unknown_format_version_is_refused() -> None:
    m = wire.job_to_proto(small_job(None))
    m.format_version = 99
    with pytest.raises(wire.WireError, match="format version 99"):
        wire.job_from_proto(m)


def test_unspecified_enum_is_refused() -> None:
    m = wire.job_to_proto(small_job(None))
    m.graph.tensors[0].dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(wire.WireError, match="DType"):
        wire.job_from_proto(m)


def test_truncated_array_bytes_are_refused() -> None:
    m = values.array_to_proto(np.zeros((2, 3)))
    m.data = m.data[:-8]
    with pytest.raises(wire.WireError, match="needs 48 bytes"):
        values.array_from_proto(m)
