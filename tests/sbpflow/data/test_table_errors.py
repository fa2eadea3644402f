"""Bad tables are each one clear DataError naming the file, the column or row, and the fix; files outside
the data roots are refused at Submit and as opened."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sbpflow.data.access import DataAccessDenied
from sbpflow.data.columns import HASHED, TableField
from sbpflow.data.sources import DataError
from sbpflow.data.tables import TableFileSource

FIELDS = (
    TableField("dense", ("x",)),
    TableField("ids", ("c",), encoding=HASHED, buckets=10),
    TableField("label", ("y",), scalar=True),
)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SBPFLOW_CACHE", str(tmp_path / "cache"))


def read(path: Path | str, fields: tuple[TableField, ...] = FIELDS, batch_size: int = 4) -> dict:
    return TableFileSource(paths=(str(path),), table_fields=fields, batch_size=batch_size).read(0)


def good(n: int = 8) -> pa.Table:
    return pa.table(
        {"x": np.arange(n, dtype=np.float64), "c": [f"v{i}" for i in range(n)], "y": [0, 1] * (n // 2)}
    )


def test_a_missing_column_is_named_with_the_columns_the_file_has(tmp_path: Path) -> None:
    pq.write_table(good().drop_columns(["c"]), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet' has no column 'c' \(its columns: x, y\)"):
        read(tmp_path / "t.parquet")


def test_a_string_in_a_dense_column_names_its_row(tmp_path: Path) -> None:
    lines = ["x,c,y"] + [f"{i}.5,v,1" for i in range(6)] + ["oops,v,0", "1,v,0"]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"t\.csv', column 'x', row 6 \(from 0\) holds 'oops', not a number"):
        read(tmp_path / "t.csv")
    t = good().set_column(0, "x", pa.array(["1", "2", "3", "4", "5", "five", "7", "8"]))
    pq.write_table(t, tmp_path / "t.parquet", row_group_size=4)  # the row counts from the file, not the group
    with pytest.raises(DataError, match=r"column 'x', row 5 \(from 0\) holds 'five'"):
        read(tmp_path / "t.parquet", batch_size=8)


@pytest.mark.parametrize("column", ["x", "c"])
def test_a_null_without_a_fill_names_column_and_row(tmp_path: Path, column: str) -> None:
    t = good()
    values = t.column(column).to_pylist()
    values[6] = None
    pq.write_table(
        t.set_column(t.schema.get_field_index(column), column, pa.array(values)), tmp_path / "t.pq"
    )
    fix = "a fill" if column == "x" else "a fill_category"
    with pytest.raises(
        DataError, match=rf"column '{column}', row 6 \(from 0\) is empty.*give field '\w+' {fix}"
    ):
        read(tmp_path / "t.pq", batch_size=8)


def test_nan_is_a_missing_value_too(tmp_path: Path) -> None:
    t = good().set_column(0, "x", pa.array([0.0, 1, 2, np.nan, 4, 5, 6, 7]))
    pq.write_table(t, tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"row 3 \(from 0\) is empty \(null or NaN\)"):
        read(tmp_path / "t.parquet", batch_size=8)
    filled = (TableField("dense", ("x",), fill=-1.0),)
    assert read(tmp_path / "t.parquet", filled, 8)["dense"][3, 0] == -1.0


def test_corrupt_empty_and_ragged_files(tmp_path: Path) -> None:
    pq.write_table(good(), tmp_path / "t.parquet")
    data = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"table file '.*cut\.parquet'.*give a Parquet"):
        read(tmp_path / "cut.parquet")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match=r"empty\.csv' is empty; a CSV file needs a header row"):
        read(tmp_path / "empty.csv")
    (tmp_path / "t.jsonl").write_text('{"x": 1, "c": "a", "y": 0}\n{"x": 2, "c": "b"\n{"x": 3}\n')
    with pytest.raises(DataError, match=r"t\.jsonl', line 2: .* is not a JSON object"):
        read(tmp_path / "t.jsonl", batch_size=2)
    (tmp_path / "short.csv").write_text("x,c,y\n1,a,0\n")
    with pytest.raises(DataError, match=r"hold 1 rows, fewer than one batch of 4"):
        read(tmp_path / "short.csv")


def test_a_glob_matching_nothing_and_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"match no file"):
        read(tmp_path / "nowhere" / "*.parquet")
    with pytest.raises(DataError, match=r"table file '.*gone\.parquet' does not exist"):
        read(tmp_path / "gone.parquet")
    with pytest.raises(DataError, match=r"has no known suffix"):
        read(tmp_path / "table.xlsx")


def test_bytes_that_are_not_utf8_are_categories_in_csv(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_bytes(
        b"x,c,y\n" + b"".join(b"%d,\xff\xfe%d,1\n" % (i, i % 2) for i in range(4))
    )
    ids = read(tmp_path / "t.csv")["ids"][:, 0]
    assert ids[0] == ids[2] != ids[1] == ids[3]


def test_declarations_that_cannot_work_are_refused_as_built() -> None:
    with pytest.raises(DataError, match="names no columns"):
        TableField("x", ())
    with pytest.raises(DataError, match="buckets=0; hashed needs at least 1"):
        TableField("ids", ("c",), encoding=HASHED)
    with pytest.raises(DataError, match="is numeric: buckets"):
        TableField("x", ("a",), buckets=3)
    with pytest.raises(DataError, match="scalar but names 2 columns"):
        TableField("y", ("a", "b"), scalar=True)
    with pytest.raises(DataError, match=r"names column\(s\) \['a'\] twice"):
        TableField("x", ("a", "b", "a"))
    with pytest.raises(DataError, match=r"table fields \['dense'\] are declared twice"):
        TableFileSource(paths=("t.pq",), table_fields=(FIELDS[0], FIELDS[0]), batch_size=1)
    with pytest.raises(DataError, match="names no files"):
        TableFileSource(paths=(), table_fields=FIELDS, batch_size=1)


def test_files_outside_the_roots_are_refused_at_submit_and_as_opened(tmp_path: Path) -> None:
    from control_plane.service.data_policy import DataPolicy

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    pq.write_table(good(), outside / "t.parquet")
    s = TableFileSource(paths=(str(outside / "t.parquet"),), table_fields=FIELDS, batch_size=4)
    assert not DataPolicy.under([root]).allows(s.file_paths()[0][1])
    (root / "t.parquet").symlink_to(outside / "t.parquet")  # under the root by name, outside as opened
    linked = dataclasses.replace(s, paths=(str(root / "*.parquet"),), allowed_roots=(str(root),))
    assert DataPolicy.under([root]).allows(linked.file_paths()[0][1])
    with pytest.raises(DataAccessDenied, match="outside what the server may read"):
        linked.read(0)
    inside = dataclasses.replace(linked, allowed_roots=(str(tmp_path),))
    assert inside.read(0)["dense"].shape == (4, 1)


@pytest.mark.parametrize(("column", "kind"), [("x", "numeric"), ("c", "categorical")])
def test_a_column_of_lists_is_refused_as_either_kind(tmp_path: Path, column: str, kind: str) -> None:
    t = good()
    lists = pa.array([[i, i] for i in range(8)])
    pq.write_table(t.set_column(t.schema.get_field_index(column), column, lists), tmp_path / "t.parquet")
    with pytest.raises(
        DataError,
        match=rf"column '{column}', row 0 \(from 0\): a {kind} .*(?:holds|not) list<",
    ):
        read(tmp_path / "t.parquet")
