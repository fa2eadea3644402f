"""The CLI as a script sees it, run as ``sbpflow`` subprocesses against a real control plane on
loopback: ``--json`` with its documented keys, exit codes (0 done, 1 failed, 2 usage), quiet on a
closed pipe, typed ``--set`` values, plain words for a missing or wrong server, defaults in ``--help``."""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbpflow.client.cli import json_output
from sbpflow.client.cli.exit_codes import UsageError
from sbpflow.client.cli.set_values import param_types, parse_set
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.runs.options import MANAGER_DEFAULTS

ROOT = Path(__file__).resolve().parents[3]
MLP = str(ROOT / "examples" / "mlp.py")


def sbpflow(
    *args: str, token: str | None = "t", stdout: int | None = subprocess.PIPE, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBPFLOW_") or k == "SBPFLOW_LOCAL_RAY"}
    if token:
        env["SBPFLOW_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "sbpflow.client.cli.main", *args],
        stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120, env=env, cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("scripting")
    cfg = ServerConfig(
        store=str(tmp / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        slots=4,
        http_port=0,
        auth_token="t",
        checkpoint_root=str(tmp / "ckpts"),
    )
    p = ControlPlane(cfg).start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def done_job(plane: ControlPlane) -> str:
    r = sbpflow(
        "submit", MLP, "--set", "steps=2", "--checkpoint-every", "1", "--watch", "--address", plane.address
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()[0]


def test_status_json_has_the_documented_keys(plane: ControlPlane, done_job: str) -> None:
    r = sbpflow("status", done_job, "--json", "--address", plane.address)
    assert r.returncode == 0, r.stderr
    one = json.loads(r.stdout)
    assert tuple(one) == json_output.JOB_KEYS
    assert (one["state"], one["step"], one["total_steps"]) == ("SUCCEEDED", 2, 2)
    assert isinstance(one["loss"], float) and one["finished"].endswith("Z")
    assert tuple(one["workers"][0]) == json_output.WORKER_KEYS
    listed = json.loads(sbpflow("status", "--json", "--address", plane.address).stdout)
    assert done_job in [j["job_id"] for j in listed["jobs"]]

    # one schema: the HTTP API serves the very objects the CLI prints
    def served(path: str) -> dict:
        ask = urllib.request.Request(f"{plane.http_address}{path}", headers={"Authorization": "Bearer t"})
        with urllib.request.urlopen(ask, timeout=30) as r:
            return dict(json.loads(r.read()))

    assert {k: v for k, v in served(f"/v1/jobs/{done_job}").items() if k != "losses"} == one
    assert served("/v1/jobs")["version"] == listed["version"] == one["version"] == 1


def test_checkpoints_and_plan_json(plane: ControlPlane, done_job: str, tmp_path: Path) -> None:
    root = plane.config.checkpoint_root or ""
    r = sbpflow("checkpoints", done_job, "--checkpoint-root", root, "--json")
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)["checkpoints"]
    assert [c["step"] for c in found] == [1, 2] and tuple(found[0]) == json_output.CHECKPOINT_KEYS
    r = sbpflow("plan", MLP, "--ranks", "2", "--tp", "--json", "--dot", str(tmp_path / "plan.dot"))
    plan = json.loads(r.stdout)  # the "wrote" line goes to stderr
    assert tuple(plan) == json_output.PLAN_KEYS and plan["job"] == "TrainMLP" and "wrote" in r.stderr
    assert all(set(o) == {"name", "op_type", "inputs", "outputs"} for o in plan["ops"])
    assert set(plan["memory"]) == {"0", "1"} and plan["boxing_bytes"] >= 0


def test_checkpoints_and_export_through_the_server_need_no_shared_disk(
    plane: ControlPlane, done_job: str, tmp_path: Path
) -> None:
    away = tmp_path / "elsewhere"  # a folder with no checkpoints: the server is asked
    away.mkdir()
    r = sbpflow("checkpoints", done_job, "--address", plane.address, "--json", cwd=away)
    assert r.returncode == 0, r.stderr
    assert [c["step"] for c in json.loads(r.stdout)["checkpoints"]] == [1, 2]
    got, want = away / "model.safetensors", tmp_path / "local.safetensors"
    r = sbpflow("export", done_job, "--address", plane.address, "--out", str(got), cwd=away)
    assert r.returncode == 0 and f"job {done_job}'s step-00000002 on" in r.stdout, r.stderr
    root = plane.config.checkpoint_root or ""
    assert sbpflow("export", done_job, "--checkpoint-root", root, "--out", str(want)).returncode == 0
    assert got.read_bytes() == want.read_bytes()  # the same export as from the server's own disk
    r = sbpflow("export", "0" * 32, "--address", plane.address, cwd=away)
    assert r.returncode == 1 and "no job" in r.stderr.lower(), r.stderr
    r = sbpflow("export", "--address", plane.address, cwd=away)
    assert r.returncode == 2 and "give a job id" in r.stderr, r.stderr


def test_the_readme_lists_every_json_key() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Scripting") :]
    for key in (
        *json_output.JOB_KEYS,
        *json_output.WORKER_KEYS,
        *json_output.PLAN_KEYS,
        *json_output.CHECKPOINT_KEYS,
    ):
        assert f"`{key}`" in section, key


def test_exit_codes(plane: ControlPlane, done_job: str) -> None:
    assert sbpflow("status", "nope", "--address", plane.address).returncode == 1  # a failed call
    unauth = sbpflow("status", "--address", plane.address, token=None)
    assert unauth.returncode == 1 and "UNAUTHENTICATED" in unauth.stderr and "ID" not in unauth.stdout
    bad = sbpflow("plan", MLP, "--set", "steps=abc")
    assert bad.returncode == 2
    assert (
        "--set steps=abc: make_job's steps takes int, not 'abc'" in bad.stderr
        and "Traceback" not in bad.stderr
    )
    readme = sbpflow("run", str(ROOT / "README.md"))
    assert (
        readme.returncode == 2 and "not a Python file" in readme.stderr and "Traceback" not in readme.stderr
    )
    assert sbpflow("status", "--limit", "x").returncode == 2  # argparse's own


def test_no_server_and_a_wrong_port_in_plain_words() -> None:
    r = sbpflow("status", "--address", "127.0.0.1:1")
    assert r.returncode == 1
    assert "no control plane at 127.0.0.1:1: start one with `sbpflow server`" in r.stderr

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        where = f"127.0.0.1:{httpd.server_address[1]}"
        r = sbpflow("status", "--address", where)
    finally:
        httpd.shutdown()
    assert r.returncode == 1 and f"{where} answers, but not as a gRPC control plane" in r.stderr
    assert "HTTP/2" not in r.stderr


def test_quiet_when_the_reader_goes_away(plane: ControlPlane, done_job: str) -> None:
    for args in (["ops"], ["status", "--address", plane.address]):
        env = {**os.environ, "SBPFLOW_TOKEN": "t"}
        p = subprocess.Popen(
            [sys.executable, "-m", "sbpflow.client.cli.main", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )  # fmt: skip
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # `| head` that has read enough
        err = p.stderr.read().decode()
        assert p.wait(60) == 141 and err == "", err


def test_help_shows_defaults() -> None:
    text = sbpflow("server", "--help").stdout
    assert re.search(r"gRPC port .*\(default:\s+50051\)", text, flags=re.S)
    assert "(default: sbpflow-jobs.db)" in text and "(default: None)" not in text
    secret = sbpflow("status", "--help", token="s3cret").stdout
    assert "s3cret" not in secret and "(default: 20)" in secret


def test_set_values_are_typed_by_make_job() -> None:
    def make_job(steps: int = 1, lr: float = 0.1, tp: bool = False, name: str = "x",
                 ranks: tuple[int, ...] = (), seed: int | None = None, untyped=3) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
        pass

    types = param_types(make_job)
    got = dict(parse_set(x, types) for x in
               ["steps=5", "lr=1", "tp=true", "name=007", "ranks=0,1", "seed=None", "untyped=4", "other=a"])  # fmt: skip
    assert got == {"steps": 5, "lr": 1.0, "tp": True, "name": "007", "ranks": (0, 1), "seed": None,
                   "untyped": 4, "other": "a"}  # fmt: skip
    assert isinstance(got["lr"], float)
    for bad, words in [("lr=fast", "lr takes float, not 'fast'"), ("untyped=x", "untyped takes int"),
                       ("seed=1.5", "seed takes int | None"), ("tp=maybe", "tp takes bool")]:  # fmt: skip
        with pytest.raises(UsageError, match=re.escape(words)):
            parse_set(bad, types)
