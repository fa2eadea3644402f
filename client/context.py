"""The active trace: which tracer, if any, the ops of the running code are recorded into.

Tensors are symbolic: they exist only while ``sf.Graph.trace`` runs the user's ``build``. A context
variable (not a global) holds the tracer, so two traces in two threads do not see each other's tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from sbpflow.errors import SbpflowError


class TracingError(SbpflowError, RuntimeError):
    """Symbolic tensors or modules used where no trace is running, or mixed between two traces."""


_ACTIVE: ContextVar[Any] = ContextVar("sbpflow_active_tracer", default=None)


def active() -> Any:
    """The tracer of the running ``build``, or None outside one."""
    return _ACTIVE.get()


@contextmanager
def activate(tracer: Any) -> Iterator[Any]:
    if _ACTIVE.get() is not None:
        raise TracingError(
            "a trace is already running in this context; sf.Graph.trace cannot be called from inside build()"
        )
    token = _ACTIVE.set(tracer)
    try:
        yield tracer
    finally:
        _ACTIVE.reset(token)


def require(what: str) -> Any:
    """The active tracer; a clear error naming ``what`` when there is none."""
    tracer = _ACTIVE.get()
    if tracer is None:
        raise TracingError(
            f"{what} needs a running trace: sbpflow tensors are symbolic and exist only inside "
            "sf.Graph.build(); put this code in build() and call graph.trace(data). To compute values, "
            "trace a job and run it (sbpflow.oracle.reference.forward(job) on one device)"
        )
    return tracer
