"""The synthetic sources (data.py's ``SyntheticSource``): a read draws its rows in one generator call,
and every read is what drawing each row on its own gave (``row_by_row``: the source as it was), bit for
bit, shuffled or not, for each kind whose rows data.py draws."""

from __future__ import annotations

import numpy as np
import pytest

from sbpflow.data.sources import DataField, SyntheticSource
from sbpflow.dtype import DType
from sbpflow.random import RandomKey, normal, row_offsets, tensor_rng_id, uniform


def row_by_row(src: SyntheticSource, f: DataField, ids: np.ndarray) -> np.ndarray:
    shape = (src.num_samples, *f.sample_shape)
    key = RandomKey(src.seed, tensor_rng_id(f.name))
    rows = []
    for i in ids:
        index = (slice(int(i), int(i) + 1), *(slice(0, d) for d in f.sample_shape))
        if f.dtype.is_floating:
            rows.append(normal(np, key, shape, index, np.float64)[0].astype(f.dtype.to_numpy()))
        else:
            vocab = int(src.params.get("vocab", 2))
            rows.append((uniform(np, key, shape, index, np.float64)[0] * vocab).astype(f.dtype.to_numpy()))
    return np.stack(rows) if rows else np.zeros((0, *f.sample_shape), f.dtype.to_numpy())


SOURCES = [
    SyntheticSource(batch_size=16, kind="normal", seed=2),
    SyntheticSource(batch_size=8, kind="tokens", params={"seq_len": 12, "vocab": 50}, seed=3),
    SyntheticSource(batch_size=32, kind="regression", params={"in": 5, "out": 3}, seed=4, shuffle=True),
]


@pytest.mark.parametrize("src", SOURCES, ids=lambda s: s.kind)
@pytest.mark.parametrize("rows", [slice(None), slice(0, 1), slice(3, 7)])
@pytest.mark.parametrize("batch", [0, 5])
def test_a_read_is_the_row_by_row_read_bit_for_bit(src: SyntheticSource, rows: slice, batch: int) -> None:
    ids = src._sample_ids(src.num_samples, batch, rows)
    for f in src.fields():
        np.testing.assert_array_equal(src._draw(f, ids), row_by_row(src, f, ids))
    if src.kind == "tokens":  # the read's own fields come from the one field of seq_len + 1
        seq = row_by_row(src, DataField("tokens", (13,), DType.int64), ids)
        got = src.read(batch, rows)
        np.testing.assert_array_equal(got["tokens"], seq[:, :-1])
        np.testing.assert_array_equal(got["targets"], seq[:, 1:])


def test_no_rows_read_is_empty_of_the_fields_shape() -> None:
    src = SOURCES[2]
    f = DataField("x", (5,), DType.float64)
    got = src._draw(f, np.zeros(0, np.int64))
    assert got.shape == (0, 5) and got.dtype == np.float64


def test_row_offsets_are_each_rows_elements_in_row_major_order() -> None:
    got = row_offsets(np.array([0, 3]), (2, 2))
    np.testing.assert_array_equal(got, np.array([[[0, 1], [2, 3]], [[12, 13], [14, 15]]], np.uint64))
    assert row_offsets(np.array([7]), ()).tolist() == [7]
