"""The op library. Importing this package registers every op family in :data:`OPS`."""

from sbpflow.ops import (  # noqa: F401  (each registers its ops)
    attention,
    attention_core,
    elementwise,
    fused,
    indexing,
    linalg,
    masking,
    nn,
    reduction,
    shape,
)
from sbpflow.ops.base import OPS, NdSignature, NoGrad, OpDef, Signature, defop, get_op
from sbpflow.ops.layers import activation, conv, norm_stats, pool, vocab  # noqa: F401
from sbpflow.ops.training import loss_scaling, optim, packing  # noqa: F401

__all__ = ["OPS", "NdSignature", "NoGrad", "OpDef", "Signature", "defop", "get_op"]
