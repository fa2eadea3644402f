"""The control plane under hostile conditions: a checkpoint root that is full or read-only (a real tmpfs in
a private mount namespace) fails the job with a CHECKPOINT_STORAGE_* reason, leaves no temp file and
keeps /readyz at 503 until a write there succeeds again; a broken job store is refused by `sbpflow
server` with one line and no traceback; a Cancel racing a SIGTERM drain is never undone by the restart
(seven tries); Cancel right after Submit ends CANCELLED, never FAILED; two Resumes of one job at once
make one job, and a retried Resume returns it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from sbpflow.checkpoint import read as ck_read
from sbpflow.client.client import Client, ClientError
from sbpflow.control_plane.service.drain import drain
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from tests.control_plane.service.test_resume import blob, job_of, wait_end
from tests.control_plane.service.test_server import LONG, start, until
from tests.examples.test_examples import load
from tests.sbpflow.test_checkpoint import REPO, in_tmpfs


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


# Run in a child with a small tmpfs on MOUNT: a control plane whose checkpoint root is MOUNT/ckpt runs a
# job whose checkpoints (~3 MB: a 512x512 layer and its Adam state) do not fit, or a read-only root.
_PLANE = """
import json, os, time, urllib.error, urllib.request
from pathlib import Path
from sbpflow.client.client import Client
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.service.test_resume import job_of
from tests.control_plane.service.test_server import start, until
from tests.examples.test_examples import load

def readyz():
    try:
        with urllib.request.urlopen(plane.http_address + "/readyz", timeout=10) as r:
            return [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode()]

plane = start(Path(STORE), http_port=0, checkpoint_root=str(Path(MOUNT) / "ckpt"))
plane.manager.storage.every = 0.3  # re-probe often: the test waits for it
out = {"ready at start": readyz()}
with Client(plane.address) as c:
    h = c.submit(job_of(load("mlp"), 100_000, every=2, n_in=512, hidden=512, lr=0.001))
    end = h.watch(stream=open(os.devnull, "w"))
out.update(state=sp.JobState.Name(end.state), reason=end.reason, message=end.message, step=end.step)
out["ready after"] = readyz()
out["temp files"] = [str(p) for p in Path(MOUNT).rglob("*.tmp")]
if not READ_ONLY:
    with open(Path(MOUNT) / "filler", "wb", buffering=0) as f:  # fill the disk: probes fail
        try:
            while f.write(bytes(1 << 16)):
                pass
        except OSError:
            pass
    time.sleep(1.0)
    out["ready while full"] = readyz()
    (Path(MOUNT) / "filler").unlink()
    until(lambda: readyz()[0] == 200, "ready again", 10)
    out["ready once freed"] = readyz()
plane.stop()
print(json.dumps(out))
"""


def _plane_on_tmpfs(tmp_path: Path, read_only: bool) -> dict:
    script = f"STORE = {str(tmp_path)!r}\nREAD_ONLY = {read_only}\n" + _PLANE
    return in_tmpfs(tmp_path / "disk", "1m", script, read_only=read_only, timeout=240)


def test_a_full_checkpoint_disk_fails_the_job_clearly_and_readyz_until_it_takes_a_write(
    tmp_path: Path,
) -> None:
    out = _plane_on_tmpfs(tmp_path, read_only=False)
    assert out["ready at start"] == [200, "ready\n"], out
    assert (out["state"], out["reason"]) == ("JOB_STATE_FAILED", "CHECKPOINT_STORAGE_FULL"), out
    where = str(tmp_path / "disk" / "ckpt")
    assert where in out["message"] and "No space left on device (ENOSPC)" in out["message"], out
    assert "free space" in out["message"] and "--checkpoint-root" in out["message"], out
    assert "OSError" not in out["message"] and out["temp files"] == [], out
    assert out["step"] < 1000, out  # stopped at the failed write, not at the end of its 100000 steps
    for key in ("ready after", "ready while full"):
        code, body = out[key]
        assert code == 503 and where in body and "ENOSPC" in body, (key, out)
    assert out["ready once freed"] == [200, "ready\n"], out


def test_a_read_only_checkpoint_root_fails_the_job_saying_so_and_is_not_ready(tmp_path: Path) -> None:
    out = _plane_on_tmpfs(tmp_path, read_only=True)
    assert out["ready at start"][0] == 503 and "EROFS" in out["ready at start"][1], out  # probed at start
    assert (out["state"], out["reason"]) == ("JOB_STATE_FAILED", "CHECKPOINT_STORAGE_READ_ONLY"), out
    assert str(tmp_path / "disk") in out["message"] and "Read-only file system (EROFS)" in out["message"], out
    assert "make it writable" in out["message"] and "INTERNAL" not in out["message"], out
    assert out["ready after"][0] == 503, out


# `sbpflow server` on a broken store: one line on stderr, exit 1, no traceback.
_READ_ONLY_STORE = """
import json, subprocess, sys
from pathlib import Path
from sbpflow.control_plane.store.job_store import JobStore
db = Path(MOUNT) / "jobs.db"
JobStore(db).close()
subprocess.run(["mount", "-o", "remount,ro", MOUNT], check=True)
r = subprocess.run([sys.executable, "-m", "sbpflow.client.cli.main", "server", "--store", str(db), "--port", "0",
                    "--http-port", "-1"], capture_output=True, text=True, timeout=60)
