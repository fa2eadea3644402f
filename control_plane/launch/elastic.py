"""Where a run goes on after a lost worker: from which checkpoint (:func:`restart_point`), and on which
layout (:func:`replan`) — the same ranks when their capacity is back within the job's grace period, else
the first of the job's fallback rank counts (``JobConfig.elastic``) the cluster can hold.

    job.config = JobConfig(..., checkpoint_every=2, elastic=(2, 1), elastic_grace=30)
    # DP 4; a node goes and is not back in 30 s: the job re-plans on 2 ranks (the S(0) batch split over 2),
    # resumes from its last intact checkpoint (read under any layout) and goes on; then on 1

Rules:
- a layout is reserved before it is chosen: its placement group must be ready (the same ranks: within
  ``elastic_grace`` s; a fallback: within :data:`PLACE_SECONDS`), so a layout the cluster cannot hold is
  never started, and capacity that comes back within the grace period gives the job its ranks back;
- a fallback of ``n`` ranks re-places the model, not re-traces it (:func:`replace_world`): every placement
  spans the job's ranks, and the first mesh axis (data parallel) is scaled by ``n / ranks``; SBP
  annotations stay, and a tensor split on that axis must still divide (the global batch over the new data
  parallel size), so the job's math — and, in float64, its losses — are those of the old layout;
- a fallback that cannot re-place (a pipeline's sub-placements, a mesh axis that does not scale, a split
  that no longer divides) is refused at Submit (``service/validation.py``'s ``check_fallbacks``); one that fails to compile or to
  be placed is passed over, and the failure names each one and why;
- a job without fallbacks waits for its own ranks as before (``SETUP_SECONDS``);
- the job manager counts the slots of the layout a job runs on (the run's ``on_resize``, told with each
  new attempt): a job shrunk from 4 ranks to 2 frees 2 for a waiting job, and takes them back to grow;
- while a job runs on a fallback, :class:`Regrow` looks whether the cluster has room for its own layout
  again; once it has, the first checkpoint completed after that (whose losses all reached the control
  plane) stops the attempt, and the next is re-planned from it as after a loss — its own ranks first —
  with reason ``ELASTIC_GROW``, not counted as a restart.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.launch.run_context import LaunchContext
from sbpflow.control_plane.launch.step_tracker import StepTracker
from sbpflow.errors import SbpflowError
from sbpflow.graph import Graph
from sbpflow.job import Job
from sbpflow.placement import Placement
from sbpflow.sbp import Split, format_nd

REGROW_SECONDS = 1.0  # how often a job on a fallback looks for room for its own layout
ELASTIC_GROW = "ELASTIC_GROW"  # the reason of an attempt that goes back to the job's own layout
PLACE_SECONDS = 60.0  # how long a fallback layout's placement group may take to be ready: Ray declares a
# lost node dead only after its health checks fail (~30 s), and may try the group there till then
ELASTIC_RESUME = "ELASTIC_RESUME"  # the reason of an attempt that goes on with another layout

# (device type of each rank, in rank order; seconds) -> a ready placement group, or None by then
Reserve = Callable[[tuple[Any, ...], float], Any]


class ElasticError(SbpflowError):
    """A job cannot go on after a lost worker: neither its ranks nor any fallback layout fit."""


@dataclass(frozen=True)
class Layout:
    """What an attempt runs: the compiled job, its reserved group and, when re-planned, what changed."""

    compiled: Compiled
    group: Any
    change: str = ""  # '' for the same layout; else e.g. "re-planned from 4 ranks to 2 (...)"


def world(job: Job) -> list[int]:
    """The job's ranks, sorted: every rank some placement names."""
    pls = [t.placement for t in job.graph.tensors.values()] + [o.placement for o in job.graph.ops]
    return sorted({r for pl in pls if pl is not None for r in pl.ranks})


