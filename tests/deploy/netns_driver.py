"""The client side of the multi-node test, run inside test host a: submit a job to the control plane, wait
for it, and print one JSON line saying what happened and where.

    python -m tests.deploy.netns_driver --server 10.77.0.1:PORT --http http://10.77.0.1:PORT \\
        --ray-address 10.77.0.1:6379 --job job.pb --params p.npz   # token in SBPFLOW_TOKEN, Ray's in RAY_AUTH_TOKEN
    python -m tests.deploy.netns_driver --ray-address 10.77.0.1:6379 --placements    # {job id: [bundle host...]}

It joins the Ray cluster only to look (the cluster's nodes, and the nodes the job's placement group was
given — Ray keeps a removed group's bundle table); the job itself goes through ``sf.Client`` and the
server, as a user's would. The JSON: ``state``, ``losses``, ``job_id``, ``nodes`` (alive node IPs),
``bundle_hosts`` (one node IP per rank's bundle), ``readyz`` and ``metrics`` (HTTP status codes) and
``metrics_names`` (the ``sbpflow_`` families the endpoint exposes); the trained parameters go to
``--params`` (.npz).
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request
from typing import Any

import numpy as np
import ray

from sbpflow.client.client import Client
from sbpflow.v1 import job_pb2


def http_get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def job_of(pg_name: str) -> str | None:
    """The job id of an sbpflow placement group's name, ``sbpflow-<job id>-a<attempt>`` (ray_backend.py)."""
    if not pg_name.startswith("sbpflow-") or "-a" not in pg_name:
        return None
    return pg_name.removeprefix("sbpflow-").rsplit("-a", 1)[0]


def bundle_hosts(job_id: str) -> list[str]:
    """The node IP of each bundle of the job's (first attempt's) placement group, in bundle (= rank)
    order."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    for pg in ray.util.placement_group_table().values():
        if pg["name"] == f"sbpflow-{job_id}-a1":
            by_bundle = pg["bundles_to_node_id"]
            return [ips.get(by_bundle[i], by_bundle[i]) for i in sorted(by_bundle)]
    return []


def placements() -> dict[str, list[str]]:
    """Every sbpflow job whose placement group the cluster has seen: job id -> its bundles' node IPs."""
    jobs = [job_of(pg["name"]) for pg in ray.util.placement_group_table().values()]
    return {j: bundle_hosts(j) for j in jobs if j is not None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ray-address", required=True)
    p.add_argument("--placements", action="store_true", help="only print every job's bundle hosts")
    p.add_argument("--server")
    p.add_argument("--http")
    p.add_argument("--job")
    p.add_argument("--params", help="write the trained parameters here (.npz)")
    args = p.parse_args()
    ray.init(address=args.ray_address, log_to_driver=False, configure_logging=False)
    if args.placements:
        print(json.dumps(placements()), flush=True)
        return
    token = os.environ["SBPFLOW_TOKEN"]
    out: dict[str, Any] = {"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])}
    out["readyz"], _ = http_get(f"{args.http}/readyz")
    with open(args.job, "rb") as f:
        job = job_pb2.Job.FromString(f.read())
    with Client(args.server, token=token) as client:
        handle = client.submit(job)
        status = handle.wait(timeout=300)
        result = handle.result()
    out.update(job_id=handle.job_id, state=result.state, losses=result.losses, message=status.message)
    np.savez(args.params, **result.parameters)
    out["bundle_hosts"] = bundle_hosts(handle.job_id)
    code, text = http_get(f"{args.http}/metrics", token)
    out["metrics"] = code
    out["metrics_names"] = sorted(
        {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE sbpflow_")}
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
