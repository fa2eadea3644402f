"""Optimizer ops: the parameter updates the compiler's optimizer pass inserts, and the clipping factor.

An update reads a parameter, its gradient and its state, and returns their next values (new arrays: the
old values may still be read elsewhere in the step). The learning rate of step ``ctx.step`` (the optimizer
step number the runtime passes to every kernel) is ``lr`` times the schedule's factor, read from attrs:
``schedule`` is ``"constant"`` or ``"warmup_cosine"`` (``warmup_steps``, ``total_steps``,
``min_lr_ratio``, computed by :meth:`sbpflow.job.WarmupCosine.factor`, the one definition).

Rows: an update is elementwise, so every tensor split alike on any axis (ZeRO's ``S(0)`` state), or all
``B``. Never ``P``: the updates are not linear in the gradient (AdamW divides by its root mean square,
weight decay adds the parameter), and a partial gradient must be reduced first, which boxing does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import REQUIRED, Attrs, KernelContext, Metas, NoGrad, Signature, defop, get_op
from sbpflow.ops.elementwise import check_kind, same_shape_rows
from sbpflow.ops.kernels.rowwise import jit_loops
from sbpflow.sbp import B

SCHEDULE_ATTRS: dict[str, Any] = {
    "schedule": "constant",
    "warmup_steps": 0,
    "total_steps": 0,
    "min_lr_ratio": 0.0,
}


def _warmup_cosine(attrs: Attrs, step: int) -> float:
    from sbpflow.job import WarmupCosine  # the job module imports the op library: import at use

    return WarmupCosine(
        int(attrs["warmup_steps"]), int(attrs["total_steps"]), float(attrs["min_lr_ratio"])
    ).factor(step)


# schedule name -> the factor on lr at a step
SCHEDULES: dict[str, Callable[[Attrs, int], float]] = {
    "constant": lambda attrs, step: 1.0,
    "warmup_cosine": _warmup_cosine,
}


def lr_at(attrs: Attrs, step: int) -> float:
    """The learning rate an update op applies at optimizer step ``step``."""
    return float(attrs["lr"]) * SCHEDULES[str(attrs["schedule"])](attrs, step)


def _update_infer(op: str, names: tuple[str, ...], n_out: int) -> Callable[[Metas, Attrs], Metas]:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        param = metas[0]
        check_kind(op, names[0], param, "floating")
        for name, m in zip(names[1:], metas[1:], strict=True):
            if m != param:
                listing = ", ".join(f"{n}: {x}" for n, x in zip(names, metas, strict=True))
                raise ShapeError(
                    f"op {op!r} needs {name!r} of the parameter's shape and dtype, got {listing}; cast the "
                    "gradient or state to the parameter's dtype (mixed precision keeps fp32 master weights)"
                )
        if attrs["schedule"] not in SCHEDULES:
            raise ShapeError(
                f"op {op!r}: schedule {attrs['schedule']!r} is unknown; use one of {sorted(SCHEDULES)}"
            )
        if attrs["schedule"] == "warmup_cosine" and int(attrs["warmup_steps"]) < 0:
            raise ShapeError(f"op {op!r}: warmup_steps={attrs['warmup_steps']} must be >= 0")
        return (param,) * n_out

    return infer


def _sgd_kernel(ctx: KernelContext, param: Any, grad: Any, buf: Any, clip: Any = None) -> tuple[Any, Any]:
    """Each result is made in one array the kernel allocates (or the buffer, when the runtime donates it)
    and then updates in place (``out=``), so a 4096 x 4096 update makes no temporaries; with momentum 0
    the buffer is the gradient itself (no pass). The same operations as the formula, in the same order,
    so the results are the formula's bits: ``param - lr * x == (-lr * x) + param`` exactly in IEEE.
    ``clip``: the clipping factor (``clipped_sgd_update``), multiplied in first as the ``mul`` it replaces."""
    a, t, xp = ctx.attrs, param.dtype.type, ctx.xp
    momentum, wd = float(a["momentum"]), float(a["weight_decay"])
    if (
        momentum
        and in_place(ctx, param)
        and donated(ctx, 2, buf)
        and (loops := jit_loops("optim_jit", xp, param, grad, buf)) is not None
    ):
        # one pass over param, grad and buf, each written in place: the operations below, an element
        scale, clipped = (1.0, False) if clip is None else (float(clip.reshape(())), True)
        alpha = float(t(-lr_at(a, ctx.step)))
        flat = param.reshape(-1), grad.reshape(-1), buf.reshape(-1)
        loops.sgd_momentum_in_place(*flat, momentum, wd, bool(a["nesterov"]), alpha, scale, clipped)
        return param, buf
    if clip is not None:
        grad = _clipped_grad(xp, grad, clip)
    d = grad
    if wd:
        d = _axpy(xp, t(wd), param, grad)  # grad + wd * param
    if momentum:
        # the first step (buf = 0) gives buf = d, as torch does
        new_buf = _axpy(xp, t(momentum), buf, d, out=buf if donated(ctx, 2, buf) else None)
        direction = _axpy(xp, t(momentum), new_buf, d) if a["nesterov"] else new_buf
    else:
        new_buf = direction = d  # 0 * buf + d is d
    alpha = t(-lr_at(a, ctx.step))
    if in_place(ctx, param) and (loops := jit_loops("optim_jit", xp, param, direction)) is not None:
        loops.sgd_in_place(param.reshape(-1), direction.reshape(-1), alpha)
        return param, new_buf
    return _axpy(xp, alpha, direction, param, out=out_buffer(ctx, 0, param)), new_buf


def _clipped_grad(xp: ModuleType, grad: Any, clip: Any) -> Any:
    """``grad * clip`` in a new array of the gradient's shape (``clip`` one value, of any shape)."""
    return xp.multiply(grad, clip.reshape(()), out=xp.empty_like(grad))


