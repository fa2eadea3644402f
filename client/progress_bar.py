"""A plain-terminal progress bar for a training job: step/total, loss, samples/s, state.

On a terminal it redraws one line (``\\r``); elsewhere (a pipe, a log file, a test) it prints one line per
step, loss last so a script can read it with ``line.split()[-1]``::

    step    3/10  [######--------------]  1234.5 samples/s  loss 0.123456

State changes are printed on their own line in both cases. No dependency beyond the standard library.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from sbpflow.v1 import service_pb2 as sp

WIDTH = 20


def _state(code: Any) -> str:
    return sp.JobState.Name(code).removeprefix("JOB_STATE_")


class ProgressBar:
    """Feed it ``JobEvent``s (``update``); ``close()`` ends the redrawn line."""

    def __init__(self, stream: TextIO | None = None, label: str = "") -> None:
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.label = label
        self._drawn = False

    def line(self, step: int, total: int, loss: float | None, sps: float) -> str:
        filled = WIDTH * min(step, total) // total if total else 0
        bar = "#" * filled + "-" * (WIDTH - filled)
        loss_text = "" if loss is None else f"  loss {loss:.6f}"
        return f"step {step:4d}/{total}  [{bar}]  {sps:9.1f} samples/s{loss_text}"

    def update(self, event: sp.JobEvent) -> None:
        st = event.status
        if event.HasField("step"):
            loss = st.loss if st.HasField("loss") else None
            text = self.line(st.step, st.total_steps, loss, st.samples_per_second)
            if self.tty:
                self.stream.write("\r" + text)
                self._drawn = True
            else:
                self.stream.write(text + "\n")
        elif event.HasField("state_change"):
            self._end_line()
            why = f" ({st.reason}: {st.message})" if st.reason else (f" ({st.message})" if st.message else "")
            who = f"job {event.job_id}" + (f" {self.label}" if self.label else "")
            self.stream.write(f"{who}: {_state(st.state)}{why}\n")
        self.stream.flush()

    def _end_line(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False

    def close(self) -> None:
        self._end_line()
        self.stream.flush()
