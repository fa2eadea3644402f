"""The plan of a stored job for the status pages: compiled once on first view, its summary and picture kept.

A job's plan does not change after Submit, so the few most recently viewed are kept (``PlanCache``);
compiling again from the stored Job gives the plan the run used (the compiler is deterministic). A
job that no longer compiles (an older format, an op since removed) shows why instead of a picture.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from sbpflow.control_plane.compiler.pipeline import compile
from sbpflow.control_plane.render import graph_page, plan_picture
from sbpflow.job import Job

KEEP = 8  # plans kept


@dataclass(frozen=True)
class PlanView:
    summary: str  # Compiled.summary(), or why there is no plan
    picture: str  # the block picture (plan_picture.picture), "" without a plan
    page: str  # the whole plan page (graph_page.html_page), "" without a plan


class PlanCache:
    """``get(job_id, job)``: the job's PlanView, compiled on first call (thread-safe, LRU of ``size``)."""

    def __init__(self, size: int = KEEP) -> None:
        self._size = size
        self._views: OrderedDict[str, PlanView] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, job_id: str, job: Job | None) -> PlanView:
        with self._lock:
            if job_id in self._views:
                self._views.move_to_end(job_id)
                return self._views[job_id]
        view = _view(job)
        with self._lock:
            self._views[job_id] = view
            while len(self._views) > self._size:
                self._views.popitem(last=False)
        return view


def _view(job: Job | None) -> PlanView:
    if job is None:
        return PlanView("no plan: the stored job does not decode with this version of sbpflow", "", "")
    try:
        c = compile(job)
    except Exception as e:  # noqa: BLE001 - a page says why, it never fails for it
        return PlanView(f"no plan: the job does not compile now: {type(e).__name__}: {e}", "", "")
    return PlanView(
        c.summary(), plan_picture.picture(c.state), graph_page.html_page(c.state, c.memory, c.notes)
    )
