"""A table's columns as a job's fields: the declarations (:class:`TableField`) and the encoders that turn
one chunk of a table (a Parquet row group, an Arrow record batch) into the field arrays.

A field is fed by columns of one encoding:

    numeric     the columns stacked as numbers, ``[k]`` (``scalar``: one column, shape ``[]``): a label,
                dense features, regression targets; float32/float64/int32/int64
    hashed      categorical columns (strings or ints), each value to ``fnv1a64(bytes) % buckets``: int64 [k]
    vocabulary  categorical columns, each value to its rank in the column's vocabulary (built once from
                the whole table: values by frequency, then by value; the ``buckets - 1`` most frequent get
                ids ``1 ..``, any other value id 0, out of vocabulary): int64 [k]

``offset_columns``: column ``c``'s ids are shifted by ``c * buckets``, so the columns share one embedding
table, each owning its own rows (Wide & Deep's one table). A categorical value is hashed or looked up as
its bytes (an int as its decimal text), so a column stored as ints in Parquet and as text in CSV gives the
same ids. Nulls (and NaN) become the declared fill; without one they are an error naming the column and
the row. pyarrow is imported inside the functions, so that ``import sbpflow`` does not load it.
"""

from __future__ import annotations

import glob
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.data.sources import DataError
from sbpflow.dtype import DType
from sbpflow.limits import LIMITS, Limits, check_count, check_float, check_int, check_name

NUMERIC, HASHED, VOCABULARY = "numeric", "hashed", "vocabulary"
ENCODINGS = (NUMERIC, HASHED, VOCABULARY)
NUMBER_DTYPES = (DType.float32, DType.float64, DType.int32, DType.int64)
_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)
SHOWN = 60  # characters of a cell's value quoted in a message
SUFFIXES = {
    "parquet": (".parquet", ".pq", ".parq"),
    "arrow": (".arrow", ".feather", ".ipc", ".arrows"),
    "csv": (".csv", ".tsv"),
    "jsonl": (".jsonl", ".ndjson", ".json"),
}
TABLE_FORMATS = tuple(SUFFIXES)
FIX = "give a Parquet, Arrow (IPC file or stream), CSV or JSON-lines file"
BLOCK = 1 << 24  # bytes a CSV/JSON reader parses at once: the longest row it takes


@dataclass(frozen=True)
class TableField:
    """One field of a table source: its ``name``, the ``columns`` feeding it and how they are encoded."""

    name: str
    columns: tuple[str, ...]
    encoding: str = NUMERIC
    dtype: DType | None = None  # numeric: float32 unless given; categorical: int64 (None: that)
    scalar: bool = False  # numeric, one column: sample shape [] rather than [1]
    buckets: int = 0  # categorical: ids per column
    offset_columns: bool = False  # categorical: column c's ids start at c * buckets
    fill: float | None = None  # numeric: what a null or NaN becomes (None: an error)
    fill_category: str | None = None  # categorical: what a null becomes (None: an error)

    def __post_init__(self) -> None:
        where = f"table field {self.name!r}"
        if self.dtype is None:  # the encoding's default, set so that equal declarations compare equal
            object.__setattr__(self, "dtype", DType.float32 if self.encoding == NUMERIC else DType.int64)
        if self.encoding not in ENCODINGS:
            raise DataError(
                f"{where}: encoding {self.encoding!r} is unknown; use one of {', '.join(ENCODINGS)}"
            )
        if not self.columns:
            raise DataError(f"{where} names no columns; give at least one")
        repeated = sorted(c for c, k in Counter(self.columns).items() if k > 1)
        if repeated:
            raise DataError(f"{where} names column(s) {repeated} twice; name each column once")
        if self.encoding == NUMERIC:
            self._check_numeric(where)
        else:
            self._check_categorical(where)

    def _check_numeric(self, where: str) -> None:
        if self.dtype not in NUMBER_DTYPES:
            raise DataError(
                f"{where}: dtype {self.field_dtype.value} is not one of float32, float64, int32, int64"
            )
        if self.scalar and len(self.columns) != 1:
            raise DataError(
                f"{where} is scalar but names {len(self.columns)} columns; a scalar field takes one"
            )
        if self.buckets or self.offset_columns or self.fill_category is not None:
            raise DataError(
                f"{where} is numeric: buckets, offset_columns and fill_category are for categorical fields; "
                "leave them unset"
            )
        if self.fill is not None and not math.isfinite(self.fill):
            raise DataError(f"{where}: fill={self.fill} is not finite; give a finite number")

    def _check_categorical(self, where: str) -> None:
        least = 2 if self.encoding == VOCABULARY else 1
        if self.buckets < least:
            what = "id 0 for values out of vocabulary and at least one value" if least == 2 else "one bucket"
            raise DataError(
                f"{where}: buckets={self.buckets}; {self.encoding} needs at least {least} ({what})"
            )
        if self.dtype != DType.int64 or self.scalar or self.fill is not None:
            raise DataError(
                f"{where} is categorical: its ids are int64 [columns]; leave dtype (int64), scalar and fill "
                "unset (fill_category fills its nulls)"
            )

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return () if self.scalar else (len(self.columns),)

    @property
    def field_dtype(self) -> DType:
        assert self.dtype is not None  # set by __post_init__
        return self.dtype

    @property
    def ids(self) -> int:
        """Ids this field's values lie in: ``buckets`` per column (times the columns if offset)."""
        return self.buckets * (len(self.columns) if self.offset_columns else 1)

    def check_limits(self, where: str, limits: Limits) -> None:
        check_name(f"{where}.name", self.name, limits)
        check_count(f"{where}.columns", self.columns, limits)
        for i, c in enumerate(self.columns):
            check_name(f"{where}.columns[{i}]", c, limits)
        if self.encoding != NUMERIC:
            check_int(f"{where}.buckets", self.buckets, 1, limits.numel // max(len(self.columns), 1))
        if self.fill is not None:
            check_float(f"{where}.fill", self.fill)
        if self.fill_category is not None:
            check_name(f"{where}.fill_category", self.fill_category, limits, empty=True)


def is_text(t: Any) -> bool:
    """Whether pyarrow type ``t`` holds strings or bytes (what a Parquet dictionary can hold)."""
    import pyarrow as pa

    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t))


