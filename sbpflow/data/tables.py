"""Tables as a data source (:class:`TableFileSource`): Parquet, Arrow IPC files and streams (Feather v2; a
Hugging Face ``datasets`` cache file is an Arrow stream), CSV and JSON lines, one file or many (globs;
their rows one file after another), their columns encoded into fields by :mod:`sbpflow.data.columns`.

A rank reads only its rows: a table is a list of chunks (Parquet row groups, Arrow record batches), and
``read`` decodes just the chunks that hold the rows asked for, the declared columns only, memory-mapped.
Each chunk is encoded once per process and kept (least recently used first out, within
``$SBPFLOW_TABLE_CACHE_MB``, default 1024), so a shuffled epoch decodes each chunk about once. CSV and JSON
lines have no chunks to seek to: they are converted once, on first open, into an Arrow file in the cache
folder (``$SBPFLOW_CACHE`` or ``~/.cache/sbpflow``, keyed by the file's identity, size and mtime and the
declared columns; written whole or not at all) and memory-mapped after. The index of files, the
vocabularies and the chunks are built lazily and cached per process, keyed by the source's values, so a
source (a frozen value) stays cheap to copy and send.

    src = TableFileSource(paths=("clicks/*.parquet",), batch_size=256, shuffle=True, table_fields=(
        TableField("dense", ("I1", "I2")), TableField("label", ("label",), scalar=True),
        TableField("ids", ("C1", "C2"), encoding="hashed", buckets=1000, offset_columns=True)))
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sbpflow.data.columns import (
    BLOCK,
    FIX,
    NUMERIC,
    SHOWN,
    TABLE_FORMATS,
    VOCABULARY,
    TableField,
    Where,
    arrow_error,
    categories,
    encode,
    expand,
    format_of,
    is_text,
    require_columns,
    value_counts,
    vocabulary,
)
from sbpflow.data.corpus import cache_dir
from sbpflow.data.sources import DataError, DataField, FileSource
from sbpflow.limits import Limits, check_count, check_name

_CONVERTED = 1  # the version of the CSV/JSON cache files' layout, part of their key


@dataclass(frozen=True, kw_only=True)
class TableFileSource(FileSource):
    """Rows of table files, their columns encoded into ``table_fields`` (module docstring)."""

    paths: tuple[str, ...] = ()
    format: str = ""  # "" (by each file's suffix), "parquet", "arrow", "csv" or "jsonl"
    table_fields: tuple[TableField, ...] = ()
    fields_need_files: ClassVar[bool] = False  # the fields are declared, the files only fill them

    def __post_init__(self) -> None:
        if not self.paths:
            raise DataError("a table source names no files; give paths (files or glob patterns)")
        if self.format and self.format not in TABLE_FORMATS:
            raise DataError(f"table format {self.format!r} is unknown; use one of {', '.join(TABLE_FORMATS)}")
        if not self.table_fields:
            raise DataError("a table source declares no fields; give table_fields (columns -> fields)")
        names = [f.name for f in self.table_fields]
        twice = sorted(n for n, k in Counter(names).items() if k > 1)
        if twice:
            raise DataError(f"table fields {twice} are declared twice; give each field one name")

    def fields(self) -> tuple[DataField, ...]:
        return tuple(DataField(f.name, f.sample_shape, f.field_dtype) for f in self.table_fields)

    def file_paths(self) -> list[tuple[str, str]]:
        return [("table file", p) for p in self.paths]

    def check_limits(self, limits: Limits) -> None:
        check_count("job.data.table_files.paths", self.paths, limits)
        for i, p in enumerate(self.paths):
            check_name(f"job.data.table_files.paths[{i}]", p, limits, chars=limits.path_chars)
        check_count("job.data.table_files.fields", self.table_fields, limits)
        for i, f in enumerate(self.table_fields):
            f.check_limits(f"job.data.table_files.fields[{i}]", limits)

    @property
    def num_samples(self) -> int:
        return _table(self).rows

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        table = _table(self)
        return table.take(self._sample_ids(table.rows, batch, rows))

    @property
    def categorical(self) -> tuple[str, ...]:
        """The columns of hashed and vocabulary fields."""
        return tuple(dict.fromkeys(c for f in self.table_fields if f.encoding != NUMERIC for c in f.columns))

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column a field reads, each once, in declaration order."""
        return tuple(dict.fromkeys(c for f in self.table_fields for c in f.columns))


# ---- files ---------------------------------------------------------------------------------------------


class _Chunks:
    """A table file as chunks: ``counts[i]`` rows in chunk i, ``chunk(i, columns)`` its columns."""

    names: list[str]
    counts: list[int]

    def __init__(self) -> None:
        self.lock = threading.Lock()  # a pyarrow reader is not promised to be thread-safe

    def chunk(self, i: int, columns: Sequence[str]) -> Any:
        raise NotImplementedError


