"""The HTTP status endpoint: probes, JSON, Prometheus /metrics (parsed by prometheus-client), the HTML
page, and the token."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sbpflow.client.client import Client, JobHandle
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.runs.options import MANAGER_DEFAULTS
from tests.control_plane.serving import serving
from tests.examples.test_examples import load


def get(url: str, token: str | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, JobHandle]]:
    with serving(tmp_path_factory.mktemp("http"), [load("mlp").make_job(steps=5)], wait=30) as (plane, (h,)):
        yield plane, h


def test_probes_are_open(served: tuple[ControlPlane, JobHandle]) -> None:
    base = served[0].http_address
    assert get(f"{base}/healthz")[::2] == (200, "ok\n")
    assert get(f"{base}/readyz")[::2] == (200, "ready\n")


@pytest.mark.parametrize("path", ["/v1/jobs", "/metrics", "/v1/jobs/x"])
def test_everything_else_needs_the_token(served: tuple[ControlPlane, JobHandle], path: str) -> None:
    base = served[0].http_address
    code, _, body = get(f"{base}{path}")
    assert code == 401 and "no credentials" in json.loads(body)["error"]
    assert get(f"{base}{path}", token="nope")[0] == 401


@pytest.mark.parametrize("path", ["/", "/jobs/x", "/jobs/x/plan"])
def test_a_page_without_the_token_answers_the_sign_in_form(
    served: tuple[ControlPlane, JobHandle], path: str
) -> None:
    code, ctype, body = get(f"{served[0].http_address}{path}")
    assert code == 401 and ctype.startswith("text/html")
    assert "<form method='post' action='/login'>" in body and f"value='{path}'" in body


def test_jobs_as_json(served: tuple[ControlPlane, JobHandle]) -> None:
    plane, h = served
    code, ctype, body = get(f"{plane.http_address}/v1/jobs", "tok")
    assert code == 200 and ctype == "application/json"
    (job,) = json.loads(body)["jobs"]
    assert job["job_id"] == h.job_id and job["state"] == "SUCCEEDED" and job["step"] == 5
    code, _, body = get(f"{plane.http_address}/v1/jobs/{h.job_id}", "tok")
    one = json.loads(body)
    assert code == 200 and len(one["losses"]) == 5 and [w["rank"] for w in one["workers"]] == [0, 1]
    assert json.loads(get(f"{plane.http_address}/v1/jobs?state=running", "tok")[2])["jobs"] == []
    code, _, body = get(f"{plane.http_address}/v1/jobs?state=sleeping", "tok")
    assert code == 400 and "state='sleeping' is unknown" in json.loads(body)["error"]
    code, _, body = get(f"{plane.http_address}/v1/jobs/nope", "tok")
    assert code == 404 and "'nope'" in json.loads(body)["error"]


def test_metrics_parse(served: tuple[ControlPlane, JobHandle]) -> None:
    plane, h = served
    code, ctype, text = get(f"{plane.http_address}/metrics", "tok")
    assert code == 200 and ctype.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    wanted = {"sbpflow_jobs", "sbpflow_job_step", "sbpflow_job_loss", "sbpflow_job_samples_per_second",
              "sbpflow_worker_up", "sbpflow_compile_seconds", "sbpflow_step_seconds"}  # fmt: skip
    assert wanted <= set(families)
    jobs = {s.labels["state"]: s.value for s in families["sbpflow_jobs"].samples}
    assert jobs["SUCCEEDED"] == 1 and jobs["RUNNING"] == 0
    (step,) = families["sbpflow_job_step"].samples
    assert step.labels == {"job_id": h.job_id, "name": "TrainMLP"} and step.value == 5
    counts = {s.name: s.value for s in families["sbpflow_step_seconds"].samples}
    assert counts["sbpflow_step_seconds_count"] == 5


def test_html_page_has_a_loss_curve(served: tuple[ControlPlane, JobHandle]) -> None:
    plane, h = served
    code, ctype, page = get(f"{plane.http_address}/", "tok")
    assert code == 200 and ctype.startswith("text/html")
    assert h.job_id in page and "<polyline" in page and f"href='/jobs/{h.job_id}'" in page
    assert ">step</text>" in page and ">loss</text>" in page  # the axes are titled


def test_unknown_path(served: tuple[ControlPlane, JobHandle]) -> None:
    code, _, body = get(f"{served[0].http_address}/nothing", "tok")
    assert code == 404 and "/metrics" in json.loads(body)["error"]


def test_not_ready_after_stop(tmp_path: Path) -> None:
    plane = ControlPlane(
        ServerConfig(store=str(tmp_path / "j.db"), run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=1)
    ).start()
    plane.manager.shutdown()
    assert get(f"{plane.http_address}/readyz")[0] == 503
    plane.stop()


def test_open_metrics_serves_metrics_without_the_token_and_nothing_else(tmp_path: Path) -> None:
    cfg = ServerConfig(
        store=str(tmp_path / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        slots=1,
        auth_token="tok",
        open_metrics=True,
    )
    plane = ControlPlane(cfg).start()
    try:
        code, ctype, body = get(f"{plane.http_address}/metrics")
        assert code == 200 and "sbpflow_jobs" in body
        assert get(f"{plane.http_address}/v1/jobs")[0] == 401
    finally:
        plane.stop()


def test_a_running_jobs_workers_show_their_cpu_and_memory(tmp_path: Path) -> None:
    """While a job runs on the in-process backend, its worker rows carry the process's CPU seconds and
    resident memory: in the job JSON, on its page and as Prometheus series."""
    cfg = ServerConfig(
        store=str(tmp_path / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        slots=2,
        auth_token="tok",
    )
    plane = ControlPlane(cfg).start()
    try:
        with Client(plane.address, token="tok") as c:
            h = c.submit(load("mlp").make_job(steps=1_000_000))
            deadline = time.monotonic() + 60
            while True:
                one = json.loads(get(f"{plane.http_address}/v1/jobs/{h.job_id}", "tok")[2])
                if one["workers"] and all(
                    w["cpu_seconds"] > 0 and w["rss_bytes"] > 0 for w in one["workers"]
                ):
                    break
                assert time.monotonic() < deadline and one["state"] in (
                    "PENDING",
                    "COMPILING",
                    "STARTING",
                    "RUNNING",
                )
                time.sleep(0.1)
            assert all(w["rss_bytes"] > 1 << 20 for w in one["workers"])
            page = get(f"{plane.http_address}/jobs/{h.job_id}", "tok")[2]
            assert "<th>CPU s</th><th>memory (RSS)</th>" in page and " MiB</td>" in page
            text = get(f"{plane.http_address}/metrics", "tok")[2]
            families = {f.name: f for f in text_string_to_metric_families(text)}
            rss = {
                s.labels["rank"]: s.value for s in families["sbpflow_worker_resident_memory_bytes"].samples
            }
            assert set(rss) == {"0", "1"} and min(rss.values()) > 1 << 20
            cpu = families["sbpflow_worker_cpu_seconds"].samples
            assert {s.labels["job_id"] for s in cpu} == {h.job_id} and min(s.value for s in cpu) > 0
            h.cancel()
            h.wait(60)
    finally:
        plane.stop()
