"""``sf.nn.functional``: the layers' math as functions of tensors, each a few registered ops.

Shape comments name the SBP each tensor takes under Megatron tensor parallelism on a 1-d placement of
``p`` ranks (``S(1)`` = split over columns); under data parallelism every activation is ``S(0)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sbpflow.client.tensor import Tensor, contract, emit, tracer_of
from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import ShapeError
from sbpflow.random import tensor_rng_id


def _op(op_type: str, *inputs: Any, **attrs: Any) -> Tensor:
    (out,) = emit(op_type, *inputs, **attrs)
    return out


# ---- dense layers ---------------------------------------------------------------------------------------


def linear(x: Tensor, weight: Any, bias: Any = None) -> Tensor:
    """``x @ weight + bias`` with ``weight`` [in, out] (so a column split S(1) splits output features)."""
    y = _op("matmul", x, weight)  # y: [..., out]  S(-1) when weight is S(1), P when weight is S(0)
    return y if bias is None else _op("add", y, bias)


def matmul(a: Tensor, b: Any, transpose_a: bool = False, transpose_b: bool = False) -> Tensor:
    """``a @ b``: ``matmul`` for a 2-d ``b`` (a weight shared by every row), else ``batch_matmul``."""
    return contract(a, b, transpose_a, transpose_b)


# ---- activations and normalisation ----------------------------------------------------------------------


def relu(x: Tensor) -> Tensor:
    return _op("relu", x)


def gelu(x: Tensor, approximate: str = "tanh") -> Tensor:
    """GELU: ``"tanh"``, the tanh approximation (GPT-2's; the default, so that existing models keep their
    numbers), or ``"none"``, exact through erf (PyTorch's default)."""
    if approximate not in ("tanh", "none"):
        raise ShapeError(f"gelu approximate={approximate!r}: use 'tanh' or 'none' (exact, through erf)")
    return _op("gelu" if approximate == "tanh" else "gelu_erf", x)


def sigmoid(x: Tensor) -> Tensor:
    return _op("sigmoid", x)


def tanh(x: Tensor) -> Tensor:
    return _op("tanh", x)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    return _op("softmax", x, axis=axis % x.ndim)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    return _op("log_softmax", x, axis=axis % x.ndim)


def layer_norm(x: Tensor, weight: Any, bias: Any, eps: float = 1e-5) -> Tensor:
    """Normalise over the last axis; under TP that axis must be whole (B or S of another axis)."""
    return _op("layer_norm", x, weight, bias, eps=eps)


def dropout(x: Tensor, rate: float = 0.5, training: bool = True) -> Tensor:
    """Zero elements with probability ``rate`` and scale the rest by ``1 / (1 - rate)``.

    The random stream is keyed by the op's scoped name (``blocks.0.attn.dropout_0``), so it does not
    depend on how many other random ops were created before it, and the same on every layout.
    """
    if rate == 0.0 or not training:
        return x
    tracer = tracer_of((x,), "dropout")
    name = tracer.next_name("dropout")
    return tracer.emit("dropout", (x,), {"rate": float(rate), "rng_id": tensor_rng_id(name)}, name=name)[0]


# ---- convolution, pooling and batch norm (NCHW) --------------------------------------------------------


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv2d(
    x: Tensor,
    weight: Any,
    bias: Any = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Tensor:
    """x [N, C, H, W] with weight [O, C/groups, KH, KW] (+ bias [O]), as torch's conv2d."""
    geometry = {"stride": _pair(stride), "padding": _pair(padding), "dilation": _pair(dilation)}
    y = _op("conv2d", x, weight, groups=groups, **geometry)  # y: [N, O, OH, OW]  S(0) under DP
    return y if bias is None else _op("add", y, bias.reshape(1, bias.shape[0], 1, 1))


def max_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0) -> Tensor:
    s = (0, 0) if stride is None else _pair(stride)  # (0, 0): the kernel size
    return _op("max_pool2d", x, kernel_size=_pair(kernel_size), stride=s, padding=_pair(padding))


def avg_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0) -> Tensor:
    """Zero padding counts in each window's mean (torch's count_include_pad=True)."""
    s = (0, 0) if stride is None else _pair(stride)
    return _op("avg_pool2d", x, kernel_size=_pair(kernel_size), stride=s, padding=_pair(padding))


def adaptive_avg_pool2d(x: Tensor, output_size: int | Sequence[int]) -> Tensor:
    return _op("adaptive_avg_pool2d", x, output_size=_pair(output_size))


