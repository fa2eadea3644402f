"""Two hosts on one machine: Linux network namespaces joined by a veth pair, each a Ray node.

    with TwoHosts(f"sbpf{os.getpid()}") as hosts:      # host a 10.77.0.1 <--veth--> host b 10.77.0.2
        cluster = RayCluster.start(hosts, workdir)    # head on a, a worker node on b; cluster.address
        proc = hosts.a.popen([...], cluster.env)      # any process inside host a
    # on exit: every process inside either namespace ended by pid, the namespaces (and so the veth) deleted

Rules:
- names carry the caller's tag (a pid), so parallel runs never clash; the addresses live inside the
  namespaces only, so two runs may both use 10.77.0.x;
- a namespace has nothing but ``lo`` and its end of the veth: no route out, so the processes inside
  can reach loopback and the other test host, nothing else;
- teardown never uses ``ray stop`` or a name pattern (both reach every Ray on the machine, the test
  session's own included): it ends exactly the pids that ``ip netns pids`` lists for our namespaces —
  every one of them was started by us — first with SIGTERM, then SIGKILL;
- Ray runs with a token made for this cluster (``RAY_AUTH_MODE=token``), so neither the machine's
  ``~/.ray/auth_token`` nor another cluster's token is read or written.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IP = shutil.which("ip") or "/usr/sbin/ip"
SUBNET = "10.77.0"
RAY_PORT = 6379  # inside the namespace: its own port space
TERM_SECONDS = 3.0  # the GCS and the autoscaler monitor outlive a SIGTERM for long; then SIGKILL
KILL_SECONDS = 10.0


@dataclass(frozen=True)
class Host:
    """One test host: a network namespace with one veth end at ``ip``."""

    netns: str
    ip: str
    dev: str

    def argv(self, cmd: Sequence[str]) -> list[str]:
        return [IP, "netns", "exec", self.netns, *cmd]

    def run(self, cmd: Sequence[str], env: dict[str, str], timeout: float = 120.0) -> str:
        """Run ``cmd`` inside this host to its end; a failure raises with its output."""
        p = subprocess.run(self.argv(cmd), env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd[:3])}... in {self.netns} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
            )
        return p.stdout

    def popen(self, cmd: Sequence[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(cmd), env=env, text=True, **kwargs)

    def pids(self) -> list[int]:
        p = subprocess.run([IP, "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []

    def link_bytes(self) -> int:
        """Bytes through this host's veth end, both directions (each byte that crossed counts once)."""
        out = subprocess.run(
            [IP, "-n", self.netns, "-s", "-j", "link", "show", "dev", self.dev],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended: only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _ip(*args: str) -> None:
    p = subprocess.run([IP, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can), found by making and deleting one."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not Path(IP).exists():
        return "iproute2's `ip` is not installed"
    probe = f"sbpfprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except OSError as e:
        return f"cannot create a network namespace: {e}"
    subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return None


class TwoHosts:
    """Hosts ``a`` (.1) and ``b`` (.2) of ``SUBNET``.0/24, joined by a veth pair."""

    def __init__(self, tag: str) -> None:
        self.a = Host(f"{tag}a", f"{SUBNET}.1", f"{tag}va")
        self.b = Host(f"{tag}b", f"{SUBNET}.2", f"{tag}vb")
        self._made: list[str] = []

    def __enter__(self) -> TwoHosts:
        try:
            for h in (self.a, self.b):
                _ip("netns", "add", h.netns)
                self._made.append(h.netns)
                _ip("-n", h.netns, "link", "set", "lo", "up")
            # made in host a, so that no end of it ever sits in the machine's own namespace for long
            _ip("-n", self.a.netns, "link", "add", self.a.dev, "type", "veth", "peer", "name", self.b.dev)
            _ip("-n", self.a.netns, "link", "set", self.b.dev, "netns", self.b.netns)
            for h in (self.a, self.b):
                _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.dev)
                _ip("-n", h.netns, "link", "set", h.dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End every process inside the namespaces (by pid), then delete them; the veth goes with them."""
        hosts = [h for h in (self.a, self.b) if h.netns in self._made]
        seen: set[int] = set()
        for sig, wait in ((signal.SIGTERM, TERM_SECONDS), (signal.SIGKILL, KILL_SECONDS)):
            for h in hosts:
                for pid in h.pids():
                    seen.add(pid)
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            while any(_running(p) for p in seen) and time.monotonic() < deadline:
                time.sleep(0.1)
        for h in hosts:
            subprocess.run([IP, "netns", "del", h.netns], capture_output=True)
        self._made.clear()

    def exists(self) -> list[str]:
        """What of this pair is still on the machine (namespaces by name): [] after close."""
        listed = subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout
        return [
            h.netns
            for h in (self.a, self.b)
            if any(line.split()[:1] == [h.netns] for line in listed.splitlines())
        ]


def base_env(token: str) -> dict[str, str]:
    """This process's environment less every RAY_ setting (the test session's own Ray among them), plus
    a Ray that may span hosts, with its own token and no usage reports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",  # the test session sets 0 (loopback only); a worker node refuses it
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass(frozen=True)
class RayCluster:
    """A Ray head on host a and a worker node on host b, ``cpus`` CPUs each."""

    address: str
    env: dict[str, str]

    @staticmethod
    def start(hosts: TwoHosts, workdir: Path, cpus: int = 2) -> RayCluster:
        ray = str(Path(sys.executable).parent / "ray")  # the venv's, beside this interpreter
        env = base_env(secrets.token_hex(32))
        address = f"{hosts.a.ip}:{RAY_PORT}"
        common = [
            f"--num-cpus={cpus}",
            "--num-gpus=0",
            "--disable-usage-stats",
            "--object-store-memory=100000000",
        ]
        hosts.a.run(
            [
                ray, "start", "--head", f"--node-ip-address={hosts.a.ip}", f"--port={RAY_PORT}",
                "--include-dashboard=false", f"--temp-dir={workdir / 'ray-a'}", *common,
            ],
            env,
        )  # fmt: skip
        hosts.b.run(
            [
                ray, "start", f"--address={address}", f"--node-ip-address={hosts.b.ip}",
                f"--temp-dir={workdir / 'ray-b'}", *common,
            ],
            env,
        )  # fmt: skip
        return RayCluster(address, env)