def replace_world(job: Job, size: int) -> Job:
    """``job`` on ranks ``0 .. size-1``: every placement's first mesh axis scaled by ``size / ranks``, its
    SBP kept; an ``SbpflowError`` naming the placement or tensor that cannot be re-placed."""
    ranks = world(job)
    memo: dict[Placement, Placement] = {}

    def scaled(pl: Placement | None) -> Placement | None:
        if pl is None:
            return None
        if pl not in memo:
            memo[pl] = _scale(pl, ranks, size)
        return memo[pl]

    graph = Graph(
        {n: dataclasses.replace(t, placement=scaled(t.placement)) for n, t in job.graph.tensors.items()},
        [dataclasses.replace(o, placement=scaled(o.placement)) for o in job.graph.ops],
    )
    for t in graph.tensors.values():
        if t.sbp is None or t.placement is None or not isinstance(t.sbp[0], Split):
            continue
        dim, old = t.meta.shape[t.sbp[0].axis], job.graph.tensors[t.name].placement
        assert old is not None
        if dim % old.shape[0] == 0 and dim % t.placement.shape[0] != 0:
            raise SbpflowError(
                f"tensor {t.name!r} {t.meta} is split {format_nd(t.sbp)}: its {dim} over {old.shape[0]} ranks "
                f"does not divide over {t.placement.shape[0]}; list rank counts that divide it in "
                "JobConfig.elastic"
            )
    return dataclasses.replace(job, graph=graph)


def _scale(pl: Placement, ranks: Sequence[int], size: int) -> Placement:
    if sorted(pl.ranks) != list(ranks):
        raise SbpflowError(
            f"{pl} covers only ranks {sorted(pl.ranks)} of the job's {list(ranks)}: elastic re-planning "
            "scales placements that span every rank (data parallel, or a data parallel first mesh axis); "
            "a pipeline's stages cannot shrink (leave JobConfig.elastic empty)"
        )
    first, rest = divmod(pl.shape[0] * size, len(ranks))
    if rest or first == 0:
        raise SbpflowError(
            f"the {'x'.join(map(str, pl.shape))} mesh of {pl} cannot go on {size} ranks: only its first "
            f"(data parallel) axis of {pl.shape[0]} scales, and {size} is not a multiple of "
            f"{len(ranks) // pl.shape[0]}"
        )
    return Placement(pl.device_type, tuple(range(size)), (first, *pl.shape[1:]))


def replan(compiled: Compiled, reserve: Reserve) -> Layout | None:
    """The layout the next attempt runs: ``compiled``'s own when its ranks are held again within the
    job's grace period, else the first fallback the cluster holds (an ``ElasticError`` when none);
    None for a job without fallbacks (it waits for its ranks as ever)."""
    job = compiled.state.job
    fallbacks = [n for n in job.config.elastic if n < len(world(job))]
    if not fallbacks:
        return None
    types = compiled.device_types()
    grace = job.config.elastic_grace
    group = reserve(tuple(types[r] for r in types), grace)
    if group is not None:
        return Layout(compiled, group)
    passed: list[str] = []
    for size in fallbacks:
        t0 = time.monotonic()
        try:
            new = pipeline.compile(replace_world(job, size))
        except SbpflowError as e:
            passed.append(f"{size} ranks: {e}")
            continue
        if new.plan is None and new.lazy is None:
            passed.append(f"{size} ranks: {'; '.join(new.notes) or 'no plan was made'}")
            continue
        kinds = new.device_types()
        group = reserve(tuple(kinds[r] for r in kinds), PLACE_SECONDS)
        if group is None:
            passed.append(f"{size} ranks: the cluster cannot hold them")
            continue
        seconds = time.monotonic() - t0
        change = (
            f"its {len(types)} ranks were not back within {grace:g} s: re-planned from {len(types)} ranks "
            f"to {size} ({_placements(job)} -> {_placements(new.state.job)}, compiled and placed in {seconds:.2f} s)"
        )
        return Layout(new, group, change)
    raise ElasticError(
        f"job {job.name!r} lost a worker; its {len(types)} ranks were not back within {grace:g} s and no "
        f"fallback of JobConfig.elastic={job.config.elastic} fits: {'; '.join(passed)}; add capacity and "
        "resume the job, or list smaller rank counts"
    )


