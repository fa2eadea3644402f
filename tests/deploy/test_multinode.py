"""A real two-node Ray cluster on this machine: ``sbpflow server --ray-address`` spreads a DP 4 job over
both nodes, whose ranks talk TCP across a veth pair, and it trains exactly as the in-process run.

The hosts are network namespaces (:mod:`tests.deploy.netns`): a Ray head on host a (10.77.0.1), a
worker node on host b (10.77.0.2), 2 CPUs each, so the job's 4 one-CPU bundles cannot fit on one node
and the PACK placement group puts two ranks on each. The server runs in host a and joins with
``--ray-address``; the client (:mod:`tests.deploy.netns_driver`) submits over gRPC with a token.

What is checked:
- the ranks' bundles sat on both nodes (Ray's placement-group table, read by the client);
- losses and trained parameters equal ``sf.run(backend="inprocess")`` to 1e-12 in float64;
- the data plane crossed the veth: abstract unix sockets and memfd rings cannot leave a namespace, so
  ranks on different hosts can only use TCP, and the bytes through the link are at least what the
  job's collectives must move between two hosts (``crossing_lower_bound``) — many times what Ray and
  the reports alone send for a job;
- the status endpoint answers /readyz and /metrics from the other side of the deployment;
- a RayJob's entrypoint works: ``sbpflow run`` on a driver whose ``RAY_ADDRESS`` names the cluster
  (as KubeRay sets it) trains on the cluster's nodes, both of them, not on a Ray of its own;
- nothing is left: no process in the namespaces, no namespace, no veth.

The test session's own Ray (``ray_local``) is not used or touched: every subprocess gets an environment
without RAY_ settings and its own Ray token, temp dirs and namespaces. Skips, saying why, where network
namespaces cannot be made (not root, no iproute2, no CAP_SYS_ADMIN).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.codec import wire
from sbpflow.control_plane.compiler.passes import boxing_pass
from sbpflow.control_plane.compiler.pipeline import compile
from sbpflow.job import Job
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.deploy import netns
from tests.examples.test_examples import load

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
RANKS = 4
SBPFLOW = Path(sys.executable).parent / "sbpflow"  # the console script, as the images run it
WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]


def dp4_job() -> Job:
    """The MLP example, data parallel over 4 ranks, in float64; wide enough that its collectives move
    far more bytes than Ray's own traffic."""
    job = load("mlp").make_job(ranks=RANKS, n_in=64, hidden=1024, batch_size=32, steps=STEPS, lr=0.02)
    return as_float64(job)


def crossing_lower_bound(job: Job) -> int:
    """Bytes that the job's collectives must move between two hosts of RANKS/2 ranks each, for STEPS.

    The compiler costs a collective as OneFlow does: all-reduce 2(p-1)|T|, all-gather and reduce-scatter
    (p-1)|T|, all-to-all (p-1)/p |T|. Between two hosts each side must receive the other side's share:
    all-reduce |T| each way, all-gather and reduce-scatter |T|/2 each way, all-to-all |T|/4 each way:
    at least the cost / (p-1), whatever algorithm runs."""
    return STEPS * boxing_pass.total_bytes(compile(job).state) // (RANKS - 1)


