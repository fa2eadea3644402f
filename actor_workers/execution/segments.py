"""A run in segments, a held-out evaluation between two: OneFlow's evaluation, another plan on the same
actors' ranks, reading the live parameters.

With ``config.eval_every`` the control plane lowers the eval job (the job's forward on its held-out split,
dropout off, no optimizer; every variable placed and split as in training) for each rank beside its
training plan (:class:`Evaluation`). A rank then trains up to the next step that is a multiple of
``every``, stops there (every act of the segment done, so no collective of training is in flight), runs
``batches`` steps of the eval plan on the same transport, and trains on. The eval plan reads this rank's
shards of the parameters from the training store as they are (no checkpoint, no copy; a variable the
eval plan assigns, a running statistic, gets a copy), and each rank that holds the eval loss hands its
share of every batch's loss to ``on_eval``. Every rank runs the same segments in the same order, so the
collectives of the eval plan meet on every member after those of training.

The training segments are rebuilt on the ranks' own contexts (:func:`.executor.rebuild`): the store, the
step and fetch hooks (step reports, checkpoints) and the fetched values carry over, and every act sees
the global step as before, so the training losses are those of one unbroken run, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sbpflow.actor_workers.execution import executor, plan_tables
from sbpflow.actor_workers.execution.executor import Program, RankProgram
from sbpflow.actor_workers.execution.variables import StoreSource
from sbpflow.actor_workers.runtime.engine import RunResult
from sbpflow.codec import wire
from sbpflow.device import asnumpy
from sbpflow.graph import TensorDecl
from sbpflow.v1 import plan_pb2 as pp

EvalDone = Callable[[int, int, list[float]], None]  # (rank, job step, this rank's loss share per batch)
RunEngines = Callable[[Sequence[RankProgram]], dict[int, RunResult]]  # run ranks' programs to the end


@dataclass(frozen=True)
class Evaluation:
    """The eval plan of these ranks (a worker's own part, or every rank's) and when it runs: after every
    job step that is a multiple of ``every``, ``batches`` batches of the held-out split."""

    plan: pp.Plan
    every: int
    batches: int

    def __post_init__(self) -> None:
        if self.every < 1 or self.batches < 1:
            raise ValueError(
                f"an evaluation every {self.every} steps over {self.batches} batches: give both >= 1"
            )


def segments(first_step: int, steps: int, evaluation: Evaluation | None) -> list[tuple[int, int, bool]]:
    """The run's segments as (first job step, steps, whether an evaluation follows): ``steps`` steps from
    ``first_step``, cut after every multiple of ``evaluation.every``."""
    end = first_step + steps
    every = evaluation.every if evaluation is not None else 0
    cuts = [s for s in range(first_step + 1, end + 1) if every and s % every == 0]
    bounds = sorted({*cuts, end})
    starts = [first_step, *bounds[:-1]]
    return [(a, b - a, b in cuts) for a, b in zip(starts, bounds, strict=True)]


class Clock:
    """A run's timeout shared by its segments: the whole of it for the first, what is left for each later."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._deadline: float | None = None

    def __call__(self) -> float:
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.timeout
            return self.timeout
        return max(self._deadline - now, 0.0)


def first_steps(first_step: int, steps: int, evaluation: Evaluation | None) -> int:
    """How many steps the program is first built for (its first segment)."""
    return segments(first_step, steps, evaluation)[0][1]


def run(
    program: Program,
    plan: pp.Plan,
    steps: int,
    first_step: int,
    evaluation: Evaluation | None,
    run_engines: RunEngines,
    on_eval: EvalDone,
    data_roots: tuple[str, ...] | None = None,
) -> dict[int, RunResult]:
    """Run ``program`` (built for its first segment, :func:`first_steps`) through ``steps`` steps of
    ``plan`` from ``first_step``, evaluating between segments; per rank, the segments' results as one."""
    results: list[dict[int, RunResult]] = []
    for i, (start, length, evaluate) in enumerate(segments(first_step, steps, evaluation)):
        if i:
            executor.rebuild(program, plan, length, start)
        results.append(run_engines(list(program.ranks.values())))
        if evaluate:
            assert evaluation is not None
            held_out = eval_program(evaluation, program, data_roots)
            run_engines(list(held_out.ranks.values()))
            for rank, share in loss_shares(held_out, evaluation.batches).items():
                on_eval(rank, start + length, share)
    return {rank: _joined([r[rank] for r in results]) for rank in results[0]}


def eval_program(evaluation: Evaluation, program: Program, data_roots: tuple[str, ...] | None) -> Program:
    """The eval plan's program on the ranks ``program`` runs, its variables the training store's shards."""
    out = Program(plan_tables.of(evaluation.plan, data_roots))
    for device in evaluation.plan.devices:
        trained = program.ranks.get(device.rank)
        if trained is not None:
            rc = trained.context
            source = _live(rc.store, rc.xp, _assigned(device))
            one = executor.build(
                evaluation.plan,
                evaluation.batches,
                {rc.rank: rc.transport},
                rc.xp,
                ranks=(rc.rank,),
                source=source,
                data_roots=data_roots,
            )
            out.ranks.update(one.ranks)
    return out


def _assigned(device: pp.DevicePlan) -> frozenset[str]:
    """The variables a rank's plan assigns."""
    sinks = [t for t in device.tasks if t.kind == pp.TASK_KIND_SINK and "assign" in t.attrs]
    return frozenset(str(wire.attr_from_proto(t.attrs["assign"])) for t in sinks)


def _live(store: Any, xp: Any, assigned: frozenset[str]) -> StoreSource:
    """The training store's shard of each variable, as it is; a copy of one the eval plan assigns."""

    def source(decl: TensorDecl, index: Any) -> Any:
        if decl.name not in store:
            return None  # not a variable of training: its initializer
        return xp.array(store[decl.name], copy=True) if decl.name in assigned else store[decl.name]

    return source


def loss_shares(held_out: Program, batches: int) -> dict[int, list[float]]:
    """Per rank that holds the eval loss, its share of each batch's loss."""
    name = held_out.loss
    out = {}
    for rank, rp in held_out.ranks.items():
        fetched = rp.context.fetched.get((name, -1))
        if fetched:
            out[rank] = [float(asnumpy(fetched[b]).reshape(-1)[0]) for b in range(batches)]
    return out


def _joined(parts: list[RunResult]) -> RunResult:
    """One rank's segments as one run: acts and seconds added, traces one after another."""
    last = parts[-1]
    return RunResult(
        trace=[e for p in parts for e in p.trace],
        last=last.last,
        peak_live={k: max(p.peak_live.get(k, 0) for p in parts) for k in last.peak_live},
        acts=sum(p.acts for p in parts),
        seconds=sum(p.seconds for p in parts),
        rank=last.rank,
    )
