"""Evaluation during training: every ``config.eval_every`` steps, the mean loss over
``config.eval_batches`` batches of the job's held-out split (``Job.eval_data``), run by the job's own
workers on their live parameters.

The control plane only compiles: the eval job (:func:`eval_job`: the job's forward on the held-out split,
every dropout off, no optimizer) with every variable placed and split as the training plan has it
(:meth:`HeldOut.compiled`), lowered per rank and shipped beside the training plan. Each rank trains to a
multiple of ``eval_every``, runs the eval plan on the parameter shards it holds, and goes on
(:mod:`sbpflow.actor_workers.execution.segments`); the ranks that hold the eval loss report their share of
each batch's loss in an ``EvalReport``, through the same report path as the step losses. :class:`HeldOut`
assembles them (as the step tracker assembles a step's loss), and each result goes to ``on_eval(step,
loss)`` (the job manager records it: status and metrics) and into ``RunResult.evals``. No forward pass
runs in the control plane, and no checkpoint is written or read for an evaluation.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable

import numpy as np

from sbpflow.actor_workers.execution.segments import Evaluation
from sbpflow.actor_workers.execution.variables import VARIABLE_KINDS
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.launch.share_assembly import ShareAssembly, ShareLayout
from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.sbp import format_nd
from sbpflow.v1 import plan_pb2 as pp

EvalListener = Callable[[int, float], None]  # (step, held-out loss)


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


def evaluates(job: Job) -> bool:
    """Whether ``job`` evaluates on a held-out split during training."""
    return bool(job.config.eval_every) and job.eval_data is not None and bool(job.loss)


def compile_eval(trained: Compiled) -> Compiled:
    """The eval job of ``trained``'s job, compiled with every variable it shares with training placed and
    split as ``trained`` stores it (a rank's eval plan reads that rank's training shards as they are)."""
    job = trained.state.job
    ev = eval_job(job)
    stored = trained.state.graph.tensors
    pinned = {
        name: dataclasses.replace(decl, placement=stored[name].placement, sbp=stored[name].sbp)
        for name, decl in ev.graph.tensors.items()
        if decl.kind in VARIABLE_KINDS and name in stored
    }
    ev = dataclasses.replace(ev, graph=dataclasses.replace(ev.graph, tensors={**ev.graph.tensors, **pinned}))
    out = pipeline.compile(ev, job_id=f"{trained.job_id}-eval" if trained.job_id else "")
    for name, decl in out.state.graph.tensors.items():
        have = stored.get(name)
        if (
            decl.kind in VARIABLE_KINDS
            and have is not None
            and (have.placement, have.sbp) != (decl.placement, decl.sbp)
        ):
            raise SbpflowError(
                f"job {job.name!r}: its eval job stores {name!r} as {format_nd(decl.sbp or ())} on "
                f"{decl.placement} but training stores it as {format_nd(have.sbp or ())} on {have.placement}; "
                "annotate the parameter's placement and SBP so both agree, or set eval_every=0"
            )
    skipped = [n for n in out.notes if "lowering skipped" in n]
    if (out.plan is None and out.lazy is None) or skipped:
        raise SbpflowError(f"job {job.name!r}: its eval job cannot run: " + "; ".join(skipped or out.notes))
    return out


class HeldOut:
    """The evaluations of one run as the control plane sees them: the eval plans it ships (compiled once
    per training layout) and the held-out losses the ranks report, assembled; thread-safe."""

    def __init__(self, job: Job, on_eval: EvalListener | None) -> None:
        self.every, self.batches = job.config.eval_every, job.config.eval_batches
        self._on_eval = on_eval
        self.results: list[tuple[int, float]] = []
        self._lock = threading.Lock()
        self._compiled: tuple[Compiled, Compiled] | None = None  # (training, its eval job)
        self._layout: ShareLayout | None = None
        self._pending: dict[int, list[ShareAssembly]] = {}  # step -> its batches' shares so far

    def compiled(self, trained: Compiled) -> Compiled:
        """The eval job of ``trained`` (compiled once; an elastic re-plan's new layout compiles again)."""
        with self._lock:
            if self._compiled is None or self._compiled[0] is not trained:
                ev = compile_eval(trained)
                self._compiled, self._pending = (trained, ev), {}
                self._layout = ShareLayout(ev.state.graph.tensors[ev.state.job.loss])
            return self._compiled[1]

    def evaluation(self, trained: Compiled) -> Evaluation:
        """Every rank's eval plan and when it runs (the in-process backend's ranks share one)."""
        ev = self.compiled(trained)
        plan = ev.plan if ev.plan is not None else whole_plan(ev)
        return Evaluation(plan, self.every, self.batches)

    def rank_evaluations(self, trained: Compiled, ranks: Iterable[int]) -> dict[int, Evaluation]:
        """Each rank's own eval plan (its DevicePlan and communicators), as a worker gets it."""
        ev = self.compiled(trained)
        return {
            r: Evaluation(pp.Plan.FromString(data), self.every, self.batches)
            for r, data in ev.rank_plans(list(ranks))
        }

    def add(self, rank: int, step: int, shares: Iterable[float]) -> None:
        """Rank ``rank``'s share of each batch's held-out loss after job step ``step``; once every rank of
        the eval loss has reported, the mean goes to ``on_eval`` (a step evaluated already is not again:
        a restarted attempt may repeat it)."""
        with self._lock:
            if self._layout is None or any(s == step for s, _ in self.results):
                return
            batches = self._pending.setdefault(
                step, [ShareAssembly(self._layout) for _ in range(self.batches)]
            )
            for b, share in zip(batches, shares, strict=True):
                b.add(rank, np.asarray(share))
            if not all(b.complete for b in batches):
                return
            del self._pending[step]
            losses = [float(b.value()) for b in batches]
            loss = sum(losses) / len(losses)
            self.results.append((step, loss))
        if self._on_eval is not None:
            self._on_eval(step, loss)


def whole_plan(compiled: Compiled) -> pp.Plan:
    """Every rank's tasks in one Plan: the whole header (a rank plan has only its own tensors) and every
    rank plan's DevicePlan and communicators, of a job lowered on demand."""
    plan, seen = compiled.header(), set[str]()
    for _, data in compiled.rank_plans(list(compiled.device_types())):
        one = pp.Plan.FromString(data)
        plan.devices.extend(one.devices)
        plan.communicators.extend(c for c in one.communicators if c.id not in seen)
        seen.update(c.id for c in one.communicators)
    return plan