def _axpy(xp: ModuleType, alpha: Any, x: Any, y: Any, out: Any = None) -> Any:
    """``alpha * x + y`` in one new array (or ``out``), no temporary (a 0-d result stays an array)."""
    out = xp.empty_like(x) if out is None else out
    xp.multiply(x, alpha, out=out)
    return xp.add(out, y, out=out)


def out_buffer(ctx: KernelContext, i: int, like: Any) -> Any:
    """The retired array the runtime gives output ``i`` to be written into (shaped like ``like``), or None:
    allocate. Only the actor runtime gives one (its context's ``out_buffers``), and only an array that no
    act reads any more and that is not ``like`` itself."""
    buffers = getattr(ctx, "out_buffers", ())
    b = buffers[i] if i < len(buffers) else None
    if b is None or b is like or b.shape != like.shape or b.dtype != like.dtype:
        return None
    flags = getattr(b, "flags", None)
    return b if flags is not None and bool(flags.writeable) else None


def in_place(ctx: KernelContext, param: Any) -> bool:
    """Whether the runtime lets the update write its new parameter over ``param`` (input 0): it lends
    that very array as ``out_buffers[0]`` once nothing but the update holds it (``tasks.Recycler``, for
    an op declared ``in_place``); every other caller (the reference, eager mode) does not."""
    buffers: tuple[Any, ...] = getattr(ctx, "out_buffers", ())
    flags = getattr(param, "flags", None)
    lent = buffers[0] if buffers else None
    return lent is param and flags is not None and bool(flags.writeable) and bool(flags.c_contiguous)


def donated(ctx: KernelContext, i: int, array: Any) -> bool:
    """Whether the caller gave input ``i``'s array to the kernel, which may then write a result into it.

    The actor runtime donates an optimizer-state buffer that only its update reads (its context carries
    ``donated``, the input positions); every other caller (the reference, eager mode) does not, and the
    kernel then leaves its inputs untouched. A read-only array (a memory-mapped checkpoint) is never
    written.
    """
    flags = getattr(array, "flags", None)
    return i in getattr(ctx, "donated", ()) and flags is not None and bool(flags.writeable)


