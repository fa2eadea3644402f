"""The checkpoint format without a runtime: safetensors bytes as the spec lays them out, shards written
under one layout and read back under another (splits, replicas, partial sums, uneven), completeness
(no manifest, no checkpoint; a dead attempt's files never mixed in), damage detected, export/import; a
full or read-only disk (a real tmpfs in a private mount namespace) fails a write with the reason and
leaves no temp file."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from sbpflow.checkpoint import write as ck
from sbpflow.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    SafetensorsFile,
    crc32_combine,
    crc_of,
    file_crc,
    step_dir,
    write_safetensors,
)
from sbpflow.checkpoint.read import (
    CheckpointReader,
    CorruptCheckpoint,
    corrupt_note,
    export,
    latest,
    latest_intact,
    list_checkpoints,
    open_tensors,
    prune,
    read_logical,
    resolve,
    verify,
)
from sbpflow.placement import Placement, placement
from sbpflow.sbp import B, NdSbp, P, S
from sbpflow.sharding import shard, shard_index

LAYOUTS: dict[str, tuple[Placement, NdSbp]] = {
    "1": (placement("cpu", [0]), (B,)),
    "dp4": (placement("cpu", [0, 1, 2, 3]), (B,)),
    "s0x4": (placement("cpu", [0, 1, 2, 3]), (S(0),)),
    "s1x3": (placement("cpu", [0, 1, 2]), (S(1),)),
    "2x2-s0-s1": (placement("cpu", [[0, 1], [2, 3]]), (S(0), S(1))),
    "2x2-b-s1": (placement("cpu", [[0, 1], [2, 3]]), (B, S(1))),
    "2x2-s0-s0": (placement("cpu", [[0, 1], [2, 3]]), (S(0), S(0))),
    "p2": (placement("cpu", [0, 1]), (P,)),
    "2x2-p-s0": (placement("cpu", [[0, 1], [2, 3]]), (P, S(0))),
}


def save(
    root: Path, step: int, value: np.ndarray, layout: str, token: str = "a1", name: str = "w"
) -> list[int]:
    where, sbp = LAYOUTS[layout]
    locals_ = shard(value, where, sbp)
    for rank in where.ranks:
        shards = [ck.shard_of(name, "parameter", locals_[rank], where, sbp, rank, value.shape)]
        ck.write_rank(root, step, rank, token, [s for s in shards if ck.writes(name, where, sbp, rank)])
    return list(where.ranks)


def test_safetensors_bytes_follow_the_spec(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray] = {
        "a": np.arange(6, dtype=np.float64).reshape(2, 3),
        "b": np.array([1, -2, 3], dtype=np.int32),
        "c": np.array([True, False]),
        "d": np.zeros((0, 4), np.float32),
        "e": np.arange(5, dtype=np.float16),
    }
    path = tmp_path / "x.safetensors"
    n = write_safetensors(path, tensors, {"k": "v"})
    raw = path.read_bytes()
    assert n == len(raw)
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert (8 + hlen) % 8 == 0, "data must start 8-byte aligned"
    header = json.loads(raw[8 : 8 + hlen])
    assert header.pop("__metadata__") == {"k": "v"}
    codes = {"a": "F64", "b": "I32", "c": "BOOL", "d": "F32", "e": "F16"}
    end = 0
    for name, want in tensors.items():
        e = header[name]
        assert e["dtype"] == codes[name] and e["shape"] == list(want.shape)
        lo, hi = e["data_offsets"]
        assert lo == end, "entries are contiguous, in order"
        end = hi
        got = np.frombuffer(raw[8 + hlen + lo : 8 + hlen + hi], dtype=want.dtype).reshape(want.shape)
        np.testing.assert_array_equal(got, want)
    assert 8 + hlen + end == len(raw)
    f = SafetensorsFile(path)
    for name, want in tensors.items():
        np.testing.assert_array_equal(f[name], want)
        assert f[name].dtype == want.dtype
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("src", list(LAYOUTS))
@pytest.mark.parametrize("dst", ["1", "s0x4", "2x2-b-s1", "s1x3", "2x2-s0-s0"])
def test_saved_under_one_layout_every_rank_of_another_reads_its_shard(
    tmp_path: Path, src: str, dst: str
) -> None:
    value = np.random.default_rng(0).standard_normal((10, 7))  # uneven under 4 and 3
    ranks = save(tmp_path, 4, value, src)
    assert ck.try_complete(tmp_path, 4, "a1", ranks, "job", seed=3)
    r = CheckpointReader(tmp_path)
    assert r.step == 4 and r.manifest.seed == 3 and r.manifest.data_position == 4
    where, sbp = LAYOUTS[dst]
    for coord in where.coords():
        index = shard_index(value.shape, where.shape, sbp, coord)
        got = r.read("w", index)
        np.testing.assert_allclose(
            got, value[index], rtol=1e-15, atol=1e-15 if LAYOUTS[src][1][0] == P else 0
        )
    entry = r.manifest.tensor("w")
    assert entry.partial == (P in LAYOUTS[src][1])


def test_replicas_are_written_once_and_spread_over_the_replicas(tmp_path: Path) -> None:
    where, sbp = LAYOUTS["dp4"]
    writers = {
        n: [r for r in where.ranks if ck.writes(n, where, sbp, r)] for n in (f"t{i}" for i in range(16))
    }
    assert all(len(w) == 1 for w in writers.values())
    assert len({w[0] for w in writers.values()}) > 1, "every replicated tensor written by one rank"
    where, sbp = LAYOUTS["2x2-b-s1"]
    assert sorted(len([r for r in where.ranks if ck.writes("x", where, sbp, r)]) for _ in range(1)) == [2]


def test_reading_touches_only_the_pieces_that_overlap(tmp_path: Path) -> None:
    value = np.arange(40.0).reshape(8, 5)
    ranks = save(tmp_path, 1, value, "s0x4")
    ck.try_complete(tmp_path, 1, "a1", ranks, "job", 0)
    r = CheckpointReader(tmp_path)
    np.testing.assert_array_equal(r.read("w", (slice(0, 2), slice(0, 5))), value[:2])
    assert list(r._files) == ["rank-00000.a1.safetensors"], "a rank's slice opened other ranks' files"


def test_a_checkpoint_is_listed_only_when_every_rank_has_written(tmp_path: Path) -> None:
    value = np.ones((4, 4))
    save(tmp_path, 5, value, "s0x4")
    ck.try_complete(tmp_path, 5, "a1", [0, 1, 2, 3], "job", 0)
    where, sbp = LAYOUTS["s0x4"]
    parts = shard(value * 2, where, sbp)
    for rank in (0, 1):  # step 10 of attempt a1: two ranks wrote, then the attempt died
        ck.write_rank(
            tmp_path, 10, rank, "a1", [ck.shard_of("w", "parameter", parts[rank], where, sbp, rank, (4, 4))]
        )
    assert not ck.try_complete(tmp_path, 10, "a1", [0, 1, 2, 3], "job", 0)
    (step_dir(tmp_path, 10) / "rank-00002.a1.safetensors.tmp").write_bytes(b"half")
    assert [c.step for c in list_checkpoints(tmp_path)] == [5]
    assert latest(tmp_path).step == 5  # type: ignore[union-attr]
    np.testing.assert_array_equal(read_logical(tmp_path)["w"], value)
    # attempt a2 writes ranks 2 and 3 of step 10: a1's files must not complete it
    for rank in (2, 3):
        ck.write_rank(
            tmp_path, 10, rank, "a2", [ck.shard_of("w", "parameter", parts[rank], where, sbp, rank, (4, 4))]
        )
    assert not ck.try_complete(tmp_path, 10, "a2", [0, 1, 2, 3], "job", 0)
    gone = prune(tmp_path)
    assert step_dir(tmp_path, 10) in gone and not step_dir(tmp_path, 10).exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [5]


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    ranks = save(tmp_path, 2, np.ones((8, 2)), "s0x4")
    ck.try_complete(tmp_path, 2, "a1", ranks, "job", 0)
    f = step_dir(tmp_path, 2) / "rank-00001.a1.safetensors"
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="rank-00001.a1.safetensors has .* bytes"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        CheckpointReader(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="has no tensor 'v'"):
        save(tmp_path, 3, np.ones(2), "1")
        ck.try_complete(tmp_path, 3, "a1", [0], "job", 0)
        CheckpointReader(step_dir(tmp_path, 3)).read("v")


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_export_then_import_gives_the_logical_tensors(tmp_path: Path, fmt: str) -> None:
    rng = np.random.default_rng(1)
    w, b = rng.standard_normal((6, 5)), rng.standard_normal(5).astype(np.float32)
    save(tmp_path, 3, w, "2x2-s0-s1", name="w")
    ranks = save(tmp_path, 3, b, "p2", name="b")  # ranks 0, 1 rewrite their files with b only
    for rank in (0, 1):  # so give ranks 0 and 1 both tensors
        where, sbp = LAYOUTS["2x2-s0-s1"]
        shards = [ck.shard_of("w", "parameter", shard(w, where, sbp)[rank], where, sbp, rank, w.shape)]
        pw, psbp = LAYOUTS["p2"]
        shards.append(ck.shard_of("b", "parameter", shard(b, pw, psbp)[rank], pw, psbp, rank, b.shape))
        ck.write_rank(tmp_path, 3, rank, "a1", shards)
    assert ranks == [0, 1] and ck.try_complete(tmp_path, 3, "a1", [0, 1, 2, 3], "job", 0)
    out = export(tmp_path, tmp_path / f"model.{fmt}", fmt)
    back = open_tensors(out)
    assert sorted(back.names()) == ["b", "w"]
    np.testing.assert_array_equal(back.read("w"), w)
    np.testing.assert_allclose(back.read("b"), b, rtol=1e-6)
    np.testing.assert_array_equal(back.read("w", (slice(1, 3), slice(0, 5))), w[1:3])
    with pytest.raises(CheckpointError, match="unknown; use one of"):
        export(tmp_path, tmp_path / "x", "pickle")


# ---- integrity: checksums, fallback, old checkpoints, temp files ----------------------------------------


def complete(root: Path, step: int, value: np.ndarray, layout: str = "s0x4") -> Path:
    ck.try_complete(root, step, "a1", save(root, step, value, layout), "job", 0)
    return step_dir(root, step)


def garble(f: Path, at: int = -16) -> None:
    """Overwrite bytes near the end of ``f`` (tensor data) with garbage of the same size."""
    raw = bytearray(f.read_bytes())
    raw[at:] = bytes(b ^ 0x5A for b in raw[at:])
    f.write_bytes(bytes(raw))


def test_crc32_combine_is_zlibs() -> None:
    rng = np.random.default_rng(0)
    for la, lb in [(0, 0), (1, 0), (0, 1), (7, 9), (100, 4097), (5, 1 << 16)]:
        a, b = rng.bytes(la), rng.bytes(lb)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)


def test_the_checkpoint_crc32_is_zlibs_for_arrays_bytes_and_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for n in [0, 1, 7, 4096, (1 << 20) + 3]:
        a = rng.random(n)
        assert crc_of(a) == zlib.crc32(a.tobytes()) and crc_of(a.tobytes(), 5) == zlib.crc32(a.tobytes(), 5)
        f = tmp_path / f"{n}.bin"
        f.write_bytes(a.tobytes())
        assert file_crc(f, chunk=1000) == (zlib.crc32(a.tobytes()), a.nbytes)


def test_the_manifest_holds_each_files_and_each_pieces_crc32(tmp_path: Path) -> None:
    d = complete(tmp_path, 1, np.arange(40.0).reshape(8, 5))
    m = json.loads((d / MANIFEST).read_text())
    assert m["format_version"] == 2 and set(m["checksums"]) == set(m["files"])
    for name, want in m["checksums"].items():  # of every byte, as any crc32 tool computes it
        assert want == f"crc32:{zlib.crc32((d / name).read_bytes()):08x}"
    for p in m["tensors"][0]["pieces"]:
        entry = SafetensorsFile(d / p["file"])[p["key"]]
        assert p["checksum"] == f"crc32:{zlib.crc32(entry.tobytes()):08x}"
    assert verify(d).step == 1


def test_a_shard_overwritten_with_same_size_garbage_is_refused_naming_it(tmp_path: Path) -> None:
    d = complete(tmp_path, 1, np.arange(40.0).reshape(8, 5))
    f = d / "rank-00002.a1.safetensors"
    size = f.stat().st_size
    garble(f)
    assert f.stat().st_size == size
    r = CheckpointReader(d)  # sizes match: it opens
    np.testing.assert_array_equal(r.read("w", (slice(0, 2), slice(0, 5))), np.arange(10.0).reshape(2, 5))
    with pytest.raises(CheckpointError, match=r"tensor 'w' in file rank-00002\.a1\.safetensors has checksum "
                       r"crc32:[0-9a-f]{8}, the manifest says crc32:[0-9a-f]{8}"):  # fmt: skip
        r.read("w")
    with pytest.raises(CheckpointError, match=r"file rank-00002\.a1\.safetensors has checksum crc32:"):
        verify(d)


def test_a_truncated_shard_is_refused(tmp_path: Path) -> None:
    d = complete(tmp_path, 1, np.ones((8, 2)))
    f = d / "rank-00003.a1.safetensors"
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(
        CheckpointError, match=r"rank-00003\.a1\.safetensors has \d+ bytes, the manifest says"
    ):
        verify(d)
    with pytest.raises(CheckpointError, match="rank-00003.a1.safetensors has"):
        CheckpointReader(d)


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_intact_one(tmp_path: Path) -> None:
    complete(tmp_path, 2, np.ones((8, 2)))
    complete(tmp_path, 4, np.ones((8, 2)) * 2)
    d6 = complete(tmp_path, 6, np.ones((8, 2)) * 3)
    garble(step_dir(tmp_path, 4) / "rank-00000.a1.safetensors")
    (d6 / "rank-00001.a1.safetensors").write_bytes(b"short")
    passed: list[CorruptCheckpoint] = []
    found = latest_intact(tmp_path, passed.append)
    assert found is not None and found.step == 2
    assert [c.info.step for c in passed] == [6, 4]
    assert latest(tmp_path).step == 6  # type: ignore[union-attr]  # listing alone reads no bytes
    assert resolve(tmp_path, lambda c: None) == step_dir(tmp_path, 2)
    note = corrupt_note(passed[0], found.step)
    assert note.startswith("checkpoint step-00000006 is corrupt (file rank-00001.a1.safetensors has 5 bytes")
    assert note.endswith("; resuming from step-00000002")
    np.testing.assert_array_equal(read_logical(resolve(tmp_path, lambda c: None))["w"], np.ones((8, 2)))


def test_latest_intact_at_most_a_step_neither_reads_nor_reports_the_later_ones(tmp_path: Path) -> None:
    complete(tmp_path, 2, np.ones((8, 2)))
    complete(tmp_path, 4, np.ones((8, 2)) * 2)
    complete(tmp_path, 6, np.ones((8, 2)) * 3)
    garble(step_dir(tmp_path, 6) / "rank-00000.a1.safetensors")
    passed: list[CorruptCheckpoint] = []
    assert latest_intact(tmp_path, passed.append, at_most=5).step == 4  # type: ignore[union-attr]
    assert passed == []  # step 6 lies past the bound: not read, so not reported
    assert latest_intact(tmp_path, passed.append, at_most=4).step == 4  # type: ignore[union-attr]
    assert latest_intact(tmp_path, passed.append, at_most=1) is None


def test_a_version_1_checkpoint_without_checksums_still_loads(tmp_path: Path) -> None:
    d = complete(tmp_path, 3, np.arange(16.0).reshape(8, 2))
    m = json.loads((d / MANIFEST).read_text())
    m["format_version"] = 1
    del m["checksums"]
    for t in m["tensors"]:
        for p in t["pieces"]:
            del p["checksum"]
    (d / MANIFEST).write_text(json.dumps(m))
    assert verify(d).format_version == 1 and latest_intact(tmp_path).step == 3  # type: ignore[union-attr]
    np.testing.assert_array_equal(read_logical(tmp_path)["w"], np.arange(16.0).reshape(8, 2))


def test_temp_files_of_a_dead_writer_are_cleaned_up(tmp_path: Path) -> None:
    d = complete(tmp_path, 2, np.ones((8, 2)))
    (d / "rank-00001.a2.safetensors.tmp").write_bytes(b"half")  # a later attempt died rewriting step 2
    (d / f"{MANIFEST}.a2.123-abcd.tmp").write_text("{")
    partial = step_dir(tmp_path, 4)
    partial.mkdir()
    (partial / "rank-00000.a2.safetensors.tmp").write_bytes(b"half")
    damaged = complete(tmp_path, 6, np.ones((8, 2)))
    (damaged / MANIFEST).write_text("{not json")
    (damaged / "rank-00000.a3.safetensors.tmp").write_bytes(b"half")
    gone = prune(tmp_path)
    assert not list(tmp_path.rglob("*.tmp")) and not partial.exists()
    assert len(gone) == 4 and (damaged / "rank-00000.a1.safetensors").exists()  # kept: not ours to judge
    assert [c.step for c in list_checkpoints(tmp_path)] == [2] and verify(d).step == 2


REPO = Path(__file__).resolve().parents[2]


def in_tmpfs(mount: Path, size: str, script: str, read_only: bool = False, timeout: float = 300) -> dict:
    """Run ``script`` (Python; ``MOUNT`` is ``mount``; it prints one JSON line, returned) in a child that
    has a fresh tmpfs of ``size`` on ``mount`` (read-only when asked), in a private mount namespace (and
    a user namespace when not root: root ignores chmod, and only a mount is really read-only or full).
    Skips when this machine allows neither."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to mount a tmpfs in a private namespace")
    ns = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    mount.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    code = f"MOUNT = {str(mount)!r}\n" + textwrap.dedent(script)
    shell = 'mount -t tmpfs -o "$1" tmpfs "$2" || exit 97; shift 2; exec "$@"'
    cmd = [*ns, "sh", "-c", shell, "sh", opts, str(mount), sys.executable, "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if r.returncode == 97 or (r.returncode and r.stderr.startswith("unshare:")):
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_WRITE = """
import json
import numpy as np
from pathlib import Path
from sbpflow.checkpoint import write as ck
from sbpflow.placement import placement
from sbpflow.sbp import B

root, where = Path(MOUNT) / "ckpt", placement("cpu", [0])
value = np.ones((256, 1024), np.float32)  # 1 MiB
shards = [ck.shard_of("w", "parameter", value, where, (B,), 0, value.shape)]
out = {}
try:
    ck.write_rank(root, 1, 0, "a1", shards)
    out["rank file"] = True
    with open(Path(MOUNT) / "filler", "wb", buffering=0) as f:  # the disk full: the manifest cannot be written
        try:
            while f.write(bytes(4096)) == 4096:
                pass
        except OSError:  # ENOSPC once a short write took the last bytes
            pass
    ck.try_complete(root, 1, "a1", [0], "job", 0)
except ck.CheckpointStorageError as e:
    out.update(error=type(e).__name__, reason=e.reason, message=str(e))
out["left"] = sorted(p.name for p in Path(MOUNT).rglob("*") if p.is_file() and p.name != "filler")
print(json.dumps(out))
"""


@pytest.mark.parametrize("size", ["512k", "1100k"])
def test_a_full_disk_fails_a_write_with_its_reason_and_leaves_no_temp_file(tmp_path: Path, size: str) -> None:
    out = in_tmpfs(tmp_path / "disk", size, _WRITE)
    assert out["error"] == "CheckpointStorageFull" and out["reason"] == "CHECKPOINT_STORAGE_FULL", out
    assert "No space left on device (ENOSPC)" in out["message"] and "free space" in out["message"], out
    assert "--checkpoint-root" in out["message"] and str(tmp_path / "disk" / "ckpt") in out["message"], out
    assert not [n for n in out["left"] if n.endswith(".tmp")], (
        out
    )  # neither the rank file's nor the manifest's
    if out.get("rank file"):  # 1100k: the rank file fit, then its manifest did not
        assert out["left"] == ["rank-00000.a1.safetensors"], out
    else:  # 512k: the rank file itself did not fit
        assert out["left"] == [], out


def test_a_read_only_disk_fails_a_write_saying_so(tmp_path: Path) -> None:
    out = in_tmpfs(tmp_path / "disk", "1m", _WRITE, read_only=True)
    assert out["error"] == "CheckpointStorageReadOnly" and out["reason"] == "CHECKPOINT_STORAGE_READ_ONLY", (
        out
    )
    assert "Read-only file system (EROFS)" in out["message"] and "make it writable" in out["message"], out
    assert out["left"] == [], out
