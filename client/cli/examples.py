"""An example file on the command line: loaded, its ``make_job`` called with the command's flags.

Every command that takes an example (``run``, ``plan``, ``trace``, ``submit``, ``resume``, ``generate``)
loads it here: ``--ranks/--tp/--dp/--layers/--device/--data`` and each ``--set KEY=VALUE`` (typed by what
``make_job`` says KEY takes) become its keyword arguments, options it does not take are refused, and
``--steps``/``--checkpoint-every`` override the traced job's config; ``--auto`` lays the job out as the
plan search's winner.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sbpflow.client.cli.auto import auto_job
from sbpflow.client.cli.exit_codes import UsageError


def load_example(path: str) -> Any:
    """Import a user's example file; it must define ``make_job(**kwargs) -> sbpflow.job.Job``."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file; pass a Python file that defines make_job()")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    if file.suffix != ".py" or spec is None or spec.loader is None:
        raise UsageError(
            f"{path}: not a Python file; pass an example that defines make_job(), e.g. examples/mlp.py"
        )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "make_job"):
        raise UsageError(f"{path} defines no make_job(); add `def make_job(**kwargs) -> Job`")
    return module


# make_job arguments naming files on this machine, made absolute under `run` (where they name one)
LOCAL_PATHS: dict[str, Callable[[str], bool]] = {
    "data": lambda v: True,  # a file, a folder or a glob pattern
    "tokenizer": lambda v: os.path.isfile(os.path.expanduser(v)),  # not the built-in "bytes"
}


def make_kwargs(args: argparse.Namespace, make_job: Callable[..., Any] | None = None) -> dict[str, Any]:
    """make_job keyword arguments from --ranks/--tp/--dp/--layers and any --set KEY=VALUE, each --set
    value typed by ``make_job``'s annotation of KEY (or its default's type) where it has one."""
    from sbpflow.client.cli.set_values import param_types, parse_set

    kw: dict[str, Any] = {
        k: getattr(args, k)
        for k in ("ranks", "dp", "layers", "device", "data")
        if getattr(args, k, None) is not None
    }
    if args.tp:
        kw["tp"] = True
    types = param_types(make_job) if make_job is not None else {}
    for item in args.set or ():
        key, value = parse_set(item, types)
        kw[key] = value
    if args.command == "run":  # read here: a worker's working folder may differ
        for key, is_path in LOCAL_PATHS.items():
            if isinstance(kw.get(key), str) and is_path(kw[key]):
                kw[key] = os.path.abspath(os.path.expanduser(kw[key]))
    return kw


def job_from_args(args: argparse.Namespace) -> Any:
    """The example's make_job(**options from the command line), refusing options it does not take."""
    import inspect

    make_job = load_example(args.example).make_job
    kw = make_kwargs(args, make_job)
    params = inspect.signature(make_job).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in kw if k not in params and not takes_any)
    if unknown:
        hint = "; --data needs a make_job(data=...) parameter" if "data" in unknown else ""
        raise UsageError(
            f"{args.example}: make_job() takes no {unknown}; it takes {[p for p in params if p != 'self']}"
            + hint
        )
    if kw.get("device") == "cuda" and args.command == "run" and not getattr(args, "ray_address", None):
        from sbpflow.device import array_module  # it runs on this machine: refuse before any work

        array_module("cuda")  # DeviceUnavailable: cupy or a GPU is missing, and how to fix it
    return auto_job(with_config(make_job(**kw), args), args)


# --flag -> the JobConfig field it overrides after tracing (for examples whose make_job does not take it)
_CONFIG_FLAGS = {"steps": "steps", "checkpoint_every": "checkpoint_every"}


def with_config(job: Any, args: argparse.Namespace) -> Any:
    """``job`` with the JobConfig fields given on the command line (--steps, --checkpoint-every)."""
    import dataclasses

    given = {f: getattr(args, a) for a, f in _CONFIG_FLAGS.items() if getattr(args, a, None) is not None}
    if given:
        job.config = dataclasses.replace(job.config, **given)
    return job