defop(
    "sgd_update",
    inputs=("param", "grad", "momentum_buf"),
    outputs=("new_param", "new_momentum_buf"),
    attrs={"lr": REQUIRED, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False, **SCHEDULE_ATTRS},
    infer=_update_infer("sgd_update", ("param", "grad", "momentum_buf"), 2),
    rows=lambda m, a: rows.elementwise(m, n_out=2),
    kernel=_sgd_kernel,
    grad=NoGrad("optimizer update"),
    in_place=True,
    doc="SGD with momentum and L2 weight decay (torch.optim.SGD, dampening 0): d = grad + wd * param, "
    "buf = momentum * buf + d, param -= lr(step) * (d + momentum * buf if nesterov else buf)",
    flops=4,
)


def _adamw_kernel(
    ctx: KernelContext, param: Any, grad: Any, m: Any, v: Any, clip: Any = None
) -> tuple[Any, Any, Any]:
    """The formula's operations in its order (so its bits), in place on arrays the kernel owns: the new
    moments (or the donated old ones), two scratch arrays and the new parameter. ``clip``: the clipping
    factor (``clipped_adamw_update``), each gradient element multiplied by it first, as the ``mul`` it
    replaces rounded it (one IEEE product in the gradient's dtype either way)."""
    a, t, xp = ctx.attrs, param.dtype.type, ctx.xp
    lr, b1, b2 = lr_at(a, ctx.step), float(a["beta1"]), float(a["beta2"])
    n = ctx.step + 1  # bias correction counts the steps taken, this one included
    loops = jit_loops("optim_jit", xp, param, grad, m, v)
    if loops is not None and param.shape == grad.shape == m.shape == v.shape:
        # the same operations in one pass, bit for bit (optim_jit.py): the moments in place, on copies
        # of those not donated, the parameter into the runtime's lent buffer or a new array
        m2 = m if donated(ctx, 2, m) else m.copy()
        v2 = v if donated(ctx, 3, v) else v.copy()
        scale = 1.0 if clip is None else float(clip.reshape(-1)[0])  # x * 1 is x: the same bits unclipped
        if in_place(ctx, param) and not any(param is x for x in (grad, m2, v2)):
            loops.adamw_in_place(
                param.reshape(-1), grad.reshape(-1), m2.reshape(-1), v2.reshape(-1), b1, b2, 1.0 - b1**n,
                1.0 - b2**n, lr, float(a["eps"]), 1.0 - lr * float(a["weight_decay"]), scale,
            )  # fmt: skip
            return param, m2, v2
        p2 = out_buffer(ctx, 0, param)
        if p2 is None or not p2.flags.c_contiguous or any(p2 is x for x in (grad, m2, v2)):
            p2 = xp.empty_like(param)
        loops.adamw_all(
            param.reshape(-1), grad.reshape(-1), m2.reshape(-1), v2.reshape(-1), b1, b2, 1.0 - b1**n,
            1.0 - b2**n, lr, float(a["eps"]), 1.0 - lr * float(a["weight_decay"]), scale, p2.reshape(-1),
        )  # fmt: skip
        return p2, m2, v2
    if clip is not None:
        grad = _clipped_grad(xp, grad, clip)
    scratch = xp.multiply(grad, t(1.0 - b1))
    new_m = xp.multiply(m, t(b1), out=m if donated(ctx, 2, m) else None)
    new_m = _iadd(xp, new_m, scratch)  # b1 * m + (1 - b1) * grad
    scratch = xp.multiply(grad, grad, out=_writable(scratch))
    scratch = xp.multiply(scratch, t(1.0 - b2), out=_writable(scratch))
    new_v = xp.multiply(v, t(b2), out=v if donated(ctx, 3, v) else None)
    new_v = _iadd(xp, new_v, scratch)  # b2 * v + (1 - b2) * grad^2
    m_hat = xp.divide(new_m, t(1.0 - b1**n), out=_writable(scratch))
    step = xp.multiply(m_hat, t(lr), out=_writable(m_hat))  # lr * m_hat
    denom = xp.divide(new_v, t(1.0 - b2**n))  # v_hat
    denom = xp.sqrt(denom, out=_writable(denom))
    denom = xp.add(denom, t(a["eps"]), out=_writable(denom))
    step = xp.divide(step, denom, out=_writable(step))
    decay = t(1.0 - lr * float(a["weight_decay"]))  # decoupled: not through the moments
    decayed = xp.multiply(param, decay, out=out_buffer(ctx, 0, param))
    return xp.subtract(decayed, step, out=_writable(decayed)), new_m, new_v


