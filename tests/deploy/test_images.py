"""The images, built by podman from this checkout and run: ``deploy/Dockerfile.cpu`` whole, and
``deploy/Dockerfile.gpu`` as far as a machine without a GPU goes (built whole; CuPy, the CUDA wheels and
NCCL load; only the driver is missing).

Both build on the registry's ``python:3.11-slim-bookworm`` where it pulls, else on a stand-in made from
Debian's packages (``deploy/standin-base.sh``). What is checked in the CPU image: sbpflow and Ray at the
manifests' version run as uid 1000; every path the non-root user writes is writable (the job store,
checkpoints, data, Ray's /tmp, its home) and /dev/shm has the size ``--shm-size`` gives; the default
command is the server, which refuses to bind every interface without a token and says how to fix it.
Skips, saying why, where podman cannot run (:func:`tests.deploy.containers.unavailable`).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.deploy import containers
from tests.deploy.containers import Built, in_image

pytestmark = [pytest.mark.containers]

WRITABLE = ("/var/lib/sbpflow", "/var/lib/sbpflow/checkpoints", "/var/lib/sbpflow/data", "/tmp", "/home/ray")
PROBE = (
    "id -u; sbpflow version | head -1; python -c 'import ray, sys; print(ray.__version__, sys.version.split()[0])'; "
    + "; ".join(f"touch {p}/.w && echo writable {p}" for p in WRITABLE)
    + "; df -k /dev/shm | tail -1"
)


def test_the_cpu_image_runs_sbpflow_as_uid_1000_with_its_writable_paths(cpu_image: Built) -> None:
    out = in_image(cpu_image.tag, PROBE, "--shm-size", "512m").splitlines()
    assert out[0] == "1000"
    assert out[1].startswith("sbpflow "), out
    assert out[2].split()[0] == "2.60.0", out  # the manifests' rayVersion (test_manifests checks it too)
    assert [x for x in out if x.startswith("writable ")] == [f"writable {p}" for p in WRITABLE]
    assert int(out[-1].split()[1]) == 512 * 1024  # 1K-blocks of /dev/shm: --shm-size reached Ray's store


def test_the_cpu_images_default_command_is_the_server_which_wants_a_token(cpu_image: Built) -> None:
    p = subprocess.run(
        [containers.PODMAN, "run", "--rm", *containers.RUN_FLAGS, cpu_image.tag],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert p.returncode != 0
    assert "refusing to serve on '0.0.0.0' without a token" in p.stderr and "SBPFLOW_TOKEN" in p.stderr, (
        p.stderr
    )


@pytest.mark.slow
def test_the_gpu_image_builds_and_loads_cuda_as_far_as_a_machine_without_a_gpu_goes(
    podman_base: str, cpu_image: Built
) -> None:
    built = containers.build("Dockerfile.gpu", f"localhost/sbpflow-test:{os.getpid()}-gpu", podman_base)
    print(f"\nDockerfile.gpu on {podman_base}: {built.seconds:.0f} s ({built.deps_seconds:.0f} s the deps stage), "
          f"{built.size / 1e6:.0f} MB")  # fmt: skip
    try:
        script = (
            "python -c 'import ray, sys; print(ray.__version__, sys.version.split()[0])'; "
            "python -c 'from cupy.cuda import nccl; print(\"nccl\", nccl.get_version())'; "
            "python -c 'from sbpflow.device import array_module; array_module(\"cuda\")' 2>&1 | tail -1"
        )
        out = in_image(built.tag, script).splitlines()
        cpu = in_image(
            cpu_image.tag, "python -c 'import ray, sys; print(ray.__version__, sys.version.split()[0])'"
        )
    finally:
        containers.remove_image(built)
    assert out[0] == cpu.strip(), "one Ray and one Python in every pod of a cluster"
    assert out[1].startswith("nccl ") and int(out[1].split()[1]) >= 22000, out  # NCCL 2.20+ loads
    # CuPy and the CUDA wheels are there; the driver is the one thing missing, and the error says so
    assert "DeviceUnavailable: device type 'cuda': cupy is installed but CUDA does not answer" in out[2], out
    assert "check the NVIDIA driver" in out[2], out
