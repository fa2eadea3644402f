"""The op library. Importing this package registers every op family in :data:`OPS`."""

from sbpflow.ops import elementwise, linalg, masking, nn, optim, reduction, shape  # noqa: F401  (each registers its ops)
from sbpflow.ops.base import OPS, NdSignature, NoGrad, OpDef, Signature, defop, get_op

__all__ = ["OPS", "NdSignature", "NoGrad", "OpDef", "Signature", "defop", "get_op"]
