"""The work of one op call: floating-point operations and bytes moved, from its shapes and its declaration.

:func:`work` gives an :class:`OpWork` for a call from its input and output metas (local shards, when the
caller prices one rank) and its attributes; the cost model (``control_plane/compiler/cost/cost_model.py``)
turns it into time with a roofline, ``max(flops / peak, bytes / bandwidth)``. Each op declares its count
in its ``defop`` (``flops=``, ``view=``), beside its kernel:

* **Contractions are exact** (a function of the shapes): ``matmul`` and ``batch_matmul`` do
  ``2 * numel(y) * k`` (a multiply and an add per term), so attention's two batched products are
  ``4 * B * H * T^2 * Dh``; a convolution does ``2 * numel(y) * (C_in / groups) * kh * kw``, and each of
  its two gradients the same count again.
* **Everything else counts per element** of its largest operand (an int): one for an add or a compare, a
  few for a transcendental or a normalisation, by the conventions of FLOP counters (fvcore, DeepSpeed's
  profiler); 0 for data movement. These ops are memory-bound, so their bytes decide their time and the
  factor rarely matters.
* **Bytes** are every input and output once; a *view* (``view=True``: reshape, identity, ...) moves
  nothing.

Every op of the library must declare its count: ``tests/control_plane/compiler/cost/test_cost_model.py`` fails
on one without, and :func:`work` refuses it, naming what to add.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sbpflow.errors import UnknownOpError
from sbpflow.ops.base import OPS, AttrValue, Metas


@dataclass(frozen=True)
class OpWork:
    flops: int
    bytes: int


def work(op_type: str, ins: Metas, outs: Metas, attrs: Mapping[str, AttrValue]) -> OpWork:
    """The flops and bytes of one call of ``op_type`` on tensors of ``ins`` -> ``outs``."""
    op = OPS.get(op_type) if op_type in OPS else None
    if op is None or op.flops is None:
        raise UnknownOpError(
            f"op {op_type!r} has no flop count; declare it in the op's defop: flops=<FLOPs per element of "
            "its largest operand> for an elementwise op, or flops=<a function (ins, outs, attrs) -> int>"
        )
    if isinstance(op.flops, int):
        flops = op.flops * max((m.numel for m in (*ins, *outs)), default=0)
    else:
        flops = op.flops(ins, outs, attrs)
    return OpWork(flops, 0 if op.view else sum(m.nbytes for m in (*ins, *outs)))
