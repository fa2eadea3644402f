"""Ray resources for sbpflow's workers: what one rank's worker reserves per device type (:data:`BUNDLES`),
a placement group for an attempt's ranks reserved within a time (:func:`reserve`), and whether the cluster
has room for a job's own layout beside a smaller one it runs on (:func:`room_for`, elastic growth).
"""

from __future__ import annotations

from dataclasses import dataclass

from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.launch.worker_pool import WarmGroup, resources_of
from sbpflow.v1 import job_pb2 as jp


@dataclass(frozen=True)
class Bundle:
    """What one rank's worker reserves, per device type (a table, not a branch)."""

    resources: dict[str, float]
    actor_options: dict[str, float]


DEVICE_TYPES = {jp.DEVICE_TYPE_CPU: "cpu", jp.DEVICE_TYPE_CUDA: "cuda"}
BUNDLES = {
    jp.DEVICE_TYPE_CPU: Bundle({"CPU": 1.0}, {"num_cpus": 1.0}),
    jp.DEVICE_TYPE_CUDA: Bundle({"GPU": 1.0}, {"num_cpus": 0.0, "num_gpus": 1.0}),
}


def room_for(own: Compiled, running: Compiled) -> bool:
    """Whether the cluster has room for ``own``'s workers beside those of ``running`` (on fewer ranks)."""
    import ray

    need = resources_of([BUNDLES[t].resources for t in own.device_types().values()])
    held = resources_of([BUNDLES[t].resources for t in running.device_types().values()])
    free = ray.available_resources()
    return all(free.get(k, 0.0) >= v - held.get(k, 0.0) for k, v in need.items())


def reserve(name: str, key: tuple[jp.DeviceType.ValueType, ...], seconds: float) -> WarmGroup | None:
    """A new placement group ``name`` with a bundle per device type of ``key`` (in rank order), ready
    within ``seconds``; None, and the group removed, when the cluster cannot hold it by then."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [BUNDLES[t].resources for t in key]
    pg = placement_group(bundles, strategy="PACK", name=name)
    ready, _ = ray.wait([pg.ready()], timeout=seconds)
    if not ready:
        remove_placement_group(pg)
        return None
    return WarmGroup(key, pg, [], resources_of(bundles))
