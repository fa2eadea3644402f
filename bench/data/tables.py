"""Parquet rows/s: sbpflow's TableFileSource against `pyarrow.dataset` scanning the same file, side by side.

    python bench/data/tables.py            # 300,000 Criteo-like rows, batch 4,096, 3 repeats
    python bench/data/tables.py --quick    # 60,000 rows, 1 repeat: a smoke run

The table is Criteo-shaped: 13 float columns (10% empty), 26 string columns of 8 hex digits (5% empty;
each column's values skewed, 10 to 100,000 distinct), a 0/1 ``label``; written here with pyarrow in row
groups of 65,536 rows. One epoch of batches is read on each side, from the file to the arrays a Wide &
Deep step takes: ``dense`` float32 [B, 13] (empty cells 0), ``ids`` int64 [B, 26] (each value's FNV-1a
hash into 2**20 buckets, column c's ids offset by c * 2**20; empty cells hashed as ""), ``label`` float32:

- sbpflow: ``TableFileSource.read(b)`` for every batch of the epoch, the source opened afresh each
  repetition (its per-process caches dropped), so the timing includes opening the file;
- the peer: ``pyarrow.dataset.dataset(path).to_batches(columns=..., batch_size=B)`` unshuffled, or, for a
  shuffled epoch, ``to_table(columns=...)`` once and ``take`` of the same shuffled rows per batch; each
  batch converted to numpy as the source does (``fill_null``, ``to_numpy``, the same hashing function,
  ``sbpflow.data.columns.hashed_ids``, so both sides do the same work per row); run twice, reading the
  string columns as strings and as dictionaries (``ParquetReadOptions(dictionary_columns=...)``, as the
  source reads them), and the faster of the two is the peer.

Both sides run in this process on the same cores (pyarrow's thread pool on each). The sides alternate
``--repeat`` times and medians are compared; ``ratio`` is sbpflow's rows/s over the peer's, unshuffled
(the shuffled ratio is printed above it). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sbpflow.data import tables  # noqa: E402
from sbpflow.data.columns import HASHED, TableField, Where, categories, hashed_ids  # noqa: E402
from sbpflow.data.tables import TableFileSource  # noqa: E402

DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
BUCKETS = 1 << 20
BATCH = 4096


def write_table(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    cols: dict[str, Any] = {}
    for name in DENSE:
        values = rng.exponential(3.0, rows).round()
        cols[name] = pa.array(values, mask=rng.random(rows) < 0.10)
    for c, name in enumerate(CATEGORICAL):
        distinct = int(10 * 10 ** (4 * c / (len(CATEGORICAL) - 1)))  # 10 .. 100,000
        words = pa.array([f"{v:08x}" for v in rng.integers(0, 1 << 32, distinct)])
        codes = np.minimum((rng.random(rows) ** 3 * distinct).astype(np.int32), distinct - 1)
        idx = pa.array(codes, mask=rng.random(rows) < 0.05)
        cols[name] = pa.DictionaryArray.from_arrays(idx, words).cast(pa.string())
    cols["label"] = pa.array((rng.random(rows) < 0.25).astype(np.int64))
    pq.write_table(pa.table(cols), path, row_group_size=1 << 16)


IDS = TableField(
    "ids", tuple(CATEGORICAL), encoding=HASHED, buckets=BUCKETS, offset_columns=True, fill_category=""
)


def source(path: Path, shuffle: bool) -> TableFileSource:
    return TableFileSource(
        paths=(str(path),),
        batch_size=BATCH,
        shuffle=shuffle,
        seed=0,
        table_fields=(
            TableField("dense", tuple(DENSE), fill=0.0),
            TableField(
                "ids",
                tuple(CATEGORICAL),
                encoding=HASHED,
                buckets=BUCKETS,
                offset_columns=True,
                fill_category="",
            ),
            TableField("label", ("label",), scalar=True),
        ),
    )


def sbpflow_epoch(path: Path, shuffle: bool) -> tuple[float, float]:
    tables._TABLES.clear()  # a fresh process's caches: the open, the index and the chunks are timed
    tables._ENCODED.items.clear()
    tables._ENCODED.bytes = 0
    t = time.perf_counter()
    src = source(path, shuffle)
    batches = src.num_samples // BATCH
    check = 0.0
    for b in range(batches):
        out = src.read(b)
        check += float(out["dense"][0, 0]) + float(out["ids"][-1, -1])
    return batches * BATCH / (time.perf_counter() - t), check


def convert(batch: Any) -> dict[str, np.ndarray]:
    """A pyarrow batch as the source's arrays (the same values, the same functions)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = batch.num_rows
    dense = np.empty((n, len(DENSE)), np.float32)
    for c, name in enumerate(DENSE):
        dense[:, c] = pc.fill_null(batch.column(name).cast(pa.float64()), 0.0).to_numpy()
    ids = np.empty((n, len(CATEGORICAL)), np.int64)
    field, where = IDS, Where("peer", 0)
    for c, name in enumerate(CATEGORICAL):
        ids[:, c] = hashed_ids(*categories(batch.column(name), field, name, where), BUCKETS) + c * BUCKETS
    label = batch.column("label").to_numpy().astype(np.float32)
    return {"dense": dense, "ids": ids, "label": label}


def peer_epoch(path: Path, shuffle: bool, dictionary: bool) -> tuple[float, float]:
    import pyarrow.dataset as ds

    t = time.perf_counter()
    # dictionary: the strings read dictionary-encoded, as stored and as the source reads them (each batch
    # then carries its row group's whole dictionary); else as plain strings
    fmt = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(dictionary_columns=set(CATEGORICAL)))
    data = ds.dataset(str(path), format=fmt if dictionary else "parquet")
    columns = [*DENSE, *CATEGORICAL, "label"]
    check, rows = 0.0, 0
    if shuffle:
        table = data.to_table(columns=columns)
        n = table.num_rows // BATCH * BATCH
        order = np.random.default_rng([0, 0]).permutation(table.num_rows)
        batches = (table.take(order[b : b + BATCH]) for b in range(0, n, BATCH))
    else:
        batches = (b for b in data.to_batches(columns=columns, batch_size=BATCH) if b.num_rows == BATCH)
    for batch in batches:
        out = convert(batch)
        rows += len(out["label"])
        check += float(out["dense"][0, 0]) + float(out["ids"][-1, -1])
    return rows / (time.perf_counter() - t), check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeat = 60_000, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "criteo.parquet"
        write_table(path, args.rows)
        print(
            f"{args.rows:,} rows, 13 float + 26 string columns + label, {path.stat().st_size / 2**20:.1f} MiB"
        )
        ratios = {}
        for shuffle in (True, False):
            ours, plain, dicts = [], [], []
            for _ in range(args.repeat):
                a, check_a = sbpflow_epoch(path, shuffle)
                b, check_b = peer_epoch(path, shuffle, dictionary=False)
                c, check_c = peer_epoch(path, shuffle, dictionary=True)
                assert check_a == check_b == check_c, "the sides read different values"
                ours.append(a)
                plain.append(b)
                dicts.append(c)
            a, b, c = statistics.median(ours), statistics.median(plain), statistics.median(dicts)
            what = "shuffled" if shuffle else "in order"
            print(
                f"{what:9} sbpflow {a:10,.0f} rows/s   pyarrow.dataset {b:10,.0f} rows/s (strings), "
                f"{c:10,.0f} (dictionaries)   {a / max(b, c):.2f}x the faster"
            )
            ratios[shuffle] = a / max(b, c)
    print(f"ratio {ratios[False]:.2f}")


if __name__ == "__main__":
    main()
