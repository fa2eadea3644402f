"""The data plane: one interface (send, recv, the collectives), one implementation per backend."""

from sbpflow.actor_workers.transport.base import Transport, TransportAborted, TransportError
from sbpflow.actor_workers.transport.cpu import CpuTransport, Endpoint
from sbpflow.actor_workers.transport.inprocess import InProcessTransport, InProcessWorld

__all__ = [
    "CpuTransport",
    "Endpoint",
    "InProcessTransport",
    "InProcessWorld",
    "Transport",
    "TransportAborted",
    "TransportError",
]