class _Parquet(_Chunks):
    def __init__(self, name: str, categorical: Sequence[str]) -> None:
        import pyarrow.parquet as pq

        super().__init__()
        # strings of categorical columns stay dictionary-encoded as stored: each distinct value is hashed
        # or looked up once a row group, and no string is copied out per row
        schema = pq.ParquetFile(name, memory_map=True).schema_arrow  # read_dictionary takes only text columns
        text = [c for c in categorical if c in schema.names and is_text(schema.field(c).type)]
        self.file = pq.ParquetFile(name, memory_map=True, read_dictionary=text)
        self.names = self.file.schema_arrow.names
        self.counts = [self.file.metadata.row_group(i).num_rows for i in range(self.file.num_row_groups)]

    def chunk(self, i: int, columns: Sequence[str]) -> Any:
        with self.lock:
            return self.file.read_row_group(i, columns=list(columns))


class _ArrowFile(_Chunks):
    def __init__(self, name: str) -> None:
        import pyarrow as pa

        super().__init__()
        self.reader = pa.ipc.open_file(pa.memory_map(name))
        self.names = self.reader.schema.names
        self.counts = [self.reader.get_batch(i).num_rows for i in range(self.reader.num_record_batches)]

    def chunk(self, i: int, columns: Sequence[str]) -> Any:
        with self.lock:
            return self.reader.get_batch(i).select(list(columns))


class _ArrowStream(_Chunks):
    def __init__(self, name: str) -> None:
        import pyarrow as pa

        super().__init__()
        table = pa.ipc.open_stream(pa.memory_map(name)).read_all()  # zero-copy: the batches map the file
        self.names = table.schema.names
        self.batches = table.to_batches()
        self.counts = [b.num_rows for b in self.batches]

    def chunk(self, i: int, columns: Sequence[str]) -> Any:
        return self.batches[i].select(list(columns))


def _arrow(name: str) -> _Chunks:
    with open(name, "rb") as f:
        magic = f.read(6)
    return _ArrowFile(name) if magic == b"ARROW1" else _ArrowStream(name)


def _converted(name: str, path: str, fmt: str, source: TableFileSource) -> _Chunks:
    """A CSV or JSON-lines file as the Arrow file it is converted to once (module docstring)."""
    import pyarrow as pa

    st = os.stat(name)
    types = _csv_types(source)
    ident = (
        f"{_CONVERTED}|{pa.__version__}|{fmt}|{os.path.realpath(name)}|{st.st_dev}|{st.st_ino}|{st.st_size}"
    )
    key = hashlib.sha256(f"{ident}|{st.st_mtime_ns}|{sorted(types.items())}".encode()).hexdigest()[:24]
    out = cache_dir() / "tables" / f"{key}.arrow"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        try:
            (_write_csv if fmt == "csv" else _write_json)(name, path, source, tmp)
            os.replace(tmp, out)  # whole or absent: a concurrent first open never sees half a file
        finally:
            tmp.unlink(missing_ok=True)
    return _ArrowFile(str(out))


def _csv_types(source: TableFileSource) -> dict[str, str]:
    """Each column's type in the converted file: numbers as float64 (int64 for an integer field), categories
    as their bytes (any encoding), a column that is both as text."""
    types: dict[str, str] = {}
    for f in source.table_fields:
        want = (
            ("int64" if f.field_dtype.to_numpy().kind == "i" else "float64")
            if f.encoding == NUMERIC
            else "binary"
        )
        for c in f.columns:
            types[c] = want if types.get(c, want) == want else "string"
    return types


