"""Mixed precision's autocast policy: the dtype an op computes in under ``JobConfig.precision``.

fp16 and bf16 jobs keep fp32 parameters (master weights) and fp32 optimizer state; the forward computes
op by op in the dtype :func:`compute_dtype` gives, a floating input of another dtype being cast first,
and the backward follows through the casts' gradients, so every parameter's gradient comes back fp32.
The policy is torch.autocast's, with fp16 flowing:

* ``FP32_OPS``, the ops declared ``defop(..., fp32=True)``, compute in fp32: sums of many terms lose their
  small addends in fp16, exp overflows it past 11, normalisations divide by those sums, and a running
  statistic is an fp32 variable's next value (each declaration says which);
* a ``cast`` is left as its user wrote it;
* any other op that reads a parameter or a low-precision tensor computes in low precision (a weight's
  matmul, then the bias add, the activation, the residual add, ... until the next fp32 op);
* the rest (glue on fp32 values, such as a loss's division by a token count, which would overflow fp16
  past 65504) runs in the widest dtype of its floating inputs.

Integer and bool tensors (token ids, masks) are never cast. fp16's range is also why its loss is scaled
(``JobConfig.loss_scale``, or dynamically by ``JobConfig.loss_scaling``: control_plane/compiler/
loss_scaling.py); bf16 has fp32's range and is not.
"""

from __future__ import annotations

from collections.abc import Sequence

from sbpflow.dtype import DType
from sbpflow.job import Precision
from sbpflow.ops.base import OPS  # its package's __init__ registers every op family first

LOW: dict[Precision, DType] = {Precision.fp16: DType.float16, Precision.bf16: DType.bfloat16}

FP32_OPS = frozenset(name for name, op in OPS.items() if op.fp32)
KEEP_OPS = frozenset({"cast"})


def low_dtype(precision: Precision) -> DType | None:
    """The low-precision compute dtype of ``precision``; None where nothing is cast (fp32, fp64)."""
    return LOW.get(precision)


def compute_dtype(op_type: str, floats: Sequence[DType], reads_parameter: bool, low: DType) -> DType | None:
    """The dtype ``op_type`` computes in, given the dtypes of its floating inputs and whether one of them
    is a parameter; None: its inputs are read as they are."""
    if op_type in KEEP_OPS:
        return None
    if op_type in FP32_OPS:
        return DType.float32
    if reads_parameter or low in floats:
        return low
    return max(floats, key=lambda d: d.itemsize, default=DType.float32)
