"""Where a restarted attempt resumes: the latest intact checkpoint whose steps' losses all reached the
control plane, so the run's losses stay complete (a worker killed with reports in flight takes them along).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from sbpflow.control_plane.launch import elastic
from sbpflow.control_plane.launch.elastic import restart_point as _restart
from sbpflow.control_plane.launch.run_context import LaunchContext
from sbpflow.control_plane.launch.step_tracker import StepTracker
from sbpflow.dtype import DType
from sbpflow.graph import TensorDecl
from sbpflow.placement import placement
from sbpflow.sbp import P
from sbpflow.tensor_meta import TensorMeta
from tests.sbpflow.test_checkpoint import complete, garble, step_dir

LOSS = TensorDecl("loss", TensorMeta((), DType.float32), placement=placement("cpu", [0, 1]), sbp=(P,))


def tracker_with(steps: int) -> StepTracker:
    t = StepTracker(LOSS, 4, None)
    for step in range(steps):
        t.add(0, step, 0.5)
        t.add(1, step, 0.25)
    return t


def failed_attempt(root: Path) -> tuple[LaunchContext, LaunchContext]:
    """The run's first attempt, which failed: 20 steps from step 0, checkpointing under ``root``."""
    first = LaunchContext(steps=20, checkpoint_dir=str(root))
    return first, first


def test_a_checkpoint_past_the_reported_losses_is_passed_over_and_said(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        complete(tmp_path, step, np.ones((8, 2)) * step)
    t = tracker_with(12)  # steps 13.. were trained, their reports died with the worker
    first, failed = failed_attempt(tmp_path)
    new, note = _restart(first, failed, t)
    assert (new.attempt, new.first_step, new.steps) == (2, 10, 10)
    assert new.resume_from == str(step_dir(tmp_path, 10))
    assert len(t.losses) == 10  # the tracker forgot steps 11-12: the attempt reports them again
    assert note == (
        "; step-00000015 passed over: the losses of the steps after 12 never reached the control plane "
        "(their reports went with the worker), so steps 11-12 train again"
    )


def test_every_loss_reported_resumes_from_the_latest_intact_checkpoint(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        complete(tmp_path, step, np.ones((8, 2)) * step)
    garble(step_dir(tmp_path, 15) / "rank-00000.a1.safetensors")
    first, failed = failed_attempt(tmp_path)
    new, note = _restart(first, failed, tracker_with(17))
    assert new.first_step == 10
    assert note.startswith("; checkpoint step-00000015 is corrupt (") and "passed over" not in note


def test_a_run_without_a_loss_takes_the_latest_checkpoint(tmp_path: Path) -> None:
    for step in (5, 10):
        complete(tmp_path, step, np.ones((8, 2)) * step)
    first, failed = failed_attempt(tmp_path)
    new, note = _restart(first, failed, StepTracker(None, 4, None))
    assert (new.first_step, note) == (10, "")


def test_regrow_stays_due_when_the_stopped_attempt_writes_one_more_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attempt stops once ``due()`` says so, but its workers may complete the next checkpoint before they
    hear the abort, and that checkpoint's losses are not in yet: ``close()`` must still say it was due (it
    said not, and the run failed with 'the job's own ranks are back' instead of growing)."""
    monkeypatch.setattr(elastic, "REGROW_SECONDS", 0.01)
    complete(tmp_path, 20, np.ones((8, 2)))
    tracker = tracker_with(20)
    regrow = elastic.Regrow(lambda: True, str(tmp_path), tracker, 0)
    try:
        deadline = time.monotonic() + 10
        while regrow._since is None and time.monotonic() < deadline:  # the look found room at step 20
            time.sleep(0.01)
        assert not regrow.due()  # no checkpoint since there was room
        complete(tmp_path, 40, np.ones((8, 2)))
        assert not regrow.due()  # step 40's losses are not in yet
        for step in range(20, 40):
            tracker.add(0, step, 0.5)
            tracker.add(1, step, 0.25)
        assert regrow.due()
        complete(tmp_path, 60, np.ones((8, 2)))  # written before the workers heard the abort
    finally:
        assert regrow.close()
