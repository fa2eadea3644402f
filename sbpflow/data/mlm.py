"""Masked-language-model samples (``SyntheticSource(kind="mlm")``), for BERT pre-training.

A sample is a sentence pair ``[CLS] a [SEP] a' [SEP]`` of ``params['seq_len']`` tokens, where ``a`` is
random ordinary tokens and ``a'`` repeats ``a`` (cut to fit), so a masked token of one sentence can be
read off the other: something an encoder can learn, not only memorise. ``token_types`` are 0 over
``[CLS] a [SEP]`` and 1 after. ``params['predictions']`` distinct ordinary positions are masked as BERT
does: 80 % become ``[MASK]``, 10 % a random ordinary token, 10 % stay; ``positions`` lists them and
``labels`` the original tokens there, so the loss reads the masked positions only. Every value is a
pure function of (seed, field, sample id) through the counter-based generator, so any rank reads
exactly its rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sbpflow.data.clicks import table_rows
from sbpflow.dtype import DType
from sbpflow.errors import SbpflowError
from sbpflow.random import RandomKey, tensor_rng_id, uniform

CLS, SEP, MASK = 1, 2, 3  # 0 is [PAD] (unused: every sequence is full); ordinary tokens from SPECIAL on
SPECIAL = 4


def mlm_sizes(params: Mapping[str, float]) -> tuple[int, int, int]:
    """(seq_len, vocab, predictions), checked: the pair needs 5 tokens, the vocabulary an ordinary one."""
    t, v, p = int(params["seq_len"]), int(params["vocab"]), int(params["predictions"])
    if t < 5 or v <= SPECIAL or not 1 <= p <= t - 3:
        raise SbpflowError(
            f"mlm data seq_len={t}, vocab={v}, predictions={p}: need seq_len >= 5, vocab > {SPECIAL} "
            "(4 special tokens) and 1 <= predictions <= seq_len - 3 (the ordinary positions)"
        )
    return t, v, p


def mlm_shapes(params: Mapping[str, float]) -> dict[str, tuple[tuple[int, ...], DType]]:
    t, _, p = mlm_sizes(params)
    return {
        "tokens": ((t,), DType.int64),
        "token_types": ((t,), DType.int64),
        "positions": ((p,), DType.int64),
        "labels": ((p,), DType.int64),
    }


def read_mlm(seed: int, params: Mapping[str, float], num_samples: int, ids: np.ndarray) -> dict[str, Any]:
    t, vocab, p = mlm_sizes(params)
    n = len(ids)
    ordinary = vocab - SPECIAL

    def draw(name: str, width: int) -> np.ndarray:
        key = RandomKey(seed, tensor_rng_id(f"mlm.{name}"))
        return table_rows(uniform, key, (num_samples, width), ids).reshape(n, width)

    first = (t - 2) // 2  # [CLS] a [SEP]: 1 + first + 1 tokens; a' [SEP] fills the rest
    a = SPECIAL + (draw("text", first) * ordinary).astype(np.int64)
    second = a[:, : t - 3 - first]
    sep = np.full((n, 1), SEP, np.int64)
    tokens = np.concatenate([np.full((n, 1), CLS, np.int64), a, sep, second, sep], axis=1)
    types = np.zeros((n, t), np.int64)
    types[:, first + 2 :] = 1
    # the p ordinary positions with the smallest draws: distinct, uniform, in increasing order
    candidates = np.concatenate([np.arange(1, first + 1), np.arange(first + 2, t - 1)])
    order = np.argsort(draw("choose", len(candidates)), axis=1, kind="stable")[:, :p]
    positions = np.sort(candidates[order], axis=1)
    rows = np.arange(n)[:, None]
    labels = tokens[rows, positions]
    how, other = draw("how", p), SPECIAL + (draw("other", p) * ordinary).astype(np.int64)
    masked = tokens.copy()
    masked[rows, positions] = np.where(how < 0.8, MASK, np.where(how < 0.9, other, labels))
    return {"tokens": masked, "token_types": types, "positions": positions, "labels": labels}
