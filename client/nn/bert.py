"""BERT (Devlin et al. 2019) for masked-language-model pre-training: the post-LN encoder and its MLM head.

Shapes use B batch, T sequence, P masked positions per sequence, D = n_embd, H heads, Dh = D / H,
V vocabulary. The SBP comments give the layout of :func:`tensor_parallel` on the TP mesh axis:

- the word embedding is split by vocabulary rows ``S(0)`` (Megatron's vocabulary-parallel embedding): a
  lookup gives each rank its rows' vectors and zeros elsewhere, a partial sum ``P`` all-reduced to ``B``;
- each layer's qkv and first feed-forward weights are column-split ``S(1)``, both output projections
  row-split ``S(0)``, so a layer all-reduces twice (``P -> B``), as GPT's blocks do;
- the MLM decoder is the word embedding itself (tied), so the logits come out split over the vocabulary
  ``S(-1)``, with the decoder bias ``S(0)`` beside them; the cross entropy takes them split
  (vocabulary-parallel, ``F.cross_entropy(vocab_chunks=TP)``), so they are never gathered.

Every other mesh axis is data parallel: the batch ``S(0)``, the parameters ``B``, their gradients ``P``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sbpflow.client import functional as F
from sbpflow.client.nn.layers import Dropout, Embedding, LayerNorm, Linear, ModuleList
from sbpflow.client.nn.layouts import Rules
from sbpflow.client.nn.module import Module
from sbpflow.client.nn.parallel import megatron, set_axis
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.tensor import Tensor
from sbpflow.errors import SbpflowError
from sbpflow.placement import Placement
from sbpflow.random import Normal, Zeros
from sbpflow.sbp import B, Sbp, Split


@dataclass(frozen=True)
class BertConfig:
    """BERT-Base by default; BERT-Large is ``n_layer=24, n_head=16, n_embd=1024``."""

    vocab_size: int = 30522
    seq_len: int = 512
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    type_vocab_size: int = 2
    dropout: float = 0.1
    eps: float = 1e-12  # BERT's layer-norm epsilon
    intermediate_size: int = 0  # the feed-forward width (Hugging Face's name); 0: 4 * n_embd
    pad_token_id: int | None = None  # a word id that reads as zeros, its row untrained (Hugging Face: 0)

    @property
    def ffn(self) -> int:
        return self.intermediate_size or 4 * self.n_embd

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise SbpflowError(
                f"BertConfig n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick n_embd = "
                "n_head * head_dim"
            )


def _init() -> Normal:
    return Normal(0.0, 0.02)  # BERT's truncated normal, untruncated


Stream = tuple[Placement, tuple[Sbp, ...]] | None


def _pinned(x: Tensor, stream: Stream) -> Tensor:
    """Under TP, the residual stream held as Megatron holds it: whole on the TP axis, the batch split on
    the others. Left to itself, SBP inference may split the sequence over the TP ranks instead and gather
    every weight for every matmul, which can move fewer bytes on a small batch than Megatron's two
    all-reduces a layer, but is not the layout this model is here to show."""
    return x if stream is None else x.to_global(*stream)


def mask_bias(attention_mask: Tensor | None, dtype: Any) -> Tensor | None:
    """[B, T] ones (a token) and zeros (padding) as what the attention scores add: [B, 1, 1, T], 0 at a
    token and -1e30 at padding, so that no query attends to a padding key (Hugging Face's extended mask)."""
    if attention_mask is None:
        return None
    b, t = attention_mask.shape
    return ((1.0 - attention_mask.to(dtype)) * -1e30).reshape(b, 1, 1, t)


class SelfAttention(Module):
    """Bidirectional multi-head self-attention: every token attends to every token of its sequence."""

    # Hugging Face's BertSelfAttention: query, key and value apart, each [out, in]
    LAYOUTS = {
        "hf-bert": Rules(
            names={"proj": "output.dense"}, qkv={"qkv": ("self.query", "self.key", "self.value")}
        )
    }

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        d = cfg.n_embd
        self.qkv = Linear(d, 3 * d, init=_init(), tp="column")  # weight [D, 3D]  S(1)
        self.proj = Linear(d, d, init=_init(), tp="row")  # weight [D, D]  S(0)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        b, t, d = x.shape  # x: [B, T, D]  B on the TP axis
        h = self.n_head
        # heads leading ([B, T, H, 3, Dh]) so that a column split of 3D keeps whole heads on each rank
        qkv = self.qkv(x).reshape(b, t, h, 3, d // h)  # S(2)
        q, k, v = (z.reshape(b, t, h, d // h).permute(0, 2, 1, 3) for z in F.split(qkv, 1, axis=3))
        if bias is None:
            y = F.scaled_dot_product_attention(
                q, k, v, False, self.dropout, self.training
            )  # [B, H, T, Dh] S(1)
        else:
            att = F.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(d // h)) + bias  # [B, H, T, T]  S(1)
            att = F.dropout(F.softmax(att, axis=-1), self.dropout, self.training)
            y = F.matmul(att, v)  # [B, H, T, Dh]  S(1)
        return self.drop(self.proj(y.permute(0, 2, 1, 3).reshape(b, t, d)))  # [B, T, D]  P -> B


class Layer(Module):
    """Post-LN encoder layer: x = LN(x + attn(x)), then x = LN(x + ffn(x)), the FFN with erf GELU."""

    LAYOUTS = {
        "hf-bert": Rules(
            names={
                "attn": "attention",
                "ln_attn": "attention.output.LayerNorm",
                "fc": "intermediate.dense",
                "fc_out": "output.dense",
                "ln_ffn": "output.LayerNorm",
            }
        )
    }

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        d = cfg.n_embd
        self.attn = SelfAttention(cfg)
        self.ln_attn = LayerNorm(d, cfg.eps)
        self.fc = Linear(d, cfg.ffn, init=_init(), tp="column")  # weight [D, F]  S(1)
        self.fc_out = Linear(cfg.ffn, d, init=_init(), tp="row")  # weight [F, D]  S(0)
        self.drop = Dropout(cfg.dropout)
        self.ln_ffn = LayerNorm(d, cfg.eps)
        self.stream: Stream = None  # under TP: the residual stream's layout (see _pinned)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        x = _pinned(self.ln_attn(x + self.attn(x, bias)), self.stream)  # x: [B, T, D]  B
        h = F.gelu(self.fc(x), approximate="none")  # h: [B, T, F]  S(2)
        return _pinned(self.ln_ffn(x + self.drop(self.fc_out(h))), self.stream)  # x: [B, T, D]  B


_EMBEDDINGS = {
    "word": "embeddings.word_embeddings",
    "position": "embeddings.position_embeddings",
    "token_type": "embeddings.token_type_embeddings",
    "ln_embed": "embeddings.LayerNorm",
    "layers": "encoder.layer",
}
# buffers of Hugging Face's BertEmbeddings that older versions save
_IDS = ("embeddings.position_ids", "embeddings.token_type_ids")


class BERT(Module):
    """The encoder (Hugging Face's ``BertModel`` without its pooler): hidden states [B, T, D]."""

    LAYOUTS = {"hf-bert": Rules(names=_EMBEDDINGS, ignored=_IDS)}

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.n_embd
        self.word = Embedding(cfg.vocab_size, d, _init(), cfg.pad_token_id)  # weight [V, D]  S(0) under TP
        self.position = Embedding(cfg.seq_len, d, _init())  # weight [T_max, D]  B
        self.token_type = Embedding(cfg.type_vocab_size, d, _init())  # weight [2, D]  B
        self.ln_embed = LayerNorm(d, cfg.eps)
        self.drop = Dropout(cfg.dropout)
        self.layers = ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.stream: Stream = None  # under TP: the residual stream's layout (see _pinned)

    def encode(self, tokens: Tensor, token_types: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Hidden states [B, T, D] for ``tokens`` and ``token_types`` [B, T]; ``attention_mask`` [B, T]:
        1 at a token, 0 at padding, which no token attends to."""
        t = tokens.shape[1]  # tokens: [B, T]  S(0) over the data-parallel axis, B over the TP one
        if t > self.config.seq_len:
            raise SbpflowError(f"BERT: a sequence of {t} tokens is longer than seq_len={self.config.seq_len}")
        x = self.word(tokens) + self.token_type(token_types)  # [B, T, D]  P -> B under TP
        x = _pinned(self.drop(self.ln_embed(x + self.position.weight[:t])), self.stream)
        bias = mask_bias(attention_mask, x.dtype)  # [B, 1, 1, T]
        for layer in self.layers:
            x = layer(x, bias)
        return x

    def forward(self, tokens: Tensor, token_types: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.encode(tokens, token_types, attention_mask)


class BertForMaskedLM(BERT):
    """The encoder and the MLM head (its decoder the word embedding, tied); the loss reads only the
    masked positions."""

    LAYOUTS = {
        "hf-bert": Rules(
            names={
                **{k: f"bert.{v}" for k, v in _EMBEDDINGS.items()},
                "transform": "cls.predictions.transform.dense",
                "ln_head": "cls.predictions.transform.LayerNorm",
                "decoder_bias": "cls.predictions.bias",
            },
            tied={
                "cls.predictions.decoder.weight": "word.weight",
                "cls.predictions.decoder.bias": "decoder_bias",
            },
            ignored=tuple(f"bert.{n}" for n in _IDS),
        )
    }

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__(cfg)
        d = cfg.n_embd
        self.transform = Linear(d, d, init=_init())  # the head's dense layer, replicated
        self.ln_head = LayerNorm(d, cfg.eps)
        self.decoder_bias = Parameter((cfg.vocab_size,), Zeros())  # [V]  S(0) under TP
        self.vocab_chunks = 1  # the TP degree once split: the loss then never gathers the logits

    def head(self, h: Tensor) -> Tensor:
        """Logits [..., V] of hidden states [..., D]."""
        h = self.ln_head(F.gelu(self.transform(h), approximate="none"))
        return F.matmul(h, self.word.weight, transpose_b=True) + self.decoder_bias  # [..., V]  S(-1) under TP

    def logits(self, tokens: Tensor, token_types: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] at every position (Hugging Face's ``BertForMaskedLM(...).logits``)."""
        return self.head(self.encode(tokens, token_types, attention_mask))

    def forward(  # type: ignore[override]
        self,
        tokens: Tensor,
        token_types: Tensor,
        positions: Tensor,
        labels: Tensor,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """The mean cross entropy over the masked ``positions`` [B, P] against their ``labels`` [B, P]."""
        x = self.encode(tokens, token_types, attention_mask)
        # the hidden states at the masked positions, as a one-hot matmul (every rank its own rows)
        pick = F.one_hot(positions, tokens.shape[1], dtype=x.dtype)  # [B, P, T]
        logits = self.head(F.matmul(pick, x))  # [B, P, V]  S(2) under TP
        # under TP, the maxima of each rank's vocabulary slice, then the sums of exponentials and the
        # label's logit as partial sums: [B, P]-sized boxings, not the [B, P, V] logits
        return F.cross_entropy(logits, labels, vocab_chunks=self.vocab_chunks)  # loss: []


def tensor_parallel(model: BertForMaskedLM, placement: Placement, tp_axis: int = -1) -> BertForMaskedLM:
    """Megatron's layout (module docstring) on mesh axis ``tp_axis``; every other axis data parallel."""
    megatron(model, placement, tp_axis)
    axis = tp_axis % placement.ndim
    set_axis(model.word.weight, placement, axis, Split(0))
    set_axis(model.decoder_bias, placement, axis, Split(0))
    tp, vocab = placement.shape[axis], model.config.vocab_size
    if vocab % tp:
        raise SbpflowError(
            f"BERT vocabulary {vocab} does not split into {tp} equal tensor-parallel parts; pad it to a "
            f"multiple of {tp} (Megatron pads to a multiple of 128 x TP)"
        )
    model.vocab_chunks = tp
    model.stream = (placement, tuple(B if a == axis else Split(0) for a in range(placement.ndim)))
    for layer in model.layers:
        layer.stream = model.stream
    return model
