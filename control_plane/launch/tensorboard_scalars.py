"""TensorBoard scalars of a run, the ones a training person reads: ``sf.run(job, tensorboard_dir="runs")``
or ``sbpflow server --tensorboard-dir runs``, then ``tensorboard --logdir runs``.

Each run writes its event files to ``<dir>/<job id>`` (a server's jobs), or ``<dir>/<job name>-<UTC
time>`` (an ``sf.run`` without an id), with the job's own step numbers, so a resumed job goes on in the
same run. What goes in (:data:`STEP_SCALARS`, then the rest):

| tag | what |
|---|---|
| ``loss/train`` | the step's loss (the mean over its micro-batches) |
| ``loss/eval`` | the held-out loss, where the job evaluates (``config.eval_every``: ``evaluation.py``) |
| ``lr`` | the learning rate the optimizer applied at the step (its schedule included) |
| ``throughput/samples_per_second`` | samples a second over the last steps |
| ``time/step_seconds`` | the step's wall time |
| ``time/compute_seconds``, ``time/communication_seconds``, ``time/data_seconds`` | how long each stream spent in acts since the rank's last step (its step reports), the mean over the ranks |

The writer is tensorboardX's ``FileWriter`` (one event a step with all its scalars: 30 us a scalar, where
``SummaryWriter.add_scalar`` takes 75 us): an 87 KB pure-Python wheel that needs only numpy,
packaging and protobuf, all of them sbpflow's already (tensorboard's own writer comes with its server:
tensorboard, its data server, grpcio, werkzeug, pillow, markdown, absl, about 30 MB of wheels). It is
imported only when a run asks for a directory (0.4 s; 3 s where torch is installed, which it imports
too); without it that run stops at once, naming the install.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from sbpflow.control_plane.launch.evaluation import EvalListener
from sbpflow.control_plane.launch.step_tracker import ReportListener, StepListener
from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.oracle.optim import learning_rate
from sbpflow.v1 import service_pb2 as sp

FLUSH_SECONDS = 5  # the writer's own flush period; ``close`` flushes the rest
STEP_SCALARS: tuple[tuple[str, Callable[[sp.StepMetrics], float]], ...] = (
    ("loss/train", lambda m: m.loss),
    ("throughput/samples_per_second", lambda m: m.samples_per_second),
    ("time/step_seconds", lambda m: m.step_seconds),
)
_FILES = itertools.count()  # event files this process opened
STREAM_TAGS = {
    "compute": "time/compute_seconds",
    "comm": "time/communication_seconds",
    "data": "time/data_seconds",
}


def run_dir(root: str | Path, job: Job, job_id: str = "") -> Path:
    """Where a run's event files go: ``<root>/<job id>``, else ``<root>/<job name>-<UTC time>``."""
    name = job_id or f"{job.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise SbpflowError(f"{name!r} cannot name a TensorBoard run directory; use letters, digits, - _ .")
    return Path(root) / name


