"""A table source goes over the wire and comes back equal; what it cannot mean is refused at Submit,
naming the field, and its sizes are bounded before any file is opened."""

from __future__ import annotations

import pytest

from sbpflow.codec.data_wire import data_from_proto, data_to_proto
from sbpflow.codec.values import WireError
from sbpflow.data.checks import check_data
from sbpflow.data.columns import HASHED, VOCABULARY, TableField
from sbpflow.data.sources import DataError, DataField
from sbpflow.data.tables import TableFileSource
from sbpflow.dtype import DType
from sbpflow.limits import LimitError, Limits
from sbpflow.v1 import data_table_pb2 as tpb
from sbpflow.v1 import job_pb2 as pb

SOURCE = TableFileSource(
    paths=("/data/clicks-*.parquet", "/data/more.csv"),
    format="",
    batch_size=64,
    shuffle=True,
    seed=9,
    table_fields=(
        TableField("dense", ("I1", "I2"), fill=0.0),
        TableField("ids", ("C1", "C2"), encoding=HASHED, buckets=1000, offset_columns=True, fill_category=""),
        TableField("vocab", ("C1",), encoding=VOCABULARY, buckets=50),
        TableField("label", ("y",), dtype=DType.int64, scalar=True),
    ),
)


def wire(s: TableFileSource) -> pb.DataSource:
    return pb.DataSource.FromString(data_to_proto(s).SerializeToString())


def test_a_table_source_round_trips_with_its_fills_and_declared_fields() -> None:
    back = data_from_proto(wire(SOURCE))
    assert isinstance(back, TableFileSource)
    assert back == SOURCE and back.table_fields[0].fill == 0.0 and back.table_fields[2].fill_category is None
    assert back.fields() == (
        DataField("dense", (2,), DType.float32),
        DataField("ids", (2,), DType.int64),
        DataField("vocab", (1,), DType.int64),
        DataField("label", (), DType.int64),
    )
    parquet = TableFileSource(
        paths=("t.pq",), format="parquet", table_fields=SOURCE.table_fields, batch_size=1
    )
    assert data_from_proto(wire(parquet)) == parquet


def table_message(**field: object) -> pb.DataSource:
    m = wire(SOURCE)
    f = m.table_files.fields[1]
    for k, v in field.items():
        setattr(f, k, v)
    return m


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"encoding": tpb.COLUMN_ENCODING_UNSPECIFIED}, WireError, r"fields\[1\]\.encoding=0 is unspecified"),
        ({"encoding": 99}, WireError, r"fields\[1\]\.encoding=99 is unspecified or unknown"),
        ({"dtype": tpb.TABLE_DTYPE_FLOAT32}, WireError, r"a categorical field's ids are int64"),
        ({"buckets": 0}, DataError, r"'ids': buckets=0; hashed needs at least 1"),
        ({"fill": 1.5}, DataError, r"'ids' is categorical: .* fill unset"),
        ({"scalar": True}, DataError, r"'ids' is categorical"),
    ],
)
def test_a_field_that_cannot_mean_anything_is_refused(change: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        data_from_proto(table_message(**change))


def test_a_source_without_columns_fields_or_files_and_with_unknown_values_is_refused() -> None:
    m = wire(SOURCE)
    del m.table_files.fields[1].columns[:]
    with pytest.raises(DataError, match="'ids' names no columns"):
        data_from_proto(m)
    m = wire(SOURCE)
    del m.table_files.fields[:]
    with pytest.raises(DataError, match="declares no fields"):
        data_from_proto(m)
    m = wire(SOURCE)
    del m.table_files.paths[:]
    with pytest.raises(DataError, match="names no files"):
        data_from_proto(m)
    m = wire(SOURCE)
    m.table_files.format = 42  # type: ignore[assignment]  # a value from a newer writer
    with pytest.raises(WireError, match=r"TableFiles\.format=42"):
        data_from_proto(m)
    m = wire(SOURCE)
    m.table_files.fields[0].dtype = tpb.TABLE_DTYPE_UNSPECIFIED
    with pytest.raises(WireError, match=r"fields\[0\]\.dtype=0 is unspecified"):
        data_from_proto(m)


def test_sizes_are_bounded_before_any_file_is_opened() -> None:
    small = Limits(count=3, name_chars=8, path_chars=30)
    check_data(SOURCE)  # the defaults take it; no file /data/... exists, none is opened
    with pytest.raises(LimitError, match=r"job\.data\.table_files\.fields=.*more than 3 entries"):
        check_data(SOURCE, small)
    wide = TableFileSource(
        paths=("/data/a-very-long-folder/t.parquet",), table_fields=SOURCE.table_fields[:1], batch_size=1
    )
    with pytest.raises(LimitError, match=r"job\.data\.table_files\.paths\[0\]=.*over the limit of 30"):
        check_data(wide, small)
    huge = TableField("ids", ("a", "b"), encoding=HASHED, buckets=1 << 48)
    over = TableFileSource(paths=("t.pq",), table_fields=(huge,), batch_size=1)
    with pytest.raises(LimitError, match=r"job\.data\.table_files\.fields\[0\]\.buckets"):
        check_data(over)
