"""The graph-rewriting passes: those that change *what* is computed, before any pass decides *where*.

    autodiff -> optimizer -> mixed_precision -> running_stats -> zero -> recompute

They are deterministic, so a job run through them twice gets the same op and tensor names: SBP
inference and micro-batching run the one-micro-batch job through them (:func:`rewritten`) to see the
same graph cut to a micro-batch.
"""

from __future__ import annotations

from sbpflow.control_plane.compiler.passes import (
    autodiff,
    mixed_precision,
    optimizer,
    recompute,
    running_stats,
    zero,
)
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.job import Job

REWRITES = (autodiff, optimizer, mixed_precision, running_stats, zero, recompute)


def rewritten(job: Job) -> CompileState:
    """``job`` through :data:`REWRITES`."""
    state = CompileState.start(job)
    for p in REWRITES:
        p.run(state)
    return state
