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

from dataclasses import dataclass

from sbpflow.client import functional as F
from sbpflow.client.nn.layers import Dropout, Embedding, LayerNorm, Linear, ModuleList
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


class SelfAttention(Module):
    """Bidirectional multi-head self-attention: every token attends to every token of its sequence."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        d = cfg.n_embd
        self.qkv = Linear(d, 3 * d, init=_init(), tp="column")  # weight [D, 3D]  S(1)
        self.proj = Linear(d, d, init=_init(), tp="row")  # weight [D, D]  S(0)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape  # x: [B, T, D]  B on the TP axis
        h = self.n_head
        # heads leading ([B, T, H, 3, Dh]) so that a column split of 3D keeps whole heads on each rank
        qkv = self.qkv(x).reshape(b, t, h, 3, d // h)  # S(2)
        q, k, v = (z.reshape(b, t, h, d // h).permute(0, 2, 1, 3) for z in F.split(qkv, 1, axis=3))
        y = F.scaled_dot_product_attention(q, k, v, False, self.dropout, self.training)  # [B, H, T, Dh] S(1)
        return self.drop(self.proj(y.permute(0, 2, 1, 3).reshape(b, t, d)))  # [B, T, D]  P -> B


class Layer(Module):
    """Post-LN encoder layer: x = LN(x + attn(x)), then x = LN(x + ffn(x)), the FFN with erf GELU."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        d = cfg.n_embd
        self.attn = SelfAttention(cfg)
        self.ln_attn = LayerNorm(d, cfg.eps)
        self.fc = Linear(d, 4 * d, init=_init(), tp="column")  # weight [D, 4D]  S(1)
        self.fc_out = Linear(4 * d, d, init=_init(), tp="row")  # weight [4D, D]  S(0)
        self.drop = Dropout(cfg.dropout)
        self.ln_ffn = LayerNorm(d, cfg.eps)
        self.stream: Stream = None  # under TP: the residual stream's layout (see _pinned)

    def forward(self, x: Tensor) -> Tensor:
        x = _pinned(self.ln_attn(x + self.attn(x)), self.stream)  # x: [B, T, D]  B
        h = F.gelu(self.fc(x), approximate="none")  # h: [B, T, 4D]  S(2)
        return _pinned(self.ln_ffn(x + self.drop(self.fc_out(h))), self.stream)  # x: [B, T, D]  B


class BertForMaskedLM(Module):
    """The encoder and the MLM head; the head reads only the masked positions."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.n_embd
        self.word = Embedding(cfg.vocab_size, d, _init())  # weight [V, D]  S(0) under TP
        self.position = Embedding(cfg.seq_len, d, _init())  # weight [T_max, D]  B
        self.token_type = Embedding(cfg.type_vocab_size, d, _init())  # weight [2, D]  B
        self.ln_embed = LayerNorm(d, cfg.eps)
        self.drop = Dropout(cfg.dropout)
        self.layers = ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.transform = Linear(d, d, init=_init())  # the head's dense layer, replicated
        self.ln_head = LayerNorm(d, cfg.eps)
        self.decoder_bias = Parameter((cfg.vocab_size,), Zeros())  # [V]  S(0) under TP
        self.vocab_chunks = 1  # the TP degree once split: the loss then never gathers the logits
        self.stream: Stream = None  # under TP: the residual stream's layout (see _pinned)

    def encode(self, tokens: Tensor, token_types: Tensor) -> Tensor:
        """Hidden states [B, T, D] for ``tokens`` and ``token_types`` [B, T]."""
        t = tokens.shape[1]  # tokens: [B, T]  S(0) over the data-parallel axis, B over the TP one
        if t > self.config.seq_len:
            raise SbpflowError(f"BERT: a sequence of {t} tokens is longer than seq_len={self.config.seq_len}")
        x = self.word(tokens) + self.token_type(token_types)  # [B, T, D]  P -> B under TP
        x = _pinned(self.drop(self.ln_embed(x + self.position.weight[:t])), self.stream)
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, tokens: Tensor, token_types: Tensor, positions: Tensor, labels: Tensor) -> Tensor:
        """The mean cross entropy over the masked ``positions`` [B, P] against their ``labels`` [B, P]."""
        x = self.encode(tokens, token_types)
        # the hidden states at the masked positions, as a one-hot matmul (every rank its own rows)
        pick = F.one_hot(positions, tokens.shape[1], dtype=x.dtype)  # [B, P, T]
        h = F.matmul(pick, x)  # h: [B, P, D]  B under TP
        h = self.ln_head(F.gelu(self.transform(h), approximate="none"))
        logits = F.matmul(h, self.word.weight, transpose_b=True) + self.decoder_bias  # [B, P, V]  S(2)
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
