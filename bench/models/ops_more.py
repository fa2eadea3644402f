"""bench/models/ops.py's cases and PyTorch peers for the ops neither timed example calls (issue 16's image,
gather, top-k and vocabulary-parallel ops, and the gradient buckets' pack and unpack).

Batch norm's passes (norm_stats.py) have no single PyTorch op each: channel_var's peer is torch.var over
the channels' values (a slow strided reduction in torch, ~0.8 ms: its ratio says little; the whole
forward, mean + channel_var + channel_affine, measured 0.91-0.93x ``native_batch_norm`` on the two
ResNet block shapes and 2.8x on [32, 64, 4, 4], where the per-call cost of 3 ops shows), channel_affine's batch norm in eval mode (the same one pass, (x - mean) * scale +
shift), channel_var_grad's too (its pass with one sum more), channel_affine_grad's the weight and bias
half of ``native_batch_norm_backward`` (the same two sums), channel_input_grad its dx alone (one pass
that takes the two sums inside), channel_var_dmean a centred sum.

Shapes: the image ops on a ResNet block's activation ([8, 16, 32, 32], 3x3 kernels), the gather and
top-k ops on the GPT's [16, 64, 128] logits and its embedding table, the vocabulary-parallel cross
entropy on the main job's [16, 64, 128] logits in 2 chunks, pack/unpack on the main job's 29 gradients
(~0.1 M parameters). The peer is the PyTorch op that does the same work (its ATen backward for a
backward op); for the vocabulary-parallel ops, which PyTorch has no single op for, the few tensor ops
that compute the same value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from sbpflow.dtype import DType
from sbpflow.ops.training.packing import unpacked_shapes
from sbpflow.tensor_meta import TensorMeta

F32, I64 = DType.float32, DType.int64
IMG = TensorMeta((8, 16, 32, 32), F32)
POOLED = TensorMeta((8, 16, 16, 16), F32)
W3 = TensorMeta((16, 16, 3, 3), F32)
C16 = TensorMeta((16,), F32)
LOGITS = TensorMeta((16, 64, 128), F32)
ROWS = TensorMeta((16, 64), F32)
LABELS = TensorMeta((16, 64), I64)
CHUNK_MAX = TensorMeta((16, 64, 2), F32)
TOP = TensorMeta((16, 64, 8), F32)
TOP_IX = TensorMeta((16, 64, 8), I64)
# BERT's FFN activation in bench/models/bert.py (batch 16, seq 128, width 4 x 256)
FFN = TensorMeta((16, 128, 1024), F32)
# the main job's gradients, as its gradient bucket packs them (width 64, 2 layers, vocabulary 128)
GRADS = tuple(
    TensorMeta(s, F32)
    for s in [(64, 128), (64,), (64,)]
    + [(64,), (256, 64), (256,), (64, 256), (64,), (64,), (64,), (64, 64), (192,), (64, 192), (64,), (64,)]
    * 2
    + [(64, 64), (128, 64)]
)
FLAT = TensorMeta((sum(m.numel for m in GRADS),), F32)
POOL = {"kernel_size": (2, 2), "stride": (2, 2), "padding": (0, 0)}
CONV = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}

EXTRA_MORE: dict[str, tuple[tuple[TensorMeta, ...], dict[str, Any]]] = {
    "conv2d": ((IMG, W3), CONV),
    "conv2d_grad_input": ((IMG, W3), {**CONV, "input_hw": (32, 32)}),
    "conv2d_grad_weight": ((IMG, IMG), {**CONV, "kernel_hw": (3, 3)}),
    "max_pool2d": ((IMG,), POOL),
    "max_pool2d_grad": ((IMG, POOLED), POOL),
    "avg_pool2d": ((IMG,), POOL),
    "avg_pool2d_grad": ((POOLED,), {**POOL, "input_hw": (32, 32)}),
    "adaptive_avg_pool2d": ((IMG,), {"output_size": (1, 1)}),
    "adaptive_avg_pool2d_grad": (
        (TensorMeta((8, 16, 1, 1), F32),),
        {"output_size": (1, 1), "input_hw": (32, 32)},
    ),
    "channel_var": ((IMG, C16), {}),
    "channel_var_grad": ((IMG, C16, C16), {}),
    "channel_affine": ((IMG, C16, C16, C16), {}),
    "channel_affine_grad": ((IMG, IMG, C16), {}),
    "channel_var_dmean": ((IMG, C16, C16), {}),
    "channel_input_grad": ((IMG, IMG, C16, C16, C16, C16), {}),
    "sigmoid": ((LOGITS,), {}),
    "gelu_erf": ((FFN,), {}),  # exact GELU: BERT's (bench/models/bert.py), on its FFN activation
    "gelu_erf_grad": ((FFN, FFN), {}),
    "binary_cross_entropy_with_logits": ((LOGITS, LOGITS), {"reduction": "mean"}),
    "one_hot": ((LABELS,), {"depth": 128}),
    "gather": ((TensorMeta((128, 64), F32), LABELS), {"axis": 0}),
    "gather_grad": ((TensorMeta((16, 64, 64), F32), LABELS), {"axis": 0, "size": 128}),
    "topk": ((LOGITS,), {"k": 8}),
    "topk_grad": ((TOP, TOP_IX), {"size": 128}),
    "running_stat": ((TensorMeta((64,), F32), TensorMeta((64,), F32)), {"momentum": 0.1}),
    "vocab_chunk_max": ((LOGITS,), {"chunks": 2}),
    "vocab_terms": ((LOGITS, LABELS, CHUNK_MAX), {}),
    "vocab_terms_grad": ((LOGITS, LABELS, CHUNK_MAX, ROWS, ROWS), {}),
    "vocab_cross_entropy": ((LOGITS, LABELS, CHUNK_MAX, ROWS, ROWS), {}),
    "vocab_cross_entropy_grad": ((LABELS, ROWS, ROWS), {}),
    "pack": (GRADS, {}),
    "unpack": (
        (FLAT,),
        {"ndims": tuple(len(m.shape) for m in GRADS), "dims": tuple(d for m in GRADS for d in m.shape)},
    ),
}

# inputs that must hold something particular: (op, input) -> what (see bench/models/ops.py make_inputs)
POSITIVE = {("vocab_terms_grad", 3), ("vocab_cross_entropy", 3), ("vocab_cross_entropy_grad", 1)}
PROBABILITIES = {("binary_cross_entropy_with_logits", 1)}
INDEX_HIGH = {"gather": 128, "gather_grad": 128, "one_hot": 128, "topk_grad": 128}


def _image_peers(op: str, a: Mapping[str, Any], t: list[Any]) -> Callable[[], Any] | None:
    import torch
    from torch.nn import functional as F

    aten = torch.ops.aten
    k, s, p = (list(a.get(n, (0, 0))) for n in ("kernel_size", "stride", "padding"))
    if op == "conv2d":
        return lambda: F.conv2d(t[0], t[1], None, a["stride"], a["padding"], a["dilation"], a["groups"])
    if op in ("conv2d_grad_input", "conv2d_grad_weight"):
        dy, other = t
        x = torch.zeros(8, 16, 32, 32) if op == "conv2d_grad_input" else other
        w = other if op == "conv2d_grad_input" else torch.zeros(16, 16, 3, 3)
        mask = [op == "conv2d_grad_input", op == "conv2d_grad_weight", False]
        args = (list(a["stride"]), list(a["padding"]), list(a["dilation"]), False, [0, 0], a["groups"], mask)
        return lambda: aten.convolution_backward(dy, x, w, None, *args)
    if op == "max_pool2d":
        return lambda: F.max_pool2d(t[0], k, s, p)
    if op == "max_pool2d_grad":
        x, dy = t
        _, ix = F.max_pool2d(x, k, s, p, return_indices=True)  # what autograd saves
        return lambda: aten.max_pool2d_with_indices_backward(dy, x, k, s, p, [1, 1], False, ix)
    if op == "avg_pool2d":
        return lambda: F.avg_pool2d(t[0], k, s, p)
    if op == "avg_pool2d_grad":
        x = torch.zeros(8, 16, *a["input_hw"])
        return lambda: aten.avg_pool2d_backward(t[0], x, k, s, p, False, True, None)
    if op in _NORM_PEERS:
        return _NORM_PEERS[op](t)
    if op == "adaptive_avg_pool2d":
        return lambda: F.adaptive_avg_pool2d(t[0], a["output_size"])
    if op == "adaptive_avg_pool2d_grad":
        x = torch.zeros(8, 16, *a["input_hw"])
        return lambda: aten._adaptive_avg_pool2d_backward(t[0], x)
    return None


def _bn_eval(x: Any, mean: Any, scale: Any, shift: Any) -> Any:
    from torch.nn import functional as F

    # (x - mean) / sqrt(var + eps) * w + b with var + eps = 1: (x - mean) * scale + shift
    return F.batch_norm(x, mean, mean * 0 + 1 - 1e-5, scale, shift, training=False, eps=1e-5)


def _bn_grad_sums(dy: Any, x: Any, mean: Any) -> Any:
    import torch

    ones = torch.ones_like(mean)
    return torch.ops.aten.native_batch_norm_backward(
        dy, x, ones, None, None, mean, ones, True, 1e-5, [False, True, True]
    )


def _bn_input_grad(dy: Any, x: Any, mean: Any, scale: Any) -> Any:
    import torch

    ones = torch.ones_like(mean)  # dx alone: the same pass over dy and x, its sums taken inside
    return torch.ops.aten.native_batch_norm_backward(
        dy, x, scale, None, None, mean, ones, True, 1e-5, [True, False, False]
    )


_NORM_PEERS: dict[str, Callable[[list[Any]], Callable[[], Any]]] = {
    "channel_var": lambda t: lambda: t[0].var((0, 2, 3), correction=0),
    "channel_var_grad": lambda t: lambda: _bn_eval(t[0], t[1], t[2], t[2]),
    "channel_affine": lambda t: lambda: _bn_eval(*t),
    "channel_affine_grad": lambda t: lambda: _bn_grad_sums(*t),
    "channel_var_dmean": lambda t: lambda: (t[0] - t[1][None, :, None, None]).sum((0, 2, 3)),
    "channel_input_grad": lambda t: lambda: _bn_input_grad(*t[:4]),
}


def _vocab_peers(op: str, a: Mapping[str, Any], t: list[Any]) -> Callable[[], Any] | None:
    import torch

    if op == "vocab_chunk_max":
        x, c = t[0], int(a["chunks"])
        return lambda: x.view(*x.shape[:-1], c, x.shape[-1] // c).amax(-1)
    if op == "vocab_terms":
        x, labels, cmax = t

        def terms() -> Any:
            m = cmax.amax(-1, keepdim=True)
            return torch.exp(x - m).sum(-1), x.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

        return terms
    if op == "vocab_terms_grad":
        x, labels, cmax, dsum, dtarget = t

        def terms_grad() -> Any:
            g = torch.exp(x - cmax.amax(-1, keepdim=True)) * dsum.unsqueeze(-1)
            return g.scatter_add(-1, labels.unsqueeze(-1), dtarget.unsqueeze(-1))

        return terms_grad
    if op == "vocab_cross_entropy":
        _, _, cmax, sum_exp, target = t
        return lambda: cmax.amax(-1) + torch.log(sum_exp) - target
    if op == "vocab_cross_entropy_grad":
        _, sum_exp, dy = t
        return lambda: (dy / sum_exp, -dy)
    return None


def torch_peer(op: str, a: Mapping[str, Any], t: list[Any]) -> Callable[[], Any] | None:
    """The PyTorch call for one of :data:`EXTRA_MORE`'s ops on the tensors ``t``, or None."""
    import torch
    from torch.nn import functional as F

    aten = torch.ops.aten
    found = _image_peers(op, a, t) or _vocab_peers(op, a, t) or _attention_peers(op, a, t)
    if found is not None:
        return found
    simple: dict[str, Callable[[], Any]] = {
        "sigmoid": lambda: torch.sigmoid(t[0]),
        "gelu_erf": lambda: F.gelu(t[0]),
        "gelu_erf_grad": lambda: aten.gelu_backward(t[0], t[1]),
        "binary_cross_entropy_with_logits": lambda: F.binary_cross_entropy_with_logits(t[0], t[1]),
        "one_hot": lambda: F.one_hot(t[0], int(a["depth"])).to(torch.float32),
        "gather": lambda: F.embedding(t[1], t[0]),
        "topk": lambda: torch.topk(t[0], int(a["k"])),
        "pack": lambda: torch.cat([x.reshape(-1) for x in t]),
    }
    if op in simple:
        return simple[op]
    if op == "gather_grad":
        dy, ids = t
        return lambda: aten.embedding_dense_backward(dy, ids, int(a["size"]), -1, False)
    if op == "topk_grad":
        dy, ix = t
        return lambda: torch.zeros(*dy.shape[:-1], int(a["size"])).scatter(-1, ix, dy)
    if op == "running_stat":
        r, b = t
        m = float(a["momentum"])
        return lambda: torch.add(r * (1 - m), b, alpha=m * float(a["scale"]))
    if op == "unpack":  # the case's own parts: the graphs' buckets differ from GRADS
        shapes = unpacked_shapes(a)
        sizes = [math.prod(s) for s in shapes]
        return lambda: [p.view(s) for p, s in zip(torch.split(t[0], sizes), shapes, strict=True)]
    return None


