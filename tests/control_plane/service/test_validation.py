"""Submit-time validation: the examples' jobs pass; each kind of bad input is refused with its message."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import ModuleType

import pytest

from sbpflow.codec import wire
from sbpflow.control_plane.compiler import plan_size
from sbpflow.control_plane.service.validation import ValidationError, compile_submit, validate_submit
from sbpflow.errors import SbpflowError
from sbpflow.limits import LIMITS
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


# ---- the compile's size: issue 29's hostile jobs, refused at Submit before any lowering -------------------


HOSTILE = {  # accepted once, they grew the control plane to 6 GB (gpt) and 3 GB (mlp) while COMPILING
    "gpt": {"layers": 8, "ranks": 2, "pp": 2, "micro_batches": 4096, "batch_size": 4096},
    "mlp": {
        "ranks": 2,
        "pp": 2,
        "layers": 2,
        "batch_size": 131_072,
        "micro_batches": 32_768,
        "grad_accum": 2,
    },
}


@pytest.mark.parametrize("example", sorted(HOSTILE))
def test_a_hostile_job_is_refused_at_submit_naming_its_plan_size(example: str) -> None:
    blob = wire.job_to_proto(load(example).make_job(**HOSTILE[example])).SerializeToString()
    t = time.monotonic()
    e = refused(blob)
    assert time.monotonic() - t < 20  # the graph passes only (~2 s for the GPT); lowering took minutes
    assert e.kind == "limit" and e.field == "rank_tasks"
    assert "tasks, over the limit of 262,144 (Limits.rank_tasks); use fewer micro-batches" in str(e)


def test_a_job_just_under_a_small_limit_passes_and_one_over_it_is_refused(mlp: ModuleType) -> None:
    blob = proto(mlp, ranks=2, pp=2, layers=2, micro_batches=8).SerializeToString()
    size = plan_size.estimate(compile_submit(blob, 2).state)
    at = dataclasses.replace(LIMITS, rank_tasks=size.rank_tasks)
    assert compile_submit(blob, 2, limits=at).state.job.config.micro_batches == 8
    with pytest.raises(ValidationError) as e:
        compile_submit(blob, 2, limits=dataclasses.replace(at, rank_tasks=size.rank_tasks - 1))
    assert e.value.field == "rank_tasks" and f"{size.rank_tasks:,} tasks" in str(e.value)


def test_a_schedule_over_its_limit_is_refused_before_any_pass(mlp: ModuleType) -> None:
    blob = proto(mlp, ranks=2, pp=2, layers=2, micro_batches=64, batch_size=64).SerializeToString()
    with pytest.raises(ValidationError) as e:
        compile_submit(blob, 2, limits=dataclasses.replace(LIMITS, pipeline_slots=100))
    assert e.value.field == "pipeline_slots" and "2 pipeline stage(s) x 64 micro-batches = 128" in str(
        e.value
    )


def test_a_job_manager_sizes_jobs_with_its_own_limits(tmp_path: Path, mlp: ModuleType) -> None:
    from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
    from sbpflow.control_plane.store.job_store import JobStore

    small = dataclasses.replace(LIMITS, rank_tasks=100)
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(store, ManagerConfig(slots=2, limits=small))
        with pytest.raises(ValidationError) as e:
            m.submit(proto(mlp, ranks=2, pp=2, layers=2, micro_batches=8).SerializeToString())
        assert e.value.field == "rank_tasks" and store.list() == []
        m.shutdown()


def test_a_launch_past_the_managers_budget_ends_failed_compile_limit(tmp_path: Path, mlp: ModuleType) -> None:
    """Under every Submit limit, but the in-process backend builds both ranks' tasks in one walk, over a
    ``built_tasks`` that holds one rank's: the run stops there and the job ends FAILED, COMPILE_LIMIT."""
    from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
    from sbpflow.control_plane.store.job_store import JobStore
    from sbpflow.runs.options import MANAGER_DEFAULTS
    from sbpflow.runs.states import JobState

    blob = proto(mlp, ranks=2, steps=2).SerializeToString()
    size = plan_size.estimate(compile_submit(blob, 2).state)
    tight = dataclasses.replace(LIMITS, built_tasks=size.rank_tasks + 5)
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(
            store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2, limits=tight)
        )
        m.start()
        rec = m.submit(blob)
        deadline = time.monotonic() + 60
        while not store.get(rec.id).state.terminal:
            assert time.monotonic() < deadline, "the job never ended"
            time.sleep(0.05)
        end = store.get(rec.id)
        m.shutdown()
    assert end.state == JobState.FAILED and end.reason == "COMPILE_LIMIT"
    assert "(Limits.built_tasks)" in end.message and "use fewer micro-batches" in end.message


def test_cancel_while_compiling_ends_the_job_cancelled_within_seconds(tmp_path: Path) -> None:
    """A job under every limit whose lowering takes ~15 s here (~150,000 tasks): a Cancel while it is
    COMPILING stops the lowering at its next check, and the job ends CANCELLED, not FAILED."""
    from sbpflow.client.client import Client
    from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
    from sbpflow.runs.options import MANAGER_DEFAULTS
    from sbpflow.v1 import service_pb2 as sp

    job = load("gpt").make_job(layers=2, ranks=2, pp=2, micro_batches=512, batch_size=512, steps=1)
    run = MANAGER_DEFAULTS.replace(backend="inprocess")
    plane = ControlPlane(
        ServerConfig(store=str(tmp_path / "jobs.db"), run=run, slots=2, http_port=None)
    ).start()
    try:
        with Client(plane.address) as client:
            h = client.submit(job)
            deadline = time.monotonic() + 60
            while sp.JobState.Name(h.status().state) != "JOB_STATE_COMPILING":
                assert time.monotonic() < deadline, "the job never started compiling"
                time.sleep(0.02)
            time.sleep(1.0)  # well into the lowering
            t = time.monotonic()
            h.cancel("stop compiling")
            st = h.wait(timeout=30)
            waited = time.monotonic() - t
    finally:
        plane.stop()
    assert sp.JobState.Name(st.state) == "JOB_STATE_CANCELLED" and st.reason == "CANCELLED_BY_USER"
    assert waited < 5, f"the cancel took {waited:.1f} s"
