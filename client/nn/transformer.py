"""GPT-2 (nanoGPT's shape): causal self-attention, the pre-LN block, and the language model.

Shapes use B batch, T sequence, D = n_embd, H heads, Dh = D / H, V vocabulary. The SBP comments give the
Megatron tensor-parallel layout on p ranks (``sf.nn.parallel.megatron``): qkv and fc weights column-split
``S(1)``, the projections row-split ``S(0)``, so each block needs only one all-reduce (``P -> B``) after
attention and one after the MLP. Under plain data parallelism every activation is ``S(0)`` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sbpflow.client import functional as F
from sbpflow.client.nn.layers import Dropout, Embedding, LayerNorm, Linear, ModuleList
from sbpflow.client.nn.layouts import Rules
from sbpflow.client.nn.module import Module
from sbpflow.client.tensor import Tensor
from sbpflow.errors import SbpflowError
from sbpflow.placement import Placement
from sbpflow.random import Normal
from sbpflow.sbp import NdSbp


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False  # lm_head reuses wte (as GPT-2); off by default so TP can split the head

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise SbpflowError(
                f"GPTConfig n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick n_embd = "
                "n_head * head_dim"
            )


def _init(std: float = 0.02) -> Normal:
    return Normal(0.0, std)


class CausalSelfAttention(Module):
    # nanoGPT's c_attn columns are [3, H, Dh]; Hugging Face GPT-2's projections are Conv1D ([in, out]),
    # and its older files hold the causal mask as buffers
    LAYOUTS = {
        "torch": Rules(qkv={"c_attn": ()}),
        "gpt2": Rules(qkv={"c_attn": ()}, conv1d=("c_attn", "c_proj"), ignored=("bias", "masked_bias")),
    }

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        d = cfg.n_embd
        self.c_attn = Linear(d, 3 * d, cfg.bias, _init(), tp="column")  # weight [D, 3D] S(1)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer): two per block add to the stream
        self.c_proj = Linear(
            d, d, cfg.bias, _init(0.02 / math.sqrt(2 * cfg.n_layer)), tp="row"
        )  # [D, D] S(0)
        self.resid_dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape  # x: [B, T, D]  B (replicated over the TP ranks)
        h = self.n_head
        qkv = self.c_attn(x)  # qkv: [B, T, 3D]  S(2)
        # [B, T, 3D] -> [B, T, H, 3, Dh], heads leading: a column split of 3D lands on the heads (S(2)),
        # so each rank keeps whole heads with their q, k and v and attention needs no boxing (Megatron's
        # layout); [B, T, 3, H, Dh] would put the split on the "3" axis and cost all-to-alls
        qkv = qkv.reshape(b, t, h, 3, d // h)
        q, k, v = F.split(qkv, 1, axis=3)  # each: [B, T, H, 1, Dh]
        q, k, v = (z.reshape(b, t, h, d // h).permute(0, 2, 1, 3) for z in (q, k, v))  # [B, H, T, Dh] S(1)
        y = F.scaled_dot_product_attention(q, k, v, True, self.dropout, self.training)  # [B, H, T, Dh] S(1)
        y = y.permute(0, 2, 1, 3).reshape(b, t, d)  # y: [B, T, D]  S(2): heads are contiguous columns
        return self.resid_dropout(self.c_proj(y))  # [B, T, D]  P -> B (all-reduce)


class FeedForward(Module):
    """GPT-2's MLP: D -> 4D (GELU) -> D."""

    LAYOUTS = {"torch": Rules(), "gpt2": Rules(conv1d=("c_fc", "c_proj"))}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.n_embd
        self.c_fc = Linear(d, 4 * d, cfg.bias, _init(), tp="column")  # weight [D, 4D] S(1)
        self.c_proj = Linear(4 * d, d, cfg.bias, _init(0.02 / math.sqrt(2 * cfg.n_layer)), tp="row")  # S(0)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.c_fc(x))  # h: [B, T, 4D]  S(2)
        return self.dropout(self.c_proj(h))  # [B, T, D]  P -> B (all-reduce)


class Block(Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    LAYOUTS = {"torch": Rules(), "gpt2": Rules()}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd)
        self.mlp = FeedForward(cfg)
        self.sequence_layout: tuple[Placement, NdSbp] | None = None  # between the sub-layers; see GPT

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # x: [B, T, D]  B (S(1) sequence-parallel)
        if self.sequence_layout is not None:
            x = x.to_global(*self.sequence_layout)
        return x + self.mlp(self.ln_2(x))  # x: [B, T, D]  B


# nanoGPT and Hugging Face GPT-2 keep the model's layers in `transformer` and name a tied head twice
_GPT = Rules(
    names={
        "wte": "transformer.wte",
        "wpe": "transformer.wpe",
        "blocks": "transformer.h",
        "ln_f": "transformer.ln_f",
    },
    tied={"lm_head.weight": "wte.weight"},
    untied_fix="GPTConfig(tie_embeddings=True)",
)


class GPT(Module):
    LAYOUTS = {"torch": _GPT, "gpt2": _GPT}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, _init())  # weight [V, D]  B
        self.wpe = Embedding(cfg.seq_len, cfg.n_embd, _init())  # weight [T_max, D]  B
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd)
        if not cfg.tie_embeddings:
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False, init=_init())  # [D, V]  B
        # cross entropy over this many slices of V: megatron(vocab_parallel=True) sets the TP degree, so
        # that logits split by class are never gathered
        self.vocab_chunks = 1
        # where the residual stream lies between blocks: megatron(sequence_parallel=True) splits it by
        # sequence over the tensor axis, so that layer norms and dropout run on shards (None: inferred)
        self.sequence_layout: tuple[Placement, NdSbp] | None = None

    def _between_blocks(self, x: Tensor) -> Tensor:
        return x if self.sequence_layout is None else x.to_global(*self.sequence_layout)

    def vocab_layers(self) -> tuple[Embedding, Linear | None]:
        """The layers whose vocabulary axis Megatron splits: the token embedding and the output head."""
        return self.wte, None if self.config.tie_embeddings else self.lm_head

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] for token ids ``idx`` [B, T]; the mean cross entropy when ``targets`` is given."""
        _, t = idx.shape  # idx: [B, T]  S(0) under DP, B under TP
        if t > self.config.seq_len:
            raise SbpflowError(f"GPT: sequence of {t} tokens is longer than seq_len={self.config.seq_len}")
        tok = self.wte(idx)  # tok: [B, T, D]
        pos = self.wpe.weight[:t]  # pos: [T, D], broadcast over the batch
        x = self.drop(tok + pos)
        for block in self.blocks:
            x = block(self._between_blocks(x))  # x: [B, T, D]  B, or S(1) sequence-parallel
        x = self.ln_f(self._between_blocks(x))
        if self.config.tie_embeddings:
            logits = F.matmul(x, self.wte.weight, transpose_b=True)  # logits: [B, T, V]
        else:
            logits = self.lm_head(x)  # logits: [B, T, V]
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets, vocab_chunks=self.vocab_chunks)  # loss: []
