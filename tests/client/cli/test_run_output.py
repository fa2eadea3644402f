"""What ``sbpflow run`` says: an example's own failure as one line and its own frames, a make_job of the
wrong type named, refusals that name real options, step lines off a terminal at most every N seconds, and
Ray's start-up narration silenced."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from sbpflow.client.cli.main import main
from sbpflow.client.progress_bar import FIRST_STEPS, ProgressBar
from sbpflow.runs.numerics import NonFiniteLoss, NonFiniteParameters
from sbpflow.v1 import service_pb2 as sp

MLP = str(Path(__file__).resolve().parents[3] / "examples" / "mlp.py")
BROKEN = """
def helper(x):
    return {"a": 1}[x]


def make_job(**kwargs):
    return helper("b")
"""


def test_an_examples_own_error_is_one_line_and_its_own_frames(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = tmp_path / "broken.py"
    example.write_text(BROKEN)
    for command in ("run", "plan"):
        assert main([command, str(example), "--backend", "inprocess"][: 2 if command == "plan" else 4]) == 1
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert lines[0] == "sbpflow: error: KeyError: 'b'"
        files = [line.split('"')[1] for line in lines if line.startswith("  File ")]
        assert files == [str(example), str(example)]  # make_job, then helper: no sbpflow or Python frame
        assert "Traceback" not in err and "sbpflow/" not in err.replace("sbpflow: error", "")


def test_a_make_job_of_the_wrong_type_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = tmp_path / "wrong.py"
    example.write_text("def make_job(**kwargs):\n    return {'steps': 3}\n")
    assert main(["run", str(example), "--steps", "3", "--backend", "inprocess"]) == 1  # --steps: still named
    assert capsys.readouterr().err.strip() == (
        f"sbpflow: error: {example}: make_job returned a dict; return a sbpflow.Job (graph.trace(...))"
    )


def test_refusals_name_real_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "clip_grad_norm" in str(NonFiniteLoss("j", 3, float("nan")))
    assert "clip_grad_norm" in str(NonFiniteParameters("j", 3, ["w"]))
    table = tmp_path / "rows.csv"
    table.write_text("a,b,y\n" + "".join(f"{i},{i % 3},{i % 2}\n" for i in range(40)))
    run = ["run", MLP, "--backend", "inprocess", "--steps", "1", "--set", "batch_size=8"]
    assert main([*run, "--set", f"data={table}"]) == 1  # outside the working directory: refused
    err = capsys.readouterr().err
    assert "--data PATH" in err and "--data-root" not in err and "sbpflow run" in err
    assert main([*run, "--data", str(table)]) == 0, capsys.readouterr().err  # --data's folder may be read


def _step(step: int, at: float, total: int = 100) -> sp.JobEvent:
    ev = sp.JobEvent(job_id="j", status=sp.JobStatus(job_id="j", step=step, total_steps=total, loss=1.0))
    ev.time.FromNanoseconds(int((1_700_000_000 + at) * 1e9))
    ev.step.step = step
    return ev


def _ended(at: float, state: str = "SUCCEEDED") -> sp.JobEvent:
    ev = _step(0, at)
    ev.ClearField("step")
    ev.status.state = ev.state_change.current = sp.JobState.Value("JOB_STATE_" + state)
    return ev


def _printed(events: list[sp.JobEvent], every: float = 10.0) -> list[int]:
    out = io.StringIO()
    bar = ProgressBar(out, every=every)
    for ev in events:
        bar.update(ev)
    bar.close()
    return [
        int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines() if line.startswith("step")
    ]


def test_off_a_terminal_a_step_line_every_n_seconds_and_the_last() -> None:
    steps = [_step(i, at=i * 0.5) for i in range(1, 101)]  # 100 steps over 50 s
    first = list(range(1, FIRST_STEPS + 1))
    assert _printed(steps) == first + [25, 45, 65, 85, 100]  # then every 10 s of the job's time, and the last
    assert _printed(steps, every=0) == list(range(1, 101))
    failed = [*steps[:40], _ended(20.5, "FAILED")]  # the last step seen comes before the end line
    assert _printed(failed)[-1] == 40


def test_ray_start_up_narration_is_silenced() -> None:
    from sbpflow.control_plane.launch.ray_backend import quiet_ray

    quiet_ray()  # starts nothing
    assert logging.getLogger("ray._private.authentication").getEffectiveLevel() == logging.ERROR


def test_a_local_ray_flag_needs_backend_ray(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", MLP, "--keep-ray", "--backend", "inprocess"]) == 2
    assert "--keep-ray is a local Ray of backend ray's" in capsys.readouterr().err
    assert main(["run", MLP, "--fresh-ray", "--ray-address", "127.0.0.1:1"]) == 2
    assert "--fresh-ray is a local Ray of backend ray's" in capsys.readouterr().err


def test_runs_share_the_kept_local_ray_and_it_stops_once_unused(tmp_path: Path) -> None:
    """`sbpflow run`'s default, for real: the first run starts a local Ray in its own folder and keeps
    it, the next joins it (no second start), a plain ray.init() on the machine would not find it, and
    its reaper stops it (every process of it) once no run has held it for SBPFLOW_RAY_IDLE seconds."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    from sbpflow.control_plane.launch.ray_cluster import KeptRay

    folder = Path(tempfile.mkdtemp(prefix="sfk", dir="/tmp"))  # short: Ray's socket paths are bounded
    # idle long enough that the second run (a Python start and its imports, seconds on a loaded machine)
    # joins before the reaper stops the first run's Ray: 3 s once let the reaper win, and run 2 started its own
    idle = 20
    env = os.environ | {
        "SBPFLOW_RAY_DIR": str(folder),
        "SBPFLOW_RAY_IDLE": str(idle),
        "SBPFLOW_LOCAL_RAY": "kept",
    }
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # as a user's shell has it: the run sets it itself
    sbpflow = [sys.executable, "-m", "sbpflow.client.cli.main", "run", MLP, "--steps", "2"]
    try:
        runs = [
            subprocess.run(sbpflow, env=env, capture_output=True, text=True, timeout=180) for _ in range(2)
        ]
        for done in runs:
            assert done.returncode == 0, done.stderr[-2000:]
        address = json.loads((folder / "ray.json").read_text())["address"]
        assert f"started a local Ray at {address}" in runs[0].stderr
        assert "started a local Ray" not in runs[1].stderr  # joined, not started again
        found = subprocess.run(
            [sys.executable, "-c", "from ray._private.services import get_ray_address_from_environment as f; "
             "print(f(None, None))"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert found.stdout.strip() == "None"  # a plain ray.init() starts its own, it does not join this one
        deadline = time.monotonic() + 60 + idle
        while KeptRay(folder).noted() is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert KeptRay(folder).noted() is None, "the reaper did not stop the kept Ray"
        # noted() is None once the GCS stops answering: the first of the reaper's kills, while it may still
        # be killing the rest (a CI run met 4 alive at that instant); every one is gone soon after
        gone = time.monotonic() + 15
        while _processes_naming(str(folder / "ray")) and time.monotonic() < gone:
            time.sleep(0.2)
        assert not _processes_naming(str(folder / "ray"))
    finally:
        KeptRay(folder).stop()
        shutil.rmtree(folder, ignore_errors=True)


def _processes_naming(mark: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark.encode() in (proc / "cmdline").read_bytes():
                out.append(int(proc.name))
        except OSError:
            continue
    return out
