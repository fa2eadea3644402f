"""What ``--json`` prints: ``sbpflow status [ID]``, ``plan`` and ``checkpoints`` as one JSON document on
stdout, with keys that stay (a script may rely on them; a new key may be added, none renamed or removed).

``status ID``: one job object; ``status``: ``{"jobs": [job, ...]}``, newest first. A job object::

    {"job_id", "name", "state", "reason", "message", "attempt", "step", "total_steps",
     "loss" (null before the first step), "samples_per_second",
     "created", "started", "finished" (ISO 8601 UTC, null when not yet),
     "last_checkpoint", "resumed_from", "resume_checkpoint",
     "workers": [{"rank", "state", "step", "host"}],
     "eval_step" (0 before the first evaluation), "eval_loss" (null then)}

``plan``: ``{"job", "ops": [{"name", "op_type", "inputs", "outputs"}] (SBP per tensor, e.g. "(S(0), B)"),
"boxing": [{"from", "to", "plan", "bytes"}], "boxing_bytes", "memory": {"RANK": {"parameters",
"gradients", "optimizer_state", "peak_activations", "total"}} (bytes), "notes"}``.

``checkpoints``: ``{"checkpoints": [{"step", "bytes", "path"}]}``, oldest first.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

JOB_KEYS = (
    "job_id", "name", "state", "reason", "message", "attempt", "step", "total_steps", "loss",
    "samples_per_second", "created", "started", "finished", "last_checkpoint", "resumed_from",
    "resume_checkpoint", "workers", "eval_step", "eval_loss",
)  # fmt: skip
WORKER_KEYS = ("rank", "state", "step", "host")
PLAN_KEYS = ("job", "ops", "boxing", "boxing_bytes", "memory", "notes")
CHECKPOINT_KEYS = ("step", "bytes", "path")


def emit(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def _time(st: Any, name: str) -> str | None:
    if not st.HasField(name):
        return None
    return str(getattr(st, name).ToDatetime().isoformat(timespec="milliseconds")) + "Z"


def job(st: Any) -> dict[str, Any]:
    """A ``JobStatus`` as the job object above."""
    from sbpflow.v1 import service_pb2 as sp

    doc: dict[str, Any] = {
        "job_id": st.job_id,
        "name": st.name,
        "state": sp.JobState.Name(st.state).removeprefix("JOB_STATE_"),
        "reason": st.reason,
        "message": st.message,
        "attempt": st.attempt,
        "step": st.step,
        "total_steps": st.total_steps,
        "loss": st.loss if st.HasField("loss") else None,
        "samples_per_second": st.samples_per_second,
        **{k: _time(st, k) for k in ("created", "started", "finished")},
        "last_checkpoint": st.last_checkpoint,
        "resumed_from": st.resumed_from,
        "resume_checkpoint": st.resume_checkpoint,
        "workers": [
            {
                "rank": w.rank,
                "state": sp.WorkerState.Name(w.state).removeprefix("WORKER_STATE_"),
                "step": w.step,
                "host": w.host,
            }
            for w in st.workers
        ],
        "eval_step": st.eval_step,
        "eval_loss": st.eval_loss if st.HasField("eval_loss") else None,
    }
    return doc


def jobs(statuses: Iterable[Any]) -> dict[str, Any]:
    return {"jobs": [job(st) for st in statuses]}


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
    return {"checkpoints": [{"step": c.step, "bytes": c.bytes, "path": str(c.path)} for c in found]}
