from __future__ import annotations

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.data.sources import ArraySource
from sbpflow.oracle import reference
from tests.client.helpers import arrays, trace

F = sf.nn.functional


def _ce_numpy(logits, labels, ignore):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    keep = labels != ignore
    picked = np.take_along_axis(logp, np.where(keep, labels, 0)[..., None], -1)[..., 0]
    return np.where(keep, -picked, 0.0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_counts_only_kept_labels(reduction: str) -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 3, 5)).astype(np.float32)
    labels = rng.integers(0, 5, size=(4, 3))
    labels[0, :2] = -100
    data = ArraySource(batch_size=4, arrays={"logits": logits, "labels": labels})
    job = trace(lambda g, lg, lb: F.cross_entropy(lg, lb, reduction=reduction), data)
    got = reference.forward(job)[job.fetches[0]]
    per = _ce_numpy(logits, labels, -100)
    want = {"none": per, "sum": per.sum(), "mean": per.sum() / (labels != -100).sum()}[reduction]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cross_entropy_mean_of_all_ignored_is_zero() -> None:
    data = ArraySource(
        batch_size=2, arrays={"logits": np.zeros((2, 4), np.float32), "labels": np.full((2,), -1, np.int64)}
    )
    job = trace(lambda g, lg, lb: F.cross_entropy(lg, lb, ignore_index=-1), data)
    assert reference.forward(job)[job.fetches[0]] == 0.0


def test_scaled_dot_product_attention_matches_numpy() -> None:
    data = arrays(batch=2, q=((2, 4, 3), "float32"), k=((2, 4, 3), "float32"), v=((2, 4, 3), "float32"))
    job = trace(lambda g, q, k, v: F.scaled_dot_product_attention(q, k, v), data)
    got = reference.forward(job)[job.fetches[0]]
    b = data.read(0)
    s = b["q"] @ b["k"].swapaxes(-1, -2) / np.sqrt(3)
    s = np.where(np.triu(np.ones((4, 4), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(got, (p / p.sum(-1, keepdims=True)) @ b["v"], rtol=1e-5, atol=1e-6)


def test_concat_split_and_matmul_dispatch() -> None:
    def build(g, x, y):
        a, b = F.split(x, [2, 4], axis=-1)
        return F.concat([b, a], axis=1), F.matmul(x, y.T), F.matmul(x.reshape(2, 2, 3), x.reshape(2, 3, 2))

    job = trace(build, arrays(batch=2, x=((6,), "float32"), y=((6,), "float32")))
    assert [o.op_type for o in job.graph.ops][:2] == ["split", "concat"]
    assert "batch_matmul" in [o.op_type for o in job.graph.ops]
    out = reference.forward(job)
    x = job.data.read(0)["x"]
    np.testing.assert_array_equal(out[job.fetches[0]], np.concatenate([x[:, 2:], x[:, :2]], 1))
    with pytest.raises(sf.ShapeError, match="must be 2-d"):
        trace(
            lambda g, x, y: F.matmul(x.reshape(1, 2, 2, 3), x.reshape(2, 3, 2)),
            arrays(batch=2, x=((6,), "float32"), y=((6,), "float32")),
        )


def test_dropout_rate_zero_and_eval_emit_nothing() -> None:
    job = trace(
        lambda g, x: (F.dropout(x, 0.0), F.dropout(x, 0.5, training=False)), arrays(x=((4,), "float32"))
    )
    assert job.graph.ops == []


def test_full_makes_a_constant_on_the_default_placement() -> None:
    where = sf.placement("cpu", ranks=[0, 1])
    job = trace(lambda g, x: x + F.full((4,), 2.0), arrays(x=((4,), "float32")), placement=where)
    assert job.graph.ops[0].op_type == "full" and job.graph.ops[0].placement == where
