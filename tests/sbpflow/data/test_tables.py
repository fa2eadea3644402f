"""TableFileSource reads the same samples from every form of a table, under any layout, decoding only the
chunks that hold the rows asked for; its hashing and vocabularies are the same in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as csv
import pyarrow.parquet as pq
import pytest

from sbpflow.data.columns import HASHED, VOCABULARY, TableField, fnv1a64
from sbpflow.data.tables import TableFileSource, chunks_decoded
from sbpflow.dtype import DType

N = 600


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SBPFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def table(n: int = N, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=n)
    return pa.table(
        {
            "f": pa.array([None if i % 11 == 3 else v for i, v in enumerate(dense)], pa.float64()),
            "i": rng.integers(-5, 50, n),
            "word": [f"w{x}" for x in rng.integers(0, 40, n)],
            "code": pa.array([None if i % 13 == 5 else int(x) for i, x in enumerate(rng.integers(0, 9, n))]),
            "label": rng.integers(0, 2, n),
        }
    )


FIELDS = (
    TableField("dense", ("f", "i"), fill=-1.0),
    TableField("ids", ("word", "code"), encoding=HASHED, buckets=97, offset_columns=True, fill_category="?"),
    TableField("vocab", ("word", "code"), encoding=VOCABULARY, buckets=10, fill_category="?"),
    TableField("label", ("label",), dtype=DType.int64, scalar=True),
)


def write_all(t: pa.Table, folder: Path) -> dict[str, Path]:
    """``t`` as Parquet (row groups of 64), CSV, JSON lines, an Arrow file and an Arrow stream."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {k: folder / f"t.{k}" for k in ("parquet", "csv", "jsonl", "feather", "arrow")}
    pq.write_table(t, out["parquet"], row_group_size=64)
    csv.write_csv(t, out["csv"])
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in t.to_pylist()))
    with pa.ipc.new_file(out["feather"], t.schema) as w:
        w.write_table(t, max_chunksize=100)
    with pa.ipc.new_stream(out["arrow"], t.schema) as w:
        w.write_table(t, max_chunksize=70)
    return out


