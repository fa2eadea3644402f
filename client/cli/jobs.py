"""The job commands of the ``sbpflow`` CLI: ``server``, ``submit``, ``status``, ``watch``, ``cancel``,
``logs``, ``resume`` (a new job from an ended one's latest checkpoint, as it was or re-traced under
another layout: ``sbpflow resume ID examples/mlp.py --ranks 2 --tp``), ``checkpoints``, ``export``, and
and their flags; ``run``, the embedded default, is ``embedded_run.py``.

The client commands find the server with ``--address`` (or ``SBPFLOW_ADDRESS``, default
``127.0.0.1:50051``), ``--token`` (or ``SBPFLOW_TOKEN``) and ``--tls-ca``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sbpflow.client.cli.byte_sizes import parse_bytes
from sbpflow.client.cli.exit_codes import UsageError
from sbpflow.client.cli.generate import cmd_generate, generate_flags
from sbpflow.client.cli.output_files import output_path
from sbpflow.client.cli.run_flags import add_run_flags, given_run_flags, run_options_from_args
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import MANAGER_DEFAULTS

DEFAULT_ADDRESS = "127.0.0.1:50051"
# `sbpflow server`: a server keeps no act traces (a job's result does not carry one)
SERVER_EXCLUDED = ("trace",)


def _client(args: argparse.Namespace) -> Any:
    from sbpflow.client.client import Client

    # the token from the environment is read here, not as the flag's default: --help shows defaults
    token = args.token or os.environ.get("SBPFLOW_TOKEN") or None
    return Client(args.address, token=token, tls_ca=args.tls_ca)


def _state(code: Any) -> str:
    from sbpflow.v1 import service_pb2 as sp

    return sp.JobState.Name(code).removeprefix("JOB_STATE_")


def _ended(status: Any) -> int:
    """Exit code of a finished job: 0 if it succeeded, 1 otherwise (its reason printed)."""
    if _state(status.state) == "SUCCEEDED":
        return 0
    print(f"job {status.job_id} {_state(status.state)}: {status.reason}: {status.message}", file=sys.stderr)
    return 1


def server_config(args: argparse.Namespace) -> Any:
    """The ServerConfig of ``sbpflow server``'s flags."""
    from sbpflow.control_plane.service.server import ServerConfig

    return ServerConfig(
        host=args.host,
        port=args.port,
        http_port=None if args.http_port < 0 else args.http_port,
        store=args.store,
        run=run_options_from_args(args, MANAGER_DEFAULTS),
        slots=args.slots,
        auth_token=args.auth_token or os.environ.get("SBPFLOW_TOKEN") or None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_message_bytes=args.max_message_bytes,
        checkpoint_root=args.checkpoint_root,
        tensorboard_dir=args.tensorboard_dir,
        open_metrics=args.open_metrics,
        data_roots=tuple(args.data_root),
        device_memory=args.device_memory,
        insecure=args.insecure,
        max_streams=args.max_streams,
        drain_grace=args.drain_grace,
        warm_workers=args.warm_workers,
        warm_idle_seconds=args.warm_idle_seconds,
        worker_port=args.worker_port,
    )


def cmd_server(args: argparse.Namespace) -> int:
    """Run the control plane until interrupted."""
    from sbpflow.control_plane.service.server import serve

    serve(server_config(args), announce=lambda line: print(line, flush=True))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    """Trace an example and submit it; print its id (and follow it with --watch)."""
    from sbpflow.client.cli.embedded_run import example_job

    with _client(args) as client:
        handle = client.submit(
            example_job(args), client_id=os.environ.get("USER", ""), **given_run_flags(args)
        )
        print(handle.job_id, flush=True)
        return _ended(handle.watch()) if args.watch else 0


def cmd_resume(args: argparse.Namespace) -> int:
    """Resume an ended job from its latest checkpoint as a new job; print the new job's id (and follow
    it with --watch). With an example file, the job is re-traced from it (--ranks/--tp/--dp/--set)."""
    from sbpflow.client.cli.embedded_run import example_job
    from sbpflow.client.cli.examples import make_kwargs

    job = None
    if args.example:
        job = example_job(args)
    elif make_kwargs(args) or args.steps is not None or args.checkpoint_every is not None:
        raise UsageError(
            "--ranks/--tp/--dp/--layers/--set/--steps/--checkpoint-every re-trace the job's example: give the "
            f"example file too, e.g. `sbpflow resume {args.id} examples/mlp.py --ranks 2`"
        )
    with _client(args) as client:
        handle = client.resume(args.id, job, client_id=os.environ.get("USER", ""))
        st = handle.status()
        print(handle.job_id, flush=True)
        print(f"job {handle.job_id} resumes job {args.id} from {st.resume_checkpoint}", file=sys.stderr)
        return _ended(handle.watch()) if args.watch else 0


