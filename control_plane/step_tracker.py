"""Progress of a run as the control plane sees it: per-step losses assembled from the ranks that hold the
loss, turned into ``StepMetrics``.

The loss is a global tensor like any other: its ranks each hold a shard (a scalar loss is ``B`` or ``P``
over them), so a step is complete when every rank of its placement has reported it, and its value is
assembled the way :func:`sbpflow.sharding.assemble` assembles any tensor (partials summed, copies
checked equal). Both backends feed the same tracker: the in-process one from its SINK fetch acts, the
Ray one from the workers' ``StepReport``s.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from sbpflow.graph import TensorDecl
from sbpflow.run_state import JobState
from sbpflow.sharding import assemble_value
from sbpflow.v1 import service_pb2 as sp

WINDOW = 8  # samples/s is measured over the last WINDOW steps: reports arrive in bursts, steps do not
StepListener = Callable[[sp.StepMetrics], None]
ReportListener = Callable[[sp.WorkerReport], None]
StateListener = Callable[[JobState], None]


class StepTracker:
    """Collects each rank's share of the loss per step and calls ``on_step`` once a step is complete.

    Steps complete in order (a rank reports step s+1 only after s); ``losses`` holds every completed
    step's loss. Thread-safe: reports arrive from stream threads or gRPC handler threads.
    """

    def __init__(self, loss: TensorDecl | None, samples_per_step: int, on_step: StepListener | None) -> None:
        self._decl = loss
        self._ranks = tuple(loss.placement.ranks) if loss is not None and loss.placement else ()
        self._samples = samples_per_step
        self._on_step = on_step
        self._lock = threading.Lock()
        self._pending: dict[int, dict[int, Any]] = {}
        self._last = time.monotonic()
        self._recent: deque[float] = deque(maxlen=WINDOW + 1)  # completion times of the recent steps
        self.losses: list[float] = []

    def restart_clock(self) -> None:
        """Time the first step from now (the run starts after compile and set-up)."""
        self._last = time.monotonic()
        self._recent.clear()
        self._recent.append(self._last)

    def rewind(self, steps: int) -> None:
        """Forget every step from ``steps`` on (a restarted attempt trains and reports them again)."""
        with self._lock:
            del self.losses[steps:]
            self._pending.clear()

    def add(self, rank: int, step: int, value: Any) -> None:
        """Rank ``rank``'s share of the loss of (0-based) ``step``."""
        if self._decl is None or rank not in self._ranks:
            return
        with self._lock:
            shares = self._pending.setdefault(step, {})
            shares[rank] = np.asarray(value)
            done = []
            while len(self._pending.get(len(self.losses), {})) == len(self._ranks):
                shares = self._pending.pop(len(self.losses))
                loss = float(assemble_value(self._decl, shares))
                now = time.monotonic()
                seconds, self._last = now - self._last, now
                self._recent.append(now)
                self.losses.append(loss)
                span = now - self._recent[0]
                done.append(
                    sp.StepMetrics(
                        step=len(self.losses),
                        loss=loss,
                        samples_per_second=self._samples * (len(self._recent) - 1) / max(span, 1e-9),
                        step_seconds=seconds,
                    )
                )
        for metrics in done:
            if self._on_step is not None:
                self._on_step(metrics)
