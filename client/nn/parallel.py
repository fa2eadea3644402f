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


def megatron(
    model: Module,
    placement: Placement,
    tp_axis: int = -1,
    vocab_parallel: bool = False,
    sequence_parallel: bool = False,
) -> Module:
    """Megatron-LM tensor parallelism: Linear layers marked ``tp="column"``/``"row"`` are split, all else B.

    For a GPT block this puts qkv and fc weights at ``S(1)`` and both projections at ``S(0)``; the
    compiler then finds the one all-reduce per sub-layer. ``vocab_parallel`` also splits the vocabulary
    as Megatron does, for a model with ``vocab_layers()`` (the token embedding and the output head) and
    ``vocab_chunks``: the embedding's rows ``S(0)`` (each rank looks up its own ids, a partial sum), the
    head's columns ``S(1)`` (logits ``S(-1)``), and the cross entropy on the split logits
    (``vocab_chunks`` = the tensor-parallel degree), so the logits are never gathered.
    ``sequence_parallel`` (Megatron's sequence parallelism, for a model with ``sequence_layout``) lays the
    residual stream between blocks out split by sequence over the tensor axis (``S(1)``; ``S(0)`` over
    the other, data-parallel axes), so that layer norms and dropout run on shards and each all-reduce
    becomes a reduce-scatter and an all-gather of the same bytes. Returns the model.
    """
    axis = tp_axis % placement.ndim if -placement.ndim <= tp_axis < placement.ndim else None
    if axis is None:
        raise SbpflowError(f"megatron tp_axis={tp_axis} is not an axis of the {placement.ndim}-d {placement}")
    data_parallel(model, placement)
    if vocab_parallel:
        _split_vocabulary(model, placement, axis)
    if sequence_parallel:
        nd: list[Sbp] = [Split(0)] * placement.ndim  # the batch over the data-parallel axes
        nd[axis] = Split(1)  # [B, T, D]: the sequence over the tensor axis
        laid = [m for m in model.modules() if hasattr(m, "sequence_layout")]
        if not laid:
            raise SbpflowError(
                f"megatron(sequence_parallel=True): {type(model).__name__} has no module with a "
                "sequence_layout; give the model one (see sf.nn.GPT) or leave sequence_parallel off"
            )
        for m in laid:
            m.sequence_layout = (placement, tuple(nd))  # type: ignore[attr-defined]
    marked = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.tp is not None:
            marked += 1
            w_sbp, b_sbp = _MEGATRON[m.tp]
            set_axis(m.__dict__["_parameters"]["weight"], placement, axis, w_sbp)
            if "bias" in m.__dict__["_parameters"]:
                set_axis(m.__dict__["_parameters"]["bias"], placement, axis, b_sbp)
    if not marked:
        raise SbpflowError(
            f"megatron: {type(model).__name__} has no Linear marked tp='column' or tp='row'; mark the layers "
            "to split (Linear(..., tp='column')) or use data_parallel"
        )
    return model


def set_axis(param: object, placement: Placement, axis: int, sbp: Sbp) -> None:
    nd: list[Sbp] = [B] * placement.ndim
    nd[axis] = sbp
    param.to_global(placement, tuple(nd))  # type: ignore[attr-defined]


def _split_vocabulary(model: Module, placement: Placement, axis: int) -> None:
    layers = getattr(model, "vocab_layers", None)
    if layers is None or not hasattr(model, "vocab_chunks"):
        raise SbpflowError(
            f"megatron(vocab_parallel=True): {type(model).__name__} has no vocab_layers() and vocab_chunks; "
            "give the model both (see sf.nn.GPT) or leave vocab_parallel off"
        )
    tp = placement.shape[axis]
    embedding, head = layers()
    for name, layer, sbp, v in (
        ("embedding", embedding, Split(0), getattr(embedding, "num_embeddings", 0)),
        ("head", head, Split(1), getattr(head, "out_features", 0)),
    ):
        if layer is None:
            continue
        if v % tp:
            raise SbpflowError(
                f"megatron(vocab_parallel=True): the {name}'s vocabulary of {v} does not split evenly over the "
                f"{tp} tensor-parallel ranks; pad the vocabulary to a multiple of {tp}"
            )
        set_axis(layer.__dict__["_parameters"]["weight"], placement, axis, sbp)
        if layer.__dict__["_parameters"].get("bias") is not None:
            set_axis(layer.__dict__["_parameters"]["bias"], placement, axis, Split(0))
    model.vocab_chunks = tp  # type: ignore[attr-defined]
