"""The ``sbpflow`` command line. Later issues add ``server``, ``submit``, ``run``, ``status`` and more."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sbpflow.errors import SbpflowError


def _load_example(path: str) -> Any:
    """Import a user's example file; it must define ``make_job(**kwargs) -> sbpflow.job.Job``."""
    file = Path(path)
    if not file.is_file():
        raise SbpflowError(f"{path}: no such file; pass a Python file that defines make_job()")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "make_job"):
        raise SbpflowError(f"{path} defines no make_job(); add `def make_job(**kwargs) -> Job`")
    return module


def cmd_trace(args: argparse.Namespace) -> int:
    """Trace an example into a Job; print its graph, or write the protobuf with --out."""
    from sbpflow import wire
    from sbpflow.client.summary import summarize

    job = _load_example(args.example).make_job()
    job.verify()
    if args.out:
        data = wire.job_to_proto(job).SerializeToString()
        Path(args.out).write_bytes(data)
        print(f"wrote {args.out} ({len(data)} bytes, {len(job.graph.ops)} ops)")
    else:
        print(job.graph.dump() if args.dump else summarize(job))
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    """List the registered ops with their inputs, outputs and attributes."""
    from sbpflow.ops import OPS

    for name, op in OPS.items():
        attrs = ", ".join(f"{k}={v!r}" for k, v in op.attrs.items())
        print(f"{name}({', '.join(op.inputs)}{'; ' + attrs if attrs else ''}) -> {', '.join(op.outputs)}")
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    from importlib.metadata import version

    print(f"sbpflow {version('sbpflow')}")
    return 0


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "trace": (cmd_trace, "trace an example file into a Job and print or save it"),
    "ops": (cmd_ops, "list the op library"),
    "version": (cmd_version, "print the installed version"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sbpflow", description="SBP global tensors and an actor runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == "trace":
            p.add_argument("example", help="a Python file defining make_job()")
            p.add_argument("--out", help="write the Job protobuf to this file")
            p.add_argument("--dump", action="store_true", help="print every tensor and op")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][0](args)
    except SbpflowError as e:
        print(f"sbpflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
