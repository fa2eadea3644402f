"""The wire form of the table sources (``protos/sbpflow/v1/data_table.proto``), registered in
:data:`sbpflow.codec.formats.FORMATS` at import (``data_wire`` imports this module).

``TableFiles`` arrives untrusted at Submit: an enum left unspecified or unknown is a :class:`WireError`
naming the field, and the declarations themselves are checked by :class:`~sbpflow.data.columns.TableField`
and :class:`~sbpflow.data.tables.TableFileSource` as they are built (a ``DataError`` naming the field)."""

from __future__ import annotations

from typing import Any

from sbpflow.codec.formats import FileFormat, register
from sbpflow.codec.values import WireError
from sbpflow.data.columns import HASHED, NUMERIC, VOCABULARY, TableField
from sbpflow.data.tables import TableFileSource
from sbpflow.dtype import DType
from sbpflow.v1 import data_table_pb2 as pb

_FORMATS = {
    "": pb.TABLE_FORMAT_UNSPECIFIED,
    "parquet": pb.TABLE_FORMAT_PARQUET,
    "arrow": pb.TABLE_FORMAT_ARROW,
    "csv": pb.TABLE_FORMAT_CSV,
    "jsonl": pb.TABLE_FORMAT_JSON_LINES,
}
_ENCODINGS = {
    NUMERIC: pb.COLUMN_ENCODING_NUMERIC,
    HASHED: pb.COLUMN_ENCODING_HASHED,
    VOCABULARY: pb.COLUMN_ENCODING_VOCABULARY,
}
_DTYPES = {
    DType.float32: pb.TABLE_DTYPE_FLOAT32,
    DType.float64: pb.TABLE_DTYPE_FLOAT64,
    DType.int32: pb.TABLE_DTYPE_INT32,
    DType.int64: pb.TABLE_DTYPE_INT64,
}


def _lookup(table: dict[Any, Any], value: int, where: str, allowed: str) -> Any:
    for k, v in table.items():
        if v == value:
            return k
    raise WireError(f"{where}={value} is unspecified or unknown; set it to one of {allowed}")


def _field_to_proto(f: TableField) -> pb.TableField:
    m = pb.TableField(
        name=f.name,
        columns=f.columns,
        encoding=_ENCODINGS[f.encoding],
        dtype=_DTYPES[f.field_dtype] if f.encoding == NUMERIC else pb.TABLE_DTYPE_UNSPECIFIED,
        scalar=f.scalar,
        buckets=f.buckets,
        offset_columns=f.offset_columns,
    )
    if f.fill is not None:
        m.fill = f.fill
    if f.fill_category is not None:
        m.fill_category = f.fill_category
    return m


def _field_from_proto(m: pb.TableField, i: int) -> TableField:
    where = f"TableFiles.fields[{i}]"
    encoding = _lookup(_ENCODINGS, m.encoding, f"{where}.encoding", "NUMERIC, HASHED, VOCABULARY")
    if encoding == NUMERIC:
        dtype = _lookup(_DTYPES, m.dtype, f"{where}.dtype", "FLOAT32, FLOAT64, INT32, INT64")
    elif m.dtype not in (pb.TABLE_DTYPE_UNSPECIFIED, pb.TABLE_DTYPE_INT64):
        raise WireError(f"{where}.dtype={m.dtype}: a categorical field's ids are int64; leave dtype unset")
    else:
        dtype = DType.int64
    return TableField(
        name=m.name,
        columns=tuple(m.columns),
        encoding=encoding,
        dtype=dtype,
        scalar=m.scalar,
        buckets=m.buckets,
        offset_columns=m.offset_columns,
        fill=m.fill if m.HasField("fill") else None,
        fill_category=m.fill_category if m.HasField("fill_category") else None,
    )


def table_to_proto(s: TableFileSource) -> pb.TableFiles:
    return pb.TableFiles(
        paths=s.paths, format=_FORMATS[s.format], fields=[_field_to_proto(f) for f in s.table_fields]
    )


def table_from_proto(m: pb.TableFiles, common: dict[str, Any]) -> TableFileSource:
    fmt = _lookup(
        _FORMATS, m.format, "TableFiles.format", "PARQUET, ARROW, CSV, JSON_LINES (or leave it unset)"
    )
    fields = tuple(_field_from_proto(f, i) for i, f in enumerate(m.fields))
    return TableFileSource(paths=tuple(m.paths), format=fmt, table_fields=fields, **common)


register(FileFormat("table_files", TableFileSource, table_to_proto, table_from_proto))