@dataclass(frozen=True)
class Where:
    """Where a chunk lies, for messages: its file and the file's row of its first row."""

    file: str
    first_row: int

    def at(self, column: str, row: int) -> str:
        return f"table file {self.file!r}, column {column!r}, row {self.first_row + row} (from 0)"


# ---- categorical values ----------------------------------------------------------------------------


def categories(col: Any, f: TableField, column: str, where: Where) -> tuple[Any, np.ndarray]:
    """``col`` as its distinct values (large_binary, each value's bytes, an int's decimal text; the fill
    among them) and each row's index into them: a column repeats its values, so each distinct value is
    hashed or looked up once. A dictionary-encoded column (Parquet's strings, read so) is taken as it is."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(col, pa.ChunkedArray):  # one array: a row group's column may come in pieces
        pieces = col.chunks
        if len(pieces) == 1:
            col = pieces[0]
        elif pa.types.is_dictionary(col.type):  # their own dictionaries each: decoded, encoded anew below
            col = col.cast(col.type.value_type).combine_chunks()
        else:
            col = col.combine_chunks()
    t = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
    text = is_text(t)
    number = pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t)
    if not (text or number or pa.types.is_large_binary(t) or pa.types.is_null(t)):
        raise DataError(
            f"{where.at(column, 0)}: a categorical column must hold strings or integers, not {t}; "
            "declare another column or convert this one"
        )
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col)
    values = col.dictionary.cast(pa.string()) if number else col.dictionary
    values, indices = values.cast(pa.large_binary()), col.indices
    if indices.null_count:
        if f.fill_category is None:
            row = pc.indices_nonzero(pc.is_null(indices))[0].as_py()
            raise DataError(
                f"{where.at(column, row)} is empty (null); give field {f.name!r} a fill_category, or fill "
                "the table"
            )
        fill = pa.array([f.fill_category.encode()], pa.large_binary())
        indices = pc.fill_null(indices, len(values))
        values = pa.concat_arrays([values, fill])
    return values, indices.to_numpy(zero_copy_only=False)


def fnv1a64(values: Any) -> np.ndarray:
    """FNV-1a (64 bit) of each value's bytes: the same on every machine and process (not Python's salted
    ``hash``); one numpy pass per byte position over the values still that long."""
    import pyarrow as pa

    values = values.cast(pa.large_binary())
    n = len(values)
    if n == 0:
        return np.zeros(0, np.uint64)
    _, offsets_buf, data_buf = values.buffers()
    offsets = np.frombuffer(offsets_buf, np.int64)[values.offset : values.offset + n + 1]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(1, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = np.full(n, _FNV_OFFSET, np.uint64)
    live = np.arange(n)
    for j in range(int(lengths.max())):
        live = live[lengths[live] > j]
        h[live] = (h[live] ^ data[starts[live] + j].astype(np.uint64)) * _FNV_PRIME
    return h


def hashed_ids(values: Any, indices: np.ndarray, buckets: int) -> np.ndarray:
    """Each row's bucket: ``fnv1a64(value) % buckets`` of its value (``categories``)."""
    return (fnv1a64(values) % np.uint64(buckets)).astype(np.int64)[indices]


