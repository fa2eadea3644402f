"""README.md, docs/from-pytorch.md, deploy/README.md and deploy/netns-cluster.sh say only what the CLI takes: every ``sbpflow``
command line they show parses with the real parser, and the script is valid bash."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from sbpflow.client.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SHOWN = {
    "README.md": 10,
    "docs/from-pytorch.md": 5,
    "deploy/README.md": 5,
    "deploy/netns-cluster.sh": 2,
}  # at least


def code(name: str) -> str:
    """The shell a file shows: a README's fenced blocks, a script's lines that are not comments."""
    text = (ROOT / name).read_text()
    if name.endswith(".md"):
        return "\n".join(re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.S))
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def commands(text: str) -> list[str]:
    """``sbpflow SUBCOMMAND ...`` command lines (continuations joined, comments cut, each command of a
    pipe, a list or a background ``&`` on its own)."""
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    out = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        for part in re.split(r"\s*(?:;|\|\|?|&&?)\s*", re.split(r"\s+#", line)[0]):  # each command
            words = part.split()
            for i, w in enumerate(words[:-1]):
                if w == "sbpflow" and words[i + 1] in subcommands and (i == 0 or words[i - 1] != "-n"):
                    out.append(" ".join(words[i:]))
    return out


@pytest.mark.parametrize("name", sorted(SHOWN))
def test_every_sbpflow_command_shown_parses(name: str) -> None:
    shown = commands(code(name))
    assert len(shown) >= SHOWN[name], shown
    for line in shown:
        try:
            build_parser().parse_args(shlex.split(line)[1:])
        except SystemExit as e:
            pytest.fail(f"{name}: `{line}` does not parse (exit {e.code})")


def test_the_cluster_script_is_valid_bash() -> None:
    p = subprocess.run(["bash", "-n", str(DEPLOY / "netns-cluster.sh")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