class ScalarBoard:
    """One run's TensorBoard writer (tensorboardX's ``FileWriter`` on a thread of its own): steps through
    :meth:`on_step`, held-out losses through :meth:`on_eval`, each step's stream times through
    :meth:`on_report`; each then calls the run's own listener. A context manager: leaving it closes."""

    def __init__(
        self,
        path: str | Path,
        job: Job,
        first_step: int = 0,
        on_step: StepListener | None = None,
        on_eval: EvalListener | None = None,
        on_report: ReportListener | None = None,
    ) -> None:
        try:
            from tensorboardX.proto.summary_pb2 import Summary
            from tensorboardX.writer import FileWriter
        except ImportError as e:
            raise SbpflowError(
                "tensorboard_dir= needs tensorboardX: pip install tensorboardX (it is in sbpflow's dev extra)"
            ) from e
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SbpflowError(
                f"tensorboard_dir: cannot make {self.path} ({e.strerror or e}); give a directory this process "
                "can write (--tensorboard-dir on a server)"
            ) from e
        # tensorboardX names an event file by the second and the host: two runs of a job in one second
        # (a resume right after its first attempt) would write one file, the second truncating the first
        suffix = f".{os.getpid()}.{next(_FILES)}"
        self._writer = FileWriter(str(self.path), flush_secs=FLUSH_SECONDS, filename_suffix=suffix)
        self._summary = Summary
        self._optimizer, self._first_step = job.optimizer, first_step
        self._then_step, self._then_eval, self._then_report = on_step, on_eval, on_report  # called after
        g = job.graph  # every rank reports every step's stream times
        placements = [t.placement for t in g.tensors.values()] + [o.placement for o in g.ops]
        self._ranks = len({r for pl in placements if pl is not None for r in pl.ranks})
        self._split: dict[int, dict[int, dict[str, float]]] = {}  # step -> rank -> stream -> seconds
        self._lock = threading.Lock()  # reports come from stream and gRPC threads
        # An event costs the writer ~0.1 ms of Python, and a thread that wakes takes the GIL from the
        # streams: the board's own thread writes what came in every FLUSH_SECONDS, in one burst.
        self._queue: queue.SimpleQueue[tuple[int, list[tuple[str, float]]]] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="sbpflow-tensorboard", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            last = self._closing.wait(FLUSH_SECONDS)
            while not self._queue.empty():
                step, values = self._queue.get_nowait()  # one event a step, all its scalars in it
                summary = self._summary(value=[self._summary.Value(tag=t, simple_value=v) for t, v in values])
                self._writer.add_summary(summary, step, time.time())
            if last:
                break
        self._writer.close()

    def on_step(self, m: sp.StepMetrics) -> None:
        """A step listener: the step's scalars, then the run's own ``on_step``."""
        step = self._first_step + int(m.step)  # the job's step: a resumed run goes on from its checkpoint
        values = [(tag, float(value(m))) for tag, value in STEP_SCALARS]
        if self._optimizer is not None:
            values.append(("lr", learning_rate(self._optimizer, step - 1)))
        self._queue.put((step, values))
        if self._then_step is not None:
            self._then_step(m)

    def on_eval(self, step: int, loss: float) -> None:
        """An eval listener: the held-out loss at the job's ``step``, then the run's own ``on_eval``."""
        self._queue.put((step, [("loss/eval", float(loss))]))
        if self._then_eval is not None:
            self._then_eval(step, loss)

    def on_report(self, rep: sp.WorkerReport) -> None:
        """A report listener: each step's stream times (compute, communication, data; ``watch_steps``), the
        mean over the job's ranks once all have reported it; then the run's own ``on_report``."""
        timings = rep.step.timings_seconds if rep.WhichOneof("payload") == "step" else {}
        if "compute" in timings:
            with self._lock:
                shares = self._split.setdefault(int(rep.step.step), {})
                shares[rep.rank] = {k: timings[k] for k in STREAM_TAGS if k in timings}
                if len(shares) == self._ranks:
                    self._write_split(int(rep.step.step))
        if self._then_report is not None:
            self._then_report(rep)

    def _write_split(self, step: int) -> None:
        """Step ``step``'s stream times, the mean over the ranks that reported it (under the lock)."""
        shares = self._split.pop(step)
        keys = {k for t in shares.values() for k in t}
        means = [
            (STREAM_TAGS[k], sum(t.get(k, 0.0) for t in shares.values()) / len(shares)) for k in sorted(keys)
        ]
        self._queue.put((step, means))

    def close(self) -> None:
        """Write what is queued (a step some rank never reported: the mean over those that did), close the
        event file (idempotent)."""
        with self._lock:
            for step in sorted(self._split):
                self._write_split(step)
        self._closing.set()
        self._thread.join()

    def __enter__(self) -> ScalarBoard:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class NoBoard:
    """What a run without ``tensorboard_dir`` has: the same calls, doing nothing."""

    def __init__(
        self,
        on_step: StepListener | None = None,
        on_eval: EvalListener | None = None,
        on_report: ReportListener | None = None,
    ) -> None:
        self.on_step, self.on_eval, self.on_report = on_step, on_eval, on_report  # the run's own, as they are

    def __enter__(self) -> NoBoard:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass


def open_board(
    root: str | Path | None,
    job: Job,
    job_id: str = "",
    first_step: int = 0,
    on_step: StepListener | None = None,
    on_eval: EvalListener | None = None,
    on_report: ReportListener | None = None,
) -> ScalarBoard | NoBoard:
    """The run's board: a writer under ``run_dir(root, ...)`` whose ``on_step`` and ``on_eval`` write, then
    call the run's own; or, without a root, a :class:`NoBoard` holding the run's own listeners."""
    if root is None:
        return NoBoard(on_step, on_eval, on_report)
    return ScalarBoard(run_dir(root, job, job_id), job, first_step, on_step, on_eval, on_report)
