"""``Parameter``: a trainable tensor's declaration — shape, dtype, initializer and optional layout.

It holds no numbers: the runtime draws each rank's shard from ``init`` (a counter-based initializer from
``sbpflow.random``), keyed by the parameter's name in the traced graph, so the values do not depend on
the layout. Inside ``build`` a module's parameter attribute reads as the traced ``Tensor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import ShapeError
from sbpflow.placement import Placement
from sbpflow.random import Initializer, Normal
from sbpflow.sbp import NdSbp, Sbp, as_nd, check_axes, format_nd
from sbpflow.tensor_meta import Shape, TensorMeta


class Parameter:
    """A declared parameter; ``to_global`` pins its placement and SBP (a hard constraint for the compiler)."""

    def __init__(
        self,
        shape: Sequence[int],
        init: Initializer | None = None,
        dtype: Any = DType.float32,
        requires_grad: bool = True,
    ) -> None:
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ShapeError(f"parameter shape {list(shape)} has a negative size")
        if init is not None and not isinstance(init, Initializer):
            raise ShapeError(
                f"parameter init {init!r} is not an initializer; use one from sbpflow.random "
                "(Normal(0, 0.02), Zeros(), xavier_uniform(fan_in, fan_out), ...)"
            )
        self.shape: Shape = dims
        self.dtype = as_dtype(dtype)
        self.init: Initializer = init if init is not None else Normal(0.0, 0.02)
        self.requires_grad = requires_grad
        self.placement: Placement | None = None
        self.sbp: NdSbp | None = None
        # the logical value, once the module holds one (trained by sf.run, loaded, or drawn by
        # state_dict); None: a run draws it from ``init``
        self.value: np.ndarray | None = None
        # (tensor name, seed) of the last trace: a run draws ``init`` under that key, and so does
        # state_dict while the parameter holds no value (None: its path in the module, seed 0)
        self.key: tuple[str, int] | None = None

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(self.shape, self.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def to_global(self, placement: Placement, sbp: Sbp | Sequence[Sbp]) -> Parameter:
        """Lay the parameter out on ``placement`` with ``sbp`` (one entry per mesh axis); returns self."""
        if not isinstance(placement, Placement):
            raise ShapeError(f"to_global needs a placement from sf.placement(...), got {placement!r}")
        nd = as_nd(sbp, placement.ndim)  # type: ignore[arg-type]
        check_axes(nd, self.ndim, f"parameter {list(self.shape)}")
        self.placement, self.sbp = placement, nd
        return self

    def requires_grad_(self, flag: bool = True) -> Parameter:
        self.requires_grad = flag
        return self

    def __repr__(self) -> str:
        layout = "" if self.sbp is None else f" {format_nd(self.sbp)} on {self.placement}"
        return f"Parameter({self.meta}{layout}, init={self.init})"
