"""A control plane for the status-page tests: in-process backend, a token, jobs trained and waited for."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from sbpflow.client.client import Client, JobHandle
from sbpflow.control_plane.service.isolation import RETRY_AFTER_KEY
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.job import Job
from sbpflow.runs.options import MANAGER_DEFAULTS

TOKEN = "tok"


def answered(fn: Any, request: bytes, timeout: float, **kwargs: Any) -> Any:
    """``fn(request)`` (a raw gRPC callable), waiting out the server's capacity refusals as a client does.

    A loaded machine's server may answer RESOURCE_EXHAUSTED with a ``retry-after-ms`` hint (a call that
    waited too long for a handler thread: the isolation contract); that is a clean answer, not a fault,
    so the call is made again after the hint until ``timeout`` seconds have passed. Any other error, or
    a refusal without a hint (a request too large), is raised at once."""
    end = time.monotonic() + timeout
    while True:
        try:
            return fn(request, timeout=max(0.001, end - time.monotonic()), **kwargs)
        except grpc.RpcError as e:
            hint = dict(e.trailing_metadata() or ()).get(RETRY_AFTER_KEY)  # type: ignore[attr-defined]
            saturated = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            if not saturated or hint is None or time.monotonic() + int(hint) / 1000 >= end:
                raise
            time.sleep(int(hint) / 1000)


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
