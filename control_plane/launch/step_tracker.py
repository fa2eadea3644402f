"""Progress of a run as the control plane sees it: per-step losses assembled from the ranks that hold the
loss, turned into ``StepMetrics``.

The loss is a global tensor like any other: its ranks each hold a shard (a scalar loss is ``B`` or ``P``
over them), so a step is complete when every rank of its placement has reported it, and its value is
assembled the way :func:`sbpflow.sharding.assemble` assembles any tensor (partials summed, copies
checked equal), one share at a time as they come (:mod:`.share_assembly`: the same adds in the same
order, so no report pays for a whole 1,024-rank step at once). Both backends feed the same tracker:
the in-process one from its SINK fetch acts, the Ray one from the workers' ``StepReport``s.

A non-finite loss (NaN, an infinity) is checked here, where each step's loss is assembled, so both
backends share the check: the step is still reported (the store keeps its NaN), later steps are not, and
``on_non_finite`` decides. The run's default (:func:`fail_on_non_finite`) records a
:class:`~sbpflow.runs.numerics.NonFiniteLoss` in ``non_finite`` and says "stop" (the launcher aborts every
rank and raises it). Under dynamic loss scaling (issue 18) a non-finite step is an overflow the scaler
skips: that policy returns True, the step is counted in ``skipped`` and the run goes on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sbpflow.actor_workers.step_reports import Scaling
from sbpflow.control_plane.launch.share_assembly import ShareAssembly, ShareLayout
from sbpflow.graph import TensorDecl
from sbpflow.runs.numerics import NonFiniteLoss, finite
from sbpflow.runs.states import JobState
from sbpflow.v1 import service_pb2 as sp

WINDOW = 8  # samples/s is measured over the last WINDOW steps: reports arrive in bursts, steps do not
StepListener = Callable[[sp.StepMetrics], None]
ReportListener = Callable[[sp.WorkerReport], None]
StateListener = Callable[[JobState], None]
NonFinitePolicy = Callable[[int, float], bool]  # (job step, loss) -> True: skip and count the step


def fail_on_non_finite(step: int, value: float) -> bool:
    """The policy without loss scaling: a non-finite loss stops the run (it is never skipped)."""
    return False


def skip_overflow(step: int, value: float) -> bool:
    """The policy under dynamic loss scaling: an fp16 forward that overflowed makes the step's gradients
    non-finite too, and the plan skips the step's update and backs the scale off; the run goes on."""
    return True