def batch_norm(
    x: Tensor,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Normalise each channel (axis 1) by the batch's statistics in training, else by the running ones.

    Synchronised batch norm is the SBP of the statistics, not a special op: under data parallelism the
    means over the batch of an ``S(0)`` x are partial sums ``P``, and the compiler all-reduces them to
    ``B`` where the centring reads them, so every rank normalises by the global batch's statistics. The
    variance is centred on the mean in one pass (``channel_var``) and y is one pass (``channel_affine``).
    Training also moves the running statistics towards the batch's, as PyTorch does (``momentum``; the
    variance unbiased over the N*H*W values of a channel): ``running_stat`` ops whose results the compiler
    writes back as the statistics' next values. ``running_mean=None`` keeps no running statistics.
    """
    c = x.shape[1]
    if training:
        mean = x.mean(tuple(a for a in range(x.ndim) if a != 1))  # mean: [C]  P under DP, all-reduced to B
        var = _op("channel_var", x, mean)  # biased, as torch normalises; centred on mean, in one pass
        if running_mean is not None and momentum > 0:
            n = math.prod(x.shape) // c
            _op("running_stat", running_mean, mean, momentum=momentum)  # -> running_mean
            _op("running_stat", running_var, var, momentum=momentum, scale=n / max(n - 1, 1))
    elif running_mean is None or running_var is None:
        raise ShapeError(
            f"batch_norm of {x.name!r} in eval mode needs running_mean and running_var; keep running "
            "statistics (BatchNorm2d(track_running_stats=True)) or normalise in training mode"
        )
    else:
        mean, var = running_mean, running_var
    scale = 1.0 / (var + eps).sqrt()  # [C]: the per-channel work stays on C numbers
    if weight is not None:
        scale = scale * weight
    shift = bias if bias is not None else full((c,), 0.0, x.dtype)
    return _op("channel_affine", x, mean, scale, shift)  # y: [N, C, ...]  S(0) under DP, one pass


# ---- lookup and losses ----------------------------------------------------------------------------------


def detach(x: Tensor) -> Tensor:
    """``x`` with no gradient flowing back to it (PyTorch's ``x.detach()``)."""
    return _op("detach", x)


def where(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``a`` where ``cond`` (bool, broadcast) holds, else ``b``."""
    return _op("where", cond, a, b)


def embedding(ids: Tensor, weight: Any) -> Tensor:
    """Rows of ``weight`` [num, dim] at ``ids`` [...]: out [..., dim] (PyTorch's argument order)."""
    return _op("embedding", weight, ids)


def gather(x: Tensor, indices: Tensor, axis: int = 0) -> Tensor:
    """``np.take(x, indices, axis)`` (ONNX Gather): out [*x[:axis], *indices.shape, *x[axis+1:]].

    Not PyTorch's ``torch.gather`` (that is ``take_along_axis``). A table split by rows along ``axis``
    gives each rank its rows and zeros elsewhere: a partial sum ``P``, as the embedding's vocabulary split.
    """
    return _op("gather", x, indices, axis=axis % x.ndim)


def index_select(x: Tensor, axis: int, index: Tensor) -> Tensor:
    """PyTorch's ``index_select``: the slices of ``x`` at a 1-d ``index`` along ``axis``."""
    if index.ndim != 1:
        raise ShapeError(f"index_select of {x.name!r}: index {list(index.shape)} must be 1-d; use gather")
    return gather(x, index, axis)


def one_hot(indices: Tensor, depth: int, dtype: Any = DType.float32) -> Tensor:
    """[*indices.shape, depth]: 1 at each index, 0 elsewhere (a row of zeros for one outside the range)."""
    return _op("one_hot", indices, depth=depth, dtype=as_dtype(dtype))


def topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest of each last-axis row, descending, and their int64 positions (ties: lower first)."""
    values, indices = emit("topk", x, k=k)
    return values, indices


def flatten(x: Tensor, start_axis: int = 0, end_axis: int = -1) -> Tensor:
    """Axes ``start_axis..end_axis`` merged into one, as torch.flatten (a reshape: a split of the first
    merged axis survives where the sizes divide)."""
    return x.flatten(start_axis, end_axis)


def cross_entropy(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, reduction: str = "mean", vocab_chunks: int = 1
) -> Tensor:
    """Softmax cross entropy of ``logits`` [..., V] against integer ``labels`` [...].

    ``"mean"`` divides by the number of labels that are not ``ignore_index`` (at least 1, so a batch
    of ignored labels gives 0, not nan), as PyTorch does. ``vocab_chunks > 1`` computes it so that logits
    split by class (``S(-1)``, a column-split head) are never gathered: the row maximum from the maxima of
    that many slices of V, the sums of exponentials and the label's logit as partial sums
    (``sbpflow/ops/layers/vocab.py``). Give it the tensor-parallel degree; it must divide V.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ShapeError(f"cross_entropy reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    if vocab_chunks > 1:
        chunk_max = _op("vocab_chunk_max", logits, chunks=vocab_chunks)  # [..., C]  S(-1) -> B (gathered)
        sum_exp, target = emit("vocab_terms", logits, labels, chunk_max, ignore_index=ignore_index)  # P each
        per = _op(
            "vocab_cross_entropy", logits, labels, chunk_max, sum_exp, target, ignore_index=ignore_index
        )
    else:
        per = _op("cross_entropy", logits, labels, ignore_index=ignore_index)  # per: [...]  S(0) under DP
    if reduction == "none":
        return per
    total = _op("sum", per, axes=None, keepdims=False)  # total: []  P under DP until reduced
    if reduction == "sum":
        return total
    valid = _op("cast", _op("ne_scalar", labels, value=ignore_index), dtype=per.dtype)
    count = _op("sum", valid, axes=None, keepdims=False)  # count: []
    none_valid = _op("cast", _op("eq_scalar", count, value=0), dtype=per.dtype)
    return _op("div", total, _op("add", count, none_valid))  # max(count, 1): count is an integer


def binary_cross_entropy_with_logits(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """-(t log sigmoid(x) + (1 - t) log(1 - sigmoid(x))) in the stable form; ``"mean"``, ``"sum"`` or
    ``"none"``. Under data parallelism the mean is a partial sum ``P`` of each rank's share."""
    return _op("binary_cross_entropy_with_logits", logits, targets, reduction=reduction)


def mse_loss(pred: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    diff = _op("sub", pred, target)
    sq = _op("mul", diff, diff)
    if reduction == "none":
        return sq
    return _op(reduction, sq, axes=None, keepdims=False)


# ---- attention ------------------------------------------------------------------------------------------


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    dropout_rate: float = 0.0,
    training: bool = True,
    scale: float | None = None,
) -> Tensor:
    """softmax(q k^T * scale, masked) v for q, k, v [B, H, T, Dh]; heads split S(1) under TP.

    Without dropout it is one ``attention`` op (sbpflow/ops/attention.py) and one ``attention_grad``
    backward, where the unfused ops below were 5 forward and 7 backward acts a layer (causal; the main
    job: 307 -> 287 acts a step); with dropout on the probabilities it stays unfused (the op has no
    dropout: its mask would be one more input to save).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if dropout_rate == 0.0 or not training:
        return emit("attention", q, k, v, scale=float(scale), causal=bool(causal))[0]
    att = _op("batch_matmul", q, k, transpose_b=True)  # att: [B, H, T, T]  S(1) under TP
    att = _op("mul_scalar", att, value=scale)
    if causal:
        att = _op("causal_mask", att)  # keys after the query get -1e30: exp() makes them 0
    att = softmax(att, axis=-1)  # att: [B, H, T, T]  S(1): the key axis stays whole
    att = dropout(att, dropout_rate, training)
    return _op("batch_matmul", att, v)  # y: [B, H, T, Dh]  S(1)


# ---- joining and splitting ------------------------------------------------------------------------------


def concat(xs: Sequence[Tensor], axis: int = 0) -> Tensor:
    if not xs:
        raise ShapeError("concat of an empty list; give at least one tensor")
    return _op("concat", *xs, axis=axis % xs[0].ndim)


def split(x: Tensor, sizes: int | Sequence[int], axis: int = 0) -> tuple[Tensor, ...]:
    """Cut ``x`` along ``axis`` into parts of ``sizes`` (an int: equal parts of that size, as PyTorch)."""
    ax = axis % x.ndim
    n = x.shape[ax]
    if isinstance(sizes, int):
        if sizes <= 0:
            raise ShapeError(f"split of {x.name!r}: the part size must be positive, got {sizes}")
        parts = tuple(min(sizes, n - i) for i in range(0, n, sizes))
    else:
        parts = tuple(int(s) for s in sizes)
    return emit("split", x, axis=ax, sizes=parts)


def cast(x: Tensor, dtype: Any) -> Tensor:
    return x.to(dtype)


def full(shape: Sequence[int], value: float, dtype: Any = DType.float32) -> Tensor:
    """A constant tensor made in the running trace (on the default or current stage placement)."""
    tracer = tracer_of((), "full")
    return tracer.emit("full", (), {"shape": tuple(shape), "value": value, "dtype": as_dtype(dtype)})[0]