def cmd_status(args: argparse.Namespace) -> int:
    """One job in detail, or a table of the newest jobs."""
    from sbpflow.client.cli import json_output
    from sbpflow.v1 import service_pb2 as sp

    with _client(args) as client:
        if args.id:
            st = client.get(args.id)
            if args.json:
                json_output.emit(json_output.job(st))
                return 0
            loss = f"{st.loss:.6f}" if st.HasField("loss") else "-"
            print(f"job {st.job_id} ({st.name}): {_state(st.state)}" + (f" {st.reason}" if st.reason else ""))
            if st.message:
                print(f"  {st.message}")
            print(
                f"  step {st.step}/{st.total_steps}  loss {loss}  {st.samples_per_second:.1f} samples/s"
                f"  attempt {st.attempt}"
            )
            if st.resumed_from:
                print(f"  resumed from job {st.resumed_from} at {st.resume_checkpoint}")
            if st.last_checkpoint:
                print(f"  last checkpoint: {st.last_checkpoint}")
            for w in st.workers:
                state = sp.WorkerState.Name(w.state).removeprefix("WORKER_STATE_")
                print(f"  rank {w.rank}: {state}  step {w.step}  {w.host}".rstrip())
            return 0
        listed = client.list(limit=args.limit)  # before the header: a failed call prints no table
        if args.json:
            json_output.emit(json_output.jobs(listed))
            return 0
        print(f"{'ID':16}  {'NAME':16}  {'STATE':10}  {'STEP':>11}  {'LOSS':>10}  REASON")
        for st in listed:
            loss = f"{st.loss:10.5g}" if st.HasField("loss") else f"{'-':>10}"
            step = f"{st.step}/{st.total_steps}"
            print(
                f"{st.job_id:16}  {st.name[:16]:16}  {_state(st.state):10}  {step:>11}  {loss}  {st.reason}"
            )
        return 0


def cmd_watch(args: argparse.Namespace) -> int:
    """Follow a job to its end with a progress bar."""
    with _client(args) as client:
        return _ended(client.handle(args.id).watch())


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        st = client.cancel(args.id, args.reason)
        print(f"job {st.job_id}: {_state(st.state)}" + (" (stopping)" if st.state in (2, 3, 4) else ""))
        return 0


def cmd_logs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for line in client.logs(args.id, args.rank, args.follow):
            who = "control" if line.rank < 0 else f"rank {line.rank}"
            print(f"{line.time.ToDatetime():%H:%M:%S} {who:>8} {line.level:7} {line.text}", flush=True)
        return 0


def client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=os.environ.get("SBPFLOW_ADDRESS", DEFAULT_ADDRESS),
        help=f"the control plane, host:port (env SBPFLOW_ADDRESS; default {DEFAULT_ADDRESS})",
    )
    p.add_argument("--token", help="bearer token (default: env SBPFLOW_TOKEN)")
    p.add_argument("--tls-ca", help="PEM certificate to trust for a TLS server")  # fmt: skip


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port, printed)")
    p.add_argument("--http-port", type=int, default=8080, help="status endpoint port (0: any free; -1: none)")
    p.add_argument(
        "--worker-port", type=int, default=0,
        help="port of the WorkerService Ray workers report to (backend ray; 0: any free port, printed)",
    )  # fmt: skip
    p.add_argument("--store", default="sbpflow-jobs.db", help="SQLite job store file")
    p.add_argument("--slots", type=int, help="device slots (default: the Ray cluster's CPUs)")
    p.add_argument("--auth-token", help="require this bearer token (env SBPFLOW_TOKEN)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without a token (only on a network where every client is trusted)",
    )
    p.add_argument(
        "--data-root",
        action="append",
        default=[],
        metavar="DIR",
        help="jobs may read data files only under DIR (repeatable; symlinks resolved); default: none",
    )
    p.add_argument(
        "--device-memory",
        type=parse_bytes,
        metavar="SIZE",
        help="memory per device that Submit's admission check holds a job's plan to (e.g. 16GiB, 8G; 0: no "
        "check); default: Ray's memory (or, in-process, this machine's) over the slots, a GPU's own",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        default=1024,
        help="open Watch/Logs streams at once; more are refused (RESOURCE_EXHAUSTED), unary calls keep their threads",
    )
    p.add_argument(
        "--open-metrics",
        action="store_true",
        help="serve /metrics without the token (for Prometheus scraping by annotation); the rest stays guarded",
    )
    p.add_argument(
        "--drain-grace",
        type=float,
        default=25.0,
        help="on SIGTERM, seconds for running jobs to reach a checkpoint the next server resumes from",
    )
    p.add_argument(
        "--warm-workers",
        type=int,
        default=8,
        help="backend ray: idle worker actors kept for the next job of the same shape (0: a new one per job)",
    )
    p.add_argument(
        "--warm-idle-seconds", type=float, default=300.0, help="an idle warm worker goes after this"
    )
    p.add_argument("--tls-cert", help="PEM certificate: serve gRPC and HTTP over TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--max-message-bytes", type=int, default=64 * 1024 * 1024, help="largest request")
    p.add_argument(
        "--checkpoint-root",
        default=os.environ.get("SBPFLOW_CHECKPOINTS"),
        help="keep job ID's checkpoints in DIR/ID, resume jobs from them (env SBPFLOW_CHECKPOINTS; default: none)",
    )
    p.add_argument("--tensorboard-dir", metavar="DIR", help="write job ID's TensorBoard scalars to DIR/ID")
    add_run_flags(p, MANAGER_DEFAULTS, exclude=SERVER_EXCLUDED)


