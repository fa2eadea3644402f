"""Resuming jobs on the control plane (in-process backend unless Ray is the point): Resume makes a new job
linked to an ended one that goes on from its latest checkpoint, under the same or another layout, and
refuses a job that does not match the checkpoint (naming the tensors) or one with nothing to resume; a
job in flight when the control plane is SIGKILLed resumes from its checkpoint as its next attempt; a job
cancelled while a large checkpoint is being written leaves only complete checkpoints, the latest of
which loads; a lost Ray worker shows as attempt 2 in status, events and metrics."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint import read as ck_read
from sbpflow.checkpoint.format import MANIFEST, step_dir
from sbpflow.checkpoint.read import CheckpointReader, list_checkpoints, read_logical
from sbpflow.client.cli.main import main as cli
from sbpflow.client.client import Client, ClientError
from sbpflow.codec import wire
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.service.resume import NotResumable, start_checkpoint
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.control_plane.service.validation import ValidationError
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.job import Job
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.service.test_server import LONG, until
from tests.examples.test_examples import load

EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "mlp.py")


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


def job_of(mlp: ModuleType, steps: int, every: int = 2, **kw: Any) -> Job:
    job = mlp.make_job(steps=steps, **kw)
    return dataclasses.replace(job, config=dataclasses.replace(job.config, checkpoint_every=every))


def blob(job: Job) -> bytes:
    return wire.job_to_proto(job).SerializeToString()


def wait_end(m: JobManager, job_id: str) -> JobState:
    for _ in m.follow(job_id):
        pass
    return m.store.get(job_id).state


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[JobManager]:
    with JobStore(tmp_path / "jobs.db") as store:
        config = ManagerConfig(
            run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=4, checkpoint_root=str(tmp_path / "ckpt")
        )
        m = JobManager(store, config)
        m.start()
        yield m
        m.shutdown()


@pytest.fixture
def ended(manager: JobManager, mlp: ModuleType) -> str:
    """A DP 2 job of 4 steps that checkpointed at steps 2 and 4."""
    rec = manager.submit(blob(job_of(mlp, 4)))
    assert wait_end(manager, rec.id) == JobState.SUCCEEDED
    return rec.id


# ---- Resume through the job manager -------------------------------------------------------------------


@pytest.mark.parametrize("layout", [{}, {"ranks": 4}, {"ranks": 2, "tp": True}, {"ranks": 1}])
def test_resume_goes_on_from_the_latest_checkpoint_under_any_layout(
    manager: JobManager, mlp: ModuleType, ended: str, layout: dict[str, Any]
) -> None:
    root = Path(manager.config.checkpoint_root or "")
    latest = ck_read.latest(root / ended)
    assert latest is not None and latest.step == 4
    new = manager.resume(ended, blob(job_of(mlp, 6, **layout)))
    assert new.id != ended and new.resumed_from == ended and new.resume_checkpoint == str(latest.path)
    assert wait_end(manager, new.id) == JobState.SUCCEEDED
    got = manager.store.losses(new.id)
    assert [p.step for p in got] == [5, 6]
    want = sf.run(job_of(mlp, 6, every=0), backend="inprocess", timeout=60).losses
    np.testing.assert_allclose([p.loss for p in got], want[4:], rtol=1e-4)
    assert [c.step for c in list_checkpoints(root / new.id)] == [6]  # its own folder
    assert manager.last_checkpoint(new.id) == str(step_dir(root / new.id, 6))
    assert manager.store.get(ended).state == JobState.SUCCEEDED  # the old job is left as it was
    logs = [line.text for line in manager.store.logs(new.id)]
    assert f"resumes job {ended} from {latest.path}" in logs


def test_resume_without_a_job_reruns_the_submitted_one(manager: JobManager, mlp: ModuleType) -> None:
    rec = manager.submit(blob(job_of(mlp, LONG)))
    until(
        lambda: ck_read.latest(Path(manager.config.checkpoint_root or "") / rec.id) is not None,
        "a checkpoint",
    )
    manager.cancel(rec.id)
    assert wait_end(manager, rec.id) == JobState.CANCELLED
    new = manager.resume(rec.id)
    until(lambda: len(manager.store.losses(new.id)) >= 2, "the resumed job to step")
    first = manager.store.losses(new.id)[0].step
    assert CheckpointReader(new.resume_checkpoint).step == first - 1
    manager.cancel(new.id)
    assert wait_end(manager, new.id) == JobState.CANCELLED


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"hidden": 64}, "'model.net.0.weight' is [16, 64] float32 in the job but [16, 32] float32 there"),
        ({"layers": 2}, "the job's parameter 'model.net.4.weight' [32, 4] float32 is not in the checkpoint"),
        ({"n_in": 8}, "'model.net.0.weight' is [8, 32] float32"),
    ],
)
def test_a_job_that_does_not_match_the_checkpoint_is_refused_naming_the_tensors(
    manager: JobManager, mlp: ModuleType, ended: str, kw: dict[str, Any], named: str
) -> None:
    before = manager.store.count()
    with pytest.raises(ValidationError, match="does not match the checkpoint") as e:
        manager.resume(ended, blob(job_of(mlp, 6, **kw)))
    assert named in str(e.value) and "only its layout" in str(e.value) and e.value.kind == "checkpoint"
    assert manager.store.count() == before  # nothing stored


def test_a_retried_resume_returns_the_first_new_job(manager: JobManager, mlp: ModuleType, ended: str) -> None:
    first = manager.resume(ended, blob(job_of(mlp, 6)), client_id="me", idempotency_key="k")
    again = manager.resume(ended, blob(job_of(mlp, 6)), client_id="me", idempotency_key="k")
    assert again.id == first.id and manager.store.count() == 2
    assert wait_end(manager, first.id) == JobState.SUCCEEDED
    assert sum("resumes job" in line.text for line in manager.store.logs(first.id)) == 1


def test_a_job_with_no_steps_left_after_the_checkpoint_is_refused(
    manager: JobManager, mlp: ModuleType, ended: str
) -> None:
    with pytest.raises(ValidationError, match="trains 4 steps .* nothing is left to train; .*--steps 8"):
        manager.resume(ended)


def test_what_cannot_be_resumed_says_why(tmp_path: Path, manager: JobManager, mlp: ModuleType) -> None:
    running = manager.submit(blob(job_of(mlp, LONG)))
    with pytest.raises(
        NotResumable, match=f"is (PENDING|COMPILING|STARTING|RUNNING).*sbpflow cancel {running.id}"
    ):
        manager.resume(running.id)
    manager.cancel(running.id)
    never = manager.submit(blob(job_of(mlp, 2, every=0)))
    assert wait_end(manager, never.id) == JobState.SUCCEEDED
    with pytest.raises(NotResumable, match="no complete checkpoint in .*checkpoint_every > 0"):
        manager.resume(never.id)
    with pytest.raises(KeyError, match="no job with id 'nope'"):
        manager.resume("nope")
    with JobStore(tmp_path / "other.db") as store:
        bare = JobManager(
            store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2)
        )  # keeps no checkpoints
        bare.start()
        rec = bare.submit(blob(job_of(mlp, 2)))
        assert wait_end(bare, rec.id) == JobState.SUCCEEDED
        with pytest.raises(NotResumable, match="--checkpoint-root"):
            bare.resume(rec.id)


def test_a_chain_of_resumes_passes_the_checkpoint_on(manager: JobManager, ended: str) -> None:
    """A resumed job that has not written a checkpoint yet goes on from the one it started from."""
    root = manager.config.checkpoint_root or ""
    first = ck_read.latest(Path(root) / ended)
    rec = manager.store.create(
        manager.store.get(ended).job_proto,
        "j",
        resumed_from=ended,
        resume_checkpoint=str(first.path if first else ""),
    )
    found = start_checkpoint(root, rec)
    assert found is not None and first is not None and (found.path, found.step) == (first.path, first.step)
    damaged = manager.store.create(b"", "j", resume_checkpoint=str(Path(root) / "gone"))
    assert start_checkpoint(root, damaged) is None


# ---- Cancel while a large checkpoint is being written -------------------------------------------------


def test_cancel_during_a_checkpoint_leaves_only_complete_ones_and_the_latest_loads(
    manager: JobManager, mlp: ModuleType
) -> None:
    # 4096 x 1024 weights with momentum: ~34 MB a checkpoint, one every step
    job = job_of(mlp, LONG, every=1, ranks=2, n_in=1024, hidden=4096)
    rec = manager.submit(blob(job))
    where = Path(manager.config.checkpoint_root or "") / rec.id

    def writing() -> bool:
        return any(d.is_dir() and not (d / MANIFEST).exists() for d in where.glob("step-*"))

    until(lambda: ck_read.latest(where) is not None and writing(), "a checkpoint being written", timeout=120)
    manager.cancel(rec.id, "mid-checkpoint")
    assert wait_end(manager, rec.id) == JobState.CANCELLED
    end = manager.store.get(rec.id)
    assert (end.reason, end.message) == ("CANCELLED_BY_USER", "mid-checkpoint")
    listed = list_checkpoints(where)
    on_disk = sorted(where.glob("step-*"))
    assert listed and [c.path for c in listed] == [d for d in on_disk if (d / MANIFEST).exists()]
    last = CheckpointReader(where)  # the latest loads: every file whole, every tensor readable
    assert last.path == listed[-1].path and manager.last_checkpoint(rec.id) == str(last.path)
    weight = last.read("model.net.0.weight")
    assert weight.shape == (1024, 4096) and np.isfinite(weight).all()
    assert sorted(last.names()) == sorted(read_logical(where, kinds=None))
    new = manager.resume(
        rec.id, blob(dataclasses.replace(job, config=dataclasses.replace(job.config, steps=last.step + 1)))
    )
    assert new.resume_checkpoint == str(last.path)
    assert wait_end(manager, new.id) == JobState.SUCCEEDED
    assert [p.step for p in manager.store.losses(new.id)] == [last.step + 1]


# ---- over gRPC and the CLI ----------------------------------------------------------------------------


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    p = ControlPlane(
        ServerConfig(
            store=str(tmp_path / "jobs.db"),
            run=MANAGER_DEFAULTS.replace(backend="inprocess"),
            slots=4,
            http_port=None,
            checkpoint_root=str(tmp_path / "ckpt"),
        )
    ).start()
    yield p
    p.stop()


def test_client_and_cli_resume(
    plane: ControlPlane, mlp: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(plane.address) as c:
        old = c.submit(job_of(mlp, 4))
        assert sp.JobState.Name(old.wait(60).state) == "JOB_STATE_SUCCEEDED"
        new = c.resume(old.job_id, job_of(mlp, 6, ranks=4))
        st = new.wait(60)
        assert sp.JobState.Name(st.state) == "JOB_STATE_SUCCEEDED" and st.resumed_from == old.job_id
        assert st.resume_checkpoint.endswith(f"{old.job_id}/step-00000004") and st.last_checkpoint.endswith(
            f"{new.job_id}/step-00000006"
        )
        assert len(new.result().losses) == 2
        with pytest.raises(ClientError) as bad:
            c.resume(old.job_id, job_of(mlp, 6, hidden=8))
        assert (
            bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'model.net.0.weight'" in bad.value.details
        )
        with pytest.raises(ClientError) as none:
            c.resume(c.submit(job_of(mlp, LONG)).job_id)
        assert (
            none.value.code == grpc.StatusCode.FAILED_PRECONDITION and "cancel it first" in none.value.details
        )
        with pytest.raises(ClientError) as unknown:
            c.resume("nope")
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND

        flags = ["--address", plane.address]
        assert cli(["submit", EXAMPLE, "--steps", "4", "--checkpoint-every", "2", "--watch", *flags]) == 0
        submitted = capsys.readouterr().out.splitlines()[0]
        where = Path(plane.config.checkpoint_root or "") / submitted
        assert [x.step for x in list_checkpoints(where)] == [2, 4]
        again = ["resume", submitted, EXAMPLE, "--ranks", "2", "--tp", "--steps", "6", "--watch"]
        assert cli([*again, *flags]) == 0
        out, err = capsys.readouterr()
        cli_job = out.splitlines()[0]
        assert f"job {cli_job} resumes job {submitted} from {where / 'step-00000004'}" in err
        assert c.get(cli_job).resumed_from == submitted and c.get(cli_job).step == 6
        assert cli(["status", cli_job, *flags]) == 0
        out, _ = capsys.readouterr()
        assert (
            f"resumed from job {submitted} at " in out and "attempt 1" in out and "last checkpoint: " in out
        )
        assert cli(["resume", old.job_id, "--ranks", "2", *flags]) == 2
        assert "give the example file too" in capsys.readouterr().err
        assert cli(["resume", old.job_id, *flags]) == 1  # the job as submitted: 4 steps, none left (refused)
        assert "nothing is left to train" in capsys.readouterr().err


# ---- a control-plane restart resumes what it can ------------------------------------------------------


def test_a_control_plane_killed_mid_job_resumes_it_from_its_checkpoint(
    tmp_path: Path, mlp: ModuleType
) -> None:
    db, root = tmp_path / "jobs.db", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "sbpflow.client.cli.main", "server", "--backend", "inprocess", "--slots", "4",
           "--port", "0", "--http-port", "-1", "--store", str(db), "--checkpoint-root", str(root)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "SBPFLOW_TOKEN": ""})
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split("gRPC on ")[1].split()[0]
        with Client(address) as c:
            saved = c.submit(job_of(mlp, LONG))
            unsaved = c.submit(job_of(mlp, LONG, every=0))
            until(
                lambda: ck_read.latest(root / saved.job_id) is not None and c.get(unsaved.job_id).step >= 2,
                "steps",
            )
    finally:
        proc.send_signal(signal.SIGKILL)  # no shutdown: the process dies mid-job
        proc.wait(30)
    at_kill = ck_read.latest(root / saved.job_id)
    assert at_kill is not None
    p = ControlPlane(
        ServerConfig(
            store=str(db),
            run=MANAGER_DEFAULTS.replace(backend="inprocess"),
            slots=4,
            http_port=None,
            checkpoint_root=str(root),
        )
    ).start()
    try:
        with Client(p.address) as c:
            st = c.get(unsaved.job_id)
            assert sp.JobState.Name(st.state) == "JOB_STATE_FAILED" and st.reason == "CONTROL_PLANE_RESTARTED"
            assert "no checkpoint to resume from" in st.message
            events = p.store.events(saved.job_id)
            resumed = [e for e in events if e.reason == "RESUMED_AFTER_RESTART"]
            assert len(resumed) == 1 and resumed[0].state == JobState.PENDING
            assert resumed[0].data == {"from": "JOB_STATE_RUNNING", "attempt": 2, "step": at_kill.step}
            assert (
                f"attempt 2 resumes from its checkpoint {at_kill.path} (step {at_kill.step})"
                in resumed[0].message
            )
            until(lambda: c.get(saved.job_id).step > at_kill.step + 2, "the resumed job to step")
            st = c.get(saved.job_id)
            assert sp.JobState.Name(st.state) == "JOB_STATE_RUNNING" and st.attempt == 2
            later = [e for e in p.store.events(saved.job_id, resumed[0].seq) if e.kind == "step"]
            assert later[0].data["step"] == at_kill.step + 1  # it went on from the checkpoint
            assert "sbpflow_job_attempt{" in p.manager.metrics.exposition().decode()  # type: ignore[union-attr]
            c.cancel(saved.job_id)
            assert sp.JobState.Name(c.handle(saved.job_id).wait(30).state) == "JOB_STATE_CANCELLED"
    finally:
        p.stop()


# ---- Ray: a lost worker is attempt 2 in the store, the events and the metrics --------------------------


def test_a_lost_ray_worker_shows_as_the_next_attempt(tmp_path: Path, mlp: ModuleType, ray_local: str) -> None:
    import ray

    from sbpflow.control_plane.status.metrics import Metrics

    with JobStore(tmp_path / "jobs.db") as store:
        config = ManagerConfig(
            run=MANAGER_DEFAULTS.replace(ray_address=ray_local, max_restarts=1),
            slots=2,
            checkpoint_root=str(tmp_path / "ckpt"),
        )
        m = JobManager(store, config)
        m.metrics = Metrics(store, m.workers)
        m.start()
        rec = m.submit(blob(job_of(mlp, LONG)))
        until(lambda: ck_read.latest(tmp_path / "ckpt" / rec.id) is not None, "a checkpoint", timeout=120)
        info = ray.get(ray.get_actor(f"sbpflow-{rec.id}-a1-r1").info.remote())
        os.kill(info["pid"], signal.SIGKILL)
        until(
            lambda: store.get(rec.id).attempt == 2 and store.get(rec.id).state == JobState.RUNNING,
            "attempt 2",
            120,
        )
        lost = [e for e in store.events(rec.id) if e.reason == "WORKER_LOST"]
        assert len(lost) == 1 and lost[0].state == JobState.STARTING and lost[0].data["attempt"] == 2
        assert "rank 1" in lost[0].message and f"pid {info['pid']}" in lost[0].message
        assert "attempt 2 (restart 1 of at most 1) resumes from step" in lost[0].message
        metrics = m.metrics.exposition().decode()
        assert f'sbpflow_job_attempt{{job_id="{rec.id}",name="{rec.name}"}} 2.0' in metrics
        m.cancel(rec.id)
        assert wait_end(m, rec.id) == JobState.CANCELLED
        m.shutdown()


def test_resume_passes_over_a_corrupt_latest_checkpoint_saying_so(
    manager: JobManager, mlp: ModuleType, ended: str
) -> None:
    root = Path(manager.config.checkpoint_root or "") / ended
    f = sorted(step_dir(root, 4).glob("rank-*.safetensors"))[0]
    raw = bytearray(f.read_bytes())
    raw[-32:] = bytes(b ^ 0xFF for b in raw[-32:])  # same size: only the checksum tells
    f.write_bytes(bytes(raw))
    new = manager.resume(ended, blob(job_of(mlp, 6)))
    assert new.resume_checkpoint == str(step_dir(root, 2))
    assert wait_end(manager, new.id) == JobState.SUCCEEDED
    assert [p.step for p in manager.store.losses(new.id)] == [3, 4, 5, 6]
    logs = [line.text for line in manager.store.logs(new.id)]
    assert any(
        t.startswith(f"checkpoint step-00000004 is corrupt (file {f.name} has checksum crc32:")
        and t.endswith("; resuming from step-00000002")
        for t in logs
    ), logs
