"""``RunResult.outputs``: a forward-only job returns what ``build`` returned, per step, on both backends."""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.data.sources import ArraySource
from sbpflow.oracle import reference


class Logits(sf.Graph):
    def __init__(self, model: sf.nn.Module) -> None:
        super().__init__()
        self.model = model

    def build(self, tokens: sf.Tensor) -> sf.Tensor:
        return self.model(tokens)  # logits: [B, T, V]


def forward_job(ranks: int, tp: bool, steps: int = 2) -> sf.Job:
    cfg = sf.nn.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, n_embd=16)
    model = sf.nn.GPT(cfg).eval()
    where = sf.placement("cpu", ranks=list(range(ranks)))
    if tp:
        sf.nn.parallel.megatron(model, where, tp_axis=-1)
    tokens = np.random.default_rng(0).integers(0, 32, size=(4 * steps, 8))
    graph = Logits(model)
    graph.config.steps = steps
    sbp = sf.sbp.broadcast if tp else sf.sbp.split(0)
    return graph.trace(ArraySource(batch_size=4, arrays={"tokens": tokens}), placement=where, input_sbp=sbp)


@pytest.mark.parametrize(("ranks", "tp"), [(1, False), (2, False), (2, True)], ids=["one", "dp", "tp"])
def test_a_forward_only_job_returns_its_outputs_per_step(ranks: int, tp: bool) -> None:
    job = forward_job(ranks, tp)
    result = sf.run(job, backend="inprocess")
    (name,) = job.fetches
    assert result.losses == [] and list(result.outputs) == [name]
    assert len(result.outputs[name]) == job.config.steps
    for step, got in enumerate(result.outputs[name]):
        want = reference.forward(job, step=step, fetches=[name])[name]
        assert got.shape == (4, 8, 32)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(result.outputs[name][0], result.outputs[name][1])  # each step its own batch


def test_a_training_run_does_not_repeat_its_loss_in_outputs() -> None:
    from tests.examples.test_examples import load

    job = load("mlp").make_job(ranks=2, steps=2)
    result = sf.run(job, backend="inprocess")
    assert len(result.losses) == 2 and job.loss in job.fetches and result.outputs == {}


@pytest.mark.usefixtures("ray_local")
def test_ray_workers_return_the_outputs_too() -> None:
    job = forward_job(2, True, steps=1)
    (name,) = job.fetches
    local = sf.run(job, backend="inprocess").outputs[name]
    got = sf.run(job, backend="ray", timeout=120).outputs[name]
    assert len(got) == 1
    np.testing.assert_allclose(got[0], local[0], rtol=1e-5, atol=1e-6)
