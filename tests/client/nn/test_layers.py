from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.oracle import reference
from sbpflow.random import tensor_rng_id
from tests.client.helpers import arrays, trace


def run(module: sf.nn.Module, **fields):
    job = trace(lambda g, *xs: g.m(*xs), arrays(**fields), modules={"m": module})
    out = reference.forward(job)
    params = reference.init_parameters(job)
    return job, out[job.fetches[0]], params, job.data.read(0)


def test_linear_is_x_at_w_plus_b() -> None:
    job, y, p, batch = run(sf.nn.Linear(5, 3), x=((5,), "float32"))
    assert p["m.weight"].shape == (5, 3)
    np.testing.assert_allclose(y, batch["x"] @ p["m.weight"] + p["m.bias"], rtol=1e-5)
    bound = np.sqrt(6 / 8)  # xavier-uniform default
    assert np.abs(p["m.weight"]).max() <= bound and not p["m.bias"].any()


def test_embedding_and_layer_norm() -> None:
    _, y, p, batch = run(sf.nn.Embedding(8, 4), ids=((3,), "int64"))
    np.testing.assert_array_equal(y, p["m.weight"][batch["ids"]])
    _, y, _, batch = run(sf.nn.LayerNorm(6), x=((6,), "float32"))
    x = batch["x"]
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


def test_dropout_keys_on_its_scoped_name_and_skips_in_eval() -> None:
    job, y, _, batch = run(sf.nn.Dropout(0.5), x=((64,), "float32"))
    (node,) = job.graph.ops
    assert node.name == "m.dropout_0" and node.attrs["rng_id"] == tensor_rng_id("m.dropout_0")
    kept = y != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(y[kept], 2 * batch["x"][kept], rtol=1e-6)
    job = trace(lambda g, x: g.m(x), arrays(x=((4,), "float32")), modules={"m": sf.nn.Dropout(0.5).eval()})
    assert job.graph.ops == [] and job.fetches == ("x",)


def test_mlp_layers_and_errors() -> None:
    mlp = sf.nn.MLP([4, 8, 8, 2], activation="gelu")
    assert [type(m).__name__ for m in mlp] == ["Linear", "GELU", "Linear", "GELU", "Linear"]
    assert len(mlp) == 5 and isinstance(mlp[-1], sf.nn.Linear)
    with pytest.raises(sf.SbpflowError, match="activation"):
        sf.nn.MLP([4, 2], activation="swish")
    with pytest.raises(sf.SbpflowError, match="at least"):
        sf.nn.MLP([4])
    with pytest.raises(sf.SbpflowError, match="rate"):
        sf.nn.Dropout(1.0)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: sf.nn.Linear(8, 0), r"Linear\(in_features=8, out_features=0\): out_features must be"),
        (lambda: sf.nn.Linear(0, 8), "in_features must be an integer >= 1"),
        (lambda: sf.nn.MLP([4, 0, 2]), "out_features must be"),
        (lambda: sf.nn.Embedding(10, 0), "embedding_dim must be"),
        (lambda: sf.nn.LayerNorm(0), r"LayerNorm\(dim=0\)"),
        (lambda: sf.nn.Linear(8, 2.0), "out_features must be an integer"),  # type: ignore[arg-type]
        (lambda: sf.nn.Linear(8, True), "out_features must be an integer"),
    ],
)
def test_a_zero_width_layer_is_refused_where_it_is_made(make: Any, words: str) -> None:
    with pytest.raises(sf.SbpflowError, match=words):
        make()
    assert sf.nn.Linear(np.int64(3), np.int64(2)).weight.shape == (3, 2)  # numpy's integers are sizes too


class _PaddedSum(sf.Graph):
    def __init__(self, emb: sf.nn.Embedding) -> None:
        super().__init__()
        self.emb = emb
        self.add_optimizer(sf.optim.SGD(emb.parameters(), lr=0.5))

    def build(self, ids: sf.Tensor) -> Any:
        out = self.emb(ids)  # [B, T, D]
        loss = (out * out).sum()
        loss.backward()
        return loss, out


def test_the_padding_row_reads_as_it_holds_and_takes_no_gradient() -> None:
    """PyTorch's padding_idx: the row's value in the forward, no update to it in the backward."""
    emb = sf.nn.Embedding(5, 3, padding_idx=1)
    emb.load_state_dict({"weight": np.arange(15, dtype=np.float32).reshape(5, 3) + 1})  # row 1 non-zero
    ids = np.array([[1, 2, 1, 4]], np.int64)
    job = _PaddedSum(emb).trace(sf.data.ArraySource(batch_size=1, arrays={"ids": ids}))
    got = sf.run(job, steps=1, return_parameters=True, backend="inprocess", timeout=60)
    start = np.arange(15, dtype=np.float32).reshape(5, 3) + 1
    (rows,) = [v[0] for v in got.outputs.values() if np.ndim(v[0]) == 3]  # the step's lookup [B, T, D]
    np.testing.assert_array_equal(rows[0], start[ids[0]])
    assert got.parameters is not None
    after = got.parameters["emb.weight"]
    np.testing.assert_array_equal(after[[0, 1, 3]], start[[0, 1, 3]])  # the padding row and unused rows
    assert not np.array_equal(after[[2, 4]], start[[2, 4]])  # the others trained
