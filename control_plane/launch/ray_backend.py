"""The scheduler: a compiled plan onto Ray worker processes, one per device, and back.

``run_on_ray`` is the ``"ray"`` backend of ``sf.run``. For one attempt of a job it

1. makes sure Ray is up: the cluster at ``ray_address``, or a local Ray started on demand with a CPU
   per rank (at least the machine's cores) and kept for later runs of this process;
2. reserves a placement group with one bundle per rank (``{"CPU": 1}`` for cpu devices, ``{"GPU": 1}``
   for cuda), ``PACK``: packed on as few hosts as fit, spread over more when one cannot hold them;
3. starts a :class:`~sbpflow.actor_workers.worker.Worker` actor per rank in its bundle; gathers every
   rank's data-plane endpoint and hands the full list, the world's ranks and the rank's own part of the
   plan (``Compiled.rank_plans``: its DevicePlan, its communicators, the job) to every worker
   (connections are set up through the control plane: no worker needs to know where another runs in
   advance). A job lowered on demand is lowered here, a batch of ranks per walk, never whole;
4. runs them, watching three things at once: the outcomes as workers finish, a worker process that
   dies (its Ray actor errors out), and the cancel event. The first failure aborts every other worker
   and is raised as a RuntimeFailure naming the rank (and, for a dead worker, its pid and host);
5. assembles the losses (and, on request, the parameters) from the ranks' shares;
6. always tears down: every worker actor killed, the placement group removed; or, with a warm pool
   installed (:mod:`.worker_pool`), a clean attempt's group kept for the next job of its shape.

Workers report progress in ``WorkerReport`` protobufs to a WorkerService (:mod:`.reports`): the control
plane's own when it passes its hub, otherwise a hub served on a loopback port for this run. Each
attempt's workers get that attempt's credential from the hub (``hub.listen``), never the client token.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from sbpflow.actor_workers.runtime.errors import RuntimeAborted, RuntimeFailure, RuntimeTimeout
from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.launch.elastic import Regrow, attempt_note, replan, restart_point
from sbpflow.control_plane.launch.ray_cluster import (  # noqa: F401 - where callers import them from
    BUNDLES,
    DEVICE_TYPES,
    SchedulingError,
    ensure_ray,
    quiet_ray,
    reserve,
    room_for,
)
from sbpflow.control_plane.launch.report_hub import ReportHub
from sbpflow.control_plane.launch.run_context import (
    LaunchContext,
    RunResult,
    assemble_outputs,
    loss_scaling_fields,
    output_names,
)
from sbpflow.control_plane.launch.step_tracker import StepTracker
from sbpflow.control_plane.launch.worker_failures import WorkerError, WorkerLost, echoes, failure_of, primary
from sbpflow.control_plane.launch.worker_pool import WarmGroup, destroy, installed, resources_of
from sbpflow.ops.training.loss_scaling import VARIABLES
from sbpflow.runs.states import JobState
from sbpflow.sharding import assemble_value
from sbpflow.v1 import job_pb2 as jp
from sbpflow.v1 import plan_pb2 as pp
from sbpflow.v1 import service_pb2 as sp

SETUP_SECONDS = 120.0  # placement group, actor start-up and connections
SETTLE_SECONDS = 1.0  # after a first failure, how long to wait for the worker that caused it to show
PING_SECONDS = 10.0  # then a worker still running that does not answer a ping within this is lost


def run_on_ray(compiled: Compiled, options: LaunchContext, tracker: StepTracker) -> RunResult:
    types = compiled.device_types()  # rank -> DeviceType, without lowering a lazy plan
    ranks = list(types)
    ensure_ray(options.run.ray_address, len(ranks))
    hub = options.report_hub
    own_hub = hub is None
    if hub is None:
        hub = ReportHub()
        hub.serve()

    def on_report(r: sp.WorkerReport) -> None:
        if r.WhichOneof("payload") == "step" and r.step.losses:
            at = r.time.ToNanoseconds() / 1e9 if r.HasField("time") else None  # when the rank ended it
            scaling = (
                (r.step.loss_scale, int(r.step.skipped_steps)) if r.step.HasField("loss_scale") else None
            )
            tracker.add(int(r.rank), int(r.step.step) - 1 - options.first_step, r.step.loss, at, scaling)
        if r.WhichOneof("payload") == "eval" and options.held_out is not None:
            options.held_out.add(int(r.rank), int(r.eval.step), r.eval.losses)
        if options.on_report is not None:
            options.on_report(r)

    job_id = options.job_id or f"run-{os.getpid()}-{time.monotonic_ns()}"
    own, current, restarts, group, regrow = compiled, options, 0, None, None
    try:
        while True:
            try:
                with hub.listen(job_id, current.attempt, on_report, ranks) as credential:
                    stop: Callable[[], bool] | None = None if regrow is None else regrow.due
                    attempt = _Attempt(types, job_id, current, hub.address, credential, stop)
                    try:
                        attempt.start(compiled, _start(compiled, current), group)
                        current.state(JobState.RUNNING)
                        tracker.restart_clock()
                        outcomes = attempt.wait()
                        result = _result(compiled, current, attempt, outcomes)
                        tracker.settle(result.losses, current.first_step - options.first_step)
                        attempt.clean = True  # its workers may go back to a warm pool
                    finally:
                        group = None
                        attempt.teardown()
            except RuntimeFailure as failure:
                grow = regrow is not None and regrow.close()  # stopped at a checkpoint: room to grow
                lost = isinstance(failure.cause, WorkerLost) and restarts < options.run.max_restarts
                if not grow and not lost:
                    raise
                current, skipped = restart_point(options, current, tracker)
                restarts += not grow
                layout = replan(
                    own if grow else compiled, partial(reserve, f"sbpflow-{job_id}-a{current.attempt}")
                )
                if layout is not None:  # a job with fallback layouts: the one reserved for this attempt
                    compiled, group = layout.compiled, layout.group
                    types, ranks = compiled.device_types(), list(compiled.device_types())
                    tracker.relayout(compiled.state.graph.tensors.get(compiled.state.job.loss))
                room = partial(room_for, own, compiled)  # on a fallback: room for the job's own ranks?
                shrunk = compiled is not own
                regrow = Regrow(room, options.checkpoint_dir, tracker, options.first_step) if shrunk else None
                note = attempt_note(layout, not grow, failure, current, restarts, skipped)
                current.new_attempt(*note, slots=len(ranks))
                continue
            done = current.first_step - options.first_step  # steps earlier attempts trained
            prefix = (tracker.losses[:done] + [float("nan")] * done)[:done]
            attempts = current.attempt - options.attempt + 1
            return dataclasses.replace(
                result, losses=prefix + result.losses, first_step=options.first_step, attempts=attempts
            )
    finally:
        if regrow is not None:
            regrow.close()  # stop looking
        if own_hub:
            hub.stop()


def _start(compiled: Compiled, options: LaunchContext) -> Any:
    """What every worker of this attempt starts from and where it checkpoints."""
    from sbpflow.actor_workers import snapshots as checkpointing

    ranks = pp.Plan(devices=[pp.DevicePlan(rank=r) for r in compiled.device_types()])  # all it reads
    return checkpointing.Start(
        options.first_step,
        options.resume_from,
        options.init_from if options.resume_from is None else None,
        checkpointing.options_for(compiled.state.job, options.checkpoint_dir, ranks, options.attempt),
    )


class _Attempt:
    """The workers of one attempt and their placement group."""

    def __init__(
        self,
        types: dict[int, jp.DeviceType.ValueType],
        job_id: str,
        options: LaunchContext,
        address: str,
        credential: str,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.ranks = list(types)
        self.stop = stop  # true: end the attempt now (Regrow: the job's own ranks are back)
        self.types = dict(types)
        self.options = options
        self.job_id = job_id
        self.address = address
        self.credential = credential  # minted by the hub for this job attempt; workers report with it
        self.workers: dict[int, Any] = {}
        self.info: dict[int, dict[str, Any]] = {}
        self.group: WarmGroup | None = None  # the placement group and workers, warm or new
        self.warm = False  # the group came from the warm pool (worker_pool.py)
        self.clean = False  # the attempt ran to the end: its group may go back to the pool
        self.uids: Any = None
        unknown = set(types.values()) - set(BUNDLES)
        if unknown:
            raise SchedulingError(f"device types {sorted(unknown)} have no Ray resources; use cpu or cuda")

    def start(self, compiled: Compiled, start: Any = None, group: WarmGroup | None = None) -> None:
        """Start a worker per rank and set each up with its plan: in ``group`` (a placement group reserved
        for this attempt, :mod:`.elastic`), else in a warm or new one (:meth:`_place`)."""
        import ray

        self.options.state(JobState.STARTING)
        if group is not None:
            self.group = group
            group.workers = [self._spawn(group.pg, i) for i in range(len(self.ranks))]
        else:
            self.group = self._place()
        self.workers = dict(zip(self.ranks, self.group.workers, strict=True))
        # each worker's own node address and id (a worker on another node listens there)
        self.info = self._get("start", {r: w.info.remote() for r, w in self.workers.items()})
        endpoints = list(
            self._get("start", {r: w.endpoint.remote() for r, w in self.workers.items()}).values()
        )
        if jp.DEVICE_TYPE_CUDA in self.types.values():  # NCCL ids: get-or-create for this attempt
            from sbpflow.actor_workers.planes import UidStore

            self.uids = ray.remote(UidStore).options(num_cpus=0).remote()
        args = (self.options.steps, endpoints, SETUP_SECONDS, self.options.run.trace, self.uids, start)
        held_out = self.options.held_out  # each rank's eval plan beside its training plan
        evals = held_out.rank_evaluations(compiled, self.ranks) if held_out is not None else {}
        setups = {  # each worker its own rank's plan; a lazy plan is lowered a batch at a time
            r: self.workers[r].setup.remote(
                data, *args, ranks=self.ranks, data_roots=self.options.run.data_roots, evaluation=evals.get(r)
            )
            for r, data in compiled.rank_plans(self.ranks)
        }
        self._get("set up", setups)

    def _place(self) -> WarmGroup:
        """A warm group of this attempt's shape from the pool, its workers assigned to this attempt, or
        a new placement group with a new worker per rank (room made first by dropping idle groups)."""
        import ray

        key = tuple(self.types[r] for r in self.ranks)
        bundles = [BUNDLES[t].resources for t in key]
        pool = installed()
        if pool is not None:
            group = pool.acquire(key, lambda g, i: self._spawn(g.pg, i))
            if group is not None:
                self.warm = True
                self.group = group  # torn down by teardown should assigning fail
                who = (self.job_id, self.options.attempt)
                self._get("start", {r: w.assign.remote(*who, r, self.address, self.credential)
                                    for r, w in zip(self.ranks, group.workers, strict=True)})  # fmt: skip
                return group
            pool.make_room(resources_of(bundles), ray.available_resources)
        name = f"sbpflow-{self.job_id}-a{self.options.attempt}"
        self.group = reserve(name, key, SETUP_SECONDS)
        if self.group is None:
            have = ray.cluster_resources()
            raise SchedulingError(
                f"the cluster cannot hold {len(bundles)} workers ({resources_of(bundles)}) within {SETUP_SECONDS:.0f} s; "
                f"it has { ({k: v for k, v in have.items() if k in ('CPU', 'GPU')}) }; use fewer ranks or a bigger cluster"
            )
        self.group.workers = [self._spawn(self.group.pg, i) for i in range(len(self.ranks))]
        return self.group

    def _spawn(self, pg: Any, index: int) -> Any:
        """A worker actor for bundle ``index`` of ``pg``: the rank at that index, of this attempt."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from sbpflow.actor_workers.worker import remote_class

        rank = self.ranks[index]
        return (
            remote_class()
            .options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
                name=f"sbpflow-{self.job_id}-a{self.options.attempt}-r{rank}",
                **BUNDLES[self.types[rank]].actor_options,
            )
            .remote(
                self.job_id,
                self.options.attempt,
                rank,
                self.address,
                self.credential,
                device_type=DEVICE_TYPES[self.types[rank]],
            )
        )

    def _get(self, what: str, refs: dict[int, Any]) -> dict[int, Any]:
        """Every rank's result of a set-up call; a worker that fails or dies there becomes a RuntimeFailure
        naming its rank, one that does not answer in time a SchedulingError."""
        import ray

        out: dict[int, Any] = {}
        deadline = time.monotonic() + SETUP_SECONDS
        for rank, ref in refs.items():
            try:
                out[rank] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise SchedulingError(
                    f"the worker of rank {rank} did not {what} within {SETUP_SECONDS:.0f} s; is the cluster overloaded?"
                ) from None
            except ray.exceptions.RayActorError as exc:
                raise self._lost(rank, exc) from exc
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                raise RuntimeFailure(
                    rank,
                    None,
                    None,
                    WorkerError(f"{what} failed: {type(cause).__name__}: {cause}", type(cause).__name__),
                ) from exc
        return out

    def wait(self) -> dict[int, Any]:
        """Every rank's outcome; the first failure (a failed act, a dead worker, a cancel, the timeout)
        aborts the others and is raised."""
        import ray

        refs = {w.run.remote(self.options.run.timeout): rank for rank, w in self.workers.items()}
        outcomes: dict[int, Any] = {}
        failures: list[RuntimeFailure] = []
        deadline = time.monotonic() + self.options.run.timeout
        settle_until: float | None = None
        cancel = self.options.cancel
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.05)
            for ref in done:
                rank = refs.pop(ref)
                try:
                    outcome = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    failures.append(self._lost(rank, exc))
                    continue
                outcomes[rank] = outcome
                if outcome.failure is not None:
                    failures.append(failure_of(outcome.failure))
            now = time.monotonic()
            if failures and settle_until is None:
                settle_until = now + SETTLE_SECONDS
                self.abort(str(failures[0]))
            if settle_until is not None and now >= settle_until:
                break
            if cancel is not None and cancel.is_set() and settle_until is None:
                failures.append(RuntimeFailure(None, None, None, RuntimeAborted("cancelled")))
                settle_until = now
                self.abort("cancelled")
            if self.stop is not None and settle_until is None and self.stop():
                failures.append(
                    RuntimeFailure(None, None, None, RuntimeAborted("the job's own ranks are back"))
                )
                settle_until = now
                self.abort("the job's own ranks are back: it goes on with them from its checkpoint")
            if now >= deadline and settle_until is None:
                failures.append(
                    RuntimeTimeout(
                        None,
                        None,
                        None,
                        TimeoutError(
                            f"workers of ranks {sorted(refs.values())} did not finish within {self.options.run.timeout:.0f} s"
                        ),
                    )
                )
                settle_until = now
                self.abort("timed out")
        if failures:
            raise primary(failures + self._unanswered(sorted(refs.values()), failures))
        return outcomes

    def _unanswered(self, ranks: list[int], failures: list[RuntimeFailure]) -> list[RuntimeFailure]:
        """The ranks among ``ranks`` (still running after the first failure) whose worker does not answer
        within ``PING_SECONDS``: lost with their node, though Ray has not said so yet (a node is declared
        dead only after its health checks fail), so their peers' transport errors came first."""
        import ray

        stopped = self.options.cancel is not None and self.options.cancel.is_set()
        if stopped or not all(echoes(f) for f in failures):  # a cause of its own, or a cancel
            return []
        pings = {self.workers[r].info.remote(): r for r in ranks}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PING_SECONDS)
        lost = [r for ref, r in pings.items() if ref not in answered]
        for ref in answered:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                lost.append(pings[ref])
        return [self._lost(r, TimeoutError(f"no answer within {PING_SECONDS:.0f} s")) for r in sorted(lost)]

    def _lost(self, rank: int, exc: BaseException) -> RuntimeFailure:
        info = self.info.get(rank, {})
        where = f" (pid {info['pid']} on {info['host']})" if info else ""
        return RuntimeFailure(
            rank, None, None, WorkerLost(f"the worker of rank {rank}{where} died: {type(exc).__name__}")
        )

    def abort(self, reason: str) -> None:
        for w in self.workers.values():
            try:
                w.abort.remote(reason)
            except Exception:  # noqa: BLE001 - a dead worker cannot be told
                pass

    def gather(self, names: Sequence[str]) -> dict[int, dict[str, Any]]:
        import ray

        ranks = list(self.workers)
        shards = ray.get([self.workers[r].shards.remote(list(names)) for r in ranks], timeout=SETUP_SECONDS)
        return dict(zip(ranks, shards, strict=True))

    def teardown(self) -> None:
        """A clean attempt's group goes back to the warm pool (if one is installed); any other is
        destroyed: every worker killed, the placement group removed."""
        import ray

        if self.uids is not None:
            try:
                ray.kill(self.uids, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers.clear()
        group, self.group = self.group, None
        if group is None:
            return
        pool = installed()
        if self.clean and pool is not None:
            pool.release(group)
        else:
            destroy(group)


def _result(
    compiled: Compiled, options: LaunchContext, attempt: _Attempt, outcomes: dict[int, Any]
) -> RunResult:
    graph, job = compiled.state.graph, compiled.state.job
    losses: list[float] = []
    if job.loss:
        decl = graph.tensors[job.loss]
        assert decl.placement is not None
        per_rank = {r: outcomes[r].losses for r in decl.placement.ranks}
        losses = [
            float(assemble_value(decl, {r: np.asarray(v[s]) for r, v in per_rank.items()}))
            for s in range(options.first_step, options.first_step + options.steps)
        ]
    parameters = None
    if options.run.return_parameters:
        names = [p.tensor for p in job.parameters]
        shards = attempt.gather(names)
        parameters = {}
        for name in names:
            decl = graph.tensors[name]
            assert decl.placement is not None
            parameters[name] = assemble_value(decl, {r: shards[r][name] for r in decl.placement.ranks})
    trace = None
    if options.run.trace:
        trace = sorted((e for o in outcomes.values() for e in o.trace), key=lambda e: e.start)
    seconds = max((o.seconds for o in outcomes.values()), default=0.0)
    bad = tuple(sorted({n for o in outcomes.values() for n in o.non_finite}))
    scaling = [n for n in VARIABLES if n in graph.tensors]  # replicated scalars: one rank's
    held = attempt.gather(scaling) if scaling else {}
    first_rank = graph.tensors[scaling[0]].placement.ranks[0] if scaling else 0  # type: ignore[union-attr]
    scaled = {n: held[first_rank][n] for n in scaling}
    outputs = assemble_outputs(
        graph.tensors,
        output_names(job.loss, job.fetches),
        {r: o.fetched for r, o in outcomes.items()},
        range(options.first_step, options.first_step + options.steps),
    )
    return RunResult(
        losses,
        parameters,
        trace,
        seconds,
        first_step=options.first_step,
        non_finite=bad,
        outputs=outputs,
        **loss_scaling_fields(scaled),
    )
