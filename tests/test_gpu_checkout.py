"""The GPU machine runs this checkout as it is: no install step, no Ray. ``tests/gpu/project_path.py``
maps the folders pyproject.toml maps, and with it a bare interpreter (``python -S``: no site-packages
``.pth``, so no editable install) imports the checkout and trains in process with Ray and cupy absent."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from tests.gpu.project_path import FOLDERS, ROOT

BARE = """
import sys
for name in ("ray", "cupy", "grpc_health", "grpc_reflection"):  # absent on the GPU machine (cupy: here)
    sys.modules[name] = None
import tests.gpu.project_path
import sbpflow as sf
import sbpflow.actor_workers.transport.nccl.transport, sbpflow.actor_workers.worker
from sbpflow.control_plane.compiler import pipeline
from tests.examples.test_examples import load
import tests.gpu.test_executor_gpu, tests.gpu.test_nccl, tests.gpu.test_streams_gpu, tests.gpu.test_kernels
assert sf.__file__.startswith(sys.argv[1]), sf.__file__
assert sf.nn.__file__.startswith(sys.argv[1] + "/client/"), sf.nn.__file__
print(sf.run(load("mlp").make_job(ranks=2, steps=2), backend="inprocess").losses)
"""


def test_the_finder_maps_what_pyproject_maps() -> None:
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {k: v for k, v in dirs.items() if k != "sbpflow"} == FOLDERS
    assert dirs["sbpflow"] == "sbpflow"


def test_a_bare_interpreter_runs_the_checkout_without_an_install_or_ray(tmp_path: Path) -> None:
    site = sysconfig.get_paths()["purelib"]  # numpy, grpc, protobuf: what the GPU machine has installed
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}  # the checkout as the device has it
    out = subprocess.run(
        [sys.executable, "-S", "-c", BARE, str(ROOT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().startswith("[")
