"""Session fixtures of the container tests: the base image and the CPU image, built once per session
from this checkout (:mod:`tests.deploy.containers`); the image's tag is removed when the session ends."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.deploy import containers


@pytest.fixture(scope="session")
def podman_base() -> str:
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
