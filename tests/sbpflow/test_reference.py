"""The one-device reference executor against hand-written numpy forwards."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import sbpflow as sf
from sbpflow import reference
from sbpflow.data import ArraySource, SyntheticSource
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


# ---- training -------------------------------------------------------------------------------------------


def one_batch_job(**config) -> sf.Job:
    """The regression MLP fed the same batch every step (one batch of data, repeated per epoch)."""
    job = mlp_job()
    batch = job.data.read(0)
    data = ArraySource(batch_size=6, arrays=batch)
    return replace(job, data=data, config=replace(job.config, steps=5, **config))


def test_train_lowers_the_loss_on_a_repeated_batch_and_is_deterministic() -> None:
    job = one_batch_job()
    result = reference.train(job)
    assert len(result.losses) == 5 and all(np.diff(result.losses) < 0)
    assert result.losses[0] == pytest.approx(float(reference.forward(job)[job.loss]), rel=1e-6)
    assert set(result.parameters) == {p.tensor for p in job.parameters}
    # SGD keeps its buffer even at momentum 0 (it then holds the last step's gradient)
    assert set(result.optimizer_state) == {f"{p.tensor}/momentum" for p in job.parameters}
    again = reference.train(job, steps=2)
    assert again.losses == result.losses[:2]


def test_gradients_are_those_of_the_forward_loss() -> None:
    job = one_batch_job()
    loss, grads = reference.gradients(job)
    assert loss == pytest.approx(float(reference.forward(job)[job.loss]))
    assert {k: v.shape for k, v in grads.items()} == {
        k: v.shape for k, v in reference.init_parameters(job).items()
    }


def test_micro_batch_job_cuts_inputs_and_follows_reshapes() -> None:
    cfg = sf.nn.GPTConfig(vocab_size=16, seq_len=4, n_layer=1, n_head=2, n_embd=8)

    class Train(sf.Graph):
        def __init__(self):
            super().__init__()
            self.gpt = sf.nn.GPT(cfg)

        def build(self, tokens, targets):
            loss = self.gpt(tokens, targets)
            loss.backward()
            return loss

    job = Train().trace(SyntheticSource(batch_size=6, kind="tokens", params={"seq_len": 4, "vocab": 16}))
    micro = reference.micro_batch_job(job, 3)
    assert micro.graph.tensors["tokens"].meta.shape == (2, 4)
    shapes = [o.attrs["shape"] for o in micro.graph.ops if o.op_type == "reshape"]
    assert shapes and all(s[0] == 2 for s in shapes if len(s) > 2)  # [B, T, ...] reshapes follow the cut
    micro.verify()
    assert reference.micro_batch_job(job, 1) is job
    with pytest.raises(sf.SbpflowError, match=r"divisible by 4; the inputs have batch sizes \[6\]"):
        reference.micro_batch_job(job, 4)
    assert [reference.micro_batch_step(5, k, 3) for k in range(3)] == [15, 16, 17]


def test_train_needs_a_loss() -> None:
    job = replace(one_batch_job(), loss="", optimizer=None)
    with pytest.raises(sf.SbpflowError, match="has no loss"):
        reference.train(job)