def fnv_reference(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % (1 << 64)
    return h


def source(*paths: Path | str, batch_size: int = 32, shuffle: bool = False, **kw) -> TableFileSource:
    return TableFileSource(
        paths=tuple(map(str, paths)),
        table_fields=FIELDS,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=5,
        **kw,
    )


def test_every_form_of_a_table_gives_the_expected_samples(tmp_path: Path) -> None:
    t = table()
    files = write_all(t, tmp_path / "t")
    rows = t.to_pylist()
    got = {k: source(p, batch_size=N // 4, shuffle=True).read(1) for k, p in files.items()}
    ids = np.random.default_rng([5, 0]).permutation(N)[N // 4 : N // 2]
    want_dense = np.array([[-1.0 if rows[i]["f"] is None else rows[i]["f"], rows[i]["i"]] for i in ids])
    words = [rows[i]["word"].encode() for i in ids]
    codes = [b"?" if rows[i]["code"] is None else str(rows[i]["code"]).encode() for i in ids]
    want_ids = np.array(
        [[fnv_reference(w) % 97, 97 + fnv_reference(c) % 97] for w, c in zip(words, codes, strict=True)]
    )
    for kind, batch in got.items():
        np.testing.assert_array_equal(batch["dense"], want_dense.astype(np.float32), err_msg=kind)
        np.testing.assert_array_equal(batch["ids"], want_ids, err_msg=kind)
        np.testing.assert_array_equal(batch["label"], [rows[i]["label"] for i in ids], err_msg=kind)
        np.testing.assert_array_equal(batch["vocab"], got["parquet"]["vocab"], err_msg=kind)
        assert batch["dense"].dtype == np.float32 and batch["ids"].dtype == np.int64
        assert batch["label"].dtype == np.int64 and batch["label"].shape == (N // 4,)


def test_fnv1a64_matches_the_published_vectors() -> None:
    values = pa.array(["", "a", "foobar", "68fd1e64"])
    got = fnv1a64(values)
    assert got[:3].tolist() == [0xCBF29CE484222325, 0xAF63DC4C8601EC8C, 0x85944171F73967E8]
    assert int(got[3]) == fnv_reference(b"68fd1e64")


def test_hashing_is_the_same_in_another_process() -> None:
    code = (
        "import pyarrow as pa; from sbpflow.data.columns import fnv1a64; "
        "print(fnv1a64(pa.array(['x', 'yz', 'x', '12', 'é'])).tolist())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == fnv1a64(pa.array(["x", "yz", "x", "12", "é"])).tolist()


def test_the_vocabulary_ranks_by_count_then_value_whatever_the_chunks(tmp_path: Path) -> None:
    words = ["b"] * 3 + ["a"] * 3 + ["c"] * 5 + ["d"] + ["e"] * 2  # c:5, a:3, b:3 (tie: a first), e:2, d:1
    order = np.random.default_rng(1).permutation(len(words))
    t = pa.table({"w": [words[i] for i in order]})
    vocab = (TableField("v", ("w",), encoding=VOCABULARY, buckets=4),)
    one, many = tmp_path / "one.parquet", tmp_path / "many.parquet"
    pq.write_table(t, one)
    pq.write_table(t, many, row_group_size=3)
    for path in (one, many):
        s = TableFileSource(paths=(str(path),), table_fields=vocab, batch_size=len(words))
        got = dict(zip([words[i] for i in order], s.read(0)["v"][:, 0].tolist(), strict=True))
        assert got == {"c": 1, "a": 2, "b": 3, "e": 0, "d": 0}, path  # e, d: out of a vocabulary of 3


def test_any_layout_reads_the_same_samples_across_files_and_epochs(tmp_path: Path) -> None:
    t = table(n=500, seed=2)
    for i, start in enumerate(range(0, 500, 125)):  # four files, their rows one after another
        pq.write_table(t.slice(start, 125), tmp_path / f"part-{i}.parquet", row_group_size=40)
    glob_src = source(tmp_path / "part-*.parquet", batch_size=64, shuffle=True)
    one_src = source(*(tmp_path / f"part-{i}.parquet" for i in range(4)), batch_size=64, shuffle=True)
    pq.write_table(t, tmp_path / "whole.parquet", row_group_size=500)
    whole = source(tmp_path / "whole.parquet", batch_size=64, shuffle=True)
    assert glob_src.num_samples == 500
    for b in (0, 3, 7 + 2):  # batch 9 is in the second epoch (7 batches an epoch)
        full = glob_src.read(b)
        halves = [one_src.read(b, slice(0, 32)), one_src.read(b, slice(32, 64))]
        for k, v in full.items():
            np.testing.assert_array_equal(v, np.concatenate([h[k] for h in halves]), err_msg=k)
            np.testing.assert_array_equal(v, whole.read(b)[k], err_msg=k)


def test_a_rank_reading_a_few_rows_decodes_only_their_row_groups(tmp_path: Path) -> None:
    pq.write_table(table(), tmp_path / "t.parquet", row_group_size=30)  # 20 row groups
    s = source(tmp_path / "t.parquet", batch_size=60)
    s.read(0, slice(0, 4))
    assert chunks_decoded(s) == 1
    s.read(1, slice(10, 40))  # rows 70..99: row groups 2 and 3
    assert chunks_decoded(s) == 3
    shuffled = source(tmp_path / "t.parquet", batch_size=60, shuffle=True)
    for b in range(10):  # an epoch, its rows everywhere: each row group decoded once
        shuffled.read(b)
    assert chunks_decoded(shuffled) == 20


def test_threads_reading_at_once_get_the_same_rows(tmp_path: Path) -> None:
    pq.write_table(table(), tmp_path / "t.parquet", row_group_size=50)
    want = source(tmp_path / "t.parquet", batch_size=100, shuffle=True).read(2)
    fresh = source(tmp_path / "t.parquet", batch_size=100, shuffle=True, format="parquet")  # another key
    got: list[dict] = [{} for _ in range(4)]

    def read(i: int) -> None:
        got[i] = fresh.read(2, slice(i * 25, (i + 1) * 25))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k, v in want.items():
        np.testing.assert_array_equal(v, np.concatenate([g[k] for g in got]))


def test_a_csv_file_is_converted_once_and_again_when_it_changes(tmp_path: Path, cache: Path) -> None:
    t = table()
    csv.write_csv(t, tmp_path / "t.csv")
    first = source(tmp_path / "t.csv", batch_size=N).read(0)
    converted = list((cache / "tables").glob("*.arrow"))
    assert len(converted) == 1
    csv.write_csv(t.slice(0, 100), tmp_path / "t.csv")
    again = source(tmp_path / "t.csv", batch_size=100, format="csv")  # a new process would see the change too
    assert again.num_samples == 100 and len(list((cache / "tables").glob("*.arrow"))) == 2
    np.testing.assert_array_equal(again.read(0)["dense"], first["dense"][:100])
