"""Ray resources for sbpflow's workers: what one rank's worker reserves per device type (:data:`BUNDLES`),
a placement group for an attempt's ranks reserved within a time (:func:`reserve`), and whether the cluster
has room for a job's own layout beside a smaller one it runs on (:func:`room_for`, elastic growth), and
the Ray they are on: the cluster at an address, or a local one started on demand (:func:`ensure_ray`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.launch.worker_pool import WarmGroup, resources_of
from sbpflow.errors import SbpflowError
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


class SchedulingError(SbpflowError):
    """The cluster cannot hold the job (too few CPUs or GPUs), or Ray could not be reached."""


def ensure_ray(address: str | None, cpus: int) -> None:
    """Connect to the Ray at ``address`` (else at ``$RAY_ADDRESS``), or start a local one with at least
    ``cpus`` CPUs."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray advertises 127.0.0.1
    import ray

    if ray.is_initialized():
        return
    quiet_ray()
    address = address or os.environ.get("RAY_ADDRESS") or None  # as ray.init() does: a RayJob sets it
    try:
        if address:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        else:
            ray.init(
                address="local",  # a new one even where `ray start` left a cluster (plain init joins it)
                num_cpus=max(cpus, os.cpu_count() or 1),
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
                configure_logging=False,
            )
    except Exception as exc:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray"
        raise SchedulingError(f"could not start or reach {where}: {type(exc).__name__}: {exc}") from exc


def quiet_ray() -> None:
    """Silence Ray's start-up narration (its token-auth banner; its errors still print, and worker errors
    come through the report hub and Ray's exceptions), and the colour reset its vendored colorama (wrapped
    round stdout/stderr by Ray's CLI logger) writes to a terminal at exit."""
    import atexit
    import logging
    import sys

    import ray.autoscaler._private.cli_logger  # noqa: F401  - what calls colorama.init(strip=False)

    logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
    init = getattr(sys.modules.get("colorama"), "initialise", None)
    if init is not None:  # its streams unwrapped only where still in place (a test may have swapped them)
        atexit.unregister(init.reset_all)
        sys.stdout = init.orig_stdout if sys.stdout is init.wrapped_stdout else sys.stdout
        sys.stderr = init.orig_stderr if sys.stderr is init.wrapped_stderr else sys.stderr
