"""The client side of the multi-node elastic test, run inside test host a: submit a job, and once the control
plane has its losses up to ``--kill-at`` (and so a checkpoint at or before it to go on from), end every
process of the other test host (``--kill-netns``: its Ray node and the workers on it, SIGKILL); then wait for
the job's end and print one JSON line: ``state``, ``losses``, ``attempt``, ``killed`` (how many pids),
``moves`` (the message of each ``ELASTIC_RESUME`` state change) and ``workers`` (the ranks of the job's
last status).

    python -m tests.deploy.netns_elastic_driver --server 10.77.0.1:PORT --job job.pb --kill-at 8 \\
        --kill-netns sbpf123b     # token in SBPFLOW_TOKEN
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from typing import Any

from sbpflow.client.client import Client
from sbpflow.control_plane.launch.elastic import ELASTIC_RESUME
from sbpflow.v1 import job_pb2
from tests.deploy.netns import IP


def kill_netns(netns: str) -> int:
    """SIGKILL every process in network namespace ``netns`` (all started by the test); how many."""
    out = subprocess.run([IP, "netns", "pids", netns], capture_output=True, text=True, check=True).stdout
    pids = [int(x) for x in out.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--kill-at", type=int, required=True)
    p.add_argument("--kill-netns", required=True)
    args = p.parse_args()
    with open(args.job, "rb") as f:
        job = job_pb2.Job.FromString(f.read())
    out: dict[str, Any] = {}
    with Client(args.server, token=os.environ["SBPFLOW_TOKEN"]) as client:
        handle = client.submit(job)
        deadline = time.monotonic() + 300
        while handle.status().step < args.kill_at and time.monotonic() < deadline:
            time.sleep(0.05)
        out["killed_at"] = handle.status().step
        out["killed"] = kill_netns(args.kill_netns)
        status = handle.wait(timeout=300)
        result = handle.result()
        moves = [
            e.status.message
            for e in handle.events()
            if e.HasField("state_change") and e.state_change.reason == ELASTIC_RESUME
        ]
    out.update(
        state=result.state,
        losses=result.losses,
        attempt=status.attempt,
        message=status.message,
        moves=moves,
        workers=[w.rank for w in status.workers],
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
