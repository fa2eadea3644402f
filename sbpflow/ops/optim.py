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

from collections.abc import Callable
from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import REQUIRED, Attrs, KernelContext, Metas, NoGrad, defop
from sbpflow.ops.elementwise import check_kind, same_shape_rows

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


def _sgd_kernel(ctx: KernelContext, param: Any, grad: Any, buf: Any) -> tuple[Any, Any]:
    a, t = ctx.attrs, param.dtype.type
    momentum = t(a["momentum"])
    d = grad + t(a["weight_decay"]) * param if a["weight_decay"] else grad
    new_buf = momentum * buf + d  # the first step (buf = 0) gives buf = d, as torch.optim.SGD does
    direction = d + momentum * new_buf if a["nesterov"] else new_buf
    return param - t(lr_at(a, ctx.step)) * direction, new_buf


defop(
    "sgd_update",
    inputs=("param", "grad", "momentum_buf"),
    outputs=("new_param", "new_momentum_buf"),
    attrs={"lr": REQUIRED, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False, **SCHEDULE_ATTRS},
    infer=_update_infer("sgd_update", ("param", "grad", "momentum_buf"), 2),
    rows=lambda m, a: rows.elementwise(m, n_out=2),
    kernel=_sgd_kernel,
    grad=NoGrad("optimizer update"),
    doc="SGD with momentum and L2 weight decay (torch.optim.SGD, dampening 0): d = grad + wd * param, "
    "buf = momentum * buf + d, param -= lr(step) * (d + momentum * buf if nesterov else buf)",
)


def _adamw_kernel(ctx: KernelContext, param: Any, grad: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
    a, t, xp = ctx.attrs, param.dtype.type, ctx.xp
    lr, b1, b2 = lr_at(a, ctx.step), float(a["beta1"]), float(a["beta2"])
    n = ctx.step + 1  # bias correction counts the steps taken, this one included
    new_m = t(b1) * m + t(1.0 - b1) * grad
    new_v = t(b2) * v + t(1.0 - b2) * (grad * grad)
    m_hat = new_m / t(1.0 - b1**n)
    v_hat = new_v / t(1.0 - b2**n)
    decayed = param * t(1.0 - lr * float(a["weight_decay"]))  # decoupled: not through the moments
    return decayed - t(lr) * m_hat / (xp.sqrt(v_hat) + t(a["eps"])), new_m, new_v


defop(
    "adamw_update",
    inputs=("param", "grad", "m", "v"),
    outputs=("new_param", "new_m", "new_v"),
    attrs={"lr": REQUIRED, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, **SCHEDULE_ATTRS},
    infer=_update_infer("adamw_update", ("param", "grad", "m", "v"), 3),
    rows=lambda m, a: rows.elementwise(m, n_out=3),
    kernel=_adamw_kernel,
    grad=NoGrad("optimizer update"),
    doc="AdamW (torch.optim.AdamW): param *= 1 - lr * wd; m, v = moving averages of grad, grad^2; "
    "param -= lr(step) * m_hat / (sqrt(v_hat) + eps) with bias correction at step + 1",
)


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
)
