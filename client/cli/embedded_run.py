"""``sbpflow run``: train an example through an embedded control plane (a job manager and a job store in
this process, no server, no network) with the same progress bar as ``watch``.

What it keeps: with ``--checkpoint-dir DIR`` the store is ``DIR/jobs.db`` and job ID's checkpoints go to
``DIR/ID`` (``sbpflow checkpoints ID --checkpoint-root DIR`` and ``sbpflow export`` read them there), a
job whose example sets no ``checkpoint_every`` keeps one at its last step, and ``--resume [ID]`` goes on
from the latest job of that store (or ID) exactly as ``sbpflow resume`` does on a server: a new job from
its latest checkpoint, under the example's layout as traced now. Without DIR the store is a temporary
folder. One run at a time holds a DIR (``DIR/jobs.lock``); a job an earlier run left in flight (killed)
is marked FAILED ``CONTROL_PLANE_RESTARTED``, never run again behind the user's back: ``--resume`` it.
``--tensorboard-dir DIR`` writes job ID's scalars to ``DIR/ID``.

Admission is Submit's: the job's plan is held to each device's memory (``--device-memory``, default
this machine's memory over the job's ranks for an in-process or local Ray run, the cluster's for
``--ray-address``), and a job that cannot fit is refused before anything starts.

What it prints: the progress bar on stdout (a line every ``--progress-every`` s off a terminal), then a
summary. ``--json``: one JSON object at the end (the bar on stderr), the job as the HTTP API's
``/v1/jobs/{id}`` has it (``control_plane/status/job_json.py``: with its workers, ``last_checkpoint`` and
``losses``) and ``"run"``: ``{"backend", "steps", "seconds", "steps_per_second", "evals": [{"step",
"loss"}], "checkpoint_dir", "tensorboard_dir", "trace"}`` (its figures; null where the job did not
finish a run). ``--json-lines``: each step as a line as it comes (``job_json.event``: ``{"version", "job_id", "seq",
"time", "kind": "step", "step", "loss", ...}``), then that object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from sbpflow.client.cli.byte_sizes import parse_bytes
from sbpflow.client.cli.exit_codes import UsageError, shown
from sbpflow.client.cli.output_files import write_output
from sbpflow.client.cli.run_flags import add_run_flags, run_options_from_args
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import MANAGER_DEFAULTS

# the embedded manager's options, parameters not kept (nothing shows them); its --trace names a file, and
# a run is not restarted (a restart would start over unless it checkpoints; --resume goes on instead)
RUN_DEFAULTS = MANAGER_DEFAULTS.replace(return_parameters=False)
RUN_EXCLUDED = ("trace", "return_parameters", "max_restarts")
PROGRESS_EVERY = 10.0  # seconds between step lines off a terminal
LATEST = "latest"  # --resume without an id
LOCAL_RAYS = ("kept", "fresh")  # backend ray without an address: the kept local Ray, or one of the run's own


def add_flags(p: argparse.ArgumentParser) -> None:
    """``run``'s flags beyond the example's."""
    p.add_argument("--steps", type=int, help="train this many steps (default: the job's own)")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of every act (Perfetto)")
    keep = p.add_argument_group("what the run keeps")
    keep.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="keep job ID's checkpoints in DIR/ID and the jobs in DIR/jobs.db, for --resume, `sbpflow "
        "checkpoints ID --checkpoint-root DIR` and `sbpflow export` (default: nothing kept)",
    )
    keep.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="checkpoint every N steps, into --checkpoint-dir (default: the job's own, else its last step)",
    )
    keep.add_argument(
        "--resume",
        nargs="?",
        const=LATEST,
        metavar="JOB_ID",
        help="go on from the latest checkpoint of the latest job in --checkpoint-dir (or of JOB_ID), as a "
        "new job traced from the example now (its layout may differ)",
    )
    keep.add_argument("--tensorboard-dir", metavar="DIR", help="write job ID's TensorBoard scalars to DIR/ID")
    out = p.add_argument_group("what it prints")
    out.add_argument(
        "--json", action="store_true", help="print one JSON object at the end: the job as /v1/jobs/ID has it"
    )
    out.add_argument(
        "--json-lines", action="store_true", help="print each step as a JSON line as it comes, then --json's"
    )
    out.add_argument(
        "--progress-every",
        type=float,
        default=PROGRESS_EVERY,
        metavar="SECONDS",
        help="off a terminal, a step line at most this often, the first steps and the last always (0: each)",
    )
    p.add_argument(
        "--device-memory",
        type=parse_bytes,
        metavar="SIZE",
        help="memory per device the job's plan is held to before it starts (e.g. 16GiB; 0: no check); "
        "default: this machine's over the job's ranks, or the Ray cluster's with --ray-address",
    )
    ray = p.add_mutually_exclusive_group()
    ray.add_argument(
        "--fresh-ray",
        dest="local_ray",
        action="store_const",
        const="fresh",
        help="backend ray: start a local Ray of this run's own, stopped at its end (a few seconds more)",
    )
    ray.add_argument(
        "--keep-ray",
        dest="local_ray",
        action="store_const",
        const="kept",
        help="backend ray: join the local Ray an earlier run kept, or start one and keep it for the next "
        "runs until $SBPFLOW_RAY_IDLE s unused (600); the default unless $SBPFLOW_LOCAL_RAY=fresh",
    )
    add_run_flags(p, RUN_DEFAULTS, exclude=RUN_EXCLUDED)


def _check(args: argparse.Namespace) -> None:
    if args.json and args.json_lines:
        raise UsageError("--json and --json-lines: give one (--json-lines ends with --json's object)")
    if args.checkpoint_dir is None:
        for flag, value in (("--resume", args.resume), ("--checkpoint-every", args.checkpoint_every)):
            if value is not None:
                raise UsageError(
                    f"{flag} needs --checkpoint-dir DIR: the folder the run keeps its checkpoints in"
                )
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every {args.checkpoint_every}: give a number of steps, at least 1")
    if args.local_ray and (args.backend != "ray" or args.ray_address):
        raise UsageError(
            f"--{args.local_ray.replace('kept', 'keep')}-ray is a local Ray of backend ray's: "
            "drop --backend inprocess / --ray-address"
        )
    if os.environ.get("SBPFLOW_LOCAL_RAY", "kept") not in LOCAL_RAYS:
        raise UsageError(
            f"SBPFLOW_LOCAL_RAY={shown(os.environ['SBPFLOW_LOCAL_RAY'])}: give one of {LOCAL_RAYS}"
        )
    if args.progress_every < 0:
        raise UsageError(f"--progress-every {args.progress_every}: give seconds, 0 or more")


def example_job(args: argparse.Namespace) -> Any:
    """``job_from_args``, with what the example's make_job returned checked before ``--steps``,
    ``--checkpoint-every`` and ``--auto`` touch it: anything but a Job is named."""
    from sbpflow.client.cli.auto import auto_job
    from sbpflow.client.cli.examples import job_from_args, with_config
    from sbpflow.job import Job

    bare = {"steps": None, "checkpoint_every": None, "auto": False, "memory_per_device": None}
    job = job_from_args(argparse.Namespace(**(vars(args) | bare)))
    if not isinstance(job, Job):
        raise SbpflowError(
            f"{args.example}: make_job returned a {type(job).__name__}; return a sbpflow.Job (graph.trace(...))"
        )
    quiet = vars(args) | {"json": getattr(args, "json", False) or getattr(args, "json_lines", False)}
    return auto_job(with_config(job, args), argparse.Namespace(**quiet))  # its table off a JSON stdout


def _job(args: argparse.Namespace) -> Any:
    """The example's job; with --checkpoint-dir, one that checkpoints (at its last step, if it says
    nothing else), so that the run keeps its model."""
    job = example_job(args)
    c = job.config
    if args.checkpoint_dir is not None and c.checkpoint_every <= 0 and c.eval_every <= 0:
        job.config = dataclasses.replace(c, checkpoint_every=max(1, c.steps))
    return job


@contextmanager
def _store(args: argparse.Namespace) -> Iterator[Any]:
    """The job store: ``DIR/jobs.db``, held by this run alone, settled from any run before it; or a
    temporary one."""
    from sbpflow.control_plane.store.job_store import JobStore

    if args.checkpoint_dir is None:
        with (
            tempfile.TemporaryDirectory(prefix="sbpflow-run-") as tmp,
            JobStore(Path(tmp) / "jobs.db") as store,
        ):
            yield store
        return
    import fcntl

    from sbpflow.runs.states import JobState

    where = Path(args.checkpoint_dir)
    try:
        where.mkdir(parents=True, exist_ok=True)
        lock = open(where / "jobs.lock", "a")  # noqa: SIM115 - held for the run, closed below
    except OSError as e:
        raise SbpflowError(
            f"--checkpoint-dir {shown(where)}: {e.strerror or e}; give a folder it may write"
        ) from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SbpflowError(
                f"another `sbpflow run` is using --checkpoint-dir {shown(where)}; wait for it, or give another folder"
            ) from None
        with JobStore(where / "jobs.db") as store:
            for rec in store.list([JobState.PENDING], limit=1 << 30):  # queued by a run that then ended
                store.request_cancel(
                    rec.id, "queued by an earlier `sbpflow run` that ended before it started"
                )
            store.reconcile_after_restart()  # no job goes on by itself: in flight -> FAILED, --resume it
            yield store


def _resumed_id(store: Any, wanted: str) -> str:
    """The job ``--resume`` names (``latest``: the store's newest), or a UsageError naming those it holds."""
    ids = [r.id for r in store.list(limit=1 << 30)]  # newest first
    if not ids:
        raise UsageError("--resume: no job in --checkpoint-dir's store yet; run once without --resume first")
    if wanted == LATEST:
        return str(ids[0])
    if wanted not in ids:
        raise UsageError(f"--resume {shown(wanted)}: no such job in --checkpoint-dir; its newest: {ids[:5]}")
    return wanted


def _manager(args: argparse.Namespace, store: Any, job: Any, job_bytes: bytes, rays: ExitStack) -> Any:
    """The embedded job manager, admitting as Submit does (the job's plan held to each device's memory);
    backend ray without an address runs on the kept local Ray (its lease entered into ``rays``) unless
    ``--fresh-ray``."""
    from sbpflow.control_plane.service.data_policy import DataPolicy
    from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig, job_ranks
    from sbpflow.control_plane.service.validation import compile_submit, describe_cluster

    options = run_options_from_args(args, RUN_DEFAULTS, trace=bool(args.trace))
    remote = options.backend == "ray" and bool(options.ray_address or os.environ.get("RAY_ADDRESS"))
    if remote:  # its memory is the cluster's, which describe_cluster reads from a connected Ray only
        from sbpflow.control_plane.launch.ray_backend import ensure_ray

        ensure_ray(options.ray_address, 1)
    config = ManagerConfig(
        run=options,
        slots=max(1, len(job_ranks(job))),
        keep_run_results=True,
        checkpoint_root=args.checkpoint_dir,
        tensorboard_dir=args.tensorboard_dir,
        data_policy=DataPolicy.embedded(also=[args.data] if args.data else []),
        device_memory=args.device_memory,
    )
    # a local Ray (not started yet) is this machine: its memory, as in-process
    cluster = None if remote else describe_cluster("inprocess", config.slots or 1, args.device_memory)
    if options.backend == "ray" and cluster is not None:  # refused before Ray's start (seconds), not after it
        compile_submit(job_bytes, cluster, None, config.data_policy, config.limits)
        if (args.local_ray or os.environ.get("SBPFLOW_LOCAL_RAY") or "kept") == "kept":
            config = dataclasses.replace(
                config, run=options.replace(ray_address=_kept(rays, config.slots or 1))
            )
    manager = JobManager(store, config)
    manager.cluster = cluster or manager.cluster
    return manager


def _kept(rays: ExitStack, ranks: int) -> str | None:
    """The kept local Ray's address, leased until ``rays`` closes; None (a Ray of the run's own) where it
    has fewer CPUs than the job's ranks."""
    from sbpflow.control_plane.launch.ray_cluster import KeptRay

    address = rays.enter_context(KeptRay.default().lease(ranks))
    if address is None:
        print(
            f"the kept local Ray has fewer CPUs than the job's {ranks} ranks: this run starts a Ray of its own",
            file=sys.stderr,
        )
    return address


def cmd_run(args: argparse.Namespace) -> int:
    """Train an example through an in-process control plane (no server) with the progress bar."""
    from sbpflow.client.progress_bar import ProgressBar
    from sbpflow.codec import wire

    _check(args)
    job = _job(args)
    job_bytes = wire.job_to_proto(job).SerializeToString()
    with _store(args) as store, ExitStack() as rays:
        manager = _manager(args, store, job, job_bytes, rays)
        manager.start()
        try:
            if args.resume is None:
                rec = manager.submit(job_bytes)
            else:
                rec = manager.resume(_resumed_id(store, args.resume), job_bytes)
                print(
                    f"job {rec.id} resumes job {rec.resumed_from} from {rec.resume_checkpoint}",
                    file=sys.stderr,
                )
            bar_stream = sys.stderr if args.json else sys.stdout
            bar = (
                None
                if args.json_lines
                else ProgressBar(bar_stream, f"({rec.name}, {args.backend})", every=args.progress_every)
            )
            _follow(manager, rec.id, bar, args.json_lines)
        finally:
            manager.shutdown()
        return _report(args, manager, store, rec.id)


def _follow(manager: Any, job_id: str, bar: Any, lines: bool) -> None:
    from sbpflow.control_plane.status import job_json

    try:
        for ev in manager.follow(job_id):
            if bar is not None:
                bar.update(ev)
            if lines and ev.HasField("step"):
                print(json.dumps(job_json.event(ev)), flush=True)
    except KeyboardInterrupt:
        manager.cancel(job_id, "interrupted (Ctrl-C)")
        raise
    finally:
        if bar is not None:
            bar.close()


def _report(args: argparse.Namespace, manager: Any, store: Any, job_id: str) -> int:
    """The run's end: its summary (or JSON object) and its exit code; a job that did not succeed raises."""
    end = store.get(job_id)
    result = manager.run_results.get(job_id)
    if args.trace and result is not None:
        from sbpflow.actor_workers.runtime.trace import chrome_trace

        write_output(args.trace, json.dumps(chrome_trace(result.trace or [])), "--trace")
    if args.json or args.json_lines:
        print(json.dumps(_final_json(args, manager, store, job_id, result)), flush=True)
    failed = SbpflowError(f"job {end.name!r} {end.state.name}: {end.reason}: {end.message}")
    if end.state.name != "SUCCEEDED":
        raise failed
    if args.json or args.json_lines:
        return 0
    n = len(result.losses)
    print(
        f"{n} steps in {result.seconds:.2f} s ({n / max(result.seconds, 1e-9):.2f} steps/s, {args.backend})"
    )
    for step, loss in result.evals:  # config.eval_every: the held-out split's loss
        print(f"step {step}: held-out loss {loss:.6f}")
    if args.trace:
        print(f"wrote {args.trace} (open it in https://ui.perfetto.dev)")
    if args.checkpoint_dir is not None:
        last = manager.last_checkpoint(job_id)
        print(
            f"kept {last or 'no checkpoint'}; list: sbpflow checkpoints {job_id} --checkpoint-root "
            f"{args.checkpoint_dir}; export: sbpflow export {job_id} --checkpoint-root {args.checkpoint_dir}"
        )
    if args.tensorboard_dir is not None:
        print(f"TensorBoard scalars in {Path(args.tensorboard_dir) / job_id}")
    return 0


def _final_json(
    args: argparse.Namespace, manager: Any, store: Any, job_id: str, result: Any
) -> dict[str, Any]:
    """The job as ``/v1/jobs/{id}`` has it (``records.py``), with ``last_checkpoint``, and the run's figures."""
    from sbpflow.control_plane.status import job_json, records

    status = records.job_status(store.get(job_id), manager.workers(job_id))
    status.last_checkpoint = manager.last_checkpoint(job_id)
    doc = job_json.document(status, (p.loss for p in store.losses(job_id)))
    n = len(result.losses) if result is not None else 0
    seconds = result.seconds if result is not None else None
    doc["run"] = {
        "backend": args.backend,
        "steps": n,
        "seconds": seconds,
        "steps_per_second": n / seconds if seconds else None,
        "evals": [{"step": s, "loss": records.json_float(x)} for s, x in (result.evals if result else ())],
        "checkpoint_dir": args.checkpoint_dir,
        "tensorboard_dir": args.tensorboard_dir,
        "trace": args.trace,
    }
    return doc
