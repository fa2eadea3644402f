"""The progress bar: plain lines off a terminal (loss last), one redrawn line on one with no stale
characters, elapsed time and ETA from the events' timestamps, and one state line before the steps."""

from __future__ import annotations

import io

from sbpflow.client.progress_bar import ProgressBar, clock
from sbpflow.v1 import service_pb2 as sp

T0 = 1_700_000_000


def _event(
    step: int, loss: float | None = None, state: str = "", at: float = 0.0, reason: str = ""
) -> sp.JobEvent:
    st = sp.JobStatus(job_id="j", step=step, total_steps=10, samples_per_second=100.0, reason=reason)
    if loss is not None:
        st.loss = loss
    ev = sp.JobEvent(job_id="j", status=st)
    ev.time.FromNanoseconds(int((T0 + at) * 1e9))
    if state:
        ev.status.state = sp.JobState.Value("JOB_STATE_" + state)
        ev.state_change.current = ev.status.state
    else:
        ev.step.step = step
    return ev


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _job(bar: ProgressBar) -> None:
    for ev in (
        _event(0, state="PENDING"),
        _event(0, state="COMPILING", at=0.1),
        _event(0, state="STARTING", at=0.2),
        _event(0, state="RUNNING", at=0.5),
        _event(5, 0.5, at=10.5),
        _event(10, 0.25, at=20.5),
        _event(10, 0.25, state="SUCCEEDED", at=20.6),
    ):
        bar.update(ev)
    bar.close()


def test_plain_lines_with_elapsed_time_and_eta() -> None:
    plain = io.StringIO()
    _job(ProgressBar(plain))
    lines = plain.getvalue().splitlines()
    assert lines[0] == "job j: RUNNING"  # one state line before the steps, not four
    assert lines[1] == "step    5/10  [##########----------]  0:10<0:10      100.0 samples/s  loss 0.500000"
    assert lines[2].startswith("step   10/10  [####################]  0:20<0:00 ")
    assert lines[3] == "job j: SUCCEEDED" and len(lines) == 4
    assert float(lines[1].split()[-1]) == 0.5  # what a script reads


def test_a_state_on_the_way_with_a_reason_is_printed() -> None:
    plain = io.StringIO()
    ProgressBar(plain).update(_event(0, state="PENDING", reason="WAITING_FOR_RESOURCES"))
    assert plain.getvalue() == "job j: PENDING (WAITING_FOR_RESOURCES)\n"


def test_the_terminal_line_is_redrawn_without_stale_characters() -> None:
    tty = _Tty()
    bar = ProgressBar(tty)
    bar.update(_event(0, state="COMPILING"))  # drawn on the live line, then wiped
    bar.update(_event(0, state="RUNNING", at=1.0))
    bar.update(_event(5, 0.123456, at=2.0))
    long = bar._width
    bar.update(_event(7, None, at=4.0))  # no loss: a shorter line
    bar.close()
    out = tty.getvalue()
    screens = out.split("\r")
    assert screens[1] == "job j: COMPILING" and screens[2].strip() == ""  # wiped
    assert "job j: RUNNING\n" in out
    last = screens[-1]
    assert last.rstrip(" \n").endswith("samples/s") and len(last.rstrip("\n")) >= long  # padded over
    assert out.endswith("\n") and out.count("\n") == 2  # the RUNNING line and the end of the bar


def test_clock() -> None:
    assert [clock(0), clock(59.6), clock(61), clock(3600 + 62)] == ["0:00", "1:00", "1:01", "1:01:02"]
