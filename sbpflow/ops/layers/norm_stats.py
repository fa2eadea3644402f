"""Running statistics of batch norm: ``running_stat``, the next value of a running mean or variance.

    y = (1 - momentum) * running + momentum * scale * batch_stat

as PyTorch's BatchNorm updates ``running_mean`` (scale 1) and ``running_var`` (scale n / (n - 1): the
unbiased variance of the n values each channel's batch statistic was taken over). The op computes a
value; that it is the variable's value for the next step is the compiler's ``running_stats`` pass, which
reads the op's first input as the variable it updates (and the one-device oracle does the same).

Rows: elementwise on same-shape inputs. The map is linear in ``(running, batch_stat)`` jointly, so
``P, P -> P`` holds (sum over ranks of the parts' updates is the update of the sums); ``P`` in one input
with the other ``B`` does not (the ``B`` input would be counted once per rank).
"""

from __future__ import annotations

from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import REQUIRED, Attrs, KernelContext, Metas, NoGrad, Signature, defop
from sbpflow.ops.elementwise import check_kind, same_dtype
from sbpflow.sbp import P


def _infer(metas: Metas, attrs: Attrs) -> Metas:
    running, stat = metas
    check_kind("running_stat", "running", running, "floating")
    same_dtype("running_stat", ("running", "batch_stat"), running, stat)
    if running.shape != stat.shape:
        raise ShapeError(
            f"op 'running_stat' needs one shape for 'running' {list(running.shape)} and 'batch_stat' "
            f"{list(stat.shape)}; reshape the batch statistic to the running one's shape"
        )
    if not 0.0 <= float(attrs["momentum"]) <= 1.0:
        raise ShapeError(f"op 'running_stat' momentum={attrs['momentum']}: use a value in [0, 1]")
    return (running,)


def _rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    return [*rows.elementwise(metas), Signature((P, P), (P,))]  # linear in both inputs at once


def _kernel(ctx: KernelContext, running: Any, stat: Any) -> Any:
    xp, m = ctx.xp, float(ctx.attrs["momentum"])
    dt = running.dtype.type
    y = xp.multiply(stat, dt(m * float(ctx.attrs["scale"])))
    return xp.add(y, xp.multiply(running, dt(1.0 - m)), out=y)


defop(
    "running_stat",
    inputs=("running", "batch_stat"),
    infer=_infer,
    rows=_rows,
    kernel=_kernel,
    grad=NoGrad("a running statistic is state carried between steps, not on any path to the loss"),
    attrs={"momentum": REQUIRED, "scale": 1.0},
    doc="(1 - momentum) * running + momentum * scale * batch_stat: batch norm's running statistics",
    flops=3,
    fp32=True,  # an fp32 variable's next value
)
