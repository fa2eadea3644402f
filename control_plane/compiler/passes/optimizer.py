"""Pass 2, optimizer insertion: state variables, gradient clipping and one update op per parameter.

``run(state)`` reads the job's :class:`~sbpflow.job.OptimizerSpec` and the gradients autodiff left in
``state.grads``, and:

* declares the optimizer state of each parameter — ``<param>/momentum`` (SGD) or ``<param>/adam_m`` and
  ``<param>/adam_v`` (AdamW) — as ``optimizer_state`` tensors with the parameter's shape, dtype, placement
  and SBP annotation, initialised to zero (the runtime and the reference fill them; the SGD buffer at
  zero gives torch's first step), listed in ``state.state_vars``;
* clips by the true global norm when ``clip_grad_norm > 0``: ``sum(g ** 2)`` per gradient, added up,
  ``clip_coef``, and every gradient multiplied by it. Nothing here is layout-aware: under SBP the sum of
  a split gradient is ``P``, and boxing before ``clip_coef`` (which takes no ``P``) makes it global;
* emits ``sgd_update`` / ``adamw_update`` per parameter with the schedule in its attrs, on the
  parameter's placement and in the stage of its gradient, and fills ``state.updates`` with the next
  value of every parameter and every state variable;
* under dynamic loss scaling (fp16, ``loss_scale = 0``) counts the non-finite gradient elements, emits the
  gated form of each update (a skipped step changes nothing) and the scale's update
  (:mod:`~sbpflow.control_plane.compiler.loss_scaling`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sbpflow.control_plane.compiler import loss_scaling
from sbpflow.control_plane.compiler.builder import GraphBuilder
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import Graph, TensorDecl, TensorKind
from sbpflow.job import SGD, AdamW, ConstantLR, LrSchedule, OptimizerSpec, WarmupCosine
from sbpflow.ops.base import AttrValue

PREFIX = "optimizer/"


@dataclass(frozen=True)
class _Rule:
    """How one algorithm maps to an op (whose attrs are the algorithm's fields) and its state variables."""

    op: str
    state: tuple[str, ...]


RULES: dict[type, _Rule] = {
    SGD: _Rule("sgd_update", ("momentum",)),
    AdamW: _Rule("adamw_update", ("adam_m", "adam_v")),
}


def schedule_attrs(schedule: LrSchedule) -> dict[str, AttrValue]:
    """The update ops' schedule attrs for a job's schedule (see sbpflow/ops/training/optim.py)."""
    if isinstance(schedule, WarmupCosine):
        return {
            "schedule": "warmup_cosine",
            "warmup_steps": schedule.warmup_steps,
            "total_steps": schedule.total_steps,
            "min_lr_ratio": schedule.min_lr_ratio,
        }
    assert isinstance(schedule, ConstantLR), schedule
    return {"schedule": "constant"}


def run(state: CompileState) -> None:
    spec = state.job.optimizer
    if spec is None:
        return
    missing = [p for p in spec.parameters if p not in state.grads]
    if missing:
        raise GraphError(
            f"the optimizer updates {missing}, which have no gradient; run autodiff before the optimizer pass "
            "(and mark the parameters trainable)"
        )
    g = state.graph
    producers = {o: node for node in g.ops for o in node.outputs}
    stage = {p: producers[state.grads[p]].stage for p in spec.parameters}
    base = GraphBuilder(g, PREFIX.rstrip("/"))

    def at(param: str) -> GraphBuilder:
        return base.at(PREFIX + param, stage=stage[param], placement=g.tensors[param].placement)

    grads = {p: state.grads[p] for p in spec.parameters}
    rule = RULES[type(spec.algorithm)]
    op, gate = rule.op, ()
    if scaling := loss_scaling.enabled(state):  # checks the unscaled gradients, before clipping
        found = loss_scaling.found(grads, at, spec.parameters[0])
        op, gate = loss_scaling.gated(rule.op, found)
    if spec.clip_grad_norm > 0:
        grads = _clip(g, spec, grads, at)
    for p in spec.parameters:
        slots = [_declare_state(g, p, suffix) for suffix in rule.state]
        state.state_vars += slots
        attrs = {**spec.hyper(p), **schedule_attrs(spec.schedule)}  # its group's lr and weight decay
        outs = at(p).emit(op, (p, grads[p], *slots, *gate), attrs, name=PREFIX + p)
        state.updates.update(zip((p, *slots), outs, strict=True))
    if scaling:
        loss_scaling.update(state, base, found)


def _declare_state(g: Graph, param: str, suffix: str) -> str:
    decl = g.tensors[param]
    name = f"{param}/{suffix}"
    g.add_tensor(TensorDecl(name, decl.meta, TensorKind.optimizer_state, decl.placement, decl.sbp))
    return name


def _clip(
    g: Graph, spec: OptimizerSpec, grads: dict[str, str], at: Callable[[str], GraphBuilder]
) -> dict[str, str]:
    """Every gradient times ``min(1, max_norm / ||all gradients||)``, the norm taken over all of them."""
    squares = []
    for p, grad in grads.items():
        (sq,) = at(p).call("pow_scalar", grad, exponent=2.0)
        squares.append(at(p).call("sum", sq)[0])
    # a mixed-dtype model adds its squared norms in the widest dtype
    wide = max((g.tensors[s].meta.dtype for s in squares), key=lambda d: d.itemsize)
    # the norm lives with the first parameter: stage 0 under a pipeline, whose backward ends last
    first = at(spec.parameters[0])
    norm = first.at(PREFIX + "global_norm", stage=first.stage, placement=first.placement)
    total = None
    for s in squares:
        if g.tensors[s].meta.dtype != wide:
            (s,) = norm.call("cast", s, dtype=wide)
        total = s if total is None else norm.call("add", total, s)[0]
    assert total is not None
    (coef,) = norm.emit("clip_coef", (total,), {"max_norm": spec.clip_grad_norm}, name=PREFIX + "clip_coef")
    clipped = {}
    for p, grad in grads.items():
        factor = coef
        if g.tensors[grad].meta.dtype != wide:
            (factor,) = at(p).call("cast", coef, dtype=g.tensors[grad].meta.dtype)
        (clipped[p],) = at(p).call("mul", grad, factor)
    return clipped
