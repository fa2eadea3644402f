"""The ``sbpflow`` command line: the parser, and the commands that run here: ``run``, ``plan``, ``trace``,
``ops``, ``version``; the job commands are ``jobs.py``'s (``server``, ``submit``, ``status``, ``watch``,
``cancel``, ``logs``, ``resume``, ``checkpoints``, ``export``, ``generate``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from sbpflow.client.cli import embedded_run
from sbpflow.client.cli.argument_checks import check_arguments
from sbpflow.client.cli.auto import add_auto_flags
from sbpflow.client.cli.embedded_run import cmd_run, example_job
from sbpflow.client.cli.examples import load_example
from sbpflow.client.cli.exit_codes import run_command
from sbpflow.client.cli.jobs import JOB_COMMANDS, client_flags
from sbpflow.client.cli.output_files import write_output
from sbpflow.client.cli.run_flags import add_run_flags
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import CLIENT_FIELDS


def cmd_trace(args: argparse.Namespace) -> int:
    """Trace an example into a Job; print its graph, or write the protobuf with --out."""
    from sbpflow.client.cli.summary import summarize
    from sbpflow.codec import wire

    job = load_example(args.example).make_job()
    job.verify()
    if args.out:
        size = write_output(args.out, wire.job_to_proto(job).SerializeToString(), "--out")
        print(f"wrote {args.out} ({size} bytes, {len(job.graph.ops)} ops)")
    else:
        print(job.graph.dump() if args.dump else summarize(job))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Compile an example; print the plan summary and write the Plan protobuf and/or an HTML picture."""
    from sbpflow.control_plane.compiler.pipeline import compile
    from sbpflow.control_plane.render import graph_page

    compiled = compile(example_job(args))
    if args.json:
        from sbpflow.client.cli import json_output

        json_output.emit(json_output.plan(compiled))
    else:
        print(compiled.summary())
    say = (lambda text: print(text, file=sys.stderr)) if args.json else print  # stdout holds the JSON
    if args.profile:
        from sbpflow.control_plane.compiler.cost.cost_model import estimate
        from sbpflow.control_plane.profiling.kernel_probe import measure_kernels
        from sbpflow.control_plane.profiling.pricing import device_profile

        profile = device_profile(args.profile)
        together = (args.link or profile.default_link) == "inprocess"  # ranks as threads of one process
        kernels = (
            measure_kernels(compiled.state, profile.threads, together) if args.profile == "cpu" else None
        )
        say(str(estimate(compiled, profile, args.link, kernels=kernels)))
    if args.out:
        if compiled.plan is None:
            raise SbpflowError(f"no plan to write to {args.out}: {'; '.join(compiled.notes)}")
        size = write_output(args.out, compiled.plan.SerializeToString(), "--out")
        say(f"wrote {args.out} ({size} bytes)")
    if args.html:
        write_output(
            args.html, graph_page.html_page(compiled.state, compiled.memory, compiled.notes), "--html"
        )
        say(f"wrote {args.html}")
    if args.dot:
        write_output(args.dot, graph_page.dot(compiled.state), "--dot")
        say(f"wrote {args.dot} (render with: dot -Tsvg {args.dot} -o plan.svg)")
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
    "run": (
        cmd_run,
        "train an example through an embedded control plane, with a progress bar; keep it with --checkpoint-dir",
    ),
    "plan": (cmd_plan, "compile an example file and print its plan summary; write the plan and a picture"),
    "ops": (cmd_ops, "list the op library"),
    "version": (cmd_version, "print the installed version"),
    **{name: (fn, help_text) for name, (fn, help_text, _, _) in JOB_COMMANDS.items()},
}


class _Formatter(argparse.HelpFormatter):
    """argparse's help, each flag's default shown unless its help already says it (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = "default" in text or action.default in (None, False, [], argparse.SUPPRESS)
        return text if shown or not action.option_strings else text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sbpflow", description="SBP global tensors and an actor runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
        if name == "trace":
            p.add_argument("example", help="a Python file defining make_job()")
            p.add_argument("--out", help="write the Job protobuf to this file")
            p.add_argument("--dump", action="store_true", help="print every tensor and op")
        if name in JOB_COMMANDS:
            _, _, flags, is_client = JOB_COMMANDS[name]
            if is_client:
                client_flags(p)
            if flags is not None:
                flags(p)
        if name in ("plan", "run", "submit", "resume"):
            if name == "resume":
                p.add_argument(
                    "example",
                    nargs="?",
                    help="re-trace this file's make_job() (e.g. under another layout); default: the job as submitted",
                )
            else:
                p.add_argument("example", help="a Python file defining make_job()")
            p.add_argument("--ranks", type=int, help="number of ranks (make_job's ranks=)")
            p.add_argument("--tp", action="store_true", help="tensor parallel (make_job's tp=True)")
            p.add_argument("--dp", type=int, help="data-parallel groups of a 2-d mesh (make_job's dp=)")
            p.add_argument("--layers", type=int, help="make_job's layers=")
            p.add_argument(
                "--device",
                choices=("cpu", "cuda"),
                help="the device type to place the job on (make_job's device=); cuda runs kernels on cupy "
                "and needs a GPU per rank where the job runs (default: the example's own)",
            )
            p.add_argument(
                "--data",
                metavar="PATH",
                help="train on this file, folder or glob (make_job's data=): text for GPT, charlm and BERT, an "
                "image folder for ResNet and InsightFace, a Parquet/CSV/JSON-lines table for Wide & Deep and "
                "the MLP; with submit, a path as the server's workers see it, under its --data-root",
            )
            p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other make_job argument")
        if name == "submit":  # the job's own run options, within the server's (unset: the server's)
            add_run_flags(p, None, only=CLIENT_FIELDS)
        if name in ("submit", "resume"):
            p.add_argument("--watch", action="store_true", help="follow the job with a progress bar")
            p.add_argument("--steps", type=int, help="train this many steps in all (default: the job's own)")
            p.add_argument(
                "--checkpoint-every",
                type=int,
                help="checkpoint every N steps (to the server's --checkpoint-root; default: the job's own)",
            )
        if name in ("plan", "run"):
            add_auto_flags(p)
        if name == "run":
            embedded_run.add_flags(p)
        if name == "plan":
            p.add_argument("--out", help="write the Plan protobuf to this file")
            p.add_argument("--html", help="write a self-contained HTML picture of the graph to this file")
            p.add_argument("--dot", help="write Graphviz dot text of the graph to this file")
            p.add_argument(
                "--profile",
                metavar="cpu|h200|FILE",
                help="print the modelled step time on this device profile (cpu: this machine, measured, "
                "with the plan's kernels timed on it)",
            )
            p.add_argument("--link", help="the profile's link kind to model (default: the profile's own)")
            p.add_argument(
                "--json",
                action="store_true",
                help="print the summary as JSON (keys: the README's Scripting section)",
            )
    return parser


def _run(args: argparse.Namespace) -> int:
    check_arguments(args)  # before any command sees a string it could choke on
    return COMMANDS[args.command][0](args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (``exit_codes.py``: 0 done, 1 failed, 2 a usage error)."""
    args = build_parser().parse_args(argv)
    return run_command(lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
