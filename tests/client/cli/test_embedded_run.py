"""``sbpflow run`` keeps what it trains: checkpoints and the job store in --checkpoint-dir (found again by
``checkpoints`` and ``export``), TensorBoard scalars, ``--resume`` under another layout, ``--json`` in the
HTTP API's schema, ``--json-lines``; Submit's memory admission before anything starts; one run a folder."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest

from sbpflow.client.cli.main import main
from sbpflow.control_plane.status import job_json, records
from sbpflow.control_plane.store.job_store import JobStore

MLP = str(Path(__file__).resolve().parents[3] / "examples" / "mlp.py")
FAST = ["--backend", "inprocess", "--set", "batch_size=8", "--set", "hidden=8"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["run", MLP, *FAST, *args])
    got = capsys.readouterr()
    return rc, got.out, got.err


def test_run_keeps_checkpoints_a_store_and_scalars_and_resumes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep, tb = tmp_path / "keep", tmp_path / "tb"
    flags = ["--checkpoint-dir", str(keep), "--checkpoint-every", "2", "--tensorboard-dir", str(tb), "--json"]
    rc, out, err = _run(capsys, "--steps", "4", *flags)
    assert rc == 0, err
    doc = json.loads(out)  # one object, the bar on stderr
    job_id = doc["job_id"]
    assert doc["state"] == "SUCCEEDED" and doc["step"] == 4 and "step    4/4" in err
    assert doc["last_checkpoint"] == str(keep / job_id / "step-00000004") and len(doc["losses"]) == 4
    assert doc["run"]["steps"] == 4 and doc["run"]["backend"] == "inprocess" and doc["run"]["seconds"] > 0
    with JobStore(keep / "jobs.db") as store:  # the HTTP API's /v1/jobs/{id}, from the store it kept
        status = records.job_status(store.get(job_id), store.workers(job_id))
        http = job_json.document(status, (p.loss for p in store.losses(job_id)))
    assert {k: v for k, v in doc.items() if k != "run"} == http | {"last_checkpoint": doc["last_checkpoint"]}
    assert list((tb / job_id).glob("events.out.tfevents.*"))

    assert main(["checkpoints", job_id, "--checkpoint-root", str(keep), "--json"]) == 0
    assert [c["step"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == [2, 4]
    exported = tmp_path / "model.npz"
    assert (
        main(["export", job_id, "--checkpoint-root", str(keep), "--format", "npz", "--out", str(exported)])
        == 0
    )
    assert exported.stat().st_size > 0 and "wrote" in capsys.readouterr().out

    # --resume: the latest job of the store, re-traced on 1 rank instead of 2, from step 4 to 6
    rc, out, err = _run(
        capsys, "--steps", "6", "--ranks", "1", "--checkpoint-dir", str(keep), "--resume", "--json-lines"
    )
    assert rc == 0, err
    *steps, last = [json.loads(line) for line in out.splitlines()]
    assert [s["step"] for s in steps] == [5, 6] and all(s["kind"] == "step" and "seq" in s for s in steps)
    assert last["resumed_from"] == job_id and last["resume_checkpoint"] == doc["last_checkpoint"]
    assert (
        last["step"] == 6 and len(last["workers"]) == 1 and last["last_checkpoint"].endswith("step-00000006")
    )
    assert f"resumes job {job_id}" in err
    assert main(["checkpoints", "--checkpoint-root", str(keep), "--json"]) == 0  # no id: the newest job's
    assert [c["step"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == [6]
    rc, _, err = _run(capsys, "--checkpoint-dir", str(keep), "--resume", "nope")
    assert rc == 2 and "--resume 'nope': no such job in --checkpoint-dir; its newest: [" in err


def test_a_job_that_cannot_fit_is_refused_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    started = ray.is_initialized()
    rc = main(["run", MLP, "--steps", "1", "--set", "hidden=2000000", "--set", "n_in=100000"])  # backend ray
    err = capsys.readouterr().err
    assert rc == 1 and "needs at least" in err and "per device" in err
    assert ray.is_initialized() == started  # refused as Submit refuses: before any worker, Ray not started


def test_one_run_a_folder_and_flags_that_need_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keep = tmp_path / "keep"
    keep.mkdir()
    with open(keep / "jobs.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        rc, _, err = _run(capsys, "--checkpoint-dir", str(keep))
    assert rc == 1 and "another `sbpflow run` is using --checkpoint-dir" in err
    rc, _, err = _run(capsys, "--resume")
    assert rc == 2 and "--resume needs --checkpoint-dir DIR" in err
    rc, _, err = _run(capsys, "--json", "--json-lines")
    assert rc == 2 and "give one" in err
    rc, _, err = _run(capsys, "--checkpoint-dir", str(keep), "--resume")  # an empty store
    assert rc == 2 and "no job in --checkpoint-dir's store yet" in err


def test_jobs_an_earlier_run_left_are_settled_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sbpflow.runs.states import JobState

    keep = tmp_path / "keep"
    keep.mkdir()
    with JobStore(keep / "jobs.db") as store:  # a run killed while training, one killed before it started
        running = store.create(b"", "killed").id
        for state in (JobState.COMPILING, JobState.STARTING, JobState.RUNNING):
            store.transition(running, state)
        queued = store.create(b"", "queued").id
    rc, out, err = _run(capsys, "--steps", "2", "--checkpoint-dir", str(keep), "--json")
    assert rc == 0, err
    with JobStore(keep / "jobs.db") as store:
        assert (
            store.get(running).state == JobState.FAILED
            and store.get(running).reason == "CONTROL_PLANE_RESTARTED"
        )
        assert store.get(queued).state == JobState.CANCELLED
        assert store.get(json.loads(out)["job_id"]).state == JobState.SUCCEEDED  # ran alone


def test_a_failed_job_still_prints_its_json_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "--steps", "5", "--set", "lr=1e30", "--json")  # diverges at step 2
    doc = json.loads(out)
    assert rc == 1 and doc["state"] == "FAILED" and doc["reason"] == "NON_FINITE_LOSS"
    assert doc["losses"][-1] in ("Infinity", "NaN") and doc["run"]["seconds"] is None
    assert err.splitlines()[-1].startswith("sbpflow: error: job 'TrainMLP' FAILED: NON_FINITE_LOSS")
    assert "clip_grad_norm" in err
