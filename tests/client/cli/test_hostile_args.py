"""Hostile command lines (client/cli/argument_checks.py): every subcommand, each of its string arguments
in turn given an overlong value, a NUL byte or bytes that are not UTF-8, ends with one line naming the
argument and an exit code of the documented table (exit_codes.py), never a traceback; odd values that
pass the checks (a file-name component too long, an empty or dot path) reach the command and fail in
words too."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbpflow.client.cli.argument_checks import MAX_ARG_CHARS, argument_name
from sbpflow.client.cli.exit_codes import BROKEN_PIPE, FAILED, INTERRUPTED, OK, USAGE
from sbpflow.client.cli.main import build_parser, main
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.runs.options import MANAGER_DEFAULTS

MLP = str(Path(__file__).resolve().parents[3] / "examples" / "mlp.py")
CODES = {OK, FAILED, USAGE, INTERRUPTED, BROKEN_PIPE}
HOSTILE = {
    "overlong": "a" * (MAX_ARG_CHARS + 904),
    "nul": "job\x00id",
    "not utf-8": b"\xff\xfe-id".decode("utf-8", "surrogateescape"),  # as Python decodes such an argv
}
# values the checks let through: the command itself must say what is wrong
ODD = ["x" * 300, "", ".", "/", "-", "\t", "..\\..", "%s%n", "ü" * 200]
# commands that would run (serve, train) on a value the checks let through
RUNS = {"server", "run"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _string_arguments(p: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The arguments of ``p`` that take a free string (not a flag, a choice, an int or a float)."""
    for a in p._actions:
        takes_value = a.nargs != 0 and not isinstance(a, argparse._HelpAction)
        if takes_value and a.choices is None and a.type in (None, str):
            yield a


def _base(command: str, p: argparse.ArgumentParser) -> list[str]:
    """A command line of ``command`` that parses: its required arguments, plausibly filled."""
    argv = [command]
    for a in p._actions:
        if not a.option_strings and a.nargs != "?" and a.dest != "help":
            argv.append(MLP if a.dest == "example" else "0123456789abcdef")
        elif a.required:
            argv += [a.option_strings[0], "ck"]
    for group in p._mutually_exclusive_groups:  # generate's --checkpoint | --job: one of them
        if group.required:
            argv += [group._group_actions[0].option_strings[0], "ck"]
    return argv


def _with(p: argparse.ArgumentParser, argv: list[str], a: argparse.Action, value: str) -> list[str]:
    """``argv`` with ``a`` given ``value`` (a flag added, a positional replaced or added)."""
    if a.option_strings:
        for group in p._mutually_exclusive_groups:  # a value for --job stands in for _base's --checkpoint
            for other in group._group_actions if a in group._group_actions else ():
                if other is not a and other.option_strings[0] in argv:
                    at = argv.index(other.option_strings[0])
                    argv = argv[:at] + argv[at + 2 :]
        return [*argv, a.option_strings[0], value]
    out, positionals = list(argv), [b.dest for b in _positionals(p)]
    if a.nargs == "?":  # status's id, resume's example: right after the others, as argparse reads them
        out.insert(1 + len(positionals), value)
    else:
        out[1 + positionals.index(a.dest)] = value
    return out


def _positionals(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if not a.option_strings and a.nargs != "?"]


def _cases() -> Iterator[tuple[str, str, str]]:
    for command, p in _subparsers().items():
        for a in _string_arguments(p):
            for kind in HOSTILE:
                yield command, a.dest, kind


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = int(e.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("command", "dest", "kind"), list(_cases()))
def test_a_hostile_value_is_refused_in_one_line(
    command: str, dest: str, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = _subparsers()[command]
    (a,) = (b for b in p._actions if b.dest == dest)
    code, err = _run(_with(p, _base(command, p), a, HOSTILE[kind]), capsys)
    assert code == USAGE, err
    assert err.startswith(f"sbpflow: error: {argument_name(dest)} ") and err.count("\n") == 1, err
    assert "Traceback" not in err and len(err) < 400


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("hostile")
    run = MANAGER_DEFAULTS.replace(backend="inprocess")
    p = ControlPlane(ServerConfig(store=str(tmp / "jobs.db"), run=run, slots=2, http_port=None)).start()
    yield p
    p.stop()


@pytest.mark.parametrize("value", ODD)
@pytest.mark.parametrize("command", sorted(set(_subparsers()) - RUNS))
def test_an_odd_value_fails_in_words(
    command: str,
    value: str,
    plane: ControlPlane,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative --out lands here, not in the checkout
    p = _subparsers()[command]
    base = _base(command, p)
    if any(a.dest == "address" for a in p._actions):
        base += ["--address", plane.address]
    for a in _string_arguments(p):
        if a.dest in ("address", "token", "tls_ca"):  # the channel's own: other tests
            continue
        code, err = _run(_with(p, base, a, value), capsys)
        assert code in CODES and "Traceback" not in err, (a.dest, err)
        assert code == OK or 0 < len(err.strip().splitlines()) <= 3, (a.dest, err)  # said in a line or so


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(min_size=1, max_size=40))
def test_any_job_id_text_to_export_fails_in_words(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run(["export", value, "--checkpoint-root", str(tmp_path)], capsys)
    assert (
        code in (FAILED, USAGE) and "Traceback" not in err and err.startswith(("sbpflow: error: ", "usage:"))
    )


def test_real_argv_bytes_not_utf8_and_overlong(tmp_path: Path) -> None:
    """As a shell passes them: bytes that are not UTF-8, a 5,000-character --out."""
    for argv in (
        [b"status", b"\xff\xfe", b"--address", b"127.0.0.1:1"],
        [b"export", b"ck", b"--out", b"o" * 5000],
    ):
        r = subprocess.run(
            [sys.executable.encode(), b"-m", b"sbpflow.client.cli.main", *argv],
            capture_output=True,
            cwd=tmp_path,
            timeout=120,
        )
        err = r.stderr.decode("utf-8", "replace")
        assert r.returncode == USAGE and b"Traceback" not in r.stderr, err
        assert err.count("\n") == 1 and ("id is not valid UTF-8" in err or "--out is 5000 characters" in err)
