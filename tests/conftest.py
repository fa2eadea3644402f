"""Test-session settings. Hypothesis is derandomized and keeps no example database on every run, not
only under CI: a clean clone draws the same examples every time, so ``python -m pytest -q`` is green on
every run and a red run is a real failure, reproducible by running it again. ``HYPOTHESIS_EXPLORE=1``
lets Hypothesis explore new examples (and keep a database) when hunting for bugs locally."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

# Set before anything imports Ray: a single-node Ray then advertises 127.0.0.1, not the external address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# `sbpflow run` under test starts a Ray of its own (or joins the session's), never the kept local Ray that
# would outlive the session; the tests of the kept Ray give it a folder of their own (SBPFLOW_RAY_DIR).
os.environ.setdefault("SBPFLOW_LOCAL_RAY", "fresh")

settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("ci", derandomize=True, database=None)  # the same; kept for --hypothesis-profile=ci
settings.register_profile("explore")
settings.load_profile("explore" if os.environ.get("HYPOTHESIS_EXPLORE") else "deterministic")


@pytest.fixture(scope="session")
def ray_local() -> Iterator[str]:
    """One local Ray for the whole test session (4 CPUs, a 256 MB object store, no dashboard), bound to
    loopback; shut down when the session ends. Yields the address that ``ray.init(address=...)`` and
    ``sf.run(..., ray_address=...)`` accept. Tests that need Ray take this fixture; nothing else starts
    one."""
    import ray

    if ray.is_initialized():
        pytest.fail("Ray was started before the ray_local fixture: a test ran Ray without taking the fixture")
    _RAY_FIXTURE.append(True)
    info = ray.init(
        address="local",  # a new one even where another Ray on this machine (`ray start`) would be joined
        num_cpus=4,
        object_store_memory=256 * 1024 * 1024,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield str(info.address_info["gcs_address"])
    finally:
        ray.shutdown()


_RAY_FIXTURE: list[bool] = []  # set once ray_local has started the session's Ray


@pytest.fixture(autouse=True)
def only_the_session_ray(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that starts Ray itself (sf.run's default backend without ``ray_local``) would start a second,
    unbounded local Ray: fail it, naming the fixture to take."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and not _RAY_FIXTURE and ray.is_initialized():
        ray.shutdown()
        pytest.fail(
            f"{request.node.nodeid} started Ray itself; take the ray_local fixture (tests/conftest.py)"
        )


# The suite runs on two pytest-xdist workers (pyproject's addopts: ``-n 2``), each with a session Ray of its
# own. A group runs whole on one worker, in order: each test file is one (its module fixtures are made
# once), and tests/deploy is one, whose images, containers and network namespaces are the machine's.
MACHINE_WIDE = "tests/deploy/"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return MACHINE_WIDE if path.startswith(MACHINE_WIDE) else path

    return ByFile(config, log)
