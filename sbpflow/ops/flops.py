"""The work of one op call: floating-point operations and bytes moved, from its shapes (a table).

:func:`work` gives an :class:`OpWork` for a call from its input and output metas (local shards, when the
caller prices one rank) and its attributes; the cost model (``control_plane/compiler/cost_model.py``)
turns it into time with a roofline, ``max(flops / peak, bytes / bandwidth)``.

* **Contractions are exact**: ``matmul`` and ``batch_matmul`` do ``2 * numel(y) * k`` (a multiply and an
  add per term), so attention's two batched products are ``4 * B * H * T^2 * Dh``; a convolution does
  ``2 * numel(y) * (C_in / groups) * kh * kw``, and each of its two gradients the same count again.
* **Everything else counts per element** of its largest operand (:data:`PER_ELEMENT`): one for an add or a
  compare, a few for a transcendental or a normalisation, by the conventions of FLOP counters (fvcore,
  DeepSpeed's profiler). These ops are memory-bound, so their bytes decide their time and the factor
  rarely matters.
* **Bytes** are every input and output once; a *view* (reshape, identity, ...) moves nothing.

Every op of the library must have a row here: ``tests/control_plane/compiler/test_cost_model.py`` fails
on one without, and :func:`work` refuses it, naming the table to extend.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import prod

from sbpflow.errors import UnknownOpError
from sbpflow.ops.base import AttrValue, Metas
from sbpflow.registry import Registry


@dataclass(frozen=True)
class OpWork:
    flops: int
    bytes: int


FlopFn = Callable[[Metas, Metas, Mapping[str, AttrValue]], int]


def _numel(metas: Metas) -> int:
    return max((m.numel for m in metas), default=0)


def _contraction(ins: Metas, outs: Metas, attrs: Mapping[str, AttrValue]) -> int:
    a = ins[0].shape
    k = a[-2] if attrs.get("transpose_a") and len(a) >= 2 else a[-1]
    return 2 * outs[0].numel * k


def _conv(ins: Metas, outs: Metas, attrs: Mapping[str, AttrValue]) -> int:
    # forward: y = conv(x, w), w [C_out, C_in/groups, kh, kw]: one multiply-add per tap of every output
    return 2 * outs[0].numel * prod(ins[1].shape[1:])


def _conv_grad_input(ins: Metas, outs: Metas, attrs: Mapping[str, AttrValue]) -> int:
    # dx = conv_transpose(dy, w): every tap of every dy element again
    return 2 * ins[0].numel * prod(ins[1].shape[1:])


def _conv_grad_weight(ins: Metas, outs: Metas, attrs: Mapping[str, AttrValue]) -> int:
    # dw = correlate(x, dy): one multiply-add per (dy element, tap of dw's input channels)
    return 2 * ins[0].numel * prod(outs[0].shape[1:])


def _pool(ins: Metas, outs: Metas, attrs: Mapping[str, AttrValue]) -> int:
    kernel = attrs.get("kernel_size", (1, 1))
    taps = prod(kernel) if isinstance(kernel, tuple) else 1
    return max(outs[0].numel, ins[0].numel) * max(int(taps), 1)  # type: ignore[call-overload]


def _fused(ins: Metas, outs: Metas, attrs: Mapping[str, AttrValue]) -> int:
    steps = json.loads(str(attrs["chain"]))
    return sum(PER_ELEMENT[str(s[0])] for s in steps) * outs[0].numel


# ops whose output is a view of (or the same bytes as) an input: no flops, no bytes
VIEWS = frozenset({"identity", "reshape", "broadcast_to", "pack", "unpack"})

# flops per element of the largest operand (inputs or outputs); 0: data movement only
PER_ELEMENT: dict[str, int] = {
    # arithmetic and compares: one operation per element
    **dict.fromkeys(
        ("add", "sub", "mul", "div", "neg", "add_scalar", "mul_scalar", "rsub_scalar", "rdiv_scalar"), 1
    ),
    **dict.fromkeys(("eq_scalar", "ne_scalar", "where", "masked_fill", "causal_mask", "relu"), 1),
    **dict.fromkeys(("sum", "mean", "max", "sum_to", "sum_grad", "mean_grad", "max_grad", "relu_grad"), 1),
    **dict.fromkeys(("sqrt", "pow_scalar", "log", "exp", "clip_coef"), 1),
    # transcendental-heavy activations (fvcore counts a handful per element)
    **dict.fromkeys(("sigmoid", "tanh"), 4),
    **dict.fromkeys(("gelu", "gelu_erf"), 8),
    **dict.fromkeys(("gelu_grad", "gelu_erf_grad"), 12),
    # row-wise normalisations: max, subtract, exp, sum, divide (softmax); mean, var, scale, shift (norm)
    **dict.fromkeys(("softmax", "log_softmax", "cross_entropy", "vocab_terms", "vocab_chunk_max"), 5),
    **dict.fromkeys(("softmax_grad", "log_softmax_grad", "cross_entropy_grad", "vocab_terms_grad"), 5),
    **dict.fromkeys(
        ("vocab_cross_entropy", "vocab_cross_entropy_grad", "binary_cross_entropy_with_logits"), 5
    ),
    "layer_norm": 8,
    "layer_norm_grad": 12,
    "running_stat": 3,
    "dropout": 4,  # a Philox draw, a compare and a scale
    # optimizers, per parameter element
    **dict.fromkeys(("adamw_update", "gated_adamw_update"), 14),  # gated: skipped on a non-finite step
    **dict.fromkeys(("sgd_update", "gated_sgd_update"), 4),
    # dynamic loss scaling: a finiteness check per element, and scalar bookkeeping
    **dict.fromkeys(("nonfinite_count", "loss_scale_seed", "loss_scale_inverse", "loss_scale_update"), 1),
    "loss_scale_read": 1,
    # data movement: copies, gathers and fills
    **dict.fromkeys(
        ("cast", "transpose", "slice", "slice_grad", "concat", "split", "full", "one_hot", "gather"), 0
    ),
    **dict.fromkeys(("gather_grad", "embedding", "embedding_grad", "topk", "topk_grad"), 0),
    **dict.fromkeys(VIEWS, 0),
}


def _per_element(factor: int) -> FlopFn:
    return lambda ins, outs, attrs: factor * _numel((*ins, *outs))


FLOPS: Registry[FlopFn] = Registry("flop count")
for _name in ("matmul", "batch_matmul"):
    FLOPS.register(_name, _contraction)
FLOPS.register("conv2d", _conv)
FLOPS.register("conv2d_grad_input", _conv_grad_input)
FLOPS.register("conv2d_grad_weight", _conv_grad_weight)
for _name in ("max_pool2d", "max_pool2d_grad", "avg_pool2d", "avg_pool2d_grad"):
    FLOPS.register(_name, _pool)
for _name in ("adaptive_avg_pool2d", "adaptive_avg_pool2d_grad"):
    FLOPS.register(_name, _per_element(1))
FLOPS.register("fused_elementwise", _fused)
for _name, _factor in PER_ELEMENT.items():
    FLOPS.register(_name, _per_element(_factor))


def work(op_type: str, ins: Metas, outs: Metas, attrs: Mapping[str, AttrValue]) -> OpWork:
    """The flops and bytes of one call of ``op_type`` on tensors of ``ins`` -> ``outs``."""
    if op_type not in FLOPS:
        raise UnknownOpError(
            f"op {op_type!r} has no flop count; add a row for it to sbpflow/ops/flops.py (PER_ELEMENT for an "
            "elementwise op, or a function of its shapes registered in FLOPS)"
        )
    moved = 0 if op_type in VIEWS else sum(m.nbytes for m in (*ins, *outs))
    return OpWork(FLOPS.get(op_type)(ins, outs, attrs), moved)
