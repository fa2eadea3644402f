"""Dynamic loss scaling in the static plan: an fp16 job with ``loss_scale = 0`` (``JobConfig.loss_scaling``).

torch.cuda.amp.GradScaler's rule, written into the graph by autodiff and the optimizer pass:

* **The scale is optimizer state**: three fp32 scalars (shape ``(1,)``), replicated (``B``) on the
  loss's placement (so the ranks that report a step's loss report its scale too), listed in ``state.state_vars`` and so checkpointed and restored with the rest
  of the optimizer state (a resume goes on with the same scale): :data:`SCALE` (``0``, its starting
  value as all optimizer state, reads as ``init``), :data:`GOOD_STEPS` (clean steps in a row) and
  :data:`SKIPPED` (steps skipped so far; AdamW's bias correction counts ``step - skipped``).
* **Autodiff** seeds ``d loss`` with the scale (``loss_scale_read``, at the loss's producer) and
  unscales each parameter's gradient by ``1 / scale`` (``loss_scale_read(inverse=True)``, torch's
  ``inv_scale``).
* **The optimizer pass** counts the inf and NaN of every unscaled gradient (``nonfinite_count``: a
  sharded gradient's count is ``P``, and the sum over all gradients is boxed to ``B`` — one all-reduced
  count, so every rank of every stage takes the same decision under DP, TP, ZeRO and pipelines alike),
  gates every update on it (``gated_sgd_update``, ``gated_adamw_update``: a skipped step leaves every
  parameter and state variable bit-identical), and updates the three variables (``loss_scale_update``:
  backoff on a non-finite step, growth after ``growth_interval`` clean ones). Clipping, where set, runs on
  the unscaled gradients, as after torch's ``scaler.unscale_``.
"""

from __future__ import annotations

from collections.abc import Callable

from sbpflow.control_plane.compiler.builder import GraphBuilder
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.dtype import DType
from sbpflow.graph import TensorDecl, TensorKind
from sbpflow.ops.base import get_op
from sbpflow.ops.training.loss_scaling import GATED, PREFIX, SCALAR, SCALE, SKIPPED, VARIABLES
from sbpflow.placement import Placement
from sbpflow.sbp import B


def enabled(state: CompileState) -> bool:
    return state.job.config.dynamic_loss_scaling


def variables(state: CompileState) -> tuple[str, ...]:
    """The loss-scaling variables, declared on first use beside the loss (the ranks that report the loss
    then report the scale with it)."""
    g = state.graph
    pl = g.tensors[state.job.loss].placement
    for name in VARIABLES:
        if name not in g.tensors:
            sbp = None if pl is None else (B,) * pl.ndim
            g.add_tensor(TensorDecl(name, SCALAR, TensorKind.optimizer_state, pl, sbp))
            state.state_vars.append(name)
    return VARIABLES


def seed(state: CompileState, at: GraphBuilder, loss: str) -> str:
    """``d loss``: the scale, in the loss's shape and dtype."""
    meta = state.graph.tensors[loss].meta
    variables(state)
    (out,) = at.call("loss_scale_read", SCALE, init=state.job.config.loss_scaling.init)
    if meta.dtype != DType.float32:
        (out,) = at.call("cast", out, dtype=meta.dtype)
    if meta.shape != SCALAR.shape:
        (out,) = at.call("reshape", out, shape=meta.shape)
    return out


def inverse(state: CompileState, base: GraphBuilder, stage: int, placement: Placement | None) -> str:
    """``1 / scale`` (fp32), by which each gradient is unscaled, on ``placement`` in ``stage``."""
    at = base.at(PREFIX + "inverse", stage=stage, placement=placement)
    init = state.job.config.loss_scaling.init
    (out,) = at.emit("loss_scale_read", (SCALE,), {"init": init, "inverse": True}, name=PREFIX + "inverse")
    return out


def unscale(at: GraphBuilder, scaled: str, inv: str, name: str) -> str:
    meta = at.graph.tensors[scaled].meta
    if meta.dtype != DType.float32:
        (inv,) = at.call("cast", inv, dtype=meta.dtype)
    if meta.ndim == 0:  # a 0-d parameter's gradient: keep its shape
        (inv,) = at.call("reshape", inv, shape=())
    (grad,) = at.emit("mul", (scaled, inv), {}, name=name, kind=TensorKind.gradient)
    return grad


def found(grads: dict[str, str], at: Callable[[str], GraphBuilder], first: str) -> str:
    """The number of inf and NaN elements over every gradient (``at(p)``: where ``p``'s update runs),
    summed where ``first``'s runs: one scalar, which its readers take ``B``."""
    total = None
    for p, grad in grads.items():
        (count,) = at(p).call("nonfinite_count", grad)
        total = count if total is None else at(first).call("add", total, count)[0]
    assert total is not None
    (out,) = at(first).emit("identity", (total,), {}, name=PREFIX + "found")
    return out


def gated(op_type: str, found_count: str) -> tuple[str, tuple[str, ...]]:
    """The gated form of update op ``op_type`` and the inputs it takes after the plain op's."""
    gate = GATED[op_type]
    extra = get_op(gate).inputs[len(get_op(op_type).inputs) :]
    names = {"found": found_count, "skipped": SKIPPED}
    return gate, tuple(names[e] for e in extra)


def update(state: CompileState, base: GraphBuilder, found_count: str) -> None:
    """The scale's next value (GradScaler's update), and its counters', where the loss is computed."""
    g, loss = state.graph, state.job.loss
    producer = next(o for o in g.ops if loss in o.outputs)
    at = base.at(PREFIX + "update", stage=producer.stage, placement=g.tensors[loss].placement)
    c = state.job.config.loss_scaling
    attrs = {
        "init": c.init,
        "growth_factor": c.growth_factor,
        "backoff_factor": c.backoff_factor,
        "growth_interval": c.growth_interval,
    }
    outs = at.emit("loss_scale_update", (*VARIABLES, found_count), attrs, name=PREFIX + "update")
    state.updates.update(zip(VARIABLES, outs, strict=True))
