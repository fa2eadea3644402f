"""What ``--json`` prints: ``sbpflow status [ID]``, ``run``, ``plan`` and ``checkpoints`` as one JSON
document on stdout, each with ``"version"`` (:data:`job_json.VERSION`): keys stay (a script may rely on
them; a new key may be added, none renamed or removed).

A job (``status ID``, ``run --json``) and a list of jobs (``status``) are the HTTP API's objects
(``control_plane/status/job_json.py`` documents them). ``plan``: ``{"version", "job", "ops": [{"name",
"op_type", "inputs", "outputs"}] (SBP per tensor, e.g. "(S(0), B)"), "boxing": [{"from", "to", "plan",
"bytes"}], "boxing_bytes", "memory": {"RANK": {"parameters", "gradients", "optimizer_state",
"peak_activations", "total"}} (bytes), "notes"}``. ``checkpoints``: ``{"version", "checkpoints":
[{"step", "bytes", "path"}]}``, oldest first.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sbpflow.control_plane.status import job_json

JOB_KEYS = ("version", *job_json.JOB_KEYS)
WORKER_KEYS = job_json.WORKER_KEYS
PLAN_KEYS = ("version", "job", "ops", "boxing", "boxing_bytes", "memory", "notes")
CHECKPOINT_KEYS = ("step", "bytes", "path")


def emit(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def job(st: Any) -> dict[str, Any]:
    """A ``JobStatus`` as one job document (``control_plane/status/job_json.py``: the HTTP API's too)."""
    return job_json.document(st)


def jobs(statuses: Iterable[Any]) -> dict[str, Any]:
    return job_json.jobs(statuses)


def plan(compiled: Any) -> dict[str, Any]:
    """A ``Compiled`` job as the plan object above."""
    from sbpflow.graph import BOXING
    from sbpflow.sbp import format_nd

    state, g = compiled.state, compiled.state.graph

    def sbp(name: str) -> str | None:
        t = g.tensors[name]
        return None if t.sbp is None else format_nd(t.sbp)

    ops = [o for o in g.ops if o.op_type != BOXING]
    boxes = [(o, state.boxings.get(o.name)) for o in g.ops if o.op_type == BOXING]
    return {
        "version": job_json.VERSION,
        "job": state.job.name,
        "ops": [
            {
                "name": o.name,
                "op_type": o.op_type,
                "inputs": [sbp(t) for t in o.inputs],
                "outputs": [sbp(t) for t in o.outputs],
            }
            for o in ops
        ],  # fmt: skip
        "boxing": [
            {
                "from": o.inputs[0],
                "to": o.outputs[0],
                "plan": None if p is None else repr(p),
                "bytes": 0 if p is None else p.bytes,
            }
            for o, p in boxes
        ],  # fmt: skip
        "boxing_bytes": sum(p.bytes for _, p in boxes if p is not None),
        "memory": {
            str(rank): {
                "parameters": m.parameters,
                "gradients": m.gradients,
                "optimizer_state": m.optimizer_state,
                "peak_activations": m.peak_activations,
                "total": m.total,
            }
            for rank, m in sorted(compiled.memory.items())
        },
        "notes": list(compiled.notes),
    }


def checkpoints(found: Iterable[Any]) -> dict[str, Any]:
    return {
        "version": job_json.VERSION,
        "checkpoints": [{"step": c.step, "bytes": c.bytes, "path": str(c.path)} for c in found],
    }
