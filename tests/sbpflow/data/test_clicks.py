"""The click source (data/clicks.py): it draws its teacher's weights of the ids a read holds, not the
whole fields x vocab table each read, and every read is still what drawing the table whole gave, bit for
bit (``whole_table_read``: the source as it was)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sbpflow.data.clicks import read_clicks, table_rows
from sbpflow.data.sources import SyntheticSource
from sbpflow.random import RandomKey, normal, normal_at, tensor_rng_id, uniform


def whole_table_read(seed: int, params: dict[str, Any], num_samples: int, ids: np.ndarray) -> dict[str, Any]:
    dense, fields, vocab = int(params["dense"]), int(params["fields"]), int(params["vocab"])

    def key(name: str) -> RandomKey:
        return RandomKey(seed, tensor_rng_id(f"clicks.{name}"))

    x = table_rows(normal, key("dense"), (num_samples, dense), ids)
    u = table_rows(uniform, key("ids"), (num_samples, fields), ids)
    hashed = np.minimum((u**3 * vocab).astype(np.int64), vocab - 1) + np.arange(fields) * vocab
    w_dense = normal(np, key("teacher.dense"), (dense,), None, np.float64) / np.sqrt(max(dense, 1))
    w_ids = 0.5 * normal(np, key("teacher.ids"), (fields * vocab,), None, np.float64)
    logit = x @ w_dense + w_ids[hashed].sum(axis=1)
    if dense >= 2:
        logit += x[:, 0] * x[:, 1]
    coin = table_rows(uniform, key("label"), (num_samples, 1), ids)[:, 0]
    label = coin < 1.0 / (1.0 + np.exp(-logit))
    return {"dense": x.astype(np.float32), "ids": hashed, "label": label.astype(np.float32)}


PARAMS = [
    {"dense": 4, "fields": 4, "vocab": 128},
    {"dense": 1, "fields": 7, "vocab": 4096},
    {"dense": 13, "fields": 26, "vocab": 1000},
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("ids", [[0], list(range(3, 40)), list(range(1000, 1064)), [5, 9, 2, 70000]])
def test_a_read_is_the_whole_tables_read_bit_for_bit(params: dict[str, Any], ids: list[int]) -> None:
    rows = np.asarray(ids)
    got, want = read_clicks(11, params, 1 << 17, rows), whole_table_read(11, params, 1 << 17, rows)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name])
    assert 0.0 < float(np.mean(whole_table_read(11, params, 1 << 17, np.arange(512))["label"])) < 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normal_at_is_the_whole_draw_at_those_offsets(dtype: Any) -> None:
    key = RandomKey(5, tensor_rng_id("t"), step=3)
    whole = normal(np, key, (64, 33), None, dtype).reshape(-1)
    at = np.array([[0, 7, 2111], [64 * 33 - 1, 5, 5]], np.uint64)
    got = normal_at(np, key, at, dtype)
    assert got.shape == at.shape and got.dtype == dtype
    np.testing.assert_array_equal(got, whole[at.astype(np.int64)])


def test_the_source_reads_its_rows_the_same_whatever_the_slice() -> None:
    src = SyntheticSource(
        batch_size=8, kind="clicks", params={"dense": 4, "fields": 4, "vocab": 4096}, seed=3
    )
    whole = src.read(0, slice(0, 8))
    parts = [src.read(0, slice(i, i + 2)) for i in range(0, 8, 2)]
    for name in ("dense", "ids", "label"):
        np.testing.assert_array_equal(whole[name], np.concatenate([p[name] for p in parts]))
