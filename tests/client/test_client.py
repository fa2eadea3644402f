"""``sf.Client`` and the job commands of the CLI against a real control plane on loopback, the embedded
``sbpflow run`` (the progress bar's renderings: test_progress_bar.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from sbpflow.client.cli.main import main
from sbpflow.client.client import Client, ClientError
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.runs.options import MANAGER_DEFAULTS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MLP = str(EXAMPLES / "mlp.py")


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("cli")
    cfg = ServerConfig(
        store=str(tmp / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        slots=4,
        http_port=None,
        auth_token="t",
    )
    p = ControlPlane(cfg).start()
    yield p
    p.stop()


def cli(plane: ControlPlane, *args: str) -> list[str]:
    return [*args, "--address", plane.address, "--token", "t"]


def test_submit_status_watch_logs(plane: ControlPlane, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(cli(plane, "submit", MLP, "--set", "steps=3")) == 0
    job_id = capsys.readouterr().out.strip()
    assert len(job_id) == 16
    assert main(cli(plane, "watch", job_id)) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("step") for line in out.splitlines()) == 3 and "SUCCEEDED" in out
    assert main(cli(plane, "status", job_id)) == 0
    out = capsys.readouterr().out
    assert f"job {job_id} (TrainMLP): SUCCEEDED" in out and "step 3/3" in out and "rank 1:" in out
    assert main(cli(plane, "status")) == 0
    assert job_id in capsys.readouterr().out
    assert main(cli(plane, "logs", job_id)) == 0
    assert "control INFO    SUCCEEDED" in capsys.readouterr().out


def test_submit_watch_flag_and_cancel(plane: ControlPlane, capsys: pytest.CaptureFixture[str]) -> None:
    with Client(plane.address, token="t") as c:
        from tests.examples.test_examples import load

        h = c.submit(load("mlp").make_job(steps=100_000))
        while h.status().step < 1:
            pass
        assert main(cli(plane, "cancel", h.job_id, "--reason", "from the cli")) == 0
        assert f"job {h.job_id}: " in capsys.readouterr().out
        st = h.wait(30)
        assert st.reason == "CANCELLED_BY_USER" and st.message == "from the cli"
        assert main(cli(plane, "watch", h.job_id)) == 1  # a job that did not succeed
        assert "CANCELLED" in capsys.readouterr().err
    assert main(cli(plane, "submit", MLP, "--set", "steps=2", "--watch")) == 0
    assert "SUCCEEDED" in capsys.readouterr().out


def test_client_errors_name_the_problem(plane: ControlPlane, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*cli(plane, "status", "nope")]) == 1  # a failed call, not a usage error
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["status", "--address", plane.address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    with Client(plane.address, token="t") as c, pytest.raises(ClientError) as e:
        c.handle("nope")
    assert "'nope'" in str(e.value)


def test_embedded_run_prints_the_progress_bar(ray_local: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``sbpflow run``'s default: a local Ray, an in-process control plane, one worker process per rank."""
    assert main(["run", MLP, "--ranks", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and "RUNNING" in out and "SUCCEEDED" in out and "3 steps in" in out


@pytest.mark.parametrize(
    ("spoil", "words"),
    [
        (lambda job: job.parameters.append(job.parameters[0]), "names 'model.net.0.weight' again"),
        (
            lambda job: _zero_width(job, "model.net.0.weight"),
            "parameter tensor 'model.net.0.weight' .* has size 0 on axis 1",
        ),
    ],
)
def test_submit_refuses_a_degenerate_job_naming_the_entry(
    plane: ControlPlane, spoil: Any, words: str
) -> None:
    from sbpflow.codec.wire import job_to_proto
    from tests.examples.test_examples import load

    job = job_to_proto(load("mlp").make_job(ranks=1))
    spoil(job)
    with Client(plane.address, token="t") as c, pytest.raises(ClientError) as e:
        c.submit(job)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and re.search(words, e.value.details), (
        e.value.details
    )


def _zero_width(job: Any, name: str) -> None:
    (t,) = (t for t in job.graph.tensors if t.name == name)
    t.shape[1] = 0


@pytest.mark.parametrize(
    ("checkpoint", "file"),
    [
        ("step-1", "../x"),
        ("..", "a"),
        ("step-1", "/etc/passwd"),
        ("", "a"),
        ("step-1", "a\\b"),
        ("s", "a/./b"),
    ],
)
def test_a_checkpoint_file_the_server_names_outside_its_folder_is_refused(
    tmp_path: Path, checkpoint: str, file: str
) -> None:
    from sbpflow.client.client import _inside

    with pytest.raises(ClientError, match="outside its folder"):
        _inside(tmp_path, checkpoint, file)
    assert _inside(tmp_path, "step-00000002", "rank-0/a.safetensors") == (
        tmp_path / "step-00000002" / "rank-0" / "a.safetensors"
    )
