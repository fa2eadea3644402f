"""A plain-terminal progress bar for a training job: step/total, elapsed time and ETA, samples/s, loss.

On a terminal it redraws one line (``\\r``, padded so that no stale characters stay when the line
shrinks); elsewhere (a pipe, a log file, a test) it prints plain lines, loss last so a script can read it
with ``line.split()[-1]``: each of an attempt's first ``FIRST_STEPS`` steps (a short job whole), then one
at most every ``every`` seconds of the job's own time (10 by default; 0: every step), and always the last
step before the job's end line, so that a log of a long run is not a line per step::

    step    3/10  [######--------------]  0:01<0:02  1234.5 samples/s  loss 0.123456

A job says one state line before its steps, ``job ID: RUNNING (ready in 0.41 s)``, and one at its end.
The states on the way (PENDING, COMPILING, STARTING) are drawn on the redrawn line of a terminal, and
printed elsewhere only when they carry a reason (a job waiting for slots, a restart). Times come from
the events' own timestamps, so a replayed job (``sbpflow watch`` of an ended one) shows its real ones.

The standard library only: tqdm writes ``\\r`` updates even to a pipe (no plain lines to read the loss
from) and rich brings its own dependencies and a slower import, for a bar of one line.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from sbpflow.v1 import service_pb2 as sp

WIDTH = 20
EVERY_SECONDS = 10.0  # off a terminal: a step line at most this often, after the first steps
FIRST_STEPS = 5  # off a terminal: these first steps of an attempt each get their line
_NONE_YET = (0, -math.inf)  # (step lines printed, the last one's time) as an attempt starts
_ENDED = frozenset({sp.JOB_STATE_SUCCEEDED, sp.JOB_STATE_FAILED, sp.JOB_STATE_CANCELLED})


def _state(code: Any) -> str:
    return sp.JobState.Name(code).removeprefix("JOB_STATE_")


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    s = max(0, int(seconds + 0.5))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def _seconds(event: sp.JobEvent) -> float:
    return event.time.ToNanoseconds() / 1e9 if event.HasField("time") else time.monotonic()


class ProgressBar:
    """Feed it ``JobEvent``s (``update``); ``close()`` ends the redrawn line."""

    def __init__(self, stream: TextIO | None = None, label: str = "", every: float = EVERY_SECONDS) -> None:
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.label = label
        self.every = every
        self._printed = _NONE_YET  # off a terminal: step lines printed this attempt, and the last one's time
        self._held = ""  # off a terminal: the latest step line not printed (printed before the end line)
        self._width = 0  # characters of the redrawn line now on the terminal
        self._keep = False  # whether that line shows a step (kept: ended by a newline) or a passing state
        self._start: tuple[float, int] | None = None  # (time, step) when the job (re)entered RUNNING

    def line(self, step: int, total: int, loss: float | None, sps: float, elapsed: float = 0.0) -> str:
        filled = WIDTH * min(step, total) // total if total else 0
        bar = "#" * filled + "-" * (WIDTH - filled)
        done = step - (self._start[1] if self._start else 0)
        eta = clock(elapsed / done * (total - step)) if done > 0 and total >= step else "?"
        loss_text = "" if loss is None else f"  loss {loss:.6f}"
        return f"step {step:4d}/{total}  [{bar}]  {clock(elapsed)}<{eta}  {sps:9.1f} samples/s{loss_text}"

    def update(self, event: sp.JobEvent) -> None:
        st = event.status
        if event.HasField("step"):
            if self._start is None:
                self._start = (_seconds(event), max(0, st.step - 1))
            loss = st.loss if st.HasField("loss") else None
            elapsed = _seconds(event) - self._start[0]
            text = self.line(st.step, st.total_steps, loss, st.samples_per_second, elapsed)
            if self.tty:
                self._draw(text, keep=True)
            else:
                self._plain(text, _seconds(event), last=st.step == st.total_steps)
        elif event.HasField("state_change"):
            self._state_change(event)
        self.stream.flush()

    def _plain(self, text: str, at: float, last: bool) -> None:
        """Off a terminal: the step line ``text`` (the job's time ``at``) now, or held for later."""
        count, before = self._printed
        if count < FIRST_STEPS or at - before >= self.every or last:
            self.stream.write(text + "\n")
            self._printed, self._held = (count + 1, at), ""
        else:
            self._held = text

    def _state_change(self, event: sp.JobEvent) -> None:
        st = event.status
        if self._held:  # the last step seen, before any state line
            self.stream.write(self._held + "\n")
            self._held = ""
        said = ": ".join(x for x in (st.reason, st.message) if x)
        why = f" ({said})" if said else ""
        who = f"job {event.job_id}" + (f" {self.label}" if self.label else "")
        if st.state == sp.JOB_STATE_RUNNING:
            self._start, self._printed = (_seconds(event), st.step), _NONE_YET
            if not why and st.HasField("created") and st.HasField("started"):
                ready = (st.started.ToNanoseconds() - st.created.ToNanoseconds()) / 1e9
                why = f" (ready in {ready:.2f} s)"
        elif st.state not in _ENDED and not st.reason:  # on the way: PENDING, COMPILING, STARTING
            if self.tty:
                self._draw(f"{who}: {_state(st.state)}{why}", keep=False)
            return
        self._end_line()
        self.stream.write(f"{who}: {_state(st.state)}{why}\n")

    def _draw(self, text: str, keep: bool) -> None:
        """Redraw the terminal's line as ``text``, blanking what a longer line before it left."""
        self.stream.write("\r" + text + " " * max(0, self._width - len(text)))
        self._width, self._keep = len(text), keep

    def _end_line(self) -> None:
        """End the redrawn line: a step stays on the screen, a passing state is wiped."""
        if self._width:
            self.stream.write("\n" if self._keep else "\r" + " " * self._width + "\r")
            self._width = 0

    def close(self) -> None:
        if self._held:
            self.stream.write(self._held + "\n")
            self._held = ""
        self._end_line()
        self.stream.flush()
