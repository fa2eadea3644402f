"""The op library. Importing this package registers every op family in :data:`OPS`."""

from sbpflow.ops import (  # noqa: F401  (each registers its ops)
    activation,
    conv,
    elementwise,
    fused,
    indexing,
    linalg,
    loss_scaling,
    masking,
    nn,
    norm_stats,
    optim,
    packing,
    pool,
    reduction,
    shape,
    vocab,
)
from sbpflow.ops.base import OPS, NdSignature, NoGrad, OpDef, Signature, defop, get_op

__all__ = ["OPS", "NdSignature", "NoGrad", "OpDef", "Signature", "defop", "get_op"]
