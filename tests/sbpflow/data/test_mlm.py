"""Masked-language-model samples: BERT's masking, a learnable pair, any rank reading exactly its rows."""

from __future__ import annotations

import numpy as np
import pytest

from sbpflow.codec.wire import data_from_proto, data_to_proto
from sbpflow.data.mlm import CLS, MASK, SEP, SPECIAL
from sbpflow.data.sources import SyntheticSource
from sbpflow.errors import SbpflowError

PARAMS = {"seq_len": 21, "vocab": 50, "predictions": 3}


def source(**kw: object) -> SyntheticSource:
    return SyntheticSource(batch_size=512, kind="mlm", params={**PARAMS, **kw}, seed=3)  # type: ignore[arg-type]


def test_samples_are_bert_masked_sentence_pairs() -> None:
    s = source()
    r = s.read(0)
    assert {f.name: f.sample_shape for f in s.fields()} == {
        "tokens": (21,),
        "token_types": (21,),
        "positions": (3,),
        "labels": (3,),
    }
    tokens, types, pos, labels = r["tokens"], r["token_types"], r["positions"], r["labels"]
    first = (21 - 2) // 2
    assert (
        (tokens[:, 0] == CLS).all() and (tokens[:, first + 1] == SEP).all() and (tokens[:, -1] == SEP).all()
    )
    assert (types[:, : first + 2] == 0).all() and (types[:, first + 2 :] == 1).all()
    assert (np.diff(pos, axis=1) > 0).all(), "distinct positions, in order"
    specials = {0, first + 1, 20}
    assert not specials.intersection(pos.ravel().tolist()), "only ordinary positions are masked"
    assert (labels >= SPECIAL).all() and (labels < 50).all()
    # unmask: the second sentence repeats the first
    original = tokens.copy()
    np.put_along_axis(original, pos, labels, axis=1)
    assert np.array_equal(original[:, first + 2 : 20], original[:, 1 : 20 - first - 1])
    shown = np.take_along_axis(tokens, pos, axis=1)
    masked, kept = np.mean(shown == MASK), np.mean(shown == labels)
    assert 0.75 < masked < 0.85 and 0.08 < kept < 0.16, (masked, kept)  # 80 % [MASK]; 10 % + chance kept


def test_a_rank_reads_exactly_its_rows_of_the_batch() -> None:
    s = source()
    whole = s.read(2)
    part = s.read(2, slice(100, 300))
    assert all(np.array_equal(whole[k][100:300], part[k]) for k in whole)
    assert not np.array_equal(s.read(3)["tokens"], whole["tokens"])


def test_the_source_crosses_the_wire() -> None:
    s = source()
    back = data_from_proto(data_to_proto(s))
    assert back == s and np.array_equal(back.read(1)["labels"], s.read(1)["labels"])


@pytest.mark.parametrize(
    "bad", [{"seq_len": 4}, {"vocab": 4}, {"predictions": 0}, {"predictions": 19}], ids=str
)
def test_impossible_sizes_are_refused_with_the_rule(bad: dict[str, int]) -> None:
    with pytest.raises(SbpflowError, match="seq_len >= 5, vocab > 4"):
        source(**bad).fields()
