"""examples/wide_deep.py and examples/mlp.py train on a user's table (``data=PATH``): the columns and sizes
come from the table unless given, the job goes over the wire, and a few steps learn in process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as csv
import pyarrow.parquet as pq
import pytest

import sbpflow as sf
from sbpflow.codec import wire
from sbpflow.data.tables import TableFileSource
from sbpflow.v1 import job_pb2
from tests.examples.test_examples import load


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SBPFLOW_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def clicks(tmp_path: Path) -> Path:
    """A Criteo-like click log: 3 float and 4 string columns (one with empty cells), a 0/1 label that the
    first float and the first string column predict."""
    rng = np.random.default_rng(0)
    n = 2048
    cols: dict[str, object] = {f"I{i}": rng.normal(size=n) for i in range(1, 4)}
    cats = rng.integers(0, 20, (4, n))
    for i in range(4):
        cols[f"C{i + 1}"] = [None if i == 3 and k % 9 == 0 else f"{v:08x}" for k, v in enumerate(cats[i])]
    logit = 2 * cols["I1"] + np.where(cats[0] % 2 == 0, 2.0, -2.0)  # type: ignore[operator]
    cols["label"] = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    path = tmp_path / "clicks.parquet"
    pq.write_table(pa.table(cols), path, row_group_size=256)
    return path


def test_wide_deep_takes_its_columns_and_sizes_from_the_table(clicks: Path) -> None:
    example = load("wide_deep")
    job = example.make_job(data=str(clicks), batch_size=64)
    source = job.data
    assert isinstance(source, TableFileSource)
    assert [f.columns for f in source.table_fields] == [
        ("I1", "I2", "I3"),
        ("C1", "C2", "C3", "C4"),
        ("label",),
    ]
    assert source.table_fields[1].buckets == 21  # 20 values a column, and id 0 for the others
    assert job.graph.tensors["model.deep.weight"].meta.shape == (4 * 21, 8)
    back = wire.job_from_proto(job_pb2.Job.FromString(wire.job_to_proto(job).SerializeToString()))
    assert back == job
    with pytest.raises(SystemExit, match=r"dense columns \['I1', 'I2', 'I3'\] are 3, but dense=4 was given"):
        example.make_job(data=str(clicks), dense=4)
    with pytest.raises(SystemExit, match="no label column 'clicked'"):
        example.make_job(data=str(clicks), label="clicked")
    hashed = example.make_job(data=str(clicks), encoding="hash", vocab=64, dense_columns=("I1",))
    assert hashed.graph.tensors["model.wide_dense.weight"].meta.shape[0] == 1


def test_wide_deep_learns_from_a_parquet_file_in_process(clicks: Path) -> None:
    example = load("wide_deep")
    job = example.make_job(data=str(clicks), ranks=2, steps=30, batch_size=128, lr=0.05)
    result = sf.run(job, backend="inprocess", timeout=120)
    assert len(result.losses) == 30 and all(np.isfinite(result.losses))
    assert np.mean(result.losses[-5:]) < result.losses[0] - 0.1, result.losses


def test_mlp_regresses_on_a_csv_table(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1024, 3))
    table = pa.table({"a": x[:, 0], "name": [f"r{i}" for i in range(1024)], "b": x[:, 1], "c": x[:, 2]})
    csv.write_csv(table.append_column("price", pa.array(x @ [1.0, -2.0, 0.5])), tmp_path / "houses.csv")
    example = load("mlp")
    job = example.make_job(data=str(tmp_path / "houses.csv"), steps=25, lr=0.02)
    assert job.graph.tensors["x"].meta.shape == (32, 3) and job.graph.tensors["y"].meta.shape == (32, 1)
    with pytest.raises(SystemExit, match="n_in=16, but the table gives x 3 columns"):
        example.make_job(data=str(tmp_path / "houses.csv"), n_in=16)
    result = sf.run(job, backend="inprocess", timeout=120)
    assert np.mean(result.losses[-5:]) < 0.3 * result.losses[0], result.losses
