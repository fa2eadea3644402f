"""What a rank tells the control plane: the ``WorkerReport`` protobufs every backend emits, and the
hooks that turn a rank's SINK acts into one ``StepReport`` per completed step.

A rank that holds the loss reports its share of it when it fetches it; any other rank reports a step
once the last variable it assigns has come in. The control plane assembles the shares into the step's
loss (:mod:`sbpflow.control_plane.launch.step_tracker`).

Every step report (and heartbeat) carries the rank's process usage, :func:`process_usage`: its CPU
seconds (user and system, ``time.process_time``) and its resident memory (``/proc/self/statm``, read at
most every :data:`RSS_SECONDS`: a step of a millisecond should not pay a file read). A rank of the
in-process backend shares its process with the control plane, and reports that process's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from sbpflow.codec import wire
from sbpflow.device import asnumpy
from sbpflow.ops.training.loss_scaling import SCALE, SKIPPED
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


Scaling = tuple[float, int]  # dynamic loss scaling after a step: (the scale, the steps skipped so far)
StepDone = Callable[[int, "float | None", Mapping[str, float], "Scaling | None"], None]


def watch_steps(rc: Any, device: pp.DevicePlan, loss: str | None, done: StepDone) -> None:
    """Call ``done(step, loss, timings, scaling)`` once per step the rank of ``rc`` completes: a rank
    that holds the loss when it fetches it (``loss`` its share), any other when the last variable it
    assigns has come in (``loss`` None: a pipeline stage without the loss, say). ``timings``: seconds
    since the last one (``"step"``), and how long each stream spent in acts in that time (``"compute"``,
    ``"comm"``, ``"data"``: ``rc.busy``, which the engine adds to). A rank that holds the dynamic loss
    scale (beside the loss: ``sbpflow.ops.training.loss_scaling``) reports once both the loss and the scale's new
    value are in, with ``scaling`` (the scale, the steps skipped so far); None elsewhere."""
    sinks = [t for t in device.tasks if t.kind == pp.TASK_KIND_SINK]
    holds_loss = any(
        "fetch" in t.attrs and str(wire.attr_from_proto(t.attrs["fetch"])) == loss for t in sinks
    )
    assigned_vars = {str(wire.attr_from_proto(t.attrs["assign"])) for t in sinks if "assign" in t.attrs}
    holds_scale = {SCALE, SKIPPED} <= assigned_vars
    assigns = len([t for t in sinks if "assign" in t.attrs])
    last = [time.monotonic()]
    busy_then: dict[str, float] = {}
    assigned: dict[int, int] = {}
    losses: dict[int, float] = {}  # a loss fetched before its step's scale came in
    scales: dict[int, dict[str, float]] = {}  # step -> the scaling variables assigned so far

    def step_done(step: int, value: float | None) -> None:
        now = time.monotonic()
        timings = {"step": now - last[0]}
        last[0] = now
        for stream in STREAMS:
            spent = rc.busy.get(stream, 0.0)
            timings[stream], busy_then[stream] = spent - busy_then.get(stream, 0.0), spent
        got = scales.pop(step, None)
        done(step, value, timings, None if got is None else (got[SCALE], int(got[SKIPPED])))

    def fetched(name: str, micro_batch: int, step: int, value: Any) -> None:
        if name == loss and micro_batch < 0:
            if holds_scale and len(scales.get(step, ())) < 2:
                losses[step] = float(asnumpy(value))  # reported when the scale is in
                return
            step_done(step, float(asnumpy(value)))

    def on_assign(name: str, step: int) -> None:
        if holds_scale and name in (SCALE, SKIPPED):
            scales.setdefault(step, {})[name] = float(asnumpy(rc.store[name]).reshape(-1)[0])
            if len(scales[step]) == 2 and step in losses:
                step_done(step, losses.pop(step))
        assigned[step] = assigned.get(step, 0) + 1
        if assigned[step] == assigns:
            del assigned[step]
            if not holds_loss:
                step_done(step, None)

    rc.fetch_hooks.append(fetched)
    rc.assign_hooks.append(on_assign)


RSS_SECONDS = 0.25  # the resident memory is read at most this often
_STATM = "/proc/self/statm"  # Linux: sizes in pages, the second the resident set
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Resident:
    """The resident size, read again once the last read is ``RSS_SECONDS`` old (threads share it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._when, self._bytes = -RSS_SECONDS, 0

    def bytes(self) -> int:
        now = time.monotonic()
        with self._lock:
            if now - self._when >= RSS_SECONDS:
                self._when, self._bytes = now, _read_rss()
            return self._bytes


def _read_rss() -> int:
    try:
        with open(_STATM, "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):  # not Linux: no resident size to report
        return 0


_RESIDENT = _Resident()


def process_usage() -> tuple[float, int]:
    """This process's CPU seconds and resident bytes now (bytes 0 where ``/proc`` is not there)."""
    return time.process_time(), _RESIDENT.bytes()


def heartbeat() -> sp.Heartbeat:
    """A heartbeat with the process's usage."""
    cpu, rss = process_usage()
    return sp.Heartbeat(cpu_seconds=cpu, rss_bytes=rss)


def step_report(
    step: int, loss: float | None, timings: Mapping[str, float] | float, scaling: Scaling | None = None
) -> sp.StepReport:
    """The StepReport of (0-based) ``step``: with the rank's loss share where it holds the loss,
    ``watch_steps``'s timings (a number: the step's seconds alone), the loss scale where it holds it, and
    the process's usage (:func:`process_usage`)."""
    losses = [] if loss is None else [loss]
    seconds = {"step": float(timings)} if isinstance(timings, (int, float)) else timings
    cpu, rss = process_usage()
    m = sp.StepReport(
        step=step + 1,
        losses=losses,
        loss=loss or 0.0,
        timings_seconds=seconds,
        cpu_seconds=cpu,
        rss_bytes=rss,
    )
    if scaling is not None:
        m.loss_scale, m.skipped_steps = scaling
    return m