class StepTracker:
    """Collects each rank's share of the loss per step and calls ``on_step`` once a step is complete.

    Steps complete in order (a rank reports step s+1 only after s); ``losses`` holds every completed
    step's loss. Thread-safe: reports arrive from stream threads or gRPC handler threads.
    """

    def __init__(
        self,
        loss: TensorDecl | None,
        samples_per_step: int,
        on_step: StepListener | None,
        *,
        job: str = "",
        first_step: int = 0,
        on_non_finite: NonFinitePolicy = fail_on_non_finite,
        stop: Callable[[], None] = lambda: None,
    ) -> None:
        self._decl = loss
        self._layout = _layout(loss)
        self._job, self._first_step = job, first_step  # the run's step s is the job's first_step + s
        self._policy, self._stop = on_non_finite, stop
        self.non_finite: NonFiniteLoss | None = None  # set when a non-finite loss stopped the run
        self.skipped = 0  # non-finite steps the policy skipped
        self._samples = samples_per_step
        self._on_step = on_step
        self._lock = threading.Lock()
        self._pending: dict[int, ShareAssembly] = {}  # per step not complete yet: its shares so far
        self._last = time.time()  # wall clock: a rank's report says when (by its clock) it ended a step
        self._at: dict[int, float] = {}  # per pending step: when its last share's rank ended it
        self._recent: deque[float] = deque(maxlen=WINDOW + 1)  # completion times of the recent steps
        self.losses: list[float] = []
        self._scaling: dict[int, Scaling] = {}  # per pending step: its loss scale and skipped count

    def restart_clock(self) -> None:
        """Time the first step from now (the run starts after compile and set-up)."""
        self._last = time.time()
        self._recent.clear()
        self._recent.append(self._last)

    def known(self) -> int | None:
        """How many steps from the run's start have their loss here (None: the run tracks no loss). A
        restart resumes no later than this, so the run's losses stay complete."""
        if self._decl is None:
            return None
        with self._lock:
            return len(self.losses)

    def relayout(self, loss: TensorDecl | None) -> None:
        """The loss is ``loss`` from now on: an elastic restart placed it on other ranks (shares pending go)."""
        with self._lock:
            self._decl, self._layout = loss, _layout(loss)
            self._pending.clear()
            self._at.clear()

    def rewind(self, steps: int) -> None:
        """Forget every step from ``steps`` on (a restarted attempt trains and reports them again)."""
        with self._lock:
            del self.losses[steps:]
            self._pending.clear()
            self._at.clear()
            self._scaling.clear()

    def add(
        self, rank: int, step: int, value: Any, at: float | None = None, scaling: Scaling | None = None
    ) -> None:
        """Rank ``rank``'s share of the loss of (0-based) ``step``, which it ended at ``at`` (seconds since
        the epoch, from its report; None: now). Workers send their reports in batches, so the step's
        time is when its last rank ended it, not when the shares arrived. ``scaling``: the dynamic loss
        scale and the steps skipped so far after the step, from a rank that holds the scale (every rank
        of the loss holds it, replicated)."""
        with self._lock:
            layout = self._layout  # under the lock: a relayout drops the shares of the old one
            if layout is None or rank not in layout.ranks or self.non_finite is not None:
                return  # the run stops at the step that diverged: later ones are not reported
            shares = self._pending.get(step)
            if shares is None:
                shares = self._pending[step] = ShareAssembly(layout)
            shares.add(rank, np.asarray(value))
            if scaling is not None:
                self._scaling[step] = scaling
            self._at[step] = max(self._at.get(step, 0.0), time.time() if at is None else at)
            done = []
            while self.non_finite is None and (nxt := self._pending.get(len(self.losses))) and nxt.complete:
                ended = self._at.pop(len(self.losses))
                del self._pending[len(self.losses)]
                done.append(self._complete(float(nxt.value()), ended))
        self._emit(done)

    def settle(self, losses: Sequence[float], start: int) -> None:
        """The run's assembled losses of steps ``start, start + 1, ...`` (an attempt's outcome): complete
        the steps whose reports never came (a report can be dropped; the outcome holds every step)."""
        with self._lock:
            done = []
            while self.non_finite is None and start <= len(self.losses) < start + len(losses):
                self._pending.pop(len(self.losses), None)
                ended = self._at.pop(len(self.losses), None)
                done.append(self._complete(float(losses[len(self.losses) - start]), ended))
        self._emit(done)

    def _complete(self, loss: float, ended: float | None = None) -> tuple[sp.StepMetrics, bool]:
        """Step ``len(losses)`` is complete with ``loss`` (ended at ``ended``; None: now): its metrics,
        and whether the run must stop. Called under the lock."""
        now = max(time.time() if ended is None else ended, self._last)  # ranks' clocks may differ a little
        seconds, self._last = now - self._last, now
        self._recent.append(now)
        self.losses.append(loss)
        span = now - self._recent[0]
        metrics = sp.StepMetrics(
            step=len(self.losses),
            loss=loss,
            samples_per_second=self._samples * (len(self._recent) - 1) / max(span, 1e-9),
            step_seconds=seconds,
        )
        scaling = self._scaling.pop(len(self.losses) - 1, None)
        if scaling is not None:
            metrics.loss_scale, metrics.skipped_steps = scaling
        if finite(loss):
            return metrics, False
        step = self._first_step + len(self.losses)
        if self._policy(step, loss):
            self.skipped += 1
            return metrics, False
        self.non_finite = NonFiniteLoss(self._job, step, loss)
        return metrics, True

    def _emit(self, done: list[tuple[sp.StepMetrics, bool]]) -> None:
        for metrics, stop in done:
            if self._on_step is not None:
                self._on_step(metrics)
            if stop:
                self._stop()


def _layout(loss: TensorDecl | None) -> ShareLayout | None:
    """Where the loss's shares go (None: the run tracks no loss, or its loss has no placement)."""
    return ShareLayout(loss) if loss is not None and loss.placement is not None else None
