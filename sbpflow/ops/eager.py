"""Run ops eagerly on arrays: the reference path for tests, and the kernel runner for one rank.

``EagerBuilder`` implements the :class:`~sbpflow.ops.base.Builder` protocol on concrete arrays, so the
same gradient rule that the compiler runs symbolically also runs here, on numbers, where it can be
checked against finite differences. ``run_local`` runs one op on one rank's shards of a signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow.dtype import as_dtype
from sbpflow.errors import ShapeError
from sbpflow.ops.base import Attrs, AttrValue, GradContext, KernelContext, NdSignature, NoGrad, OpDef, get_op
from sbpflow.placement import Placement
from sbpflow.sharding import shard_index
from sbpflow.tensor_meta import TensorMeta


def meta_of(array: Any) -> TensorMeta:
    return TensorMeta(tuple(int(d) for d in array.shape), as_dtype(array.dtype))


def full_index(meta: TensorMeta) -> tuple[slice, ...]:
    return tuple(slice(0, d) for d in meta.shape)


class EagerBuilder:
    """Runs each op at once on whole arrays (one device)."""

    def __init__(self, xp: ModuleType = np, seed: int = 0, step: int = 0) -> None:
        self.xp, self.seed, self.step = xp, seed, step

    def meta(self, value: Any) -> TensorMeta:
        return meta_of(value)

    def call(self, op_type: str, *inputs: Any, **attrs: AttrValue) -> tuple[Any, ...]:
        op = get_op(op_type)
        full_attrs = op.normalize_attrs(attrs)
        metas = tuple(meta_of(x) for x in inputs)
        outs = op.run_infer(metas, full_attrs)
        ctx = KernelContext(
            self.xp,
            full_attrs,
            metas,
            outs,
            tuple(map(full_index, metas)),
            tuple(map(full_index, outs)),
            self.seed,
            self.step,
        )
        results = op.run_kernel(ctx, inputs)
        _check_outputs(op, outs, results, ctx)
        return results


def _check_outputs(
    op: OpDef, metas: Sequence[TensorMeta], results: Sequence[Any], ctx: KernelContext
) -> None:
    if len(results) != len(metas):
        raise ShapeError(
            f"kernel of {op.name!r} returned {len(results)} outputs, its inference says {len(metas)}"
        )
    for i, (m, r) in enumerate(zip(metas, results, strict=True)):
        if tuple(r.shape) != ctx.out_shape(i) or r.dtype != m.dtype.to_numpy():
            raise ShapeError(
                f"kernel of {op.name!r} output {op.output_name(i)!r} is {list(r.shape)} {r.dtype}, "
                f"expected {list(ctx.out_shape(i))} {m.dtype.value}"
            )


def vjp(
    op_type: str,
    inputs: Sequence[Any],
    grads: Sequence[Any | None],
    builder: EagerBuilder | None = None,
    **attrs: AttrValue,
) -> tuple[Any, ...]:
    """Input gradients of one op by its gradient rule, run eagerly: the thing finite differences check."""
    b = builder or EagerBuilder()
    op = get_op(op_type)
    if isinstance(op.grad, NoGrad):
        raise ShapeError(f"op {op_type!r} takes no gradient: {op.grad.reason}")
    full = op.normalize_attrs(attrs)
    outputs = b.call(op_type, *inputs, **full)
    if len(grads) != len(outputs):
        raise ShapeError(
            f"op {op_type!r} has {len(outputs)} output(s) but {len(grads)} output gradient(s) were given"
        )
    ctx = GradContext(
        b,
        tuple(inputs),
        outputs,
        tuple(grads),
        tuple(map(meta_of, inputs)),
        tuple(map(meta_of, outputs)),
        full,
    )
    result = tuple(op.grad(ctx))
    if len(result) != len(inputs):
        raise ShapeError(
            f"gradient rule of {op_type!r} returned {len(result)} grads for {len(inputs)} inputs"
        )
    return result


def run_local(
    op: OpDef,
    attrs: Attrs,
    logical: Sequence[TensorMeta],
    local_inputs: Sequence[Any],
    placement: Placement,
    nd_sig: NdSignature,
    rank: int,
    xp: ModuleType = np,
    seed: int = 0,
    step: int = 0,
) -> tuple[Any, ...]:
    """Run ``op`` on one rank's local inputs under an n-d signature; returns that rank's local outputs."""
    full = op.normalize_attrs(attrs)
    metas = tuple(logical)
    outs = op.run_infer(metas, full)
    coord = placement.coord_of(rank)
    ctx = KernelContext(
        xp,
        full,
        metas,
        outs,
        tuple(
            shard_index(m.shape, placement.shape, s, coord) for m, s in zip(metas, nd_sig.ins, strict=True)
        ),
        tuple(
            shard_index(m.shape, placement.shape, s, coord) for m, s in zip(outs, nd_sig.outs, strict=True)
        ),
        seed,
        step,
    )
    results = op.run_kernel(ctx, local_inputs)
    _check_outputs(op, outs, results, ctx)
    return results
