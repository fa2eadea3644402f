from __future__ import annotations

from collections import Counter

import pytest

import sbpflow as sf
from sbpflow.data.sources import SyntheticSource
from sbpflow.graph import TensorKind

CFG = sf.nn.GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)


class TrainGPT(sf.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.AdamW(model.parameters()))

    def build(self, tokens, targets):
        loss = self.model(tokens, targets)
        loss.backward()
        return loss


def gpt_job(cfg=CFG, **kw):
    data = SyntheticSource(
        batch_size=2, kind="tokens", params={"seq_len": cfg.seq_len, "vocab": cfg.vocab_size}
    )
    return TrainGPT(sf.nn.GPT(cfg)).trace(data, **kw)


def test_gpt_traces_with_expected_ops_and_parameters() -> None:
    job = gpt_job()
    job.verify()
    ops = Counter(o.op_type for o in job.graph.ops)
    # without dropout, attention is one op a layer (sbpflow/ops/attention.py), not its unfused five
    assert ops["attention"] == 2 and not {"batch_matmul", "causal_mask", "softmax"} & set(ops)
    assert ops["layer_norm"] == 5 and ops["cross_entropy"] == 1 and ops["embedding"] == 1
    assert ops["gelu"] == 2 and ops["split"] == 2 and "dropout" not in ops  # dropout=0 emits nothing
    params = {t.name: t.meta.shape for t in job.graph.of_kind(TensorKind.parameter)}
    assert params["model.wte.weight"] == (64, 16) and params["model.wpe.weight"] == (8, 16)
    assert params["model.blocks.1.attn.c_attn.weight"] == (16, 48)
    assert params["model.blocks.0.mlp.c_fc.weight"] == (16, 64)
    assert params["model.blocks.0.mlp.c_proj.weight"] == (64, 16)
    assert params["model.lm_head.weight"] == (16, 64)
    assert len(params) == 2 + 2 * 12 + 2 + 1
    reshape = next(o for o in job.graph.ops if o.name == "model.blocks.0.attn.reshape_0")
    assert reshape.attrs["shape"] == (2, 8, 2, 3, 8)  # [B, T, H, 3, Dh]: heads lead, so TP splits heads
    assert job.graph.tensors[job.loss].meta.shape == ()


def test_gpt_dropout_and_tied_embeddings() -> None:
    cfg = sf.nn.GPTConfig(
        vocab_size=64, seq_len=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1, tie_embeddings=True
    )
    job = gpt_job(cfg)
    names = [o.name for o in job.graph.ops if o.op_type == "dropout"]
    assert names == [
        "model.drop.dropout_0",
        "model.blocks.0.attn.dropout_0",
        "model.blocks.0.attn.resid_dropout.dropout_0",
        "model.blocks.0.mlp.dropout.dropout_0",
    ]
    assert "model.lm_head.weight" not in job.graph.tensors
    head = [o for o in job.graph.ops if o.op_type == "matmul"][-1]
    assert head.inputs[1] == "model.wte.weight" and head.attrs["transpose_b"]


def test_gpt_config_checks_heads() -> None:
    with pytest.raises(sf.SbpflowError, match="not divisible by n_head"):
        sf.nn.GPTConfig(n_embd=10, n_head=3)
