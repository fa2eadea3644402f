"""How a job runs — the one definition of the options shared by ``sf.run``, the job manager, the server,
the wire (``sbpflow.v1.RunOptions``) and the CLI flags (``--backend``, ``--ray-address``, ...).

    sf.run(job, options=RunOptions(backend="inprocess", timeout=60))
    RunOptions(max_restarts=-1)   # RunOptionsError: max_restarts=-1: ... give 0 (never restart) or more

What a job trains (its steps, checkpoints, the file it starts from) and the state of one attempt live
with the launcher (``control_plane/launch/run_context.py``); these are the knobs an operator or a user turns.
Each field's ``metadata["help"]`` is its documentation, reused for the CLI's help text; different
contexts start from different defaults (``sf.run`` waits 600 s, the job manager a day:
``MANAGER_DEFAULTS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from sbpflow.errors import SbpflowError

BACKEND_NAMES: tuple[str, ...] = ("ray", "inprocess")
"""The launcher's backends, by name (``control_plane.launcher.BACKENDS`` has one entry each)."""


class RunOptionsError(SbpflowError, ValueError):
    """A run option out of range: ``field`` names it, ``value`` is what was given, ``fix`` what to give."""

    def __init__(self, name: str, value: Any, fix: str) -> None:
        self.field, self.value, self.fix = name, value, fix
        super().__init__(f"{name}={value!r}: {fix}")


def _help(text: str, **more: Any) -> dict[str, Any]:
    return {"help": text, **more}


@dataclass(frozen=True)
class RunOptions:
    """How a job runs: where, for how long at most, how often it restarts, and what it gives back."""

    backend: str = field(
        default="ray",
        metadata=_help(
            "ray: one Ray worker process per rank (a local Ray unless --ray-address); "
            "inprocess: every rank a thread of this process",
            choices=BACKEND_NAMES,
        ),
    )
    ray_address: str | None = field(
        default=None,
        metadata=_help(
            "the Ray cluster to run on, host:port or auto (default: $RAY_ADDRESS, else a local Ray "
            "started on demand)",
            metavar="HOST:PORT",
        ),
    )
    timeout: float = field(
        default=600.0,
        metadata=_help("a run that has not finished after this many seconds fails", metavar="SECONDS"),
    )
    max_restarts: int = field(
        default=0,
        metadata=_help(
            "restart a job whose worker is lost from its last checkpoint (it needs one) up to N times",
            metavar="N",
        ),
    )
    trace: bool = field(default=False, metadata=_help("record a trace of every act (Chrome/Perfetto format)"))
    return_parameters: bool = field(
        default=False, metadata=_help("keep every parameter's trained logical value in the result")
    )
    threads: int = field(
        default=0,
        metadata=_help(
            "BLAS / intra-op threads for the kernels of an inprocess run (0: the process's setting); a ray "
            "worker always uses its device slots (1 thread per CPU it holds)",
            metavar="N",
        ),
    )
    data_roots: tuple[str, ...] | None = field(
        default=None,
        metadata=_help(
            "set by the control plane from its --data-root, never by a client: the folders a job's data "
            "files must lie in, checked on each file as a worker opens it (None: no check)",
            server_only=True,
        ),
    )

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise RunOptionsError("backend", self.backend, f"use one of {BACKEND_NAMES}")
        if self.ray_address is not None and not self.ray_address.strip():
            raise RunOptionsError(
                "ray_address", self.ray_address, "give host:port or auto, or None for a local Ray"
            )
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
            raise RunOptionsError("timeout", self.timeout, "give a number of seconds")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise RunOptionsError("timeout", self.timeout, "give a finite number of seconds greater than 0")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise RunOptionsError("max_restarts", self.max_restarts, "give a whole number, 0 or more")
        if self.max_restarts < 0:
            raise RunOptionsError("max_restarts", self.max_restarts, "give 0 (never restart) or more")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise RunOptionsError(
                "threads", self.threads, "give a whole number of threads, or 0 to leave them"
            )
        roots = self.data_roots
        if roots is not None and not (isinstance(roots, tuple) and all(isinstance(r, str) for r in roots)):
            raise RunOptionsError("data_roots", roots, "give a tuple of folder paths, or None")
        for name in ("trace", "return_parameters"):
            if not isinstance(getattr(self, name), bool):
                raise RunOptionsError(name, getattr(self, name), "give True or False")

    def replace(self, **changes: Any) -> RunOptions:
        """A copy with ``changes`` (validated again); an unknown name is an error listing the known ones."""
        known = [f.name for f in fields(RunOptions)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise SbpflowError(f"RunOptions has no field(s) {unknown}; it has {known}")
        return replace(self, **changes)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(RunOptions) if not f.metadata.get("server_only"))
"""The options a user or an operator sets: on the wire (``sbpflow.v1.RunOptions``), as flags and as
``sf.run`` keywords. The others (``data_roots``) are the control plane's own."""

CLIENT_FIELDS: tuple[str, ...] = ("timeout", "max_restarts", "trace", "return_parameters")
"""What a client may set for its own job at Submit (``SubmitJobRequest.options``); the rest of
``FIELD_NAMES`` (where and how the server runs jobs) is the server's, and a Submit that sets it is refused."""

MANAGER_DEFAULTS = RunOptions(timeout=24 * 3600.0, return_parameters=True)
"""The job manager's (and so the server's) defaults: a job may run for a day, its parameters are kept."""
