"""The CLI's run flags are made from RunOptions' fields: one flag each, typed by its hint, with its help
text and the command's defaults; parsed flags make a RunOptions, and a bad value names the flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from sbpflow.client.cli.main import build_parser
from sbpflow.client.cli.run_flags import add_run_flags, flag_of, run_options_from_args
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import FIELD_NAMES, MANAGER_DEFAULTS, RunOptions

SF_RUN = RunOptions()  # sf.run's defaults


def parser(defaults: RunOptions = SF_RUN, exclude: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_run_flags(p, defaults, exclude)
    return p


def flags_of(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def test_one_flag_per_field_with_its_help() -> None:
    flags = flags_of(parser())
    for f in dataclasses.fields(RunOptions):
        if f.name not in FIELD_NAMES:  # the control plane's own (data_roots): no flag
            assert flag_of(f.name) not in flags
            continue
        action = flags[flag_of(f.name)]
        assert action.dest == f.name and action.help and f.metadata["help"] in action.help
    assert {"--backend", "--ray-address", "--timeout", "--max-restarts", "--trace", "--no-trace"} <= set(
        flags
    )
    assert flags["--backend"].choices == ("ray", "inprocess")


def test_parsed_flags_make_options_typed_by_the_hints() -> None:
    argv = ["--backend", "inprocess", "--ray-address", "auto", "--timeout", "2.5", "--max-restarts", "3"]
    got = run_options_from_args(parser().parse_args([*argv, "--trace", "--return-parameters"]), RunOptions())
    want = RunOptions("inprocess", "auto", 2.5, 3, trace=True, return_parameters=True)
    assert got == want
    assert (
        run_options_from_args(parser(MANAGER_DEFAULTS).parse_args([]), MANAGER_DEFAULTS) == MANAGER_DEFAULTS
    )
    off = parser(MANAGER_DEFAULTS).parse_args(["--no-return-parameters"])
    assert run_options_from_args(off, MANAGER_DEFAULTS).return_parameters is False


def test_excluded_fields_have_no_flag_and_keep_their_default() -> None:
    p = parser(exclude=("trace", "max_restarts"))
    assert "--trace" not in flags_of(p) and "--max-restarts" not in flags_of(p)
    args = p.parse_args(["--timeout", "9"])
    args.trace = "a-file.json"  # a command's own flag of that name is not read
    assert run_options_from_args(args, RunOptions()) == RunOptions(timeout=9.0)
    with pytest.raises(SbpflowError, match="no such field"):
        parser(exclude=("steps",))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-restarts", "-1"], "--max-restarts -1: give 0 (never restart) or more"),
        (["--timeout", "0"], "--timeout 0.0: give a finite number of seconds greater than 0"),
        (["--timeout", "inf"], "--timeout inf: give a finite number"),
    ],
)
def test_a_bad_value_names_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SbpflowError) as e:
        run_options_from_args(parser().parse_args(argv), RunOptions())
    assert message in str(e.value)


def test_server_and_run_take_the_shared_flags() -> None:
    server = build_parser().parse_args(["server", "--timeout", "60", "--no-return-parameters"])
    from sbpflow.client.cli.jobs import server_config

    cfg = server_config(server)
    assert cfg.run == MANAGER_DEFAULTS.replace(timeout=60.0, return_parameters=False)
    run = build_parser().parse_args(
        ["run", "x.py", "--backend", "inprocess", "--timeout", "5", "--trace", "t.json"]
    )
    assert (run.backend, run.timeout, run.trace) == ("inprocess", 5.0, "t.json")  # run's --trace is a file
    assert set(FIELD_NAMES) - set(run.run_option_flags) == {"trace", "return_parameters", "max_restarts"}