def attempt_note(
    layout: Layout | None, lost: bool, failure: Exception, attempt: LaunchContext, restarts: int, skipped: str
) -> tuple[str, str]:
    """The reason and message of the attempt after ``failure``: a restart after a lost worker (on the same
    or a fallback layout), or a planned one back onto the job's own ranks (``lost`` false)."""
    change = "" if layout is None else layout.change
    at = f"resumes from step {attempt.first_step}{skipped}"
    if not lost:
        back = "" if layout is None else f"its own ranks are back: {_placements(layout.compiled.state.job)}"
        return ELASTIC_GROW, f"{change or back}; attempt {attempt.attempt} {at}"
    limit = attempt.run.max_restarts
    return (
        ELASTIC_RESUME if change else "WORKER_LOST",
        f"{failure}; {change + '; ' if change else ''}attempt {attempt.attempt} (restart {restarts} of at "
        f"most {limit}) {at}",
    )


class Regrow:
    """While a job runs on a fallback: whether the cluster has room for its own layout again (``room()``,
    beyond what the attempt holds), looked at every :data:`REGROW_SECONDS`; ``due()`` turns true at the
    first checkpoint completed after there was room, with every loss up to it reported, and stays true
    (the attempt it stopped may write one more checkpoint before its workers hear the abort)."""

    def __init__(
        self, room: Callable[[], bool], root: str | None, tracker: StepTracker, first_step: int
    ) -> None:
        self._room, self._root, self._tracker, self._first = room, root, tracker, first_step
        self._since: int | None = None  # the latest checkpoint's step when there was room
        self._closed = threading.Event()
        self._due = False  # latched: once true, a later checkpoint whose losses are not in yet cannot undo it
        if root is not None:
            threading.Thread(target=self._look, name="sbpflow-regrow", daemon=True).start()

    def _look(self) -> None:
        while not self._closed.wait(REGROW_SECONDS):
            if self._room():
                self._since = self._checkpoint()
                return

    def _checkpoint(self) -> int:
        from sbpflow.checkpoint.read import latest

        found = latest(self._root) if self._root else None
        return 0 if found is None else found.step

    def due(self) -> bool:
        """Whether the attempt should stop now to grow (see the class)."""
        if self._due or self._since is None:
            return self._due
        step, known = self._checkpoint(), self._tracker.known()
        self._due = step > self._since and (known is None or step <= self._first + known)
        return self._due

    def close(self) -> bool:
        """Stop looking; whether the attempt was due to grow."""
        self._closed.set()
        return self.due()


def _placements(job: Job) -> str:
    """The job's placements' ranks, as the user wrote them (``[0, 1, 2, 3]``, ``[[0, 1], [2, 3]]``)."""
    seen = {t.placement for t in job.graph.tensors.values() if t.placement is not None}
    return ", ".join(sorted({str(p.grid()) for p in seen}))


def restart_point(
    first: LaunchContext, failed: LaunchContext, tracker: StepTracker
) -> tuple[LaunchContext, str]:
    """The options of the attempt after ``failed``: from the latest intact checkpoint of the run's
    directory (or from where the run started when none was written), its steps forgotten by the
    tracker; and a note naming the corrupt checkpoints passed over ('' if none).

    A checkpoint later than the last step whose loss reached the tracker is passed over too (the
    reports of the steps before it died with a worker): the attempt trains those steps again, so the
    run's losses stay complete and equal to an uninterrupted run's."""
    from sbpflow.checkpoint.read import corrupt_note, latest_intact, list_checkpoints

    corrupt: list[Any] = []
    known = tracker.known()
    at_most = None if known is None else first.first_step + known
    root = first.checkpoint_dir
    last = latest_intact(root, corrupt.append, at_most) if root else None
    end = failed.first_step + failed.steps
    if last is not None and first.first_step < last.step < end:
        at, resume = last.step, str(last.path)
    else:
        at, resume = first.first_step, first.resume_from
    tracker.rewind(at - first.first_step)
    skipped = "".join(f"; {corrupt_note(c, at)}" for c in corrupt)
    later = (
        [c.path.name for c in list_checkpoints(root) if at_most is not None and c.step > at_most]
        if root
        else []
    )
    if later:
        skipped += (
            f"; {', '.join(later)} passed over: the losses of the steps after {at_most} never reached the "
            f"control plane (their reports went with the worker), so steps {at + 1}-{at_most} train again"
        )
    new = dataclasses.replace(
        failed, attempt=failed.attempt + 1, first_step=at, steps=end - at, resume_from=resume
    )
    return new, skipped