def value_counts(values: Any, indices: np.ndarray) -> Any:
    """A table of ``value`` and ``count``: how many rows hold each value."""
    import pyarrow as pa

    return pa.table({"value": values, "count": np.bincount(indices, minlength=len(values))})


def vocabulary(counts: Sequence[Any], buckets: int) -> Any:
    """The ``buckets - 1`` most frequent values over ``counts`` (tables of ``value_counts``), by count then
    by value (bytewise): the same on every machine; value ``k`` of it gets id ``k + 1``."""
    import pyarrow as pa

    total = pa.concat_tables(counts).group_by("value").aggregate([("count", "sum")])
    ranked = total.sort_by([("count_sum", "descending"), ("value", "ascending")])
    return ranked.column("value").slice(0, buckets - 1).combine_chunks()


def vocabulary_ids(values: Any, indices: np.ndarray, vocab: Any) -> np.ndarray:
    import pyarrow.compute as pc

    at = pc.index_in(values, value_set=vocab)
    return pc.fill_null(pc.add(at.cast("int64"), 1), 0).to_numpy(zero_copy_only=False)[indices]


# ---- numbers -----------------------------------------------------------------------------------------


def _first_failing(col: Any, to: Any) -> int:
    """The row of ``col`` whose value does not cast to ``to`` (``col`` as a whole does not): bisection,
    each half cast whole."""
    lo, hi = 0, len(col)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            col.slice(lo, mid - lo).cast(to)
            lo = mid
        except (ValueError, TypeError, ArithmeticError, NotImplementedError):
            hi = mid
    return lo


