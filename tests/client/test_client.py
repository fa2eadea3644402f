"""``sf.Client`` and the job commands of the CLI against a real control plane on loopback, the embedded
``sbpflow run``, and the progress bar's two renderings."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbpflow.client.cli import main
from sbpflow.client.client import Client, ClientError
from sbpflow.client.progress_bar import ProgressBar
from sbpflow.control_plane.server import ControlPlane, ServerConfig
from sbpflow.run_options import MANAGER_DEFAULTS
from sbpflow.v1 import service_pb2 as sp

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
        from tests.client.test_examples import load

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
    assert main([*cli(plane, "status", "nope")]) == 2
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["status", "--address", plane.address]) == 2
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


def _event(step: int, loss: float | None = None, state: str = "") -> sp.JobEvent:
    st = sp.JobStatus(job_id="j", step=step, total_steps=10, samples_per_second=100.0)
    if loss is not None:
        st.loss = loss
    ev = sp.JobEvent(job_id="j", status=st)
    if state:
        ev.status.state = sp.JobState.Value(state)
        ev.state_change.current = ev.status.state
    else:
        ev.step.step = step
    return ev


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_renderings() -> None:
    plain = io.StringIO()
    bar = ProgressBar(plain)
    for ev in (_event(0, state="JOB_STATE_RUNNING"), _event(5, 0.5), _event(10, 0.25)):
        bar.update(ev)
    lines = plain.getvalue().splitlines()
    assert lines[0] == "job j: RUNNING"
    assert lines[1] == "step    5/10  [##########----------]      100.0 samples/s  loss 0.500000"
    assert lines[2].startswith("step   10/10  [####################]")
    tty = _Tty()
    bar = ProgressBar(tty)
    bar.update(_event(5, 0.5))
    bar.update(_event(6, 0.4))
    bar.close()
    assert tty.getvalue().count("\r") == 2 and tty.getvalue().endswith("loss 0.400000\n")
