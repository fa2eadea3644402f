"""Dynamic loss scaling's ops: the scale read from its variable, the non-finite count of a gradient, the
scale's update (torch.cuda.amp.GradScaler's rule) and the optimizer updates gated on a clean step.

The scale lives in three fp32 variables of shape ``(1,)`` the compiler declares (control_plane/compiler/
loss_scaling.py): the scale (``0`` reads as ``init``: optimizer state starts at zero), the good steps in a
row, and the steps skipped so far. ``loss_scale_read`` and ``loss_scale_update`` are elementwise (each
element its own scaler; the plan has one, replicated). ``nonfinite_count`` of a slice is a partial sum of
the whole's count, which is how one all-reduced count over every rank's shards makes every rank take the
same decision.

A gated update reads the step's non-finite count: where it is not zero, the step is skipped and the
update's results are copies of its inputs (parameter and state bit-identical, the donated buffers left
untouched; an update in place keeps its parameter's own array); where it is zero, it is the plain update's kernel. AdamW's bias correction counts the steps
taken (``step - skipped``, as torch.optim.AdamW's ``state['step']`` does not move on a step GradScaler
skips), while the learning-rate schedule follows the iteration (torch's scheduler steps every iteration).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sbpflow.dtype import DType
from sbpflow.errors import ShapeError
from sbpflow.ops.base import REQUIRED, Attrs, KernelContext, Metas, NoGrad, Signature, defop, get_op
from sbpflow.ops.rows import all_broadcast, elementwise
from sbpflow.ops.training import optim
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta

# the loss-scaling variables the compiler declares (control_plane/compiler/loss_scaling.py), named here
# where every layer can read them: the workers report their values with each step
PREFIX = "loss_scale/"
SCALE, GOOD_STEPS, SKIPPED = PREFIX + "scale", PREFIX + "good_steps", PREFIX + "skipped_steps"
VARIABLES = (SCALE, GOOD_STEPS, SKIPPED)

# every loss-scaling variable and the step's non-finite count: one float32 each, shaped (1,) as a
# checkpoint and a transport hold them everywhere
SCALAR = TensorMeta((1,), DType.float32)


def _check_scalars(op: str, names: tuple[str, ...], metas: Metas) -> None:
    for name, m in zip(names, metas, strict=True):
        if m.shape != SCALAR.shape or not m.dtype.is_floating:
            raise ShapeError(
                f"op {op!r} needs {name!r} as {SCALAR} (a loss-scaling variable), got {m}; the "
                "compiler declares these variables (control_plane/compiler/loss_scaling.py)"
            )


def read_scale(xp: Any, scale: Any, init: float) -> Any:
    """The scale a variable holds: ``init`` where it is still 0 (before the first update)."""
    return xp.where(scale == 0, xp.float32(init), scale).astype(xp.float32)


def _read_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    if not x.dtype.is_floating:
        raise ShapeError(f"op 'loss_scale_read' reads a loss-scaling variable (floating), got {x}")
    return (TensorMeta(x.shape, DType.float32),)


def _read_kernel(ctx: KernelContext, scale: Any) -> Any:
    xp = ctx.xp
    value = read_scale(xp, scale, float(ctx.attrs["init"]))
    if not ctx.attrs["inverse"]:
        return value
    return xp.reciprocal(value.astype(xp.float64)).astype(
        xp.float32
    )  # torch: scale.double().reciprocal().float()


defop(
    "loss_scale_read",
    inputs=("scale",),
    attrs={"init": REQUIRED, "inverse": False},
    infer=_read_infer,
    rows=lambda m, a: elementwise(m),
    kernel=_read_kernel,
    grad=NoGrad("loss scaling"),
    doc="the loss scale a variable holds (init where it is still 0), or with inverse=True 1 / it in float64 "
    "rounded to float32 (torch's inv_scale): the loss gradient's seed, and what unscales each gradient",
    flops=1,
)


def _count_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    if not x.dtype.is_floating:
        raise ShapeError(f"op 'nonfinite_count' counts a floating tensor's inf and NaN, got {x}")
    return (SCALAR,)


def _count_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    # the count of a slice is a partial sum of the whole's count; no P in: inf + (-inf) is not finite
    rows = [Signature((Split(i),), (P,)) for i in range(metas[0].ndim)]
    return [*rows, all_broadcast(1, 1)]


def _count_kernel(ctx: KernelContext, x: Any) -> Any:
    xp = ctx.xp
    return xp.asarray(x.size - xp.count_nonzero(xp.isfinite(x)), dtype=xp.float32).reshape(1)


defop(
    "nonfinite_count",
    inputs=("x",),
    infer=_count_infer,
    rows=_count_rows,
    kernel=_count_kernel,
    grad=NoGrad("a count"),
    doc="how many elements of x are inf or NaN, as a float32 scalar",
    flops=1,
)

UPDATE_ATTRS = {"init": REQUIRED, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


def _update_infer(metas: Metas, attrs: Attrs) -> Metas:
    names = ("scale", "good_steps", "skipped", "found")
    for name, m in zip(names, metas, strict=True):
        if m.shape != metas[0].shape or not m.dtype.is_floating:
            raise ShapeError(f"op 'loss_scale_update' needs {names} floating of one shape, got {name!r}: {m}")
    return (TensorMeta(metas[0].shape, DType.float32),) * 3


def _update_kernel(
    ctx: KernelContext, scale: Any, good: Any, skipped: Any, found: Any
) -> tuple[Any, Any, Any]:
    """torch's ``_amp_update_scale_``, element by element: back off and restart the count on a
    non-finite step; else count it, and grow (where the grown scale is finite) at ``growth_interval``
    good steps in a row."""
    xp, a = ctx.xp, ctx.attrs
    f32 = xp.float32
    s = read_scale(xp, scale, float(a["init"]))
    bad = found > 0
    count = good.astype(f32) + f32(1)
    grow = ~bad & (count == f32(a["growth_interval"]))
    grown = (s.astype(xp.float64) * float(a["growth_factor"])).astype(f32)
    backed = (s.astype(xp.float64) * float(a["backoff_factor"])).astype(f32)
    new_scale = xp.where(bad, backed, xp.where(grow & xp.isfinite(grown), grown, s))
    new_good = xp.where(bad | grow, f32(0), count)
    new_skipped = skipped.astype(f32) + bad.astype(f32)
    return new_scale.astype(f32), new_good.astype(f32), new_skipped


defop(
    "loss_scale_update",
    inputs=("scale", "good_steps", "skipped", "found"),
    outputs=("new_scale", "new_good_steps", "new_skipped"),
    attrs=UPDATE_ATTRS,
    infer=_update_infer,
    rows=lambda m, a: elementwise(m, n_out=3),
    kernel=_update_kernel,
    grad=NoGrad("loss scaling"),
    doc="GradScaler's update: found > 0: scale *= backoff, good = 0, skipped += 1; else good += 1 and at "
    "growth_interval scale *= growth (kept where it would overflow fp32), good = 0",
    flops=1,
)


def _kept(ctx: KernelContext, i: int, x: Any) -> Any:
    """Output ``i`` of a skipped step: ``x`` itself where the runtime lent it to be written over (the
    parameter of an update in place, ``optim.in_place``), else a copy, into the buffer lent, if any."""
    if i == 0 and optim.in_place(ctx, x):
        return x
    out = optim.out_buffer(ctx, i, x)
    if out is None:
        return ctx.xp.array(x, copy=True)
    ctx.xp.copyto(out, x)
    return out


def _gated(plain: str, scalars: tuple[str, ...]) -> None:
    """Declare ``gated_<plain>``: the update ``plain`` on a clean step, its inputs unchanged on another."""
    base = get_op(plain)
    n = len(base.inputs)
    name = f"gated_{plain}"

    def infer(metas: Metas, attrs: Attrs) -> Metas:
        _check_scalars(name, scalars, metas[n:])
        return base.infer(metas[:n], attrs)

    def rows(metas: Metas, attrs: Attrs) -> list[Signature]:
        return [
            Signature((*r.ins, *(B,) * len(scalars)), r.outs)
            for r in elementwise(metas[:n], n_out=len(base.outputs))
        ]

    def kernel(ctx: KernelContext, *arrays: Any) -> tuple[Any, ...]:
        inputs, found = arrays[:n], arrays[n]
        if float(found[0]) > 0:  # a skipped step: every variable as it was (into the recycled buffer if lent)
            return tuple(_kept(ctx, i, x) for i, x in enumerate((inputs[0], *inputs[2:])))
        if len(scalars) > 1:  # AdamW: bias correction over the steps taken, lr at the iteration
            taken = ctx.step - int(float(arrays[n + 1][0]))
            attrs = {**ctx.attrs, "lr": optim.lr_at(ctx.attrs, ctx.step), "schedule": "constant"}
            ctx = replace(ctx, step=taken, attrs=attrs)
        return base.run_kernel(ctx, inputs)

    defop(
        name,
        inputs=(*base.inputs, *scalars),
        outputs=base.outputs,
        attrs=base.attrs,
        infer=infer,
        rows=rows,
        kernel=kernel,
        grad=NoGrad("optimizer update"),
        doc=f"{plain} where found == 0; on a step whose gradients are not finite, its inputs unchanged"
        + (" (AdamW's bias correction counts the steps taken: step - skipped)" if len(scalars) > 1 else ""),
        flops=base.flops,  # a skipped step costs the update's count too: the model prices the worst case
        in_place=base.in_place,
    )


_gated("sgd_update", ("found",))
_gated("adamw_update", ("found", "skipped"))
GATED = {"sgd_update": "gated_sgd_update", "adamw_update": "gated_adamw_update"}
