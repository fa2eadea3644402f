"""The CLI writes only regular files (client/cli/output_files.py): ``export --out``, ``trace --out``,
``plan --out/--html/--dot`` refuse a symlink, a device, a FIFO or a directory and replace nothing; a
regular file is replaced whole, and a failed write leaves it as it was."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint.read import TensorFile
from sbpflow.client.cli.exit_codes import FAILED, OK, USAGE, UsageError
from sbpflow.client.cli.main import main
from sbpflow.client.cli.output_files import output_path, write_output
from tests.examples.test_examples import load

MLP = str(Path(__file__).resolve().parents[3] / "examples" / "mlp.py")


def _symlink(tmp: Path) -> Path:
    (tmp / "victim").write_text("keep me")
    (tmp / "link").symlink_to(tmp / "victim")
    return tmp / "link"


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "fifo")
    return tmp / "fifo"


def _directory(tmp: Path) -> Path:
    (tmp / "folder").mkdir()
    return tmp / "folder"


def _device(tmp: Path) -> Path:
    try:  # a character device of our own (null's numbers), never the machine's /dev/null
        os.mknod(tmp / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return tmp / "dev"


def _dangling(tmp: Path) -> Path:
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    return tmp / "dangling"


TARGETS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "symlink": (_symlink, "a symbolic link"),
    "dangling symlink": (_dangling, "a symbolic link"),
    "fifo": (_fifo, "a FIFO"),
    "directory": (_directory, "a directory"),
    "device": (_device, "a character device"),
}


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Each entry of ``folder`` with its lstat mode and, for a regular file, its text."""
    out = {}
    for p in sorted(folder.iterdir()):
        mode = p.lstat().st_mode
        out[p.name] = (mode, p.read_text() if stat.S_ISREG(mode) else "")
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ck")
    job = load("mlp").make_job(ranks=1, hidden=4, layers=1, steps=2)
    job = dataclasses.replace(job, config=dataclasses.replace(job.config, checkpoint_every=2))
    sf.run(job, backend="inprocess", checkpoint_dir=str(root), timeout=60)
    return root


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize(
    "command",
    [
        ["trace", MLP, "--out"],
        ["plan", MLP, "--dot"],
        ["export", "CHECKPOINT", "--format", "npz", "--out"],
        ["export", "CHECKPOINT", "--out"],
    ],
)
def test_a_target_that_is_not_a_regular_file_is_refused_and_kept(
    kind: str, command: list[str], tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, words = TARGETS[kind]
    target = make(tmp_path)
    before = _snapshot(tmp_path)
    argv = [str(checkpoint) if a == "CHECKPOINT" else a for a in command] + [str(target)]
    assert main(argv) == USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"sbpflow: error: {command[-1]} ") and f"is {words};" in err and "\n" == err[-1]
    assert err.count("\n") == 1
    assert _snapshot(tmp_path) == before  # nothing replaced, no temp folder left


def test_export_replaces_a_regular_file_whole(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = sorted(p.tensor for p in load("mlp").make_job(ranks=1, hidden=4, layers=1).parameters)
    out = tmp_path / "weights.bin"  # not .npz: the file is still written under this very name
    out.write_text("old")
    assert main(["export", str(checkpoint), "--format", "npz", "--out", str(out)]) == OK
    with np.load(out) as z:
        assert sorted(z.files) == names
    assert f"wrote {out}" in capsys.readouterr().out
    safetensors = tmp_path / "w.safetensors"
    assert main(["export", str(checkpoint), "--out", str(safetensors)]) == OK
    assert sorted(TensorFile(safetensors).names()) == names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors", "weights.bin"]


def test_a_failed_write_leaves_the_target_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "plan.pb"
    target.write_bytes(b"previous")
    with pytest.raises(RuntimeError), output_path(target, "--out") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert target.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["plan.pb"]


def test_write_output_through_a_symlinked_folder_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert write_output(tmp_path / "alias" / "f.txt", "héllo", "--html") == 6
    assert (tmp_path / "real" / "f.txt").read_text(encoding="utf-8") == "héllo"


def test_a_symlink_target_is_refused_even_to_a_regular_file(tmp_path: Path) -> None:
    link = _symlink(tmp_path)
    with pytest.raises(UsageError, match="--dot .* is a symbolic link"):
        write_output(link, "x", "--dot")
    assert (tmp_path / "victim").read_text() == "keep me" and link.is_symlink()


def test_a_missing_folder_fails_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", MLP, "--out", str(tmp_path / "no" / "such.pb")]) == FAILED
    assert "cannot write in its folder (No such file or directory)" in capsys.readouterr().err
