from __future__ import annotations

import pytest

import sbpflow as sf
from sbpflow.sbp import B, S

CFG = sf.nn.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, n_embd=16)


def sbps(model):
    return {n: p.sbp for n, p in model.named_parameters()}


def test_megatron_on_one_axis() -> None:
    where = sf.placement("cpu", ranks=[0, 1])
    got = sbps(sf.nn.parallel.megatron(sf.nn.GPT(CFG), where))
    assert got["blocks.0.attn.c_attn.weight"] == (S(1),) and got["blocks.0.attn.c_attn.bias"] == (S(0),)
    assert got["blocks.0.attn.c_proj.weight"] == (S(0),) and got["blocks.0.attn.c_proj.bias"] == (B,)
    assert got["blocks.0.mlp.c_fc.weight"] == (S(1),) and got["blocks.0.mlp.c_proj.weight"] == (S(0),)
    assert got["wte.weight"] == (B,) and got["ln_f.weight"] == (B,) and got["lm_head.weight"] == (B,)


def test_megatron_on_a_2d_mesh_keeps_dp_axis_replicated() -> None:
    where = sf.placement("cpu", ranks=[[0, 1], [2, 3]])
    got = sbps(sf.nn.parallel.megatron(sf.nn.GPT(CFG), where, tp_axis=1))
    assert got["blocks.0.attn.c_attn.weight"] == (B, S(1))
    assert got["blocks.0.mlp.c_proj.weight"] == (B, S(0))
    assert got["wpe.weight"] == (B, B)


def test_megatron_needs_marked_layers() -> None:
    with pytest.raises(sf.SbpflowError, match="no Linear marked"):
        sf.nn.parallel.megatron(sf.nn.MLP([4, 4]), sf.placement("cpu", ranks=[0, 1]))
    with pytest.raises(sf.SbpflowError, match="tp_axis"):
        sf.nn.parallel.megatron(sf.nn.GPT(CFG), sf.placement("cpu", ranks=[0, 1]), tp_axis=1)


def test_data_parallel_replicates_everything() -> None:
    where = sf.placement("cpu", ranks=[0, 1, 2])
    assert set(sbps(sf.nn.parallel.data_parallel(sf.nn.MLP([4, 8, 2]), where)).values()) == {(B,)}
