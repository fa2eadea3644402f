"""A containerised sbpflow cluster, as deploy/README.md's podman section runs it: a Ray head container, a
Ray worker container and the control-plane container on one podman network, the job store and the
checkpoints on volumes, the control plane's ports published on the host's loopback.

    with Made(prefix) as made:
        cluster = PodCluster.start(made, image, worker_cpus=2)
        cluster.address, cluster.http          # gRPC host:port and http://... on the host
        cluster.kill_worker(); cluster.start_worker(); cluster.restart_control_plane()

Each container runs the image's own entrypoint tools (tini, ray, sbpflow) as uid 1000, with /dev/shm
sized for Ray's object store (``--shm-size``). Ray runs with a token made for this cluster. The control
plane joins as a Ray node that takes no work (``ray start --num-cpus=0``), then runs ``sbpflow server
--ray-address`` in the same container, as the Kubernetes Deployment does.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from tests.deploy.containers import Made, podman

RAY_PORT = 6379
SHM = "512m"  # Ray's object store lives in /dev/shm; an engine's default is 64 MB
OBJECT_STORE = 200_000_000  # bytes, below SHM
HOSTS = {"head": 2, "worker": 3, "control-plane": 4}  # the last byte of each container's address
STOP_SECONDS = 40  # podman stop: SIGTERM, then SIGKILL after this (the server drains within 25 s)


def subnet_for(pid: int) -> str:
    """A /24 in 10.89.0.0/16 for this run (podman's own default network is 10.88.0.0/16)."""
    return f"10.89.{pid % 200 + 20}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_start(*args: str) -> list[str]:
    """The command of a Ray node container: ``ray start --block`` under tini."""
    return ["tini", "--", "ray", "start", "--block", "--disable-usage-stats",
            f"--object-store-memory={OBJECT_STORE}", *args]  # fmt: skip


@dataclass(frozen=True)
class PodCluster:
    made: Made
    image: str
    net: str
    subnet: str
    token: str  # sbpflow's API token
    ray_env: tuple[str, ...]  # -e flags: Ray's token
    grpc_port: int
    http_port: int
    worker_cpus: int
    max_restarts: int

    def ip(self, what: str) -> str:
        """The fixed address of container ``what`` on the test's network (restarts keep it)."""
        return f"{self.subnet}.{HOSTS[what]}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ray_address(self) -> str:
        return f"{self.ip('head')}:{RAY_PORT}"

    @staticmethod
    def start(made: Made, image: str, worker_cpus: int = 2, max_restarts: int = 2) -> PodCluster:
        subnet = subnet_for(os.getpid())
        ray_token = secrets.token_hex(32)
        cluster = PodCluster(
            made=made,
            image=image,
            net=made.network("net", f"{subnet}.0/24"),
            subnet=subnet,
            token=secrets.token_hex(16),
            ray_env=(
                "-e",
                "RAY_AUTH_MODE=token",
                "-e",
                f"RAY_AUTH_TOKEN={ray_token}",
                "-e",
                "RAY_USAGE_STATS_ENABLED=0",
            ),  # fmt: skip
            grpc_port=free_port(),
            http_port=free_port(),
            worker_cpus=worker_cpus,
            max_restarts=max_restarts,
        )
        made.volume("store")
        made.volume("checkpoints")
        cluster._head()
        cluster.start_worker()
        cluster.wait_joined("worker")  # the control plane counts the cluster's CPUs once, as it starts
        cluster._control_plane()
        return cluster

    def _node_flags(self, ip: str) -> list[str]:
        return ["--network", self.net, "--ip", ip, "--shm-size", SHM, *self.ray_env]

    def _head(self) -> None:
        self.made.run(
            "head", self.image, self._node_flags(self.ip("head")),
            ray_start("--head", f"--node-ip-address={self.ip('head')}", f"--port={RAY_PORT}",
                      "--num-cpus=0", "--num-gpus=0", "--include-dashboard=false"),
        )  # fmt: skip

    def start_worker(self) -> None:
        """The worker container: made the first time, started again (as a pod is recreated) after."""
        name = self.made.name("worker")
        if name in self.made.containers:
            podman("start", name)
            return
        self.made.run(
            "worker", self.image,
            [*self._node_flags(self.ip("worker")), "-v", f"{self.made.name('checkpoints')}:/var/lib/sbpflow/checkpoints"],
            ray_start(f"--address={self.ray_address}", f"--node-ip-address={self.ip('worker')}",
                      f"--num-cpus={self.worker_cpus}", "--num-gpus=0"),
        )  # fmt: skip

    def kill_worker(self) -> None:
        """SIGKILL the worker container: every Ray process in it dies at once, as when a node is lost."""
        podman("kill", "--signal", "KILL", self.made.name("worker"))
        podman("wait", self.made.name("worker"), check=False, timeout=60)

    def _control_plane(self) -> None:
        """Join Ray as a node without CPUs, then ``exec`` the server: bash's ``"$0" "$@"`` are the words
        after the script, so SIGTERM from tini reaches the server itself (deploy/README.md's line)."""
        join = (
            f"ray start --address={self.ray_address} --node-ip-address={self.ip('control-plane')} --num-cpus=0 "
            f'--num-gpus=0 --object-store-memory={OBJECT_STORE // 2} --disable-usage-stats && exec "$0" "$@"'
        )
        serve = ["sbpflow", "server", "--host", "0.0.0.0", "--worker-port", "50052", "--ray-address", self.ray_address,
                 "--store", "/var/lib/sbpflow/jobs.db", "--checkpoint-root", "/var/lib/sbpflow/checkpoints",
                 "--max-restarts", str(self.max_restarts)]  # fmt: skip
        flags = [
            "--network", self.net, "--ip", self.ip("control-plane"), "--shm-size", SHM, *self.ray_env,
            "-e", f"SBPFLOW_TOKEN={self.token}",
            "-v", f"{self.made.name('store')}:/var/lib/sbpflow",
            "-v", f"{self.made.name('checkpoints')}:/var/lib/sbpflow/checkpoints",
            "-p", f"127.0.0.1:{self.grpc_port}:50051", "-p", f"127.0.0.1:{self.http_port}:8080",
        ]  # fmt: skip
        self.made.run("control-plane", self.image, flags, ["tini", "--", "bash", "-c", join, *serve])

    def restart_control_plane(self) -> float:
        """``podman stop`` (SIGTERM: the server drains) then ``podman start``; the seconds the stop took."""
        t0 = time.monotonic()
        podman("stop", "-t", str(STOP_SECONDS), self.made.name("control-plane"), timeout=STOP_SECONDS + 60)
        stopped = time.monotonic() - t0
        podman("start", self.made.name("control-plane"))
        return stopped

    def wait_joined(self, what: str, timeout: float = 180.0) -> None:
        """Until the ``what`` container's Ray node has started (``ray start`` says so before it blocks)."""
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.logs(what):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the {what} node did not join Ray in {timeout:g} s:\n{self.logs(what)[-4000:]}"
                )
            time.sleep(0.5)

    def logs(self, what: str) -> str:
        return podman("logs", self.made.name(what), check=False)

    def get(self, path: str, token: bool = False) -> tuple[int, str]:
        """GET the status endpoint from the host: (status, body); 0 while nothing answers."""
        req = urllib.request.Request(self.http + path)
        if token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Until /readyz answers 200 from the control-plane container (it joins Ray first)."""
        deadline = time.monotonic() + timeout
        while self.get("/readyz")[0] != 200:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the control plane was not ready in {timeout:g} s:\n{self.logs('control-plane')[-4000:]}"
                )
            time.sleep(0.5)
