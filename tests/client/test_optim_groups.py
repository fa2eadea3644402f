"""Parameter groups: a group's lr and weight decay replace the optimizer's for its parameters, in the
compiled update ops and in the one-device oracle alike, and they cross the wire."""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.codec import wire
from sbpflow.data.sources import ArraySource
from sbpflow.oracle import reference

CFG = sf.nn.GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, n_embd=8)


class Train(sf.Graph):
    def __init__(self, model: sf.nn.GPT, groups: list[dict]) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(
            sf.optim.AdamW(groups, lr=1e-2, weight_decay=0.5),
            lr_scheduler=sf.optim.lr_scheduler.WarmupCosine(1, 3),
        )
        self.config.steps = 3

    def build(self, tokens: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        loss = self.model(tokens, targets)
        loss.backward()
        return loss


def job(tp: bool = False, groups: object = None) -> tuple[sf.Job, sf.nn.GPT]:
    model = sf.nn.GPT(CFG).to(sf.float64)
    where = sf.placement("cpu", [0, 1])
    if tp:
        sf.nn.parallel.megatron(model, where, tp_axis=-1)
    ids = np.random.default_rng(0).integers(0, 16, size=(12, 9))
    data = ArraySource(batch_size=4, arrays={"tokens": ids[:, :-1], "targets": ids[:, 1:]})
    chosen = groups if groups is not None else sf.optim.decay_groups(model, 0.1)
    if callable(chosen):
        chosen = chosen(model)
    sbp = sf.sbp.broadcast if tp else sf.sbp.split(0)
    return Train(model, chosen).trace(data, placement=where, input_sbp=sbp), model


def test_decay_groups_exclude_biases_and_layer_norms_from_weight_decay() -> None:
    j, _ = job()
    assert j.optimizer is not None
    decay, no_decay = j.optimizer.groups
    assert decay.weight_decay == 0.1 and no_decay.weight_decay == 0.0
    assert "model.blocks.0.attn.c_attn.weight" in decay.parameters and "model.wte.weight" in decay.parameters
    assert (
        "model.blocks.0.ln_1.weight" in no_decay.parameters
        and "model.blocks.0.attn.c_attn.bias" in no_decay.parameters
    )
    assert j.optimizer.hyper("model.ln_f.bias")["weight_decay"] == 0.0
    assert j.optimizer.hyper("model.ln_f.bias")["lr"] == 1e-2  # not set by the group: the optimizer's
    assert wire.job_from_proto(wire.job_to_proto(j)).optimizer == j.optimizer


@pytest.mark.parametrize("tp", [False, True], ids=["dp", "tp"])
def test_groups_train_as_the_oracle_says(tp: bool) -> None:
    def groups(m: sf.nn.GPT) -> list[dict]:
        decay, no_decay = sf.optim.decay_groups(m, 0.1)
        return [decay, {**no_decay, "lr": 3e-2}]

    j, _ = job(tp, groups)
    got = sf.run(j, backend="inprocess", return_parameters=True)
    want = reference.train(j)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-12)
    assert got.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got.parameters[name], value, rtol=1e-10, atol=1e-13)
    plain, _ = job(tp, lambda m: [{"params": list(m.parameters())}])
    assert reference.train(plain).losses[-1] != want.losses[-1]  # the groups changed the training


def test_a_group_with_lr_zero_is_left_as_it_started() -> None:
    model = sf.nn.GPT(CFG).to(sf.float64)
    j, model = job(
        groups=lambda m: [{"params": [m.lm_head.weight], "lr": 0.0}, {"params": list(m.parameters())[:-1]}]
    )
    start = model.state_dict()["lm_head.weight"]
    sf.run(j, backend="inprocess")
    after = model.state_dict()
    np.testing.assert_array_equal(after["lm_head.weight"], start)
    assert not np.array_equal(after["wte.weight"], start[:0]) and j.optimizer is not None


@pytest.mark.parametrize(
    ("group", "words"),
    [
        ({"params": [], "momentum": 0.9}, "any of \\['lr', 'weight_decay'\\]"),
        ({"lr": 1.0}, "'params'"),
        ({"params": [], "lr": -1}, "lr=-1.0"),
    ],
)
def test_a_bad_group_is_named(group: dict, words: str) -> None:
    with pytest.raises(sf.SbpflowError, match=words):
        sf.optim.SGD([group, {"params": list(sf.nn.Linear(2, 2).parameters())}])