# ---- attention (sbpflow/ops/attention.py) ---------------------------------------------------------------
# The main job's graph calls both ops (ops.py times them on its own shapes and attrs); these entries are
# the shapes where no graph does, and say that the peers below exist. The peer is ATen's CPU attention
# (what F.scaled_dot_product_attention runs on CPU, flash-style: no [T, T] array) and its backward, given
# the output and log-sum-exp it saves. Its ratio on BERT's shape ([16, 4, 128, 64], no mask) is in
# bench/README.md.

ATTN = TensorMeta((16, 4, 64, 16), F32)  # the main job's q, k, v and y: batch 16, 4 heads, seq 64
ATTN_PROBS = TensorMeta((16, 4, 64, 64), F32)
EXTRA_MORE["attention"] = ((ATTN, ATTN, ATTN), {"scale": 0.25, "causal": True})
EXTRA_MORE["attention_grad"] = ((ATTN, ATTN, ATTN, ATTN_PROBS, ATTN), {"scale": 0.25, "causal": True})
# the unfused attention's ops, which the main job called until it had the one op (bench/README.md's
# figures for them are its shapes): timed on them still, by ops.py's own peers
EXTRA_MORE.update(
    {
        "batch_matmul": ((ATTN, ATTN), {"transpose_b": True}),
        "mul_scalar": ((ATTN_PROBS,), {"value": 0.25}),
        "causal_mask": ((ATTN_PROBS,), {}),
        "softmax": ((ATTN_PROBS,), {"axis": 3}),
        "softmax_grad": ((ATTN_PROBS, ATTN_PROBS), {"axis": 3}),
    }
)


