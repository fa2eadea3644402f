"""Ray resources for sbpflow's workers: what one rank's worker reserves per device type (:data:`BUNDLES`),
a placement group for an attempt's ranks reserved within a time (:func:`reserve`), and whether the cluster
has room for a job's own layout beside a smaller one it runs on (:func:`room_for`, elastic growth), and
the Ray they are on: the cluster at an address, or a local one started on demand (:func:`ensure_ray`).

:class:`KeptRay` is the local Ray that ``sbpflow run`` keeps for the runs after it (a Ray takes seconds to
start; joining one takes well under one). It lives in a folder of its own (``$SBPFLOW_RAY_DIR``, default
``$TMPDIR/sbpflow-ray-UID``): its address, a lock that every run holds shared while it uses the Ray, and
Ray's own temp dir, so that a plain ``ray.init()`` on the machine does not find and join it (Ray looks for
the last ``ray start`` in ``/tmp/ray``). A detached reaper stops it once no run has held it for
``$SBPFLOW_RAY_IDLE`` seconds (600): it takes the lock exclusively, so a run that comes meanwhile waits and
then starts a new one. Stopping kills that Ray's processes only (``ray stop`` would end every Ray of the
user, a test session's too).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.launch.ports import free_on_all
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


KEPT_IDLE = 600.0  # seconds a kept Ray waits unused before its reaper stops it
KEPT_LOCAL = "127.0.0.1"
KEPT_OBJECT_STORE = 1 << 30  # bytes: tensors move on sbpflow's own transport; a Ray left running holds little


@dataclass(frozen=True)
class KeptRay:
    """The local Ray kept in ``folder`` for the runs after the one that started it (see the module)."""

    folder: Path
    idle_seconds: float = KEPT_IDLE

    @classmethod
    def default(cls) -> KeptRay:
        """The user's: ``$SBPFLOW_RAY_DIR`` (else ``$TMPDIR/sbpflow-ray-UID``), ``$SBPFLOW_RAY_IDLE`` s."""
        folder = (
            os.environ.get("SBPFLOW_RAY_DIR") or Path(tempfile.gettempdir()) / f"sbpflow-ray-{os.getuid()}"
        )
        idle = os.environ.get("SBPFLOW_RAY_IDLE", "")
        try:
            seconds = float(idle) if idle else KEPT_IDLE
        except ValueError:
            raise SbpflowError(f"SBPFLOW_RAY_IDLE={idle!r}: give seconds, e.g. 600") from None
        return cls(Path(folder).absolute(), seconds)

    @contextmanager
    def lease(self, cpus: int) -> Iterator[str | None]:
        """The kept Ray's address, in use until the block ends (the reaper waits for every lease): the
        one running, else one started now with its reaper; None where the running one has fewer than
        ``cpus`` CPUs (the run then needs a Ray of its own)."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.folder.stat().st_uid != os.getuid():
                raise PermissionError(0, "it belongs to another user, whose Ray this run would join")
            held = open(self.folder / "in_use", "a")  # noqa: SIM115 - closed below, with the lease
        except OSError as e:
            raise SbpflowError(
                f"the kept local Ray's folder {self.folder}: {e.strerror or e}; set SBPFLOW_RAY_DIR to a "
                "folder you may write, or pass --fresh-ray"
            ) from None
        with held:
            fcntl.flock(held, fcntl.LOCK_SH)  # waits while the reaper stops it
            self.touch()
            try:
                yield self._joined(cpus)
            finally:
                self.touch()

    def touch(self) -> None:
        (self.folder / "last_used").touch()

    def noted(self) -> dict[str, object] | None:
        """What the Ray that answers here noted (address, cpus, reaper), or None."""
        try:
            noted = json.loads((self.folder / "ray.json").read_text())
            host, _, port = str(noted["address"]).rpartition(":")
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return dict(noted)
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none yet, or gone (stopped, a reboot)

    def _joined(self, cpus: int) -> str | None:
        with open(self.folder / "start.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one run starts it; the others wait and join
            noted = self.noted() or self._start(max(cpus, os.cpu_count() or 1))
            if not self._reaping(int(str(noted.get("reaper", 0)))):
                noted["reaper"] = self._reaper()
                (self.folder / "ray.json").write_text(json.dumps(noted))
        os.environ["RAY_AUTH_MODE"] = "token"  # how ensure_ray joins it: it was started so (token in ~/.ray)
        # Ray reads this at its import: without it a driver takes 127.0.0.1 for the machine's outside address
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        if "ray" in sys.modules and not _ray_keeps_loopback():
            raise SbpflowError(
                "Ray was imported before the kept local Ray's address was set; pass --fresh-ray"
            )
        return str(noted["address"]) if int(str(noted["cpus"])) >= cpus else None

    def _start(self, cpus: int) -> dict[str, object]:
        """``ray start --head`` in this folder: ports picked free (its defaults, 10001 and 8265 among them,
        may be another Ray's), token auth, detached from this run."""
        self.stop()  # what a Ray that stopped answering left
        gcs, client, dash, agent = _distinct_ports(4)
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        ray = Path(sys.executable).parent / "ray"
        started = subprocess.run(
            [str(ray), "start", "--head", f"--port={gcs}", f"--node-ip-address={KEPT_LOCAL}",
             f"--temp-dir={self.folder / 'ray'}", f"--ray-client-server-port={client}",
             f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
             "--include-dashboard=false", "--disable-usage-stats", f"--num-cpus={cpus}",
             f"--object-store-memory={KEPT_OBJECT_STORE}"],
            capture_output=True, text=True, timeout=120, env=env, start_new_session=True,
        )  # fmt: skip
        if started.returncode != 0:
            said = (started.stderr or started.stdout).strip().splitlines()[-3:]
            self.stop()
            raise SbpflowError(
                f"starting the kept local Ray: `ray start --head` failed: {' | '.join(said)}; "
                "pass --fresh-ray for a Ray of the run's own"
            )
        noted: dict[str, object] = {"address": f"{KEPT_LOCAL}:{gcs}", "cpus": cpus, "reaper": 0}
        (self.folder / "ray.json").write_text(json.dumps(noted))
        print(
            f"started a local Ray at {noted['address']}, kept for the next runs until {self.idle_seconds:g} s "
            "unused (--fresh-ray: a Ray of the run's own)",
            file=sys.stderr,
        )
        return noted

    def _reaper(self) -> int:
        log = open(self.folder / "reaper.log", "a")  # noqa: SIM115 - the child's; closed here once passed
        with log:
            child = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.folder), str(self.idle_seconds)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip
        return child.pid

    def _reaping(self, pid: int) -> bool:
        """Whether ``pid`` is this folder's reaper, running (not a zombie, not a reused pid)."""
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        return pid > 0 and f" {self.folder} " in line

    def reap(self) -> None:
        """The reaper's loop: stop the Ray once nobody has held it for ``idle_seconds``; end when it does,
        or when the Ray is gone."""
        every = min(15.0, max(0.5, self.idle_seconds / 4))
        while True:
            time.sleep(every)
            if self.noted() is None:
                return  # stopped by someone else (KeptRay.stop), or died
            with open(self.folder / "in_use", "a") as held:
                try:
                    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a run is on it
                unused = time.time() - (self.folder / "last_used").stat().st_mtime
                if unused >= self.idle_seconds:
                    self.stop()
                    return

    def stop(self) -> None:
        """Kill this folder's Ray (every process whose command line names its temp dir or GCS address:
        SIGKILL, as ``ray stop --force``; they outlive a SIGTERM on some machines) and forget it."""
        marks = [
            f"{self.folder / 'ray'}/",
            f"{self.folder / 'ray'} ",
        ]  # a command line ends with a space here
        try:
            marks.append(f"{json.loads((self.folder / 'ray.json').read_text())['address']} ")
        except (OSError, ValueError, KeyError, TypeError):
            pass
        for proc in Path("/proc").iterdir():
            try:
                line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if proc.name.isdigit() and int(proc.name) != os.getpid() and any(m in line for m in marks):
                    os.kill(int(proc.name), 9)
            except (OSError, ValueError):
                continue  # gone, or not ours
        (self.folder / "ray.json").unlink(missing_ok=True)
        shutil.rmtree(self.folder / "ray", ignore_errors=True)  # its session logs


def _ray_keeps_loopback() -> bool:
    """Whether the Ray imported in this process took RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 at its import."""
    from ray._private import ray_constants

    return not ray_constants.ENABLE_RAY_CLUSTER


def _distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_on_all([(socket.AF_INET, KEPT_LOCAL)])
        ports += [port] if port and port not in ports else []
    return ports


if __name__ == "__main__":  # the reaper: python -m ...ray_cluster FOLDER IDLE_SECONDS
    KeptRay(Path(sys.argv[1]), float(sys.argv[2])).reap()
