"""The one-device reference executor against hand-written numpy forwards."""

from __future__ import annotations

import math

import numpy as np
import pytest

import sbpflow as sf
from sbpflow import reference
from sbpflow.data import SyntheticSource
from sbpflow.random import RandomKey, kaiming_uniform, tensor_rng_id


class Regression(sf.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.SGD(model.parameters(), lr=0.1))
        self.config.seed = 7

    def build(self, x, y):
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss


def mlp_job():
    mlp = sf.nn.MLP([5, 8, 3], activation="tanh")
    mlp[0].weight.init = kaiming_uniform(5)
    data = SyntheticSource(batch_size=6, kind="regression", params={"in": 5, "out": 3}, seed=3)
    return Regression(mlp).trace(data)


def draw(job, name):
    """A parameter drawn by hand from its initializer, keyed as the runtime keys it."""
    spec = next(p for p in job.parameters if p.tensor == name)
    shape = job.graph.tensors[name].meta.shape
    return spec.init.sample(np, RandomKey(7, tensor_rng_id(name)), shape, None, np.float32)


@pytest.mark.parametrize("step", [0, 3])
def test_mlp_forward_equals_numpy(step: int) -> None:
    job = mlp_job()
    w0, b0, w1, b1 = (draw(job, f"model.{i}.{k}") for i in (0, 2) for k in ("weight", "bias"))
    batch = job.data.read(step)
    pred = np.tanh(batch["x"] @ w0 + b0) @ w1 + b1
    want = ((pred - batch["y"]) ** 2).mean()
    got = reference.forward(job, step=step)
    assert list(got) == [job.loss]
    np.testing.assert_allclose(got[job.loss], want, rtol=1e-5)
    np.testing.assert_array_equal(reference.init_parameters(job)["model.0.weight"], w0)
    assert np.abs(w0).max() <= math.sqrt(6 / 5) and not b0.any()


def test_fetch_override_and_errors() -> None:
    job = mlp_job()
    params = {k: np.zeros_like(v) for k, v in reference.init_parameters(job).items()}
    got = reference.forward(job, parameters=params, fetches=["model.0.add_0"])
    assert not got["model.0.add_0"].any()
    with pytest.raises(sf.SbpflowError, match="names no tensor"):
        reference.forward(job, fetches=["nope"])
    with pytest.raises(sf.ShapeError, match="declared"):
        reference.forward(job, parameters={"model.0.bias": np.zeros(3, np.float32)})


def test_gpt_loss_at_init_is_near_log_vocab() -> None:
    vocab = 128
    cfg = sf.nn.GPTConfig(vocab_size=vocab, seq_len=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)

    class Train(sf.Graph):
        def __init__(self):
            super().__init__()
            self.gpt = sf.nn.GPT(cfg)

        def build(self, tokens, targets):
            loss = self.gpt(tokens, targets)
            loss.backward()
            return loss

    data = SyntheticSource(batch_size=4, kind="tokens", params={"seq_len": 16, "vocab": vocab})
    job = Train().trace(data)
    losses = [float(reference.forward(job, step=s)[job.loss]) for s in (0, 1)]
    assert all(np.isfinite(losses)) and all(abs(loss - math.log(vocab)) < 0.3 for loss in losses)
    assert losses[0] != losses[1]  # a new batch (and new dropout masks) per step
    again = float(reference.forward(job, step=0)[job.loss])
    assert again == losses[0]  # deterministic in (seed, step)