def _attention_peers(op: str, a: Mapping[str, Any], t: list[Any]) -> Callable[[], Any] | None:
    import torch

    if op in ("qkv_attention", "qkv_attention_grad"):
        return _qkv_peers(op, a, t)
    if op not in ("attention", "attention_grad"):
        return None
    aten = torch.ops.aten
    scale, causal = float(a["scale"]), bool(a["causal"])
    if op == "attention":
        q, k, v = t
        return lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    q, k, v, _, dy = t  # attention_grad
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dy, q, k, v, out, lse, 0.0, causal, scale=scale
    )


# The attention core folded with its layout ops (sbpflow/ops/attention_core.py; the main job's graph calls
# both, and ops.py times them there): the same ATen attention on q, k and v viewed out of qkv
# [B, T, H, 3, Dh], y put back as [B, T, H Dh], and backward dq, dk and dv stacked into qkv's layout, as
# the model's own ops would. The entries say that the peers exist (the main job's shapes).

QKV, QKV_Y = TensorMeta((16, 64, 192), F32), TensorMeta((16, 64, 64), F32)
QKV_ATTRS = {"head_dim": 16, "scale": 0.25, "causal": True}
EXTRA_MORE["qkv_attention"] = ((QKV,), QKV_ATTRS)
EXTRA_MORE["qkv_attention_grad"] = ((QKV, ATTN_PROBS, QKV_Y), QKV_ATTRS)


def _qkv_peers(op: str, a: Mapping[str, Any], t: list[Any]) -> Callable[[], Any]:
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    scale, causal, d = float(a["scale"]), bool(a["causal"]), int(a["head_dim"])
    qkv = t[0]
    b, n, w = qkv.shape
    q, k, v = (x.transpose(1, 2) for x in qkv.view(b, n, w // (3 * d), 3, d).unbind(3))
    if op == "qkv_attention":
        return lambda: flash(q, k, v, 0.0, causal, scale=scale)[0].transpose(1, 2).reshape(b, n, -1)
    dy = t[2].view(b, n, -1, d).transpose(1, 2)
    out, lse = flash(q, k, v, 0.0, causal, scale=scale)

    def backward() -> Any:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return torch.stack([g.transpose(1, 2) for g in grads], dim=3).reshape(b, n, w)

    return backward
