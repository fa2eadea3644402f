"""The read-time half of the data policy (issue 13): a file-backed source carrying the server's roots
checks each file as opened, so a symlink swapped after Submit (or mid-run) leads no worker out of the
roots — in-process and on Ray — and the job ends FAILED with reason PERMISSION_DENIED, with no byte of
the other file in any message."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from types import ModuleType

import grpc
import numpy as np
import pytest

import sbpflow as sf
from sbpflow.actor_workers.runtime.errors import RuntimeFailure
from sbpflow.client.client import Client, ClientError
from sbpflow.control_plane.service.data_policy import DataPolicy, reason_of
from sbpflow.data.access import DENIED, DataAccessDenied
from sbpflow.data.sources import ArrayFileSource, DataError, TokenFileSource
from sbpflow.job import Job
from sbpflow.runs.options import RunOptions
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.service.test_server import LONG, mlp, start, until  # noqa: F401 - mlp is a fixture

SECRET = 4242.0  # what the files outside the roots hold: never in a message, never trained on


def swap(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` atomically (a reader sees the old link or the new, never none)."""
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def files_job(example: ModuleType, tmp_path: Path, steps: int) -> tuple[Job, Path]:
    """The mlp job reading .npy files through ``<root>/link`` (-> ``<root>/real``), and files of the same
    shapes holding SECRET in ``<tmp>/outside``; returns the job and the link."""
    job = example.make_job(steps=steps)
    batch = job.data.read(0)
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    for k, v in batch.items():
        np.save(root / "real" / f"{k}.npy", np.concatenate([v] * 4))
        np.save(outside / f"{k}.npy", np.full((4 * len(v), *v.shape[1:]), SECRET, v.dtype))
    link = root / "link"
    link.symlink_to(root / "real")
    paths = {k: str(link / f"{k}.npy") for k in batch}
    data = ArrayFileSource(paths=paths, batch_size=job.data.batch_size)
    return dataclasses.replace(job, data=data), link


# ---- the sources ------------------------------------------------------------------------------------


