"""Session fixtures of the container tests: the base image and the CPU image, built once per session
from this checkout (:mod:`tests.deploy.containers`); the image's tag is removed when the session ends.

Most of an image's build is its deps stage (the base's OS packages, Ray, the CUDA wheels): downloads
and unpacking, mostly waiting on the network and the disk. So once the session has collected a
container test, a thread makes the base and the deps stages the collected tests need while the other
tests run, and the fixtures wait for it; they then find those stages in podman's cache. A failure there
is left to the fixtures, which build again and say what failed. Under pytest-xdist every worker collects the
container tests but one runs them (tests/deploy is one group, tests/conftest.py): one worker's thread warms the
stages, holding a lock of the run's, and the fixtures wait on that lock wherever they run."""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import containers

HERE = Path(__file__).resolve().parent
_warming: list[threading.Thread] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    ours = [
        i for i in session.items if i.get_closest_marker("containers") and HERE in Path(str(i.path)).parents
    ]
    if not ours or os.environ.get("SBPFLOW_NO_IMAGE_WARMUP"):
        return
    wanted = ["Dockerfile.cpu"] + (["Dockerfile.gpu"] if any("gpu_image" in i.name for i in ours) else [])
    _warming.append(threading.Thread(target=_warm, args=(wanted,), name="image warm-up", daemon=True))
    _warming[0].start()


def _run_lock() -> Path:
    """A lock file of this test run, the same for each of its xdist workers (the run's id, else the pid)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
    return Path(tempfile.gettempdir()) / f"sbpflow-image-warm-up-{run}.lock"


def pytest_sessionfinish(session: pytest.Session) -> None:
    _run_lock().unlink(missing_ok=True)  # a waiter that opened it holds on; a later one makes it anew


def _warm(dockerfiles: list[str]) -> None:
    with open(_run_lock(), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another worker of this run warms them
        try:
            if containers.unavailable() is None:
                base = containers.base_image()
                for dockerfile in dockerfiles:
                    containers.build_deps(dockerfile, base)
        except Exception:  # noqa: BLE001  the fixtures build again and report it
            pass


@pytest.fixture(scope="session")
def podman_base() -> str:
    for warm_up in _warming:  # the base and the deps stages it makes are then in podman's cache
        warm_up.join()
    with open(_run_lock(), "a") as lock:  # and another worker's warm-up, where it holds the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
    why = containers.unavailable()
    if why is not None:
        pytest.skip(why)
    try:
        return containers.base_image()
    except containers.NoBase as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def cpu_image(podman_base: str) -> Iterator[containers.Built]:
    built = containers.build("Dockerfile.cpu", f"localhost/sbpflow-test:{os.getpid()}-cpu", podman_base)
    print(f"\nDockerfile.cpu on {podman_base}: {built.seconds:.0f} s ({built.deps_seconds:.0f} s the deps stage), "
          f"{built.size / 1e6:.0f} MB")  # fmt: skip
    try:
        yield built
    finally:
        containers.remove_image(built)