def _write_csv(name: str, path: str, source: TableFileSource, tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.csv as csv

    parse = csv.ParseOptions(delimiter="\t" if path.lower().endswith(".tsv") else ",")
    read = csv.ReadOptions(block_size=BLOCK)
    fix = "each line must be one row of the header's columns"
    try:
        header = csv.open_csv(name, read_options=read, parse_options=parse).schema.names
    except pa.ArrowInvalid as e:
        if "Empty CSV" in str(e):
            raise DataError(f"table file {path[:200]!r} is empty; a CSV file needs a header row") from None
        raise arrow_error(path, e, fix) from None
    types = _csv_types(source)
    require_columns(header, list(types), path)
    convert = csv.ConvertOptions(
        column_types={c: getattr(pa, t)() for c, t in types.items()},
        include_columns=list(types),
        strings_can_be_null=True,  # an empty cell is null in every column, as in Parquet
    )
    try:
        reader = csv.open_csv(name, read_options=read, parse_options=parse, convert_options=convert)
        with pa.ipc.new_file(str(tmp), reader.schema) as w:
            for batch in reader:
                w.write_batch(batch)
    except pa.ArrowInvalid as e:
        m = re.search(r"column #(\d+)", str(e))
        if m and "conversion error" in str(e) and int(m.group(1)) < len(header):
            _refuse_cell(name, path, header[int(m.group(1))], read, parse, source)
        raise arrow_error(path, e, fix) from None


def _refuse_cell(name: str, path: str, column: str, read: Any, parse: Any, source: TableFileSource) -> None:
    """The error naming the first row of CSV ``column`` that is not a number (its values read as text)."""
    import pyarrow as pa
    import pyarrow.csv as csv

    from sbpflow.data.columns import numbers

    as_text = csv.ConvertOptions(column_types={column: pa.string()}, include_columns=[column])
    values = csv.read_csv(name, read_options=read, parse_options=parse, convert_options=as_text).column(0)
    field = next(f for f in source.table_fields if column in f.columns and f.encoding == NUMERIC)
    numbers(values.combine_chunks(), field, column, Where(path, 0))  # raises, naming the row


def _write_json(name: str, path: str, source: TableFileSource, tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.json as pj

    try:
        table = pj.read_json(name, read_options=pj.ReadOptions(block_size=BLOCK))
    except pa.ArrowInvalid as e:
        raise _json_error(name, path, e) from None
    require_columns(table.schema.names, source.columns, path)
    table = table.select(list(source.columns))
    with pa.ipc.new_file(str(tmp), table.schema) as w:
        for batch in table.to_batches(max_chunksize=1 << 16):
            w.write_batch(batch)


def _json_error(name: str, path: str, e: Exception) -> DataError:
    """pyarrow's row counts from its block, not the file: the first line that is not a JSON object is
    found here, else pyarrow's message (a column changing type, say) is given."""
    import json

    fix = "each line must be one JSON object, a column's values all of one type"
    with open(name, "rb") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                ok = isinstance(json.loads(line), dict)
            except (ValueError, UnicodeDecodeError):
                ok = False
            if not ok:
                shown = line[:SHOWN].decode("utf-8", "replace")
                return DataError(
                    f"table file {path[:200]!r}, line {i + 1}: {shown!r} is not a JSON object; {fix}"
                )
    return arrow_error(path, e, fix)


def _open(source: TableFileSource, path: str) -> _Chunks:
    import pyarrow as pa

    fmt = format_of(path, source.format)
    with source._file("table file", path, FIX) as name:
        try:
            if fmt == "parquet":
                chunks: _Chunks = _Parquet(name, source.categorical)
            elif fmt == "arrow":
                chunks = _arrow(name)
            else:
                chunks = _converted(name, path, fmt, source)
        except pa.ArrowException as e:  # a corrupt or truncated file (ArrowInvalid is also a ValueError)
            raise arrow_error(path, e, FIX) from None
    require_columns(chunks.names, source.columns, path)
    return chunks


# ---- a table, once per process ------------------------------------------------------------------------


class _Table:
    """The open files of a source, their chunks and vocabularies; ``take`` reads rows by global id."""

    def __init__(self, source: TableFileSource) -> None:
        self.source = source
        self.paths = expand(source.paths)
        self.files = [_open(source, p) for p in self.paths]
        spans = [(f, i, first) for f, c in enumerate(self.files) for i, first in enumerate(_firsts(c.counts))]
        counts = [n for c in self.files for n in c.counts]
        self.chunks = spans  # (file, chunk in file, file row of the chunk's first row)
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.rows = int(self.starts[-1])
        if self.rows < source.batch_size:
            raise DataError(
                f"the table files {self.paths[:3]} hold {self.rows} rows, fewer than one batch of "
                f"{source.batch_size}; give more rows or a smaller batch"
            )
        self.decoded = 0  # chunks decoded so far (tests count them)
        self.serial = next(_SERIALS)  # its chunks' key: a table opened again never meets the old one's
        self.stamp, self.checked = _stamp(self.paths), time.monotonic()
        self.lock = threading.Lock()
        self._vocabs: dict[tuple[str, str], Any] | None = None

    def _chunk(self, k: int, columns: Sequence[str]) -> tuple[Any, Where]:
        import pyarrow as pa

        f, i, first = self.chunks[k]
        path = self.paths[f]
        try:
            return self.files[f].chunk(i, columns), Where(path, first)
        except pa.ArrowException as e:
            raise arrow_error(path, e, f"chunk {i} cannot be read; {FIX}") from None

    def vocabs(self) -> dict[tuple[str, str], Any]:
        """(field, column) -> vocabulary of every vocabulary field, from every row (built once)."""
        with self.lock:
            if self._vocabs is None:
                wanted = [
                    (f, c) for f in self.source.table_fields if f.encoding == VOCABULARY for c in f.columns
                ]
                values: dict[tuple[str, str], list[Any]] = {(f.name, c): [] for f, c in wanted}
                columns = list(dict.fromkeys(c for _, c in wanted))
                for k in range(len(self.chunks)) if wanted else ():
                    chunk, where = self._chunk(k, columns)
                    for f, c in wanted:
                        values[f.name, c].append(value_counts(*categories(chunk.column(c), f, c, where)))
                self._vocabs = {(f.name, c): vocabulary(values[f.name, c], f.buckets) for f, c in wanted}
            return self._vocabs

    def encoded(self, k: int) -> dict[str, np.ndarray]:
        key = (self.serial, k)
        got = _ENCODED.get(key)
        if got is None:
            with _ENCODED.decoding(key):
                got = _ENCODED.get(key)
                if got is None:
                    vocabs = self.vocabs()
                    chunk, where = self._chunk(k, self.source.columns)
                    got = encode(chunk, self.source.table_fields, vocabs, where)
                    self.decoded += 1
                    _ENCODED.put(key, got)
        return got

    def take(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``ids`` (global) of every field: each chunk holding some of them decoded once."""
        at = np.searchsorted(self.starts, ids, side="right") - 1
        out = {
            f.name: np.empty((len(ids), *f.sample_shape), f.field_dtype.to_numpy())
            for f in self.source.table_fields
        }
        order = np.argsort(at, kind="stable")
        bounds = np.flatnonzero(np.diff(at[order])) + 1
        for group in np.split(order, bounds) if len(ids) else ():
            k = int(at[group[0]])
            arrays = self.encoded(k)
            local = ids[group] - self.starts[k]
            for name, a in arrays.items():
                out[name][group] = a[local]
        return out


def _firsts(counts: Sequence[int]) -> list[int]:
    return [0, *np.cumsum(counts, dtype=np.int64)[:-1].tolist()] if counts else []


class _ChunkCache:
    """Encoded chunks, least recently used out past ``$SBPFLOW_TABLE_CACHE_MB``; one decoder per chunk."""

    def __init__(self) -> None:
        self.items: OrderedDict[Any, dict[str, np.ndarray]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()
        self.decoders: dict[Any, threading.Lock] = {}

    def budget(self) -> int:
        return int(float(os.environ.get("SBPFLOW_TABLE_CACHE_MB", 1024)) * (1 << 20))

    def get(self, key: Any) -> dict[str, np.ndarray] | None:
        with self.lock:
            got = self.items.get(key)
            if got is not None:
                self.items.move_to_end(key)
            return got

    def decoding(self, key: Any) -> threading.Lock:
        with self.lock:
            return self.decoders.setdefault(key, threading.Lock())

    def put(self, key: Any, arrays: dict[str, np.ndarray]) -> None:
        with self.lock:
            self.items[key] = arrays
            self.bytes += sum(a.nbytes for a in arrays.values())
            self.decoders.pop(key, None)
            while self.bytes > self.budget() and len(self.items) > 1:
                _, old = self.items.popitem(last=False)
                self.bytes -= sum(a.nbytes for a in old.values())


_ENCODED = _ChunkCache()
_TABLES: OrderedDict[Any, _Table] = OrderedDict()
_TABLES_LOCK = threading.Lock()
_SERIALS = itertools.count()
OPEN_TABLES = 8  # tables a process keeps open (least recently used closed first)
RECHECK_S = 10.0  # how often an open table looks whether its files changed


def _stamp(paths: Sequence[str]) -> tuple[tuple[int, int], ...]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((-1, -1))
    return tuple(out)


def _current(table: _Table) -> bool:
    """Whether ``table``'s files are still those it opened (looked at every RECHECK_S at most): a worker
    serving job after job must not read a rewritten file through its old index."""
    now = time.monotonic()
    if now - table.checked < RECHECK_S:
        return True
    try:
        same = expand(table.source.paths) == table.paths and _stamp(table.paths) == table.stamp
    except DataError:
        same = False
    table.checked = now
    return same


def _table(source: TableFileSource) -> _Table:
    """The open table of ``source`` in this process (opened on first use; a failed open is tried again)."""
    key = (source, source.allowed_roots)
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is None or not _current(table):
            table = _TABLES[key] = _Table(source)
            while len(_TABLES) > OPEN_TABLES:
                _TABLES.popitem(last=False)
        _TABLES.move_to_end(key)
        return table


def chunks_decoded(source: TableFileSource) -> int:
    """How many chunks (row groups, record batches) this process has decoded for ``source``."""
    return _table(source).decoded
