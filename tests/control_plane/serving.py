"""A control plane for the status-page tests: in-process backend, a token, jobs trained and waited for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sbpflow.client.client import Client, JobHandle
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.job import Job
from sbpflow.runs.options import MANAGER_DEFAULTS

TOKEN = "tok"


@contextmanager
def serving(
    tmp: Path, jobs: list[Job], wait: float = 120.0, **config: Any
) -> Iterator[tuple[ControlPlane, list[JobHandle]]]:
    """A started control plane (token ``TOKEN``) that has run ``jobs`` to their end; stopped after."""
    cfg = ServerConfig(
        store=str(tmp / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        slots=2,
        auth_token=TOKEN,
        **config,
    )
    plane = ControlPlane(cfg).start()
    try:
        with Client(plane.address, token=TOKEN) as c:
            handles = [c.submit(job) for job in jobs]
            for h in handles:
                h.wait(wait)
            yield plane, handles
    finally:
        plane.stop()
