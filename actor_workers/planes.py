"""Each device type's data plane, as a worker sets it up: an address to publish, then a connect with
everyone's addresses (a table from device type to plane, not a branch per type).

- ``cpu``: :class:`~sbpflow.actor_workers.transport.cpu.transport.CpuTransport` — it listens at once; its
  :class:`Endpoint` is the address; ``connect`` builds the full mesh (shared memory on one host, TCP
  between hosts). Kernels run on numpy.
- ``cuda``: :class:`~sbpflow.actor_workers.transport.nccl.transport.NcclTransport` — nothing to publish; every
  communicator's NCCL unique id comes from :class:`UidStore`, the control plane's get-or-create store
  (one Ray actor per attempt): the first member to ask files an id it made itself, as NCCL requires, and
  every other member gets that one. Kernels run on cupy (one GPU per worker: Ray sets
  ``CUDA_VISIBLE_DEVICES``, so the device is 0).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

import numpy as np


class DataPlane(Protocol):
    xp: ModuleType
    transport: Any  # a Transport once connected (the CPU plane's exists from the start)

    def address(self) -> Any: ...

    def connect(self, addresses: Sequence[Any], ranks: Sequence[int], uids: Any, timeout: float) -> Any: ...


class CpuPlane:
    def __init__(self, rank: int, host: str, host_id: str | None, shared_memory: bool = True) -> None:
        from sbpflow.actor_workers.transport.cpu.transport import CpuTransport

        self.xp = np
        self.transport = CpuTransport(rank, host=host, host_id=host_id, shared_memory=shared_memory)

    def address(self) -> Any:
        return self.transport.endpoint

    def connect(self, addresses: Sequence[Any], ranks: Sequence[int], uids: Any, timeout: float) -> Any:
        self.transport.connect(addresses, timeout=timeout)
        return self.transport


class NcclPlane:
    def __init__(self, rank: int, host: str, host_id: str | None, shared_memory: bool = True) -> None:
        from sbpflow.device import array_module

        self.rank = rank
        self.xp = array_module("cuda")
        self.transport: Any = None

    def address(self) -> Any:
        return None

    def connect(self, addresses: Sequence[Any], ranks: Sequence[int], uids: Any, timeout: float) -> Any:
        import ray

        from sbpflow.actor_workers.transport.nccl.comms import CommKey
        from sbpflow.actor_workers.transport.nccl.transport import NcclTransport

        if uids is None:
            raise ValueError(
                "a cuda worker needs the control plane's UidStore to make its NCCL communicators"
            )

        def uid_for(key: CommKey) -> bytes:
            return bytes(
                ray.get(uids.get_or_set.remote(str(key), NcclTransport.unique_id()), timeout=timeout)
            )

        world = tuple(int(r) for r in ranks)
        self.transport = NcclTransport(
            self.rank,
            world,
            uid_for(CommKey("collective", world)),
            device=0,
            uid_for=uid_for,
            timeout=timeout,
        )
        return self.transport


PLANES: dict[str, type[CpuPlane] | type[NcclPlane]] = {"cpu": CpuPlane, "cuda": NcclPlane}


class UidStore:
    """Get-or-create of NCCL unique ids by communicator name, for the members of one job attempt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, bytes] = {}

    def get_or_set(self, key: str, candidate: bytes) -> bytes:
        with self._lock:
            return self._ids.setdefault(key, candidate)
