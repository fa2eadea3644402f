"""The actor runtime: actors exchanging registers by req/ack on stream threads, independent of the plan."""

from sbpflow.actor_workers.runtime.actor import ActorSpec
from sbpflow.actor_workers.runtime.engine import Engine, RunResult
from sbpflow.actor_workers.runtime.errors import (
    ActorGraphError,
    RunCancelled,
    RuntimeAborted,
    RuntimeFailure,
    RuntimeTimeout,
)
from sbpflow.actor_workers.runtime.group import EngineGroup
from sbpflow.actor_workers.runtime.register import RegisterSpec
from sbpflow.actor_workers.runtime.trace import ActEvent, chrome_trace, write_chrome_trace

__all__ = [
    "ActEvent",
    "ActorGraphError",
    "ActorSpec",
    "Engine",
    "EngineGroup",
    "RegisterSpec",
    "RunCancelled",
    "RunResult",
    "RuntimeAborted",
    "RuntimeFailure",
    "RuntimeTimeout",
    "chrome_trace",
    "write_chrome_trace",
]
