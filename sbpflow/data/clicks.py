"""Click-log-shaped synthetic samples (``SyntheticSource(kind="clicks")``), for Wide & Deep.

Each sample has ``dense`` features (N(0, 1), float32), ``ids``: one categorical id per field, hashed
into one shared table (field ``f`` owns rows ``[f * vocab, (f + 1) * vocab)``, skewed towards the low
rows as click-log categories are), and a 0/1 float32 ``label`` drawn with probability
``sigmoid(logit)`` from a fixed teacher: a linear part in the dense features and per-id weights, plus a
product of two dense features that a linear model cannot fit. Every value is a pure function of (seed,
field, sample id) through the counter-based generator, so any rank reads exactly its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sbpflow.dtype import DType
from sbpflow.random import RandomKey, normal, normal_at, tensor_rng_id, uniform

Draw = Callable[..., Any]


def click_shapes(params: Mapping[str, float]) -> dict[str, tuple[tuple[int, ...], DType]]:
    dense, fields = int(params["dense"]), int(params["fields"])
    return {"dense": ((dense,), DType.float32), "ids": ((fields,), DType.int64), "label": ((), DType.float32)}


def table_rows(draw: Draw, key: RandomKey, shape: tuple[int, ...], ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of the logical draw: one call per run of consecutive ids (all of them, unshuffled)."""
    if len(ids) == 0:
        return np.zeros((0, *shape[1:]))
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    parts = []
    for run in np.split(ids, breaks):
        index = (slice(int(run[0]), int(run[-1]) + 1), *(slice(0, d) for d in shape[1:]))
        parts.append(draw(np, key, shape, index, np.float64))
    return np.concatenate(parts)


def read_clicks(seed: int, params: Mapping[str, float], num_samples: int, ids: np.ndarray) -> dict[str, Any]:
    dense, fields, vocab = int(params["dense"]), int(params["fields"]), int(params["vocab"])

    def key(name: str) -> RandomKey:
        return RandomKey(seed, tensor_rng_id(f"clicks.{name}"))

    x = table_rows(normal, key("dense"), (num_samples, dense), ids)
    u = table_rows(uniform, key("ids"), (num_samples, fields), ids)
    local = np.minimum((u**3 * vocab).astype(np.int64), vocab - 1)  # skewed: low rows are frequent
    hashed = local + np.arange(fields, dtype=np.int64) * vocab
    w_dense = normal(np, key("teacher.dense"), (dense,), None, np.float64) / np.sqrt(max(dense, 1))
    # the teacher's weights of the ids read, not its whole table of fields * vocab (1.7 ms a read at
    # vocabulary 4,096, and growing with it): the same values, element by element
    w_ids = 0.5 * normal_at(np, key("teacher.ids"), hashed.astype(np.uint64), np.float64)
    logit = x @ w_dense + w_ids.sum(axis=1)
    if dense >= 2:
        logit += x[:, 0] * x[:, 1]
    coin = table_rows(uniform, key("label"), (num_samples, 1), ids)[:, 0]
    label = coin < 1.0 / (1.0 + np.exp(-logit))
    return {"dense": x.astype(np.float32), "ids": hashed, "label": label.astype(np.float32)}
