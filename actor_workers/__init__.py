"""The workers: the actor runtime (``runtime``), the data plane (``transport``) and ``run``.

``run`` is imported on first use, so ``import sbpflow.actor_workers`` stays as light as ``import sbpflow``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    if name == "run":
        from sbpflow.actor_workers.api import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