def test_a_token_file_swapped_to_etc_passwd_is_refused_as_opened(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    np.arange(100, dtype=np.int32).tofile(root / "tokens.bin")
    link = root / "tokens"
    link.symlink_to(root / "tokens.bin")
    roots = DataPolicy.under([root]).run_roots
    src = TokenFileSource(path=str(link), seq_len=4, batch_size=2, allowed_roots=roots)
    assert src.read(0)["tokens"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    swap(link, Path("/etc/passwd"))
    for read in (lambda: src.read(0), lambda: src.num_samples):
        with pytest.raises(DataAccessDenied) as e:
            read()
        assert (
            str(link) in str(e.value)
            and str(root.resolve()) in str(e.value)
            and "--data-root" in str(e.value)
        )
        assert "passwd" not in str(e.value) and "root:" not in str(e.value)  # not even where it led
    # without roots (a user's own run) the source opens what its user can: the check is the roots'
    # (/etc/passwd is no whole number of int32s: the reader's own refusal, quoting nothing)
    with pytest.raises(DataError, match="not readable") as e:
        _ = dataclasses.replace(src, allowed_roots=None).num_samples
    assert "root:" not in str(e.value)


def test_an_array_file_swapped_out_of_the_roots_is_refused_and_one_inside_is_read(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    np.save(root / "a.npy", np.ones((4, 2), np.float32))
    np.save(outside / "a.npy", np.full((4, 2), SECRET, np.float32))
    link = root / "x.npy"
    link.symlink_to(root / "a.npy")
    src = ArrayFileSource(paths={"x": str(link)}, batch_size=2, allowed_roots=(str(root.resolve()),))
    assert src.read(1)["x"].tolist() == [[1.0, 1.0]] * 2 and src.fields()[0].sample_shape == (2,)
    swap(link, outside / "a.npy")
    with pytest.raises(DataAccessDenied, match="data field 'x'") as e:
        src.read(1)
    assert str(int(SECRET)) not in str(e.value)


def test_what_cannot_be_read_under_a_root_is_a_data_error_and_a_fifo_does_not_block(tmp_path: Path) -> None:
    roots = (str(tmp_path.resolve()),)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir.npy").mkdir()
    for name in ("fifo", "dir.npy", "missing.npy"):
        with pytest.raises(DataError, match="does not exist|not readable"):
            ArrayFileSource(paths={"x": str(tmp_path / name)}, batch_size=1, allowed_roots=roots).fields()
    with pytest.raises(DataAccessDenied):  # no roots at all: nothing may be opened
        _ = TokenFileSource(
            path=str(tmp_path / "fifo"), seq_len=2, batch_size=1, allowed_roots=()
        ).num_samples


def test_the_roots_are_no_part_of_the_wire_or_of_equality(tmp_path: Path) -> None:
    from sbpflow.codec import wire

    src = TokenFileSource(path="t.bin", seq_len=4, batch_size=2, allowed_roots=("/data",))
    back = wire.data_from_proto(wire.data_to_proto(src))
    assert back == src and isinstance(back, TokenFileSource) and back.allowed_roots is None


def test_data_roots_are_the_control_planes_option_not_a_flag_or_a_wire_field() -> None:
    from sbpflow.codec.run_options import run_options_to_proto
    from sbpflow.runs.options import FIELD_NAMES

    o = RunOptions(data_roots=("/data",))
    assert "data_roots" not in FIELD_NAMES and run_options_to_proto(o) == run_options_to_proto(RunOptions())
    assert "data_roots" not in {f.name for f in sp.RunOptions.DESCRIPTOR.fields}
    with pytest.raises(ValueError, match="data_roots"):
        RunOptions(data_roots="/data")  # type: ignore[arg-type]


# ---- runs ------------------------------------------------------------------------------------------


def _swapping_run(example: ModuleType, tmp_path: Path, backend: str) -> tuple[BaseException, list[float]]:
    job, link = files_job(example, tmp_path, steps=LONG)
    losses: list[float] = []
    once = threading.Event()

    def on_step(m: sp.StepMetrics) -> None:
        losses.append(m.loss)
        if not once.is_set():  # after the first step: the files the run goes on reading are elsewhere
            once.set()
            swap(link, tmp_path / "outside")

    roots = DataPolicy.under([tmp_path / "root"]).run_roots
    with pytest.raises(RuntimeFailure) as e:
        sf.run(job, options=RunOptions(backend=backend, timeout=120, data_roots=roots), on_step=on_step)
    return e.value, losses


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_a_run_whose_files_are_swapped_mid_run_fails_permission_denied(
    mlp: ModuleType,  # noqa: F811
    tmp_path: Path,
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    if backend == "ray":
        request.getfixturevalue("ray_local")
    failure, losses = _swapping_run(mlp, tmp_path, backend)
    assert reason_of(failure, "WORKER_ERROR") == DENIED, failure
    assert "outside what the server may read" in str(failure) and str(int(SECRET)) not in str(failure)
    assert 1 <= len(losses) < LONG and all(abs(x) < SECRET for x in losses)


def test_a_job_swapped_after_submit_fails_permission_denied_on_a_server(
    tmp_path: Path,
    mlp: ModuleType,  # noqa: F811
) -> None:
    job, link = files_job(mlp, tmp_path, steps=LONG)
    plane = start(tmp_path, data_roots=(str(tmp_path / "root"),))
    try:
        with Client(plane.address) as c:
            h = c.submit(job)
            until(lambda: h.status().step >= 1, "the job's first step", timeout=60)
            swap(link, tmp_path / "outside")
            final = h.wait(timeout=120)
            assert sp.JobState.Name(final.state) == "JOB_STATE_FAILED", final
            assert final.reason == DENIED and "outside what the server may read" in final.message
            logs = "\n".join(line.text for line in plane.store.logs(h.job_id))
            assert str(int(SECRET)) not in final.message + logs
            # and a second job naming the swapped link is refused at Submit, as any path outside is
            with pytest.raises(ClientError) as e:
                c.submit(job)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        plane.stop()


def test_a_job_swapped_while_it_waits_fails_permission_denied_as_it_starts(
    tmp_path: Path,
    mlp: ModuleType,  # noqa: F811
) -> None:
    """The check before a run (a job queued, or re-queued by a restart, was checked under Submit's view)."""
    job, link = files_job(mlp, tmp_path, steps=2)
    plane = start(tmp_path, data_roots=(str(tmp_path / "root"),), slots=2)
    try:
        with Client(plane.address) as c:
            blocker = c.submit(mlp.make_job(steps=LONG))
            until(lambda: blocker.status().state == sp.JOB_STATE_RUNNING, "the blocker to run")
            waiting = c.submit(job)
            assert waiting.status().state == sp.JOB_STATE_PENDING
            swap(link, tmp_path / "outside")
            blocker.cancel()
            final = waiting.wait(timeout=60)
            assert sp.JobState.Name(final.state) == "JOB_STATE_FAILED" and final.reason == DENIED, final
            assert final.step == 0 and "outside what the server may read" in final.message
    finally:
        plane.stop()
