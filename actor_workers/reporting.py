"""What a rank tells the control plane: the ``WorkerReport`` protobufs every backend emits, and the
hooks that turn a rank's SINK acts into one ``StepReport`` per completed step.

A rank that holds the loss reports its share of it when it fetches it; any other rank reports a step
once the last variable it assigns has come in. The control plane assembles the shares into the step's
loss (:mod:`sbpflow.control_plane.step_tracker`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from sbpflow import wire
from sbpflow.device import asnumpy
from sbpflow.v1 import plan_pb2 as pp
from sbpflow.v1 import service_pb2 as sp


def report(
    job_id: str, attempt: int, rank: int, worker_id: str = "", host: str = "", **payload: Any
) -> sp.WorkerReport:
    """A WorkerReport with its time set now; ``payload`` is exactly one of its oneof fields."""
    (field,) = payload
    msg = sp.WorkerReport(job_id=job_id, attempt=attempt, rank=rank, worker_id=worker_id, host=host)
    msg.time.GetCurrentTime()
    getattr(msg, field).CopyFrom(payload[field])
    return msg


STREAMS = ("compute", "comm", "data")  # the engine's streams, each a key of a step's timings


def watch_steps(
    rc: Any,
    device: pp.DevicePlan,
    loss: str | None,
    done: Callable[[int, float | None, Mapping[str, float]], None],
) -> None:
    """Call ``done(step, loss, timings)`` once per step the rank of ``rc`` completes: a rank that holds
    the loss when it fetches it (``loss`` its share), any other when the last variable it assigns has
    come in (``loss`` None: a pipeline stage without the loss, say). ``timings``: seconds since the last
    one (``"step"``), and how long each stream spent in acts in that time (``"compute"``, ``"comm"``,
    ``"data"``: ``rc.busy``, which the engine adds to)."""
    sinks = [t for t in device.tasks if t.kind == pp.TASK_KIND_SINK]
    holds_loss = any(
        "fetch" in t.attrs and str(wire.attr_from_proto(t.attrs["fetch"])) == loss for t in sinks
    )
    assigns = sum("assign" in t.attrs for t in sinks)
    last = [time.monotonic()]
    busy_then: dict[str, float] = {}
    assigned: dict[int, int] = {}

    def step_done(step: int, value: float | None) -> None:
        now = time.monotonic()
        timings = {"step": now - last[0]}
        last[0] = now
        for stream in STREAMS:
            spent = rc.busy.get(stream, 0.0)
            timings[stream], busy_then[stream] = spent - busy_then.get(stream, 0.0), spent
        done(step, value, timings)

    def fetched(name: str, micro_batch: int, step: int, value: Any) -> None:
        if name == loss and micro_batch < 0:
            step_done(step, float(asnumpy(value)))

    def on_assign(name: str, step: int) -> None:
        assigned[step] = assigned.get(step, 0) + 1
        if assigned[step] == assigns:
            del assigned[step]
            if not holds_loss:
                step_done(step, None)

    rc.fetch_hooks.append(fetched)
    rc.assign_hooks.append(on_assign)


def step_report(step: int, loss: float | None, timings: Mapping[str, float] | float) -> sp.StepReport:
    """The StepReport of (0-based) ``step``: with the rank's loss share where it holds the loss, and
    ``watch_steps``'s timings (a number: the step's seconds alone)."""
    losses = [] if loss is None else [loss]
    seconds = {"step": float(timings)} if isinstance(timings, (int, float)) else timings
    return sp.StepReport(step=step + 1, losses=losses, loss=loss or 0.0, timings_seconds=seconds)
