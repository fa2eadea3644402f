"""The Ray backend: the same plans on real worker processes, one per rank, over the CPU data plane.

The issue's layouts (DP 4, TP 4, PP2xDP2, ZeRO-2 on 4 worker processes) give the in-process run's
losses and parameters; a worker killed mid-step fails the job within seconds with a report naming it,
and leaves no worker process, placement group or shared-memory segment behind; every worker reports to
the WorkerService in protobuf. One local Ray serves the whole session (``ray_local``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.actor_workers.runtime.errors import RuntimeFailure
from sbpflow.control_plane.launch import ray_backend
from sbpflow.data.sources import ArrayFileSource
from sbpflow.graph import TensorKind
from sbpflow.runs.states import JobState
from tests.actor_workers.test_equivalence import LAYOUTS, mlp_job
from tests.control_plane.compiler.passes.test_autodiff import as_float64

pytestmark = pytest.mark.usefixtures("ray_local")
STEPS = 3


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def sbpflow_actors(wait: float = 10.0) -> list[str]:
    """Named sbpflow actors still registered with Ray (killed ones leave within moments)."""
    import ray

    deadline = time.monotonic() + wait
    while True:
        names = [n for n in ray.util.list_named_actors() if n.startswith("sbpflow-")]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.1)


@pytest.mark.parametrize("layout", ["mlp-dp4", "mlp-tp4", "gpt-pp2xdp2", "gpt-zero2"])
def test_worker_processes_train_exactly_as_the_in_process_run(layout: str) -> None:
    job = as_float64(LAYOUTS[layout]())
    want = sf.run(job, backend="inprocess", steps=STEPS, return_parameters=True)
    got = sf.run(job, backend="ray", steps=STEPS, return_parameters=True, timeout=120)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-12, atol=0)
    assert got.parameters is not None and want.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got.parameters[name], value, rtol=1e-12, atol=1e-15, err_msg=name)


def test_sf_run_defaults_to_ray_and_workers_report_in_protobuf() -> None:
    reports: list[Any] = []
    steps: list[Any] = []
    states: list[str] = []
    job = LAYOUTS["mlp-dp4"]()
    result = sf.run(
        job, steps=STEPS, on_report=reports.append, on_step=steps.append, on_state=states.append, job_id="rep"
    )
    assert states == [JobState.COMPILING, JobState.STARTING, JobState.RUNNING]
    assert [m.step for m in steps] == [1, 2, 3]
    assert [m.loss for m in steps] == pytest.approx(result.losses, rel=1e-6)
    kinds = {(r.rank, r.WhichOneof("payload")) for r in reports}
    assert {(r, "done") for r in range(4)} <= kinds
    assert all(
        r.job_id == "rep" and r.attempt == 1 and r.worker_id and r.host == "127.0.0.1" for r in reports
    )
    assert not sbpflow_actors(), "workers outlived their run"


def test_a_failing_loader_in_a_worker_names_the_rank_and_the_op(tmp_path: Path) -> None:
    """A data file rewritten with the wrong shape under a running job: every loader fails on its next read."""
    job = LAYOUTS["mlp-dp4"]()
    assert job.data is not None
    rng = np.random.default_rng(0)
    paths = {}
    for f in job.data.fields():
        paths[f.name] = str(tmp_path / f"{f.name}.npy")
        np.save(paths[f.name], rng.standard_normal((64, *f.sample_shape)).astype(f.dtype.value))
    job = dataclasses.replace(job, data=ArrayFileSource(paths=paths, batch_size=job.data.batch_size))
    target = job.graph.of_kind(TensorKind.input)[-1].name
    shape = job.graph.tensors[target].meta.shape

    def corrupt(m: Any) -> None:
        # written aside and renamed over the old file: np.save in place would let a loader read a torn
        # file (an EOFError, not the wrong shape this test is about)
        if m.step == 1:
            aside = tmp_path / "aside.npy"
            np.save(aside, np.zeros((64, *shape[1:], 2), dtype=np.float32))
            os.replace(aside, paths[target])

    with pytest.raises(RuntimeFailure) as info:
        sf.run(job, steps=100_000, timeout=120, on_step=corrupt)
    message = str(info.value)
    assert "rank" in message and "ShapeError" in message and repr(target) in message, message
    assert not sbpflow_actors()


def test_killing_a_worker_fails_the_job_within_seconds_naming_it_and_leaves_nothing_behind() -> None:
    job = LAYOUTS["mlp-dp4"]()
    shm_before = shm_entries()
    killed: dict[str, Any] = {}

    def kill_rank_2_at_step_2(r: Any) -> None:
        if r.WhichOneof("payload") == "step" and r.step.step == 2 and not killed:
            import ray

            actor = ray.get_actor("sbpflow-kill-a1-r2")
            info = ray.get(actor.info.remote())
            killed.update(info, at=time.monotonic())
            os.kill(info["pid"], signal.SIGKILL)

    with pytest.raises(RuntimeFailure) as failure:
        sf.run(job, steps=100_000, job_id="kill", on_report=kill_rank_2_at_step_2, timeout=300)
    assert killed, "the worker was never killed"
    assert time.monotonic() - killed["at"] < 15, "the job took too long to notice the dead worker"
    assert (
        failure.value.rank == 2
        and "rank 2" in str(failure.value)
        and str(killed["pid"]) in str(failure.value)
    )
    assert not sbpflow_actors()
    assert shm_entries() <= shm_before, "shared-memory segments left behind"
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)


def test_cancel_stops_every_worker_promptly() -> None:
    cancel = threading.Event()
    with pytest.raises(sf.RunCancelled):
        sf.run(
            LAYOUTS["mlp-dp4"](), steps=100_000, cancel=cancel, on_step=lambda m: cancel.set(), timeout=300
        )
    assert not sbpflow_actors()


def test_a_job_larger_than_the_cluster_is_refused_with_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_backend, "SETUP_SECONDS", 2.0)
    with pytest.raises(ray_backend.SchedulingError, match="cannot hold 8 workers"):
        sf.run(mlp_job(ranks=8), steps=1, timeout=30)


def test_the_kept_ray_is_joined_by_runs_it_fits_and_reaped_once_unused(tmp_path: Path) -> None:
    """KeptRay's lease and reaper without a Ray: a listening socket stands in for its GCS, a sleeping
    process naming its temp dir for its processes. A lease for more CPUs than it has gets None; while a
    lease is held the reaper waits; once unused for idle_seconds it kills that process (alone) and
    forgets the Ray."""
    import json
    import socket
    import subprocess
    import sys

    from sbpflow.control_plane.launch.ray_cluster import KeptRay

    kept = KeptRay(tmp_path, idle_seconds=1.0)
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        address = f"127.0.0.1:{gcs.getsockname()[1]}"
        (tmp_path / "ray.json").write_text(json.dumps({"address": address, "cpus": 2, "reaper": 0}))
        ray_process = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)", f"--temp-dir={tmp_path / 'ray'}"]
        )
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(tmp_path)])
        try:
            with kept.lease(4) as too_small:
                assert too_small is None  # 2 CPUs: that run starts a Ray of its own
            with kept.lease(2) as joined:
                assert joined == address
                time.sleep(2.5)  # past idle_seconds, but held
                assert ray_process.poll() is None and kept.noted() is not None
            ray_process.wait(timeout=30)  # the reaper killed it
            assert kept.noted() is None and not (tmp_path / "ray.json").exists()
            assert bystander.poll() is None  # it names the folder, not the Ray's temp dir
        finally:
            for p in (ray_process, bystander):
                p.kill()
                p.wait()


def test_the_kept_rays_settings_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sbpflow.control_plane.launch.ray_cluster import KeptRay
    from sbpflow.errors import SbpflowError

    monkeypatch.setenv("SBPFLOW_RAY_IDLE", "soon")
    with pytest.raises(SbpflowError, match="SBPFLOW_RAY_IDLE='soon': give seconds"):
        KeptRay.default()
    (tmp_path / "file").write_text("")
    with pytest.raises(SbpflowError, match="set SBPFLOW_RAY_DIR to a folder you may write"):
        with KeptRay(tmp_path / "file" / "ray").lease(1):
            pass
