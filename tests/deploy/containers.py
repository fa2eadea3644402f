"""Podman for the deploy tests: the images built from ``deploy/Dockerfile.*`` and containers run from them.

    why = unavailable()                             # None where podman can build and run images here
    base = base_image()                             # the registry's python image, or a Debian stand-in
    image = build("Dockerfile.cpu", "localhost/sbpflow-test:123-cpu", base)
    with Made("sbpf123") as made:                   # every container, volume, network it names
        made.network(subnet)...; made.run([...])
    # on exit: exactly what ``made`` created, removed by name; nothing else on the machine is touched

Rules:
- every ``podman run`` and ``podman build`` takes ``RUN_FLAGS``: runc as the runtime and rlimits no
  higher than this machine lets a process raise (its cgroups are hybrid and its hard limits fixed);
- the base image: the registry's ``python:3.11-slim-bookworm`` when it is present or can be pulled, else
  ``deploy/standin-base.sh``'s stand-in from Debian's packages (``localhost/python:3.11-slim-bookworm``);
- kept between runs, as caches: the base image, one ``localhost/sbpflow-deps`` image per Dockerfile
  (stage ``deps``: the OS packages, Ray, the CUDA wheels; tagged by the Dockerfile's hash, older ones of
  that Dockerfile removed) and pip's build-cache mount. Removed: every image tag, container, volume and
  network a test makes.
- the build context is this checkout's working tree, or the folder ``$SBPFLOW_IMAGE_CONTEXT`` names
  (e.g. ``git archive HEAD`` unpacked, to build the committed sources while others edit the tree).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PODMAN = shutil.which("podman") or "podman"
RUN_FLAGS = ("--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
REGISTRY_BASE = "docker.io/library/python:3.11-slim-bookworm"
STANDIN_BASE = "localhost/python:3.11-slim-bookworm"
DEPS_REPO = "localhost/sbpflow-deps"
PULL_SECONDS = 120
CONTEXT = Path(os.environ.get("SBPFLOW_IMAGE_CONTEXT") or ROOT)
BUILD_SECONDS = 1800  # the first GPU build downloads ~3 GB of CUDA wheels; later ones hit the cache


class PodmanError(RuntimeError):
    """A podman command failed; the message holds its command line and output."""


class NoBase(RuntimeError):
    """Neither the registry's base image nor the tools to make its stand-in are here."""