class Server:
    """``sbpflow server`` inside a host; its announced addresses, its output kept for failure messages."""

    def __init__(self, host: netns.Host, env: dict[str, str], *args: str) -> None:
        self.proc = host.popen(
            [str(SBPFLOW), "server", *args], env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("store:"):  # the last line serve() announces
                self._ready.set()
        self._ready.set()  # exited

    def addresses(self, timeout: float = 120.0) -> tuple[str, str]:
        """(gRPC host:port, HTTP base URL) as announced."""
        self._ready.wait(timeout)
        grpc_line = next((x for x in self.lines if "gRPC on " in x), None)
        http_line = next((x for x in self.lines if x.startswith("status endpoint: ")), None)
        assert grpc_line and http_line, "the server did not come up:\n" + "\n".join(self.lines)
        return grpc_line.split("gRPC on ")[1].split()[0], http_line.split()[2].rstrip("/")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def driver(host: netns.Host, env: dict[str, str], *args: str) -> Any:
    """Run :mod:`tests.deploy.netns_driver` inside ``host``; its JSON answer."""
    out = host.run([sys.executable, "-m", "tests.deploy.netns_driver", *args], env, timeout=300)
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def hosts() -> Iterator[netns.TwoHosts]:
    pair = netns.TwoHosts(f"sbpf{os.getpid()}")
    with pair:
        yield pair
    assert pair.exists() == [], f"namespaces left behind: {pair.exists()}"


@pytest.fixture
def work(hosts: netns.TwoHosts) -> Iterator[Path]:
    """A short folder (Ray's socket paths must stay short), removed after the hosts' processes end."""
    path = Path(tempfile.mkdtemp(prefix="sbpf-", dir="/tmp"))
    try:
        yield path
    finally:
        hosts.close()
        shutil.rmtree(path, ignore_errors=True)


def test_server_joins_a_two_node_cluster_and_dp4_trains_as_in_process(
    hosts: netns.TwoHosts, work: Path
) -> None:
    job = dp4_job()
    want = sf.run(job, backend="inprocess", return_parameters=True)
    (work / "job.pb").write_bytes(wire.job_to_proto(job).SerializeToString())
    cluster = netns.RayCluster.start(hosts, work)
    env = {**cluster.env, "SBPFLOW_TOKEN": "multinode-test-token", "PYTHONPATH": str(ROOT)}
    del env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]  # as a deployment has it: unset (ray start needed it)
    server = Server(
        hosts.a, env, "--host", hosts.a.ip, "--port", "0", "--http-port", "0",
        "--ray-address", cluster.address, "--store", str(work / "jobs.db"),
    )  # fmt: skip
    grpc_address, http = server.addresses()
    before = hosts.a.link_bytes()
    got = driver(
        hosts.a, env, "--server", grpc_address, "--http", http, "--ray-address", cluster.address,
        "--job", str(work / "job.pb"), "--params", str(work / "p.npz"),
    )  # fmt: skip
    crossed = hosts.a.link_bytes() - before
    assert server.stop() == 0, "\n".join(server.lines)
    params = dict(np.load(work / "p.npz"))
    # a RayJob's entrypoint: `sbpflow run` on a driver whose RAY_ADDRESS names the cluster
    embedded = hosts.a.run(
        [str(SBPFLOW), "run", str(ROOT / "examples" / "mlp.py"), "--ranks", "4", "--steps", "3"],
        {**env, "RAY_ADDRESS": cluster.address},
    )
    placed = driver(hosts.a, env, "--ray-address", cluster.address, "--placements")

    assert got["state"] == "SUCCEEDED", got
    assert got["nodes"] == [hosts.a.ip, hosts.b.ip]
    assert len(got["bundle_hosts"]) == RANKS and set(got["bundle_hosts"]) == {hosts.a.ip, hosts.b.ip}, got
    np.testing.assert_allclose(got["losses"], want.losses, rtol=1e-12, atol=0)
    assert got["losses"][3] < got["losses"][0]  # it trains: step 4 sees step 1's batch again (3 batches)
    assert want.parameters is not None and params.keys() == want.parameters.keys()
    for name, value in want.parameters.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-12, atol=1e-15, err_msg=name)
    bound = crossing_lower_bound(job)
    assert bound > 1_000_000  # else Ray's own traffic (~0.25 MB a job) could pass for the data plane
    assert crossed >= bound, f"only {crossed} bytes crossed the veth; the collectives need {bound}"
    assert got["readyz"] == 200 and got["metrics"] == 200
    assert "3 steps in" in embedded, embedded
    others = [hosts_ for job_id, hosts_ in placed.items() if job_id != got["job_id"]]
    assert len(others) == 1 and set(others[0]) == {hosts.a.ip, hosts.b.ip}, placed
    assert "sbpflow_jobs" in got["metrics_names"], got["metrics_names"]


def test_a_lost_node_the_job_goes_on_with_the_ranks_of_the_other_and_succeeds(
    hosts: netns.TwoHosts, work: Path
) -> None:
    """Issue 19's acceptance: a DP 4 job over both nodes (elastic to 2 ranks); host b — its Ray node and
    the two workers on it — is SIGKILLed mid-job; its ranks are not back within the job's grace period,
    so the job re-plans as DP 2 on host a, goes on from its last checkpoint and ends SUCCEEDED, its float64
    losses those of the uninterrupted in-process run (the same global batch) to 1e-12 of their scale."""
    steps = 300  # reports come a second apart: the job must run well past --kill-at by then
    job = load("mlp").make_job(ranks=RANKS, n_in=64, hidden=1024, batch_size=32, steps=steps, lr=0.02)
    job = as_float64(job)
    job = dataclasses.replace(
        job, config=dataclasses.replace(job.config, checkpoint_every=10, elastic=(2,), elastic_grace=5.0)
    )
    want = sf.run(job, backend="inprocess")
    (work / "job.pb").write_bytes(wire.job_to_proto(job).SerializeToString())
    cluster = netns.RayCluster.start(hosts, work)
    env = {**cluster.env, "SBPFLOW_TOKEN": "multinode-test-token", "PYTHONPATH": str(ROOT)}
    del env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]
    server = Server(
        hosts.a, env, "--host", hosts.a.ip, "--port", "0", "--http-port", "0",
        "--ray-address", cluster.address, "--store", str(work / "jobs.db"),
        "--checkpoint-root", str(work / "ckpt"), "--max-restarts", "1",
    )  # fmt: skip
    grpc_address, _ = server.addresses()
    out = hosts.a.run(
        [sys.executable, "-m", "tests.deploy.netns_elastic_driver", "--server", grpc_address,
         "--job", str(work / "job.pb"), "--kill-at", "10", "--kill-netns", hosts.b.netns],
        env, timeout=600,
    )  # fmt: skip
    got = json.loads(out.strip().splitlines()[-1])
    assert server.stop() == 0, "\n".join(server.lines)
    said = {k: got[k] for k in ("state", "message", "attempt", "moves", "killed_at", "killed", "workers")}
    assert got["state"] == "SUCCEEDED", (said, "\n".join(server.lines[-60:]))
    assert got["killed"] >= 3 and got["killed_at"] < steps, got  # a raylet and two workers at least
    assert got["attempt"] == 2 and got["workers"] == [0, 1], got
    (move,) = got["moves"]
    assert "re-planned from 4 ranks to 2 ([0, 1, 2, 3] -> [0, 1]" in move, move
    assert len(got["losses"]) == steps
    # 1e-12 of the loss's scale: trained this long, the loss falls to ~1e-7 and the reduction order's
    # last bits (4 ranks, then 2) show as a relative 1e-9 there, 3e-19 absolute
    np.testing.assert_allclose(got["losses"], want.losses, rtol=1e-12, atol=1e-12 * want.losses[0])