def _writable(x: Any) -> Any:
    """``x`` as an ``out=`` target where it is an array (a 0-d operation gives a scalar: no target)."""
    return x if getattr(x, "ndim", 0) else None


def _iadd(xp: ModuleType, x: Any, y: Any) -> Any:
    return xp.add(x, y, out=_writable(x))


defop(
    "adamw_update",
    inputs=("param", "grad", "m", "v"),
    outputs=("new_param", "new_m", "new_v"),
    attrs={"lr": REQUIRED, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, **SCHEDULE_ATTRS},
    infer=_update_infer("adamw_update", ("param", "grad", "m", "v"), 3),
    rows=lambda m, a: rows.elementwise(m, n_out=3),
    kernel=_adamw_kernel,
    grad=NoGrad("optimizer update"),
    in_place=True,
    doc="AdamW (torch.optim.AdamW): param *= 1 - lr * wd; m, v = moving averages of grad, grad^2; "
    "param -= lr(step) * m_hat / (sqrt(v_hat) + eps) with bias correction at step + 1",
    flops=14,
)


# Each update's form that takes the clipping factor as a last input: the fusion pass folds the ``mul`` of
# a gradient by ``clip_coef``'s factor into the update that reads it (one act and one pass over the
# gradient fewer a parameter; control_plane/compiler/passes/fusion.py).
CLIPPED = {"sgd_update": "clipped_sgd_update", "adamw_update": "clipped_adamw_update"}


def _clipped(plain: str) -> None:
    """Declare ``clipped_<plain>``: ``plain`` on ``grad * clip``, ``clip`` one value (``B`` everywhere)."""
    base = get_op(plain)
    n, name, kernel = len(base.inputs), CLIPPED[plain], base.kernel

    def infer(metas: Metas, attrs: Attrs) -> Metas:
        clip, param = metas[n], metas[0]
        if clip.dtype != param.dtype or math.prod(clip.shape) != 1:
            raise ShapeError(
                f"op {name!r} needs 'clip' as one value of the parameter's dtype {param.dtype}, got {clip}; "
                "pass clip_coef's factor cast to the gradient's dtype"
            )
        return base.infer(metas[:n], attrs)

    def clip_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
        return [Signature((*r.ins, B), r.outs) for r in base.rows(metas[:n], attrs)]

    defop(
        name,
        inputs=(*base.inputs, "clip"),
        outputs=base.outputs,
        attrs=base.attrs,
        infer=infer,
        rows=clip_rows,
        kernel=lambda ctx, *arrays: kernel(ctx, *arrays[:n], clip=arrays[n]),
        grad=NoGrad("optimizer update"),
        doc=f"{plain} of grad * clip (the gradient times clip_coef's factor, folded in by the fusion pass)",
        flops=int(base.flops) + 1,  # type: ignore[arg-type]
        in_place=base.in_place,
    )


for _plain in CLIPPED:
    _clipped(_plain)


def _clip_coef_kernel(ctx: KernelContext, norm_sq: Any) -> Any:
    t = norm_sq.dtype.type
    return ctx.xp.minimum(t(1.0), t(ctx.attrs["max_norm"]) / (ctx.xp.sqrt(norm_sq) + t(1e-6)))


def _clip_coef_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    check_kind("clip_coef", "norm_sq", x, "floating")
    if not float(attrs["max_norm"]) > 0:
        raise ShapeError(f"op 'clip_coef' needs max_norm > 0, got {attrs['max_norm']}")
    return (x,)


defop(
    "clip_coef",
    inputs=("norm_sq",),
    attrs={"max_norm": REQUIRED},
    infer=_clip_coef_infer,
    # elementwise (the optimizer pass feeds it one scalar, the squared global norm); no P: it is nonlinear
    rows=same_shape_rows(),
    kernel=_clip_coef_kernel,
    grad=NoGrad("optimizer update (gradient clipping)"),
    doc="min(1, max_norm / (sqrt(norm_sq) + 1e-6)): the factor that clips gradients to a global norm",
    flops=1,
)