def podman(*args: str, timeout: float = 300.0, check: bool = True) -> str:
    """Run ``podman ARGS``; its stdout. A failure (``check``) raises with the command and its output."""
    p = subprocess.run([PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise PodmanError(
            f"podman {' '.join(args)[:300]} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    return p.stdout


def unavailable() -> str | None:
    """Why images cannot be built and run here (None: they can): podman missing, not root, or a
    container that does not start."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install -y --no-install-recommends podman runc debootstrap)"
    if os.geteuid() != 0:
        return "the container tests run rootful podman: run them as root"
    try:
        podman("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout=60)
    except (PodmanError, subprocess.TimeoutExpired) as e:
        return f"podman cannot run here: {e}"
    return None


def image_exists(ref: str) -> bool:
    return subprocess.run([PODMAN, "image", "exists", ref], capture_output=True).returncode == 0


def base_image() -> str:
    """The python image to build on: the registry's where it is here or pulls, else the stand-in (built
    once by ``deploy/standin-base.sh``, then kept)."""
    if image_exists(REGISTRY_BASE):
        return REGISTRY_BASE
    pulled = subprocess.run([PODMAN, "pull", "-q", REGISTRY_BASE], capture_output=True, timeout=PULL_SECONDS)
    if pulled.returncode == 0:
        return REGISTRY_BASE
    if not image_exists(STANDIN_BASE):
        if shutil.which("debootstrap") is None:
            raise NoBase(
                f"{REGISTRY_BASE} does not pull ({pulled.stderr.decode()[-300:].strip()}) and debootstrap, which "
                "makes the stand-in, is not installed: apt-get install -y --no-install-recommends debootstrap"
            )
        made = subprocess.run(
            ["bash", str(DEPLOY / "standin-base.sh"), STANDIN_BASE],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if made.returncode != 0:
            raise PodmanError(f"deploy/standin-base.sh failed:\n{made.stderr[-3000:]}")
    return STANDIN_BASE


@dataclass(frozen=True)
class Built:
    """An image a test built: its tag, the seconds its build took and its size in bytes."""

    tag: str
    seconds: float
    size: int
    deps_seconds: float  # of that, the `deps` stage (0-ish when it came from the cache)
    dangling_before: frozenset[str]  # untagged images that were there before the build: not ours


def dangling() -> frozenset[str]:
    return frozenset(podman("images", "-q", "--no-trunc", "--filter", "dangling=true").split())


def image_size(ref: str) -> int:
    return int(json.loads(podman("image", "inspect", ref))[0]["Size"])


def _deps_tag(dockerfile: str, base: str) -> str:
    """The kept cache of ``dockerfile``'s deps stage: named by the Dockerfile's and the base's content."""
    digest = hashlib.sha256((DEPLOY / dockerfile).read_bytes())
    digest.update(podman("image", "inspect", "--format", "{{.Id}}", base).encode())
    return f"{DEPS_REPO}:{dockerfile.split('.')[-1]}-{digest.hexdigest()[:12]}"


def _drop_older_deps(dockerfile: str, keep: str) -> None:
    kind = dockerfile.split(".")[-1]
    for ref in podman("images", "--format", "{{.Repository}}:{{.Tag}}", DEPS_REPO).split():
        if ref.split(":")[-1].startswith(f"{kind}-") and ref != keep:
            podman("rmi", ref, check=False)


def _build_args(dockerfile: str, base: str) -> list[str]:
    return [*RUN_FLAGS, "-f", str(DEPLOY / dockerfile), "--build-arg", f"BASE={base}", "--layers"]


def build_deps(dockerfile: str, base: str) -> None:
    """Build ``deploy/<dockerfile>``'s deps stage on ``base`` and tag it as the kept cache (nothing to do
    when the cache holds it); the session starts this early, beside the other tests (conftest.py)."""
    deps = _deps_tag(dockerfile, base)
    podman(
        "build",
        *_build_args(dockerfile, base),
        "--target",
        "deps",
        "-t",
        deps,
        str(CONTEXT),
        timeout=BUILD_SECONDS,
    )
    _drop_older_deps(dockerfile, deps)


def build(dockerfile: str, tag: str, base: str) -> Built:
    """Build ``deploy/<dockerfile>`` from the repository root (``CONTEXT``) as ``tag`` on ``base``: first its deps stage
    (tagged and kept as the cache), then the whole image."""
    before, t0 = dangling(), time.monotonic()
    build_deps(dockerfile, base)
    t1 = time.monotonic()
    podman("build", *_build_args(dockerfile, base), "-t", tag, str(CONTEXT), timeout=BUILD_SECONDS)
    return Built(tag, time.monotonic() - t0, image_size(tag), t1 - t0, before)


def remove_image(built: Built) -> None:
    """Remove the image's tag, the layers only it holds (the deps cache below it stays: it is tagged)
    and the untagged images its build left (the wheel stage); no other image."""
    podman("rmi", "-f", built.tag, check=False)
    for image in sorted(dangling() - built.dangling_before):
        podman("rmi", image, check=False)


def in_image(image: str, script: str, *flags: str, timeout: float = 300.0) -> str:
    """Run ``bash -c script`` in a throwaway container of ``image``; its stdout."""
    return podman(
        "run", "--rm", *RUN_FLAGS, *flags, "--entrypoint", "bash", image, "-c", script, timeout=timeout
    )


class Made:
    """Containers, volumes and networks named ``<prefix>-...``, made through this object and removed by
    name on exit (containers first, forcibly, then volumes and networks)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.containers: list[str] = []
        self.volumes: list[str] = []
        self.networks: list[str] = []

    def __enter__(self) -> Made:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def name(self, what: str) -> str:
        return f"{self.prefix}-{what}"

    def network(self, what: str, subnet: str) -> str:
        name = self.name(what)
        podman("network", "create", "--subnet", subnet, name)
        self.networks.append(name)
        return name

    def volume(self, what: str) -> str:
        name = self.name(what)
        podman("volume", "create", name)
        self.volumes.append(name)
        return name

    def run(self, what: str, image: str, flags: Sequence[str], command: Sequence[str]) -> str:
        """``podman run -d --name <prefix>-what FLAGS --entrypoint COMMAND[0] image COMMAND[1:]`` (the
        image's entrypoint is ``tini -- sbpflow``; a Ray node runs ``tini -- ray start``): its name."""
        name = self.name(what)
        self.containers.append(name)
        podman(
            "run", "-d", "--name", name, *RUN_FLAGS, *flags, "--entrypoint", command[0], image, *command[1:]
        )
        return name

    def close(self) -> None:
        for c in reversed(self.containers):
            podman("rm", "-f", "-t", "0", c, check=False, timeout=120)
        for v in self.volumes:
            podman("volume", "rm", "-f", v, check=False)
        for n in self.networks:
            podman("network", "rm", "-f", n, check=False)
        self.containers, self.volumes, self.networks = [], [], []

    def left(self) -> list[str]:
        """What of the names this object made is still on the machine ([] after close)."""
        names = podman("ps", "-a", "--format", "{{.Names}}").split()
        names += podman("volume", "ls", "--format", "{{.Name}}").split()
        names += podman("network", "ls", "--format", "{{.Name}}").split()
        return sorted(n for n in names if n.startswith(f"{self.prefix}-"))
