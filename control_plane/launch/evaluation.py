"""Evaluation during training: every ``config.eval_every`` steps, the mean loss over
``config.eval_batches`` batches of the job's held-out split (``Job.eval_data``).

An evaluation reads the parameters of that step's checkpoint (``eval_every`` is a multiple of
``checkpoint_every``; a run without a checkpoint directory gets a temporary one), so it never touches the
training run: a thread waits for the checkpoint to complete and runs the eval job — the job's forward,
no optimizer, nothing trainable, on the held-out batches — in process while training goes on. Each result
goes to ``on_eval(step, loss)`` (the job manager records it: status and metrics) and into
``RunResult.evals``. The graph is the training graph with every dropout off (rate 0), as in eval mode.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sbpflow.checkpoint.read import list_checkpoints
from sbpflow.control_plane.launch.step_tracker import StepListener
from sbpflow.job import Job
from sbpflow.v1 import service_pb2 as sp

EvalListener = Callable[[int, float], None]  # (step, held-out loss)
log = logging.getLogger(__name__)
WAIT_SECONDS = 600.0  # for a step's checkpoint to complete, at most


def eval_job(job: Job) -> Job:
    """``job``'s forward on its held-out split, ``eval_batches`` steps of it, in eval mode: every
    dropout at rate 0 (the identity)."""
    assert job.eval_data is not None
    c = job.config
    ops = [
        dataclasses.replace(o, attrs={**o.attrs, "rate": 0.0}) if o.op_type == "dropout" else o
        for o in job.graph.ops
    ]
    return dataclasses.replace(
        job,
        name=f"{job.name}-eval",
        graph=dataclasses.replace(job.graph, ops=ops),
        parameters=[dataclasses.replace(p, trainable=False) for p in job.parameters],
        data=job.eval_data,
        optimizer=None,
        config=dataclasses.replace(c, steps=c.eval_batches, checkpoint_every=0, eval_every=0),
        eval_data=None,
        bound=None,
    )


class Evaluation:
    """The evaluations of one run; ``on_step`` is the run's step listener, wrapped."""

    def __init__(
        self,
        job: Job,
        checkpoint_dir: str,
        first_step: int,
        on_step: StepListener | None,
        on_eval: EvalListener | None,
        run: Callable[..., Any],
    ) -> None:
        self.job, self.every, self.checkpoint_dir = eval_job(job), job.config.eval_every, checkpoint_dir
        self.first_step, self._on_step, self._on_eval, self._run = first_step, on_step, on_eval, run
        self.results: list[tuple[int, float]] = []
        self._due: queue.Queue[int | None] = queue.Queue()
        self._ended = threading.Event()  # the training run is over: every checkpoint it wrote is complete
        self._thread = threading.Thread(target=self._loop, name="sbpflow-eval", daemon=True)
        self._thread.start()

    def on_step(self, s: sp.StepMetrics) -> None:
        if self._on_step is not None:
            self._on_step(s)
        if (self.first_step + s.step) % self.every == 0:
            self._due.put(self.first_step + s.step)

    def _loop(self) -> None:
        while (step := self._due.get()) is not None:
            path = self._checkpoint(step)
            if path is None:
                log.warning(
                    "no complete checkpoint of step %d in %s: its evaluation is skipped",
                    step,
                    self.checkpoint_dir,
                )
                continue
            try:
                losses = self._run(self.job, backend="inprocess", init_from=path).losses
            except Exception:  # noqa: BLE001 - an evaluation never stops the training run
                log.exception("the evaluation at step %d failed", step)
                continue
            loss = sum(losses) / len(losses)
            self.results.append((step, loss))
            if self._on_eval is not None:
                self._on_eval(step, loss)

    def _checkpoint(self, step: int) -> str | None:
        deadline = time.monotonic() + WAIT_SECONDS
        while time.monotonic() < deadline:
            ended = self._ended.is_set()
            found = [c.path for c in list_checkpoints(self.checkpoint_dir) if c.step == step]
            if found or ended:
                return str(found[0]) if found else None
            time.sleep(0.05)
        return None

    def close(self, wait: bool) -> None:
        """The run ended: finish the evaluations still due (``wait``) or drop them."""
        self._ended.set()
        if not wait:
            while not self._due.empty():
                self._due.get_nowait()
        self._due.put(None)
        self._thread.join()


@contextmanager
def evaluating(
    job: Job,
    checkpoint_dir: str | None,
    first_step: int,
    on_step: StepListener | None,
    on_eval: EvalListener | None,
    run: Callable[..., Any],
) -> Iterator[Evaluation | None]:
    """The run's evaluations (None: the job evaluates nothing); on a clean exit every one is done."""
    if not job.config.eval_every or job.eval_data is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="sbpflow-eval-") as scratch:
        ev = Evaluation(job, checkpoint_dir or scratch, first_step, on_step, on_eval, run)
        try:
            yield ev
        except BaseException:
            ev.close(wait=False)
            raise
        ev.close(wait=True)
