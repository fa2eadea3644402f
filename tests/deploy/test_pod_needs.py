"""What the containers need, in the rendered manifests (the podman runs of test_images and
test_pod_cluster show the same needs on a real engine):

- /dev/shm: every Ray pod (head, every worker group, the control plane, the RayJob's pods) mounts an
  in-memory emptyDir there, with a sizeLimit above the Ray object store it is given, and within the
  container's memory limit (a memory volume counts against it);
- the non-root user's writable paths: every path the server writes (its store's folder, the checkpoint
  and data roots) sits on a volume the pod's fsGroup makes writable to uid 1000;
- graceful shutdown: SIGTERM reaches the server (tini, then ``exec sbpflow server``), and the pod's grace
  period outlasts the server's drain (``--drain-grace``) with a margin for the gRPC stop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.test_manifests import container, one, rendered, server_args

Obj = dict[str, Any]
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
STOP_MARGIN = 3.0  # seconds after the drain: the gRPC and HTTP servers stop, Ray disconnects


def quantity(q: str | int) -> int:
    """A Kubernetes quantity in bytes ("2Gi", "800M", "1000")."""
    s = str(q)
    for suffix in sorted(UNITS, key=len, reverse=True):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * UNITS[suffix])
    return int(s)


def ray_pods(name: str) -> list[tuple[str, Obj, Obj]]:
    """(what, pod spec, rayStartParams) of every Ray group of target ``name``'s RayCluster or RayJob."""
    objs = rendered(name)
    kind = "RayJob" if name == "rayjob" else "RayCluster"
    spec = one(objs, kind)["spec"]
    spec = spec["rayClusterSpec"] if kind == "RayJob" else spec
    groups = [("head", spec["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    return [(what, g["template"]["spec"], g.get("rayStartParams", {})) for what, g in groups]


def shm_of(pod: Obj) -> tuple[Obj, Obj]:
    """The /dev/shm volume of the pod's one container, and that container."""
    (c,) = pod["containers"]
    (mount,) = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return vol, c


def check_shm(what: str, pod: Obj, object_store: int) -> None:
    vol, c = shm_of(pod)
    assert vol.get("emptyDir", {}).get("medium") == "Memory", f"{what}: /dev/shm is not an in-memory emptyDir"
    size = quantity(vol["emptyDir"]["sizeLimit"])
    assert object_store < size, (
        f"{what}: Ray's object store ({object_store} B) does not fit /dev/shm ({size} B)"
    )
    assert size < quantity(c["resources"]["limits"]["memory"]), (
        f"{what}: /dev/shm takes the whole memory limit"
    )


@pytest.mark.parametrize("name", ["cpu", "gpu", "rayjob"])
def test_every_ray_pod_has_a_memory_shm_above_its_object_store(name: str) -> None:
    pods = ray_pods(name)
    assert len(pods) >= 2
    for what, pod, params in pods:
        assert "object-store-memory" in params, f"{what}: set object-store-memory (Ray's default may not fit)"
        check_shm(what, pod, int(params["object-store-memory"]))
    if name != "rayjob":
        dep = one(rendered(name), "Deployment", "sbpflow-control-plane")
        _, start = server_args(container(dep))
        (store,) = [int(a.split("=", 1)[1]) for a in start if a.startswith("--object-store-memory=")]
        check_shm("control plane", dep["spec"]["template"]["spec"], store)


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_what_the_server_writes_is_on_a_volume_its_user_can_write(name: str) -> None:
    dep = one(rendered(name), "Deployment", "sbpflow-control-plane")
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    args, _ = server_args(c)
    mounts = [m["mountPath"] for m in c["volumeMounts"] if m["mountPath"] != "/dev/shm"]
    written = [str(Path(args.store).parent), *args.data_root]
    written += [args.checkpoint_root] if args.checkpoint_root else []
    for path in written:
        assert any(path == m or path.startswith(m + "/") for m in mounts), f"{path} is on no volume: {mounts}"
    user = pod["securityContext"]
    assert user["runAsNonRoot"] and user["runAsUser"] == 1000 and user["fsGroup"] == 1000


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_sigterm_reaches_the_server_and_its_drain_fits_the_grace_period(name: str) -> None:
    dep = one(rendered(name), "Deployment", "sbpflow-control-plane")
    c = container(dep)
    assert c["command"][:2] == ["tini", "--"], "tini as PID 1 passes SIGTERM on"
    assert any(line.strip().startswith("exec sbpflow server") for line in c["args"][0].splitlines())
    args, _ = server_args(c)
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert args.drain_grace + STOP_MARGIN <= grace, (args.drain_grace, grace)
