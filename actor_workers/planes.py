"""Each device type's data plane, as a worker sets it up: an address to publish, then a connect with
everyone's addresses (a table from device type to plane, not a branch per type).

- ``cpu``: :class:`~sbpflow.actor_workers.transport.cpu.transport.CpuTransport` — it listens at once; its
  :class:`Endpoint` is the address; ``connect`` builds the full mesh (shared memory on one host, TCP
  between hosts). Kernels run on numpy.
- ``cuda``: :class:`~sbpflow.actor_workers.transport.nccl.transport.NcclTransport` — nothing to publish; every
  communicator's NCCL unique id comes from :class:`UidStore`, the control plane's store (one Ray actor
  per attempt): the first member to ask a key is named its maker and files an id it made itself, as NCCL
  requires; every other member waits for that one, so no id is made and discarded. Kernels run on cupy (one GPU per worker: Ray sets
  ``CUDA_VISIBLE_DEVICES``, so the device is 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport.nccl.uids import UidBook


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
        from sbpflow.actor_workers.transport.nccl.uids import fetch_uid

        if uids is None:
            raise ValueError(
                "a cuda worker needs the control plane's UidStore to make its NCCL communicators"
            )

        def uid_for(key: CommKey) -> bytes:  # an id is made only by the member the store names, once
            return fetch_uid(
                lambda k, m: ray.get(uids.ask.remote(k, m), timeout=timeout),
                lambda k, u: ray.get(uids.file.remote(k, u), timeout=timeout),
                str(key),
                self.rank,
                NcclTransport.unique_id,
                timeout,
            )

        world = tuple(int(r) for r in ranks)
        self.transport = NcclTransport(
            self.rank,
            world,
            uid_for(CommKey("collective", world)),
            device=0,
            uid_for=uid_for,
            timeout=timeout,
            static_shapes=True,  # a plan's shapes are static: a header round only on each tag's first call
        )
        return self.transport


PLANES: dict[str, type[CpuPlane] | type[NcclPlane]] = {"cpu": CpuPlane, "cuda": NcclPlane}


class UidStore(UidBook):
    """The NCCL unique ids of one job attempt, by communicator name (a Ray actor the scheduler makes):
    one maker per key, so no id is made and discarded."""
