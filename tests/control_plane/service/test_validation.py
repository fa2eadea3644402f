"""Submit-time validation: the examples' jobs pass; each kind of bad input is refused with its message."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from sbpflow.codec import wire
from sbpflow.control_plane.service.validation import ValidationError, validate_submit
from sbpflow.errors import SbpflowError
from sbpflow.v1 import job_pb2
from tests.examples.test_examples import load


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


def proto(mlp: ModuleType, **kwargs) -> job_pb2.Job:
    return wire.job_to_proto(mlp.make_job(**kwargs))


def refused(blob: bytes, cluster_size: int | None = 2) -> ValidationError:
    with pytest.raises(ValidationError) as e:
        validate_submit(blob, cluster_size)
    assert isinstance(e.value, SbpflowError)
    return e.value


@pytest.mark.parametrize(
    "kwargs, cluster", [({}, 2), ({}, None), ({"tp": True, "ranks": 4}, 4), ({"ranks": 2}, 8)]
)
def test_the_mlp_example_passes(mlp: ModuleType, kwargs, cluster) -> None:
    job = validate_submit(proto(mlp, **kwargs).SerializeToString(), cluster)
    assert job.loss and job.data is not None and "matmul" in {o.op_type for o in job.graph.ops}


def test_the_gpt_example_passes() -> None:
    job = load("gpt").make_job(tp=True)
    blob = wire.job_to_proto(job).SerializeToString()
    assert validate_submit(blob, 8).loss == job.loss


@pytest.mark.parametrize("blob", [b"\xff\xff\xff\xff", b"this is not a protobuf at all", b"\x0a\x05ab"])
def test_garbage_bytes(blob: bytes) -> None:
    e = refused(blob)
    assert str(e).startswith("malformed Job protobuf: ") and e.kind == "malformed" and e.field == "job"


def test_wrong_format_version(mlp: ModuleType) -> None:
    m = proto(mlp)
    m.format_version = 99
    e = refused(m.SerializeToString())
    assert "format version 99" in str(e) and e.kind == "wire"


def test_unknown_op(mlp: ModuleType) -> None:
    m = proto(mlp)
    m.graph.ops[2].op_type = "frobnicate"
    e = refused(m.SerializeToString())
    assert "frobnicate" in str(e) and m.graph.ops[2].name in str(e) and e.kind == "graph"


def test_shape_mismatch(mlp: ModuleType) -> None:
    m = proto(mlp)
    w = next(t for t in m.graph.tensors if t.name == "model.net.0.weight")
    del w.shape[:]
    w.shape.extend([17, 32])  # x is [32, 16]: the matmul's inner sizes no longer agree
    e = refused(m.SerializeToString())
    msg = str(e)
    assert "model.net.0.matmul_0" in msg and "model.net.0.weight" in msg and "16 vs 17" in msg
    assert e.kind == "graph"


def test_missing_loss(mlp: ModuleType) -> None:
    m = proto(mlp)
    m.loss = ""
    e = refused(m.SerializeToString())
    assert "no loss" in str(e) and "loss.backward()" in str(e) and e.field == "job.loss"


def test_missing_data_source(mlp: ModuleType) -> None:
    m = proto(mlp)
    m.ClearField("data")
    e = refused(m.SerializeToString())
    assert "no data source" in str(e) and "Graph.trace" in str(e) and e.field == "job.data"


def test_placement_larger_than_the_cluster(mlp: ModuleType) -> None:
    e = refused(proto(mlp, ranks=4).SerializeToString(), cluster_size=2)
    msg = str(e)
    assert "rank 3" in msg and "2 device(s)" in msg and "at most 2 ranks" in msg and e.kind == "compile"


def test_too_large() -> None:
    with pytest.raises(ValidationError, match="over the limit of 10 bytes") as e:
        validate_submit(b"x" * 11, None, max_bytes=10)
    assert e.value.kind == "too_large"


def test_impossible_sbp(mlp: ModuleType) -> None:
    m = proto(mlp, tp=True, ranks=4)
    w = next(t for t in m.graph.tensors if t.name == "model.net.0.weight")
    w.sbp.sbp[0].split.axis = 5
    e = refused(m.SerializeToString(), cluster_size=4)
    assert "S(5)" in str(e) and "model.net.0.weight" in str(e) and "only 2 axes" in str(e)


def test_validation_writes_nothing(mlp: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    validate_submit(proto(mlp).SerializeToString(), 2)
    refused(b"\xff\xff")
    assert list(tmp_path.iterdir()) == []