print(json.dumps({"rc": r.returncode, "stderr": r.stderr, "stdout": r.stdout}))
"""


def _server_on(db: Path) -> dict:
    cmd = [sys.executable, "-m", "sbpflow.client.cli.main", "server", "--store", str(db), "--port", "0",
           "--http-port", "-1"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    return {"rc": r.returncode, "stderr": r.stderr, "stdout": r.stdout}


@pytest.mark.parametrize("broken", ["garbage", "truncated", "directory", "no permission", "read-only"])
def test_a_broken_store_is_refused_with_one_line(tmp_path: Path, broken: str) -> None:
    db = tmp_path / "jobs.db"
    with JobStore(db) as s:
        for _ in range(200):
            s.create(b"x" * 500, "j")
    for extra in (tmp_path / "jobs.db-wal", tmp_path / "jobs.db-shm"):
        extra.unlink(missing_ok=True)
    says = {
        "garbage": "restore it from a backup, or move it aside",
        "truncated": "database disk image is malformed",
        "directory": "is a directory",
        "no permission": "fix its permissions",
        "read-only": "mount it writable",
    }[broken]
    if broken == "garbage":
        db.write_bytes(os.urandom(64 << 10))
    elif broken == "truncated":
        db.write_bytes(db.read_bytes()[:50_000])
    elif broken == "directory":
        db.unlink()
        db.mkdir()
    elif broken == "no permission":
        if os.geteuid() == 0:
            pytest.skip("root reads and writes a chmod 000 file; the read-only case covers a refused write")
        db.chmod(0)
    if broken == "read-only":
        out = in_tmpfs(tmp_path / "disk", "4m", _READ_ONLY_STORE)
        db = tmp_path / "disk" / "jobs.db"
    else:
        out = _server_on(db)
    lines = out["stderr"].strip().splitlines()
    assert out["rc"] == 1 and len(lines) == 1 and "Traceback" not in out["stderr"], out
    assert lines[0].startswith(f"sbpflow: error: the job store {db}") and says in lines[0], out


def test_cancel_racing_a_drain_is_never_undone_by_the_restart(tmp_path: Path, mlp: ModuleType) -> None:
    """Seven tries, the Cancel before, during and after the drain (SIGTERM's code): each time the
    restarted control plane ends the job CANCELLED and never runs it again."""
    root = tmp_path / "ckpt"
    config = ManagerConfig(
        run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=4, checkpoint_root=str(root)
    )
    for attempt in range(7):
        db = tmp_path / f"jobs-{attempt}.db"
        with JobStore(db) as store:
            m = JobManager(store, config)
            m.start()
            job_id = m.submit(blob(job_of(mlp, LONG, every=5))).id
            until(lambda j=job_id: ck_read.latest(root / j) is not None, "a first checkpoint", 60)
            cancel = threading.Thread(target=m.cancel, args=(job_id, f"try {attempt}"))
            when = attempt % 3  # 0: as the drain begins, 1: while it drains, 2: once it stopped the run
            if when == 0:
                cancel.start()
            drained = threading.Thread(target=drain, args=(m, 5.0))
            drained.start()
            if when == 1:
                time.sleep(0.05 * attempt)
                cancel.start()
            drained.join(60)
            if when == 2:
                cancel.start()
            cancel.join(30)
            m.shutdown()
        with JobStore(db) as store:  # the next control plane on the same store
            m2 = JobManager(store, config)
            m2.start()
            rec = store.get(job_id)
            m2.shutdown()
        assert rec.state == JobState.CANCELLED, (attempt, rec.state, rec.reason, rec.message)
        assert (rec.reason, rec.message, rec.attempt) == ("CANCELLED_BY_USER", f"try {attempt}", 1), attempt
        assert [e for e in store_events(db, job_id) if e == "JOB_STATE_PENDING"] == ["JOB_STATE_PENDING"]


def store_events(db: Path, job_id: str) -> list[str]:
    with JobStore(db) as store:
        return [str(e.state) for e in store.events(job_id) if e.kind in ("created", "state")]


def test_cancel_right_after_submit_ends_cancelled_within_seconds(tmp_path: Path, mlp: ModuleType) -> None:
    plane = start(tmp_path)
    try:
        with Client(plane.address) as c:
            for i in range(5):
                h = c.submit(
                    job_of(mlp, LONG, every=0, n_in=256, hidden=256, lr=0.002)
                )  # lr 0.05 diverged by step 12: FAILED before the Cancel came
                time.sleep(0.02 * i)  # PENDING, COMPILING or STARTING
                t0 = time.monotonic()
                c.cancel(h.job_id, "changed my mind")
                until(lambda j=h.job_id: plane.store.get(j).state.terminal, "the job to end", 10)
                rec = plane.store.get(h.job_id)
                assert (rec.state, rec.reason) == (JobState.CANCELLED, "CANCELLED_BY_USER"), (i, rec)
                assert time.monotonic() - t0 < 10
    finally:
        plane.stop()


def test_two_resumes_at_once_make_one_job_and_a_retry_returns_it(tmp_path: Path, mlp: ModuleType) -> None:
    plane = start(tmp_path, checkpoint_root=str(tmp_path / "ckpt"))
    try:
        ended = plane.manager.submit(blob(job_of(mlp, 4, every=2))).id
        assert wait_end(plane.manager, ended) == JobState.SUCCEEDED
        clients = [Client(plane.address) for _ in range(2)]
        barrier, made, refused = threading.Barrier(2), [], []

        def resume(c: Client, key: str) -> None:
            barrier.wait()
            try:
                made.append(c.resume(ended, job_of(mlp, 8, every=2), idempotency_key=key).job_id)
            except ClientError as e:
                refused.append(e)

        threads = [threading.Thread(target=resume, args=(c, f"key-{i}")) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(made) == 1 and len(refused) == 1, (made, refused)
        assert refused[0].code == grpc.StatusCode.FAILED_PRECONDITION, refused[0]
        assert f"already being resumed by job {made[0]}" in refused[0].details, refused[0]
        key = "key-0" if plane.store.find("", "key-0") is not None else "key-1"  # the one that won
        again = clients[0].resume(ended, idempotency_key=key)
        assert again.job_id == made[0]  # a retried Resume: the same new job, not a refusal
        assert [r.id for r in plane.store.list() if r.resumed_from == ended] == [made[0]]
        for c in clients:
            c.close()
    finally:
        plane.stop()


def test_a_failures_reason_comes_from_its_causes_type_in_process_and_from_ray() -> None:
    from sbpflow.actor_workers.runtime.errors import RuntimeFailure
    from sbpflow.checkpoint.write import (
        CheckpointStorageError,
        CheckpointStorageFull,
        CheckpointStorageReadOnly,
    )
    from sbpflow.control_plane.launch.worker_failures import WorkerError
    from sbpflow.control_plane.service.data_policy import reason_of
    from sbpflow.data.access import DENIED, DataAccessDenied

    def ray(name: str) -> RuntimeFailure:  # a Ray worker's cause: its type's name and its text only
        return RuntimeFailure(1, "sink w", "sink", WorkerError(f"{name}: no room", name), 2)

    for cls, reason in [
        (CheckpointStorageFull, "CHECKPOINT_STORAGE_FULL"),
        (CheckpointStorageReadOnly, "CHECKPOINT_STORAGE_READ_ONLY"),
        (CheckpointStorageError, "CHECKPOINT_STORAGE_ERROR"),
        (DataAccessDenied, DENIED),
    ]:
        assert reason_of(RuntimeFailure(0, "a", "sink", cls("x")), "WORKER_ERROR") == reason, cls
        assert reason_of(ray(cls.__name__), "WORKER_ERROR") == reason, cls
        assert reason_of(cls("x"), "RUN_ERROR") == reason, cls  # raised by the control plane itself
    assert reason_of(ray("ValueError"), "WORKER_ERROR") == "WORKER_ERROR"
    assert reason_of(RuntimeFailure(0, "a", "sink", OSError(28, "full")), "WORKER_ERROR") == "WORKER_ERROR"


def test_a_real_sigterm_racing_a_cancel_never_resumes_the_job(tmp_path: Path, mlp: ModuleType) -> None:
    """The probe that found it, on real processes: `sbpflow server` gets SIGTERM while a Cancel of its
    checkpointing job is on its way (before, with and after the signal, and once the drain stopped the
    job's run); the next server on the same store never runs the job again."""
    from tests.control_plane.service.test_drain import _server

    root = tmp_path / "ckpt"
    for attempt, delay in enumerate((-0.05, 0.0, 0.5, 2.0)):  # 2 s: the drain has stopped the job
        db = tmp_path / f"jobs-{attempt}.db"
        proc, address = _server(db, root)
        try:
            with Client(address) as c:
                job_id = c.submit(job_of(mlp, LONG, every=5)).job_id
                c.submit(job_of(mlp, LONG, every=0))  # never saved: holds the drain open for its grace (4 s)
                until(lambda j=job_id: ck_read.latest(root / j) is not None, "a first checkpoint", 60)
                if delay < 0:
                    c.cancel(job_id, f"try {attempt}")
                proc.send_signal(signal.SIGTERM)
                time.sleep(max(delay, 0.0))
                if delay >= 0:
                    c.cancel(job_id, f"try {attempt}")
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        plane = start(tmp_path, store=str(db), checkpoint_root=str(root))  # the next server
        try:
            time.sleep(0.5)  # a resumed job would be queued and started by now
            rec = plane.store.get(job_id)
            assert (rec.state, rec.reason, rec.message) == (
                JobState.CANCELLED,
                "CANCELLED_BY_USER",
                f"try {attempt}",
            )
            assert rec.attempt == 1, rec
        finally:
            plane.stop()
