"""Layout helpers: annotate a model's parameters for a parallel strategy, changing nothing else.

The same model code runs data-, tensor- or hybrid-parallel; only these SBP annotations differ. On an
n-d placement, ``tp_axis`` is the mesh axis that tensor parallelism splits; every other mesh axis keeps
the parameters replicated (``B``) — data parallelism over that axis.
"""

from __future__ import annotations

from sbpflow.client.nn.layers import Linear
from sbpflow.client.nn.module import Module
from sbpflow.errors import SbpflowError
from sbpflow.placement import Placement
from sbpflow.sbp import B, Sbp, Split

# Linear.tp -> (weight [in, out], bias [out]) on the TP axis. Column-parallel splits the output features,
# row-parallel the input features (its output is a partial sum, so its bias is added once: B).
_MEGATRON: dict[str, tuple[Sbp, Sbp]] = {
    "column": (Split(1), Split(0)),
    "row": (Split(0), B),
}


def data_parallel(model: Module, placement: Placement) -> Module:
    """Replicate every parameter (``B`` on every mesh axis)."""
    for p in model.parameters():
        p.to_global(placement, (B,) * placement.ndim)
    return model


def megatron(model: Module, placement: Placement, tp_axis: int = -1) -> Module:
    """Megatron-LM tensor parallelism: Linear layers marked ``tp="column"``/``"row"`` are split, all else B.

    For a GPT block this puts qkv and fc weights at ``S(1)`` and both projections at ``S(0)``; the
    compiler then finds the one all-reduce per sub-layer. Returns the model.
    """
    axis = tp_axis % placement.ndim if -placement.ndim <= tp_axis < placement.ndim else None
    if axis is None:
        raise SbpflowError(f"megatron tp_axis={tp_axis} is not an axis of the {placement.ndim}-d {placement}")
    data_parallel(model, placement)
    marked = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.tp is not None:
            marked += 1
            w_sbp, b_sbp = _MEGATRON[m.tp]
            _set_axis(m.__dict__["_parameters"]["weight"], placement, axis, w_sbp)
            if "bias" in m.__dict__["_parameters"]:
                _set_axis(m.__dict__["_parameters"]["bias"], placement, axis, b_sbp)
    if not marked:
        raise SbpflowError(
            f"megatron: {type(model).__name__} has no Linear marked tp='column' or tp='row'; mark the layers "
            "to split (Linear(..., tp='column')) or use data_parallel"
        )
    return model


def _set_axis(param: object, placement: Placement, axis: int, sbp: Sbp) -> None:
    nd: list[Sbp] = [B] * placement.ndim
    nd[axis] = sbp
    param.to_global(placement, tuple(nd))  # type: ignore[attr-defined]