def _id(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", help="job id (from `sbpflow submit` or `sbpflow status`)")


def _status(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", nargs="?", help="a job id; without one, list the newest jobs")
    p.add_argument("--limit", type=int, default=20, help="jobs to list")
    _json_flag(p)


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (keys: the README's Scripting section)")


def _cancel(p: argparse.ArgumentParser) -> None:
    _id(p)
    p.add_argument("--reason", default="", help="why (kept in the job's message)")


def _logs(p: argparse.ArgumentParser) -> None:
    _id(p)
    p.add_argument(
        "--rank", type=int, default=-1, help="only this rank's lines (-1: all and the control plane)"
    )
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")


LOCAL_ROOT = "sbpflow-checkpoints"  # the local --checkpoint-root where none is given and it exists


def _on_server(args: argparse.Namespace) -> bool:
    """Whether the checkpoints are read through the server at --address: unless --checkpoint-root (or
    $SBPFLOW_CHECKPOINTS) is given, ID is a folder here, or ./sbpflow-checkpoints exists."""
    local = args.checkpoint_root is not None or (args.id is not None and Path(args.id).exists())
    if local or Path(LOCAL_ROOT).is_dir():
        return False
    if args.id is None:
        raise UsageError(
            "give a job id (`sbpflow status` lists them) to read its checkpoints through the server, or "
            "--checkpoint-root DIR to read them on this machine"
        )
    return True


def _checkpoint_dir(args: argparse.Namespace) -> Path:
    """A job's checkpoint folder: ``ID`` under ``--checkpoint-root`` (the server's, or ``sbpflow run``'s
    --checkpoint-dir), or a path; without either, the root's job with the newest complete checkpoint."""
    from sbpflow.checkpoint.read import list_checkpoints

    root = Path(args.checkpoint_root or LOCAL_ROOT)
    if args.id is None:
        kept = [
            (found[-1].path.stat().st_mtime, d) for d in root.glob("*/") if (found := list_checkpoints(d))
        ]
        if not kept:
            raise SbpflowError(
                f"no job under --checkpoint-root {root} has a complete checkpoint; give a job id"
            )
        return max(kept)[1]
    given = Path(args.id)
    return given if given.exists() else root / args.id


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """List a job's complete checkpoints (partial ones are never listed)."""
    from sbpflow.checkpoint.read import CheckpointInfo, list_checkpoints
    from sbpflow.client.cli import json_output

    if _on_server(args):
        with _client(args) as client:
            kept = client.checkpoints(args.id)
        where = Path(f"{args.address}:{args.id}")  # shown: the server and the job
        found = [CheckpointInfo(c.step, Path(args.id) / c.name, c.bytes) for c in kept]
    else:
        where = _checkpoint_dir(args)
        found = list_checkpoints(where)
    if args.json:
        json_output.emit(json_output.checkpoints(found))
        return 0 if found else 1
    if not found:
        print(f"no complete checkpoint in {where}", file=sys.stderr)
        return 1
    print(f"{'STEP':>8}  {'MB':>9}  PATH")
    for c in found:
        print(f"{c.step:>8}  {c.bytes / 1e6:>9.1f}  {c.path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a checkpoint's logical parameters to one safetensors or .npz file, in sbpflow's layout or
    PyTorch's (``--layout torch --example FILE``: the example's modules say how)."""
    import tempfile

    from sbpflow.checkpoint.read import resolve

    convert = _layout_of(args)
    if not _on_server(args):
        return _export(args, resolve(_checkpoint_dir(args)), convert)
    with tempfile.TemporaryDirectory(prefix="sbpflow-export-") as tmp, _client(args) as client:
        src = client.download_checkpoint(args.id, Path(tmp) / args.id)  # streamed: no shared disk needed
        return _export(args, src, convert, shown=f"job {args.id}'s {src.name} on {args.address}")


def _export(args: argparse.Namespace, src: Path, convert: Any, shown: str = "") -> int:
    from sbpflow.checkpoint.read import export

    out = Path(args.out or f"{src.parent.name}-{src.name}.{args.format}")
    # the writers take a path; theirs is a file in output_path's private folder (np.savez adds ".npz"
    # to a name without it, so the name has the format's suffix)
    with output_path(out, "--out", name=f"export.{args.format}") as tmp:
        export(src, tmp, args.format, convert=convert)
        size = tmp.stat().st_size
    print(f"wrote {out} ({size / 1e6:.1f} MB) from {shown or src}")
    return 0


def _layout_of(args: argparse.Namespace) -> Callable[[Any], Any] | None:
    """How ``--layout`` converts the exported tensors (None: sbpflow's own layout)."""
    if args.layout == "sbpflow":
        return None
    if not args.example:
        raise UsageError(
            f"--layout {args.layout} reads the names and orientations off the model: give the example that "
            "trained it, e.g. --example examples/charlm.py"
        )
    from sbpflow.client.cli.examples import load_example
    from sbpflow.client.cli.set_values import param_types, parse_set

    make_job = load_example(args.example).make_job
    kwargs = dict(parse_set(item, param_types(make_job)) for item in args.set or ())
    bound = make_job(**kwargs).bound
    return lambda tensors: bound.to_layout(args.layout, tensors)


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "id",
        nargs="?",
        help="a job id (its checkpoints under --checkpoint-root), or a checkpoint folder; default: the job "
        "under --checkpoint-root with the newest checkpoint",
    )
    p.add_argument(
        "--checkpoint-root",
        default=os.environ.get("SBPFLOW_CHECKPOINTS"),
        help="read the checkpoints on this machine, in this folder (the server's --checkpoint-root, or "
        "`sbpflow run`'s --checkpoint-dir; env SBPFLOW_CHECKPOINTS); without it (and without "
        f"./{LOCAL_ROOT}) they are read through the server at --address",
    )


def _checkpoints_flags(p: argparse.ArgumentParser) -> None:
    _checkpoint_flags(p)
    _json_flag(p)


def _export_flags(p: argparse.ArgumentParser) -> None:
    _checkpoint_flags(p)
    p.add_argument("--format", choices=("safetensors", "npz"), default="safetensors")
    p.add_argument("--out", help="the file to write (default: <job id>-step-NNNNNNNN.<format>)")
    p.add_argument(
        "--layout",
        choices=("sbpflow", "torch", "gpt2", "hf-bert", "torchvision"),
        default="sbpflow",
        help="torch: nanoGPT names, Linear weights [out, in], qkv as [q | k | v]; gpt2: Hugging Face's GPT-2 "
        "(the same, its Conv1D weights [in, out]); hf-bert, torchvision: Hugging Face's BERT, torchvision's "
        "ResNet; each needs --example",
    )
    p.add_argument("--example", help="with --layout torch: the example file whose make_job() built the model")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="with --example: make_job's arguments, as trained"
    )


# name -> (command, help, flags beyond the example's, takes an example file, is a client of a server)
JOB_COMMANDS: dict[
    str, tuple[Callable[[argparse.Namespace], int], str, Callable[[Any], None] | None, bool]
] = {
    "server": (cmd_server, "run the control plane (gRPC JobService, status endpoint)", _server_flags, False),
    "submit": (cmd_submit, "trace an example and submit it to a control plane", None, True),
    "status": (cmd_status, "list jobs, or show one", _status, True),
    "watch": (cmd_watch, "follow a job with a progress bar until it ends", _id, True),
    "cancel": (cmd_cancel, "cancel a job", _cancel, True),
    "resume": (
        cmd_resume,
        "resume an ended job from its latest checkpoint, maybe under another layout",
        _id,
        True,
    ),
    "logs": (cmd_logs, "print a job's log lines", _logs, True),
    "checkpoints": (cmd_checkpoints, "list a job's complete checkpoints", _checkpoints_flags, True),
    "export": (cmd_export, "export a checkpoint's parameters to safetensors or .npz", _export_flags, True),
    "generate": (
        cmd_generate,
        "sample text from a trained language model's checkpoint",
        generate_flags,
        True,  # --job ID reads its checkpoint through the server at --address
    ),
}
