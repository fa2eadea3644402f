"""A containerised cluster end to end, from this checkout's CPU image: a Ray head container, a Ray worker
container and the control-plane container (joining with ``--ray-address``), the job store and the
checkpoints on volumes (:mod:`tests.deploy.pod_cluster`). From the host:

- ``sbpflow submit --watch`` of a DP 2 job (examples/mlp.py in float64) trains it to the losses of
  ``sf.run(backend="inprocess")``;
- a longer DP 2 job: the worker container SIGKILLed mid-job and started again (a lost node, a pod
  recreated) restarts it as attempt 2 from its checkpoint; the control-plane container stopped (SIGTERM:
  the server drains within its grace) and started again keeps every job record and resumes the job as
  attempt 3; it ends SUCCEEDED with every step's loss equal to the in-process run's;
- /healthz and /readyz answer without the token, /metrics and /v1/jobs with it, from the container;
- nothing is left: no container, volume or network of the test.

Known bug, marked (xfail, not strict) only after everything else has passed: after the control-plane
restart, GetResult's losses are only those of the resumed attempt (the steps after its checkpoint),
while the store's loss history (``/v1/jobs/{id}``) has every step; the test checks the history in full
and GetResult's tail. Slow (about 3 1/2 minutes here on 2 busy cores, the image cached); skips where
podman cannot run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.client.client import Client
from sbpflow.v1 import service_pb2 as sp
from tests.deploy import mlp_float64
from tests.deploy.containers import Built, Made
from tests.deploy.pod_cluster import STOP_SECONDS, PodCluster

pytestmark = [pytest.mark.containers, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = Path(__file__).parent / "mlp_float64.py"  # examples/mlp.py in float64
SBPFLOW = Path(sys.executable).parent / "sbpflow"  # the host's console script
SHORT = {"steps": 6}
LONG = {"n_in": 128, "hidden": 1024, "batch_size": 256, "steps": 240}
EVERY = 5  # checkpoint every EVERY steps
RTOL = 1e-9  # float64; BLAS threads differ between the containers' workers and this process


def flags(kw: dict[str, int], every: int = 0) -> list[str]:
    out = ["--ranks", "2", "--steps", str(kw["steps"])]
    out += [x for k, v in kw.items() if k != "steps" for x in ("--set", f"{k}={v}")]
    return out + (["--checkpoint-every", str(every)] if every else [])


def in_process(kw: dict[str, int]) -> list[float]:
    job = mlp_float64.make_job(ranks=2, **kw)
    return list(sf.run(job, backend="inprocess").losses)


def submit(cluster: PodCluster, *args: str) -> str:
    """``sbpflow submit`` on the host; the job id it prints."""
    p = subprocess.run(
        [str(SBPFLOW), "submit", str(EXAMPLE), *args, "--address", cluster.address],
        env={**os.environ, "SBPFLOW_TOKEN": cluster.token, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, f"sbpflow submit exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout.splitlines()[0].strip()


def until(cond: Callable[[], bool], what: str, cluster: PodCluster, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{cluster.logs('control-plane')[-4000:]}")
        time.sleep(0.05)


def state(st: sp.JobStatus) -> str:
    return sp.JobState.Name(st.state).removeprefix("JOB_STATE_")


def test_a_containerised_cluster_trains_restarts_and_keeps_its_jobs(cpu_image: Built) -> None:
    short_want, long_want = in_process(SHORT), in_process(LONG)
    with Made(f"sbpf{os.getpid()}") as made:
        t0 = time.monotonic()
        cluster = PodCluster.start(made, cpu_image.tag)
        cluster.wait_ready()
        up = time.monotonic() - t0
        assert cluster.get("/healthz") == (200, "ok\n") and cluster.get("/readyz")[0] == 200
        assert cluster.get("/v1/jobs")[0] == 401  # the rest needs the token

        short = submit(cluster, *flags(SHORT), "--watch")
        with Client(cluster.address, token=cluster.token) as c:
            np.testing.assert_allclose(c.result(short).losses, short_want, rtol=RTOL)
            long = submit(cluster, *flags(LONG, EVERY))
            until(
                lambda: c.get(long).step >= 2 * EVERY and bool(c.get(long).last_checkpoint),
                "a checkpoint",
                cluster,
            )
            killed_at = c.get(long).step
            cluster.kill_worker()
            cluster.start_worker()
            until(lambda: c.get(long).attempt == 2 and state(c.get(long)) == "RUNNING", "attempt 2", cluster)
            until(lambda: c.get(long).step >= killed_at + EVERY, "attempt 2 past the kill", cluster)
            st = c.get(long)
            assert state(st) == "RUNNING" and st.step < LONG["steps"], "the job ended before the restart"
            records = {j.job_id: state(j) for j in c.list()}
        stop_seconds = cluster.restart_control_plane()
        cluster.wait_ready()
        with Client(cluster.address, token=cluster.token) as c:
            assert {j.job_id for j in c.list()} == set(records) == {short, long}
            assert state(c.get(short)) == "SUCCEEDED"
            np.testing.assert_allclose(c.result(short).losses, short_want, rtol=RTOL)
            until(
                lambda: state(c.get(long)) in ("SUCCEEDED", "FAILED", "CANCELLED"),
                "the long job",
                cluster,
                600,
            )
            st = c.get(long)
            assert state(st) == "SUCCEEDED" and st.attempt == 3, (st, cluster.logs("control-plane")[-4000:])
            result = c.result(long).losses
        logs = cluster.logs("control-plane")
        assert stop_seconds < STOP_SECONDS and "SIGTERM: draining" in logs and "drained in" in logs, logs[
            -4000:
        ]
        code, body = cluster.get(f"/v1/jobs/{long}", token=True)
        assert code == 200
        np.testing.assert_allclose(json.loads(body)["losses"], long_want, rtol=RTOL)  # every step, 3 attempts
        code, metrics = cluster.get("/metrics", token=True)
        assert code == 200 and f'sbpflow_job_attempt{{job_id="{long}"' in metrics, metrics[:2000]
        code, body = cluster.get("/v1/jobs", token=True)
        assert code == 200 and {j["job_id"] for j in json.loads(body)["jobs"]} == {short, long}
        np.testing.assert_allclose(result, long_want[-len(result) :], rtol=RTOL)
        print(f"\ncluster up and ready in {up:.0f} s; control plane stopped (drained) in {stop_seconds:.1f} s; "
              f"whole test {time.monotonic() - t0:.0f} s")  # fmt: skip
    assert made.left() == []
    if len(result) != len(long_want):  # the bug this marks: see the module docstring
        pytest.xfail(
            f"GetResult after a control-plane restart holds {len(result)} of {len(long_want)} losses: the "
            "resumed attempt's RunResult is saved as the job's result, without the steps before its checkpoint"
        )