def numbers(col: Any, f: TableField, column: str, where: Where) -> np.ndarray:
    """``col`` as numbers of ``f.dtype`` (float64 kept for float fields), nulls and NaN filled or refused."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    t = col.type
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
    if not (numeric or pa.types.is_boolean(t) or pa.types.is_null(t) or pa.types.is_string(t)):
        if not (pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)):
            raise DataError(f"{where.at(column, 0)}: a numeric field's column holds {t}, not numbers")
    to = pa.int64() if f.field_dtype.to_numpy().kind == "i" else pa.float64()
    try:
        col = col.cast(to)
    except (ValueError, TypeError, ArithmeticError, NotImplementedError):
        row = _first_failing(col, to)
        value = str(col[row].as_py())[:SHOWN]
        raise DataError(
            f"{where.at(column, row)} holds {value!r}, not a number {f.field_dtype.value} can take; fix the value, "
            "or feed the column to a categorical field"
        ) from None
    missing = pc.is_null(col, nan_is_null=True)
    if pc.any(missing).as_py():
        if f.fill is None:
            row = pc.indices_nonzero(missing)[0].as_py()
            raise DataError(
                f"{where.at(column, row)} is empty (null or NaN); give field {f.name!r} a fill, or fill the table"
            )
        col = pc.if_else(missing, pa.scalar(f.fill).cast(to), col)
    return col.to_numpy(zero_copy_only=False)


# ---- a chunk -------------------------------------------------------------------------------------------


def encode(
    chunk: Any, fields: Sequence[TableField], vocabs: dict[tuple[str, str], Any], where: Where
) -> dict[str, np.ndarray]:
    """The fields of every row of ``chunk`` (a pyarrow Table or RecordBatch holding the fields' columns);
    ``vocabs``: (field, column) -> the column's vocabulary, for the vocabulary fields."""
    n = chunk.num_rows
    out: dict[str, np.ndarray] = {}
    for f in fields:
        arr = np.empty((n, *f.sample_shape), f.field_dtype.to_numpy())
        for c, column in enumerate(f.columns):
            col = chunk.column(column)
            if f.encoding == NUMERIC:
                values = numbers(col, f, column, where)
            else:
                cats = categories(col, f, column, where)
                values = (
                    hashed_ids(*cats, f.buckets)
                    if f.encoding == HASHED
                    else vocabulary_ids(*cats, vocabs[f.name, column])
                )
                if f.offset_columns:
                    values = values + c * f.buckets
            if f.scalar:
                arr[:] = values
            else:
                arr[:, c] = values
        out[f.name] = arr
    return out


# ---- files and what they hold ------------------------------------------------------------------------


def format_of(path: str, declared: str = "") -> str:
    if declared:
        return declared
    low = path.lower()
    found = [k for k, ends in SUFFIXES.items() if low.endswith(ends)]
    if not found:
        raise DataError(
            f"table file {path[:200]!r} has no known suffix ({', '.join(e for s in SUFFIXES.values() for e in s)}); "
            "rename it or give the source's format"
        )
    return found[0]


def expand(patterns: Sequence[str]) -> list[str]:
    """Each path as is, each glob pattern as its matches in sorted order; a pattern matching nothing and a
    file named twice are errors."""
    out: list[str] = []
    for p in patterns:
        if glob.has_magic(p):
            matched = sorted(m for m in glob.glob(p) if not os.path.isdir(m))
            if not matched:
                raise DataError(f"table files {p[:200]!r} match no file; check the pattern and the folder")
            out.extend(matched)
        else:
            out.append(p)
    if len(out) > LIMITS.count:
        raise DataError(
            f"table files {list(patterns)[:3]} name {len(out):,} files, over {LIMITS.count:,}; merge them"
        )
    twice = sorted(p for p, k in Counter(out).items() if k > 1)
    if twice:
        raise DataError(f"table files {twice[:3]} are named twice; name each file once")
    return out


def require_columns(names: Sequence[str], columns: Sequence[str], path: str) -> None:
    present = set(names)
    gone = [c for c in columns if c not in present]
    if gone:
        have = ", ".join(names[:40]) + (" ..." if len(names) > 40 else "")
        raise DataError(
            f"table file {path[:200]!r} has no column {gone[0]!r} (its columns: {have}); name a column it has"
        )


def arrow_error(path: str, e: Exception, fix: str) -> DataError:
    text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    return DataError(f"table file {path[:200]!r}: {text}; {fix}")


def _whole(path: str, fmt: str, columns: Sequence[str] | None) -> Any:
    """The file as a pyarrow Table (``columns`` only, when given): for a client looking at its own file."""
    import pyarrow as pa
    import pyarrow.csv as csv
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    if fmt == "parquet":
        return pq.read_table(path, columns=None if columns is None else list(columns))
    if fmt == "arrow":
        with open(path, "rb") as f:
            arrow_file = f.read(6) == b"ARROW1"
        src = pa.memory_map(path)
        table = (pa.ipc.open_file(src) if arrow_file else pa.ipc.open_stream(src)).read_all()
    elif fmt == "csv":
        parse = csv.ParseOptions(delimiter="\t" if path.lower().endswith(".tsv") else ",")
        table = csv.read_csv(
            path, parse_options=parse, convert_options=csv.ConvertOptions(strings_can_be_null=True)
        )
    else:
        table = pj.read_json(path, read_options=pj.ReadOptions(block_size=BLOCK))
    return table if columns is None else table.select(list(columns))


def describe(paths: Sequence[str], format: str = "") -> dict[str, str]:
    """Column -> ``"number"`` (ints, floats, bools), ``"category"`` (strings) or ``"other"``, as the first
    file holds them (read whole: a client's look at its own data, not a worker's read)."""
    import pyarrow as pa

    first = expand(paths)[0]
    try:
        schema = _whole(first, format_of(first, format), None).schema
    except (OSError, pa.ArrowException) as e:
        raise arrow_error(first, e, FIX) from None
    kinds = {}
    for name, t in zip(schema.names, schema.types, strict=True):
        t = t.value_type if pa.types.is_dictionary(t) else t
        number = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
        text = is_text(t)
        kinds[name] = "number" if number else "category" if text else "other"
    return kinds


def distinct(paths: Sequence[str], columns: Sequence[str], format: str = "") -> dict[str, int]:
    """Column -> how many distinct values it holds over every file (nulls not counted)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts: dict[str, list[Any]] = {c: [] for c in columns}
    for p in expand(paths):
        try:
            table = _whole(p, format_of(p, format), None)
        except (OSError, pa.ArrowException) as e:
            raise arrow_error(p, e, FIX) from None
        require_columns(table.schema.names, columns, p)
        for c in columns:
            col = table.column(c)
            parts[c].extend(pc.cast(col, pa.string()).cast(pa.large_binary()).chunks)
    return {
        c: int(pc.count_distinct(pa.chunked_array(v, pa.large_binary())).as_py()) for c, v in parts.items()
    }
