"""``sbpflow plan --auto`` and ``sbpflow run --auto``: the example's job laid out as the automatic plan
search's winner (``control_plane/compiler/search/auto_plan.py``), after printing the candidates it weighed and
why the winner won."""

from __future__ import annotations

import argparse
import sys

from sbpflow.client.cli.byte_sizes import parse_bytes
from sbpflow.client.cli.exit_codes import UsageError
from sbpflow.job import Job


def add_auto_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--auto",
        action="store_true",
        help="search the layouts (DP, TP, DPxTP, PPxDP, ZeRO 1-3, recompute, micro-batches) on --ranks and "
        "use the fastest whose plan fits --memory-per-device, as the cost model prices it",
    )
    p.add_argument(
        "--memory-per-device",
        type=parse_bytes,
        metavar="SIZE",
        help="with --auto: each device's memory budget, e.g. 80GB or 16GiB (default: the profile's device)",
    )


def auto_job(job: Job, args: argparse.Namespace) -> Job:
    """``job`` as the search's winner when ``--auto`` is given; the table and the reasons go to stdout, or
    to stderr where stdout holds JSON."""
    budget = getattr(args, "memory_per_device", None)
    if not getattr(args, "auto", False):
        if budget is not None:
            raise UsageError("--memory-per-device is the budget of --auto's search: add --auto")
        return job
    if getattr(args, "tp", False) or getattr(args, "dp", None):
        raise UsageError("--auto chooses the layout itself: drop --tp and --dp (give --ranks)")
    from sbpflow.control_plane.compiler.search.auto_layouts import relayout
    from sbpflow.control_plane.profiling import pricing  # the compiler loads only for --auto

    profile = getattr(args, "profile", None) or "cpu"
    found = pricing.search(job, budget, profile=profile)
    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    print(f"--auto on the {profile} profile: {len(found.candidates)} layouts weighed", file=out)
    print(found.table(), found.why(), sep="\n\n", end="\n\n", file=out)
    return relayout(job, found.winner.layout)
