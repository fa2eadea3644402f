"""TensorBoard scalars, read back from the event files with a reader of our own (TFRecord framing with
masked CRC-32C, then the Event protobuf): every step's loss, lr, throughput and time, at the job's steps."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

import sbpflow as sf
from sbpflow.control_plane.launch.tensorboard_scalars import ScalarBoard, run_dir
from sbpflow.errors import SbpflowError
from sbpflow.job import WarmupCosine
from sbpflow.oracle.optim import learning_rate
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.serving import serving
from tests.examples.test_examples import load

tensorboardX = pytest.importorskip("tensorboardX", reason="tensorboardX is in the dev extra")
from tensorboardX.crc32c import crc32c  # noqa: E402
from tensorboardX.proto.event_pb2 import Event  # noqa: E402


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file, each one's length and data checked against their CRCs."""
    data, at = path.read_bytes(), 0
    while at < len(data):
        header = data[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[at + 8 : at + 12])
        assert crc == _masked(header), f"{path}: a corrupt length at byte {at}"
        body = data[at + 12 : at + 12 + length]
        (crc,) = struct.unpack("<I", data[at + 12 + length : at + 16 + length])
        assert crc == _masked(body), f"{path}: a corrupt record at byte {at}"
        yield body
        at += 16 + length


def scalars(run: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, over every event file of a run directory."""
    out: dict[str, dict[int, float]] = {}
    files = sorted(run.glob("events.out.tfevents.*"))
    assert files, f"no event file under {run}"
    for f in files:
        for rec in records(f):
            e = Event.FromString(rec)
            for v in e.summary.value:
                out.setdefault(v.tag, {})[int(e.step)] = v.simple_value
    return out


def scheduled(job: sf.Job) -> sf.Job:
    """``job`` with a warm-up and cosine schedule, so lr differs from step to step."""
    assert job.optimizer is not None
    schedule = WarmupCosine(warmup_steps=2, total_steps=job.config.steps)
    return dataclasses.replace(job, optimizer=dataclasses.replace(job.optimizer, schedule=schedule))


def test_sf_run_writes_every_steps_scalars(tmp_path: Path) -> None:
    job = scheduled(load("mlp").make_job(steps=5))
    reports: list[sp.WorkerReport] = []
    result = sf.run(
        job, backend="inprocess", timeout=120, tensorboard_dir=str(tmp_path), on_report=reports.append
    )
    (run,) = tmp_path.iterdir()
    assert run.name.startswith(f"{job.name}-")
    got = scalars(run)
    steps = [1, 2, 3, 4, 5]
    assert sorted(got["loss/train"]) == steps
    for s, loss in zip(steps, result.losses, strict=True):
        assert math.isclose(got["loss/train"][s], loss, rel_tol=1e-6)  # float32 in the file
    assert job.optimizer is not None
    for s in steps:
        assert math.isclose(got["lr"][s], learning_rate(job.optimizer, s - 1), rel_tol=1e-6)
    assert len(set(got["lr"].values())) > 2  # the schedule shows
    assert all(v > 0 for v in got["throughput/samples_per_second"].values())
    assert all(v > 0 for v in got["time/step_seconds"].values())
    for tag in ("time/compute_seconds", "time/communication_seconds", "time/data_seconds"):
        assert sorted(got[tag]) == steps and all(v >= 0 for v in got[tag].values()), tag
    for s in steps:  # each the mean over the ranks of what their step reports said
        said = [
            r.step.timings_seconds for r in reports if r.WhichOneof("payload") == "step" and r.step.step == s
        ]
        assert len(said) == 2 and all(t["compute"] > 0 and t["comm"] >= 0 and t["data"] >= 0 for t in said)
        assert math.isclose(got["time/compute_seconds"][s], sum(t["compute"] for t in said) / 2, rel_tol=1e-5)
    assert sum(got["time/compute_seconds"].values()) > 0  # the run's own on_report heard them all too


def test_a_server_writes_each_job_under_its_id(tmp_path: Path) -> None:
    board = tmp_path / "tb"
    with serving(tmp_path, [load("mlp").make_job(steps=3)], tensorboard_dir=str(board)) as (_, (h,)):
        assert h.status().state == sp.JOB_STATE_SUCCEEDED
        got = scalars(board / h.job_id)
    assert sorted(got["loss/train"]) == [1, 2, 3]


def test_a_resumed_run_goes_on_at_the_jobs_steps(tmp_path: Path) -> None:
    job = load("mlp").make_job(steps=6)
    job = dataclasses.replace(job, config=dataclasses.replace(job.config, checkpoint_every=3))
    ckpt = tmp_path / "ckpt"
    sf.run(dataclasses.replace(job, config=dataclasses.replace(job.config, steps=3)), backend="inprocess",
           timeout=120, checkpoint_dir=str(ckpt), tensorboard_dir=str(tmp_path / "tb"), job_id="j1")  # fmt: skip
    sf.run(job, backend="inprocess", timeout=120, resume_from=str(ckpt), tensorboard_dir=str(tmp_path / "tb"),
           job_id="j1")  # fmt: skip
    assert sorted(scalars(tmp_path / "tb" / "j1")["loss/train"]) == [1, 2, 3, 4, 5, 6]


def test_held_out_losses_go_to_their_own_tag(tmp_path: Path) -> None:
    from tests.control_plane.launch.test_evaluation import job as evaluating_job

    heard: list[tuple[int, float]] = []
    result = sf.run(evaluating_job(every=2, steps=4), backend="inprocess", tensorboard_dir=str(tmp_path),
                    job_id="ev", on_eval=lambda s, loss: heard.append((s, loss)))  # fmt: skip
    assert heard == list(result.evals)  # the run's own listener still hears every evaluation
    got = scalars(tmp_path / "ev")["loss/eval"]
    assert sorted(got) == [2, 4]
    for step, loss in result.evals:
        assert math.isclose(got[step], loss, rel_tol=1e-6)


def test_a_board_without_a_run_listener_writes_alone(tmp_path: Path) -> None:
    with ScalarBoard(tmp_path / "run", load("mlp").make_job(steps=2)) as board:
        board.on_eval(10, 1.5)
        board.on_step(sp.StepMetrics(step=1, loss=2.0, samples_per_second=3.0, step_seconds=0.5))
    got = scalars(tmp_path / "run")
    assert (
        got["loss/eval"] == {10: 1.5}
        and got["loss/train"] == {1: 2.0}
        and got["time/step_seconds"] == {1: 0.5}
    )


def test_a_run_name_that_cannot_be_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SbpflowError, match="cannot name a TensorBoard run directory"):
        run_dir(tmp_path, load("mlp").make_job(steps=1), job_id="../escape")


def test_two_runs_in_one_second_keep_both_files(tmp_path: Path) -> None:
    job = load("mlp").make_job(steps=2)
    for step in (1, 2):  # tensorboardX alone names both files alike, and the second truncates the first
        with ScalarBoard(tmp_path / "run", job) as board:
            board.on_step(sp.StepMetrics(step=step, loss=float(step)))
    assert len(list((tmp_path / "run").iterdir())) == 2
    assert scalars(tmp_path / "run")["loss/train"] == {1: 1.0, 2: 2.0}


def test_a_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(SbpflowError, match=r"cannot make .*file/r.*give a directory this process can write"):
        ScalarBoard(tmp_path / "file" / "r", load("mlp").make_job(steps=1))
