"""Fixtures of the transport tests. ``no_leftover_threads`` is opt-in (``pytestmark``), so the pool and NCCL
import tests in this folder run as they did."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest


@pytest.fixture
def no_leftover_threads() -> Iterator[None]:
    """Fails a test that leaves a thread running: every rank-thread joined, every transport closed."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before]
    assert not left, f"threads left behind: {left}"
