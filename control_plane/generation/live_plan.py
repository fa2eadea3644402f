"""A forward plan compiled once and kept running: its actors stay up between calls.

    with LivePlan(job, init_from=path) as plan:
        logits = plan({"tokens": ids})      # one step of the plan: the job's inputs in, its fetch out
        logits = plan({"tokens": more})     # the same actors, the next step; no new job, no recompile

``sf.run`` builds a rank's actors for a fixed number of steps, each step's batch read from the job's data
source, and tears them down at the end. A live plan builds them once for :data:`CAPACITY` steps over an
in-process world (every rank a thread set of this process, TP included) and swaps each rank's data source
for a :class:`Feed`: the data loads of step ``s`` wait until a call hands in batch ``s``, and the call
waits for the fetch SINKs of step ``s``. So a step costs the plan's acts only, and the variables the plan
keeps (an assigned variable: a ``running_stat``'s, e.g. a KV cache) carry over from call to call.

The job must be forward-only (no loss, no optimizer) with one fetch: what ``build`` returned.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import numpy as np

from sbpflow.actor_workers import snapshots
from sbpflow.actor_workers.execution import executor
from sbpflow.actor_workers.runtime import heap, threads
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.actor_workers.runtime.errors import RuntimeFailure
from sbpflow.actor_workers.runtime.group import EngineGroup
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.control_plane.launch.launcher import compile_for_run
from sbpflow.control_plane.launch.start_values import start_file
from sbpflow.errors import SbpflowError
from sbpflow.graph import TensorKind
from sbpflow.job import Job
from sbpflow.sharding import assemble_value

CAPACITY = 1 << 40  # steps the actors are built for: a live plan ends when closed, never by count
ORDERED = (*executor.ORDERED_STREAMS, "data")
IDLE = 24 * 3600.0  # seconds the engines wait, idle between calls, before they time out


class LivePlanError(SbpflowError):
    """A live plan that cannot be made or cannot take a call (the message says why and what to do)."""


class Feed:
    """The data source of a live plan: batch ``s`` is what the caller handed in for step ``s``; a read
    waits for it (every rank's loads of a step read one batch). Closing wakes every waiting read."""

    def __init__(self, fields: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        self.fields = dict(fields)  # name -> (batch shape, dtype), as the plan was traced
        self._cond = threading.Condition()
        self._batches: dict[int, dict[str, np.ndarray]] = {}
        self._closed = False

    def put(self, step: int, batch: Mapping[str, Any]) -> None:
        values = {}
        for name, (shape, dtype) in self.fields.items():
            if name not in batch:
                raise LivePlanError(f"the batch has no field {name!r}; the plan reads {sorted(self.fields)}")
            value = np.asarray(batch[name])
            if value.shape != shape or value.dtype != dtype:
                raise LivePlanError(
                    f"field {name!r} is {list(value.shape)} {value.dtype}; the plan was compiled for "
                    f"{list(shape)} {dtype}: pad the batch to that shape (or trace another plan)"
                )
            values[name] = np.array(value, order="C")  # a copy: the caller may reuse its array
        with self._cond:
            self._batches[step] = values
            for done in [s for s in self._batches if s < step - 2]:  # every rank has read them
                del self._batches[done]
            self._cond.notify_all()

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        with self._cond:
            while batch not in self._batches:
                if self._closed:
                    raise LivePlanError("the live plan was closed")
                self._cond.wait()
            return {k: v[rows] for k, v in self._batches[batch].items()}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class LivePlan:
    """``job`` (forward only, one fetch) compiled once and run step by step on call (module docstring).
    ``init_from``: a parameters file or checkpoint (default: the values of the job's traced modules);
    ``strict=False``: the file may lack parameters (plan state such as a KV cache: their initializers);
    ``threads_``: BLAS threads while it lives (None: as they are)."""

    def __init__(
        self, job: Job, init_from: str | None = None, threads_: int | None = None, strict: bool = True
    ) -> None:
        if job.loss or job.optimizer is not None:
            raise LivePlanError(
                f"job {job.name!r} trains (a loss or an optimizer); a live plan runs a forward-only job: "
                "trace the model's forward with no loss"
            )
        if len(job.fetches) != 1 or job.data is None:
            raise LivePlanError(
                f"job {job.name!r} fetches {list(job.fetches)} from data {type(job.data).__name__}; a live "
                "plan returns one tensor (what build() returned) from the job's inputs"
            )
        self.output = job.fetches[0]
        compiled = compile_for_run(job)
        if compiled.plan is None:
            raise LivePlanError(
                f"job {job.name!r} is lowered on demand (a big plan); a live plan needs it whole"
            )
        plan = compiled.plan
        inputs = job.graph.of_kind(TensorKind.input)
        self.feed = Feed({t.name: (t.meta.shape, t.meta.dtype.to_numpy()) for t in inputs})
        self._stack = ExitStack()
        init = self._stack.enter_context(start_file(job, init_from, None, strict))
        ranks = [d.rank for d in plan.devices]
        world = self._stack.enter_context(InProcessWorld(ranks, timeout=IDLE))
        self._world = world
        self.program = executor.build(
            plan,
            CAPACITY,
            {r: world.transport(r) for r in ranks},
            source=snapshots.source_for(None, init),
        )
        self._cond = threading.Condition()
        self._got: dict[int, dict[int, Any]] = {}  # step -> rank -> its shard of the output
        self._holders = self.program.tensors[self.output].placement.ranks  # type: ignore[union-attr]
        for rp in self.program.ranks.values():
            rp.context.tables = dataclasses.replace(rp.context.tables, data=self.feed)  # type: ignore[arg-type]
            rp.context.fetch_hooks.append(self._fetched(rp.rank, rp.context.fetched))
        self._step = 0
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._threads = threads_
        self._runner = threading.Thread(target=self._run, name="sbpflow-live-plan", daemon=True)
        self._runner.start()

    def __call__(self, batch: Mapping[str, Any], timeout: float = 600.0) -> Any:
        """The logical value of the job's fetch at the next step, the job's inputs given by ``batch``."""
        step = self._step
        if self._failure is not None or self._stop.is_set():
            raise LivePlanError("the live plan has stopped") from self._failure
        self.feed.put(step, batch)
        self._step += 1
        with self._cond:
            while len(self._got.get(step, ())) < len(self._holders):
                if self._failure is not None:
                    raise LivePlanError(f"the live plan failed at step {step}") from self._failure
                if not self._cond.wait(timeout):
                    raise LivePlanError(f"step {step} of the live plan gave nothing in {timeout}s")
            shards = self._got.pop(step)
        return assemble_value(self.program.tensors[self.output], shards)

    def _fetched(self, rank: int, record: dict[tuple[str, int], dict[int, Any]]) -> Any:
        def hook(name: str, micro_batch: int, step: int, value: Any) -> None:
            record.get((name, micro_batch), {}).pop(step, None)  # the plan holds no step's value after it
            if name != self.output:
                return
            with self._cond:
                self._got.setdefault(step, {})[rank] = value
                self._cond.notify_all()

        return hook

    def _run(self) -> None:
        try:
            with threads.limited(self._threads):
                hooks = [self._world.abort, self._close_feed]  # a load waiting for a batch wakes
                # the data stream ordered as the communication one: every load of step s before any of
                # s + 1, which waits in its read for the next call (the first input's would run ahead
                # and starve the others' loads of step s on the stream's one thread)
                engines = [
                    Engine(rp.actors, rp.registers, rank=r, ordered_streams=ORDERED, busy=rp.context.busy)
                    for r, rp in sorted(self.program.ranks.items())
                ]
                with heap.frozen():
                    EngineGroup(engines, hooks).run(IDLE, self._stop)
        except RuntimeFailure as failure:
            if not self._stop.is_set():
                self._failure = failure
        except BaseException as e:  # noqa: BLE001 - handed to the caller's next call
            self._failure = e
        finally:
            self.feed.close()
            with self._cond:
                self._failure = self._failure or LivePlanError("the live plan ended")
                self._cond.notify_all()

    def _close_feed(self, reason: str) -> None:
        self.feed.close()

    def close(self) -> None:
        """Stop the actors (every rank) and free what the plan held."""
        self._stop.set()
        self.feed.close()
        self._runner.join()
        self._stack.close()

    def __enter__(self) -> LivePlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
