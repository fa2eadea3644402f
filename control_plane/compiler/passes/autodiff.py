"""Pass 1, autodiff: backward ops from each op's gradient rule, from the loss back to the parameters.

``run(state)`` seeds ``d loss = full(loss_scale or 1)``, walks the forward ops in reverse and calls each
op's gradient rule through a :class:`GraphBuilder` stamped with that op's stage, placement and scope, and
fills ``state.grads[param]`` with the tensor ``grad/<param>`` (kind ``gradient``) for every trainable
parameter. Decisions:

* Only tensors on a path from a trainable parameter to the loss take a gradient, and only floating ones:
  an integer or bool branch (token ids, a count of non-ignored labels) is skipped, as is everything the
  parameters do not reach. Rules emit a gradient for every input; those nobody needs are removed at the
  end (dead-code elimination over the ops this pass emitted), so ``d tokens`` is never computed.
* A tensor read by several ops gets the sum of their contributions (``add`` as they arrive, so at most
  one partial sum is live); its final gradient is named ``grad/<tensor>`` where that is safe.
* A trainable parameter that the loss does not depend on (differentiably) is an error naming it: a
  silent zero gradient would still move it under weight decay and would hide a wiring mistake.
* A loss-scaled job (``config.loss_scale > 0``) seeds ``d loss = scale`` and unscales each parameter's
  gradient (``mul_scalar 1/scale``) before the optimizer sees it; a dynamically scaled one (fp16 with
  ``loss_scale = 0``) reads the scale from its variable and multiplies by ``1 / scale``
  (:mod:`~sbpflow.control_plane.compiler.loss_scaling`).
* ``checkpoint=True`` on a forward op is left to the recompute pass. Backward ops keep ``checkpoint=False``
  (the flag means "recompute my outputs", which has no sense for a backward op); they are recognised by
  their names, ``grad/<forward op>/...`` (:func:`is_backward`), and carry the forward op's scope.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sbpflow.control_plane.compiler import loss_scaling
from sbpflow.control_plane.compiler.builder import GraphBuilder
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import Graph, OpNode, TensorKind
from sbpflow.ops.base import GradContext, NoGrad, get_op

GRAD = "grad/"  # prefix of every backward op and of every final gradient tensor


def is_backward(node: OpNode) -> bool:
    """Whether ``node`` was emitted by autodiff (its name is ``grad/<forward op>/...``)."""
    return node.name.startswith(GRAD)


def run(state: CompileState) -> None:
    job = state.job
    if not job.loss:
        return  # a forward-only job: nothing to differentiate
    trainable = _trainable(state)
    if not trainable:
        return
    g = state.graph
    loss = g.tensors[job.loss]
    if loss.meta.numel != 1 or not loss.meta.dtype.is_floating:
        raise GraphError(
            f"loss {loss.name!r} is {loss.meta}; autodiff needs a floating scalar: reduce it with mean() or sum()"
        )
    forward = list(g.ops)
    wanted = _on_a_path(g, forward, set(trainable), job.loss)
    missing = [p for p in trainable if p not in wanted]
    if missing:
        raise GraphError(
            f"trainable parameter(s) {missing} do not affect the loss {job.loss!r} (no differentiable path "
            "leads from them to it); use them in the model, or exclude them from training "
            "(requires_grad=False, or leave them out of the optimizer)"
        )
    scale = job.config.loss_scale if job.config.loss_scale > 0 else 1.0
    producer = next((o for o in forward if job.loss in o.outputs), None)
    if producer is None:
        raise GraphError(f"loss {job.loss!r} is not computed by any op; the loss must be an op's output")
    acc = _Accumulator(GraphBuilder(g, GRAD.rstrip("/")))
    seed_at = acc.builder.at(
        GRAD + producer.name, stage=producer.stage, placement=producer.placement, scope=producer.scope
    )
    dynamic = loss_scaling.enabled(state)
    if dynamic:
        seed = loss_scaling.seed(state, seed_at, job.loss)
    else:
        (seed,) = seed_at.call("full", shape=loss.meta.shape, dtype=loss.meta.dtype, value=scale)
    acc.add(seed_at, job.loss, seed)
    for node in reversed(forward):
        if any(o in wanted for o in node.outputs):
            _backward_of(node, g, acc, wanted)
    stage_of = _first_use_stage(forward, trainable)
    first = trainable[0]
    inv = None
    if dynamic:
        inv = loss_scaling.inverse(state, acc.builder, stage_of[first], g.tensors[first].placement)
    for p in trainable:
        decl = g.tensors[p]
        at = acc.builder.at(GRAD + p, stage=stage_of[p], placement=decl.placement)
        state.grads[p] = _parameter_grad(at, acc, p, scale, inv)
    _eliminate_dead(g, acc.builder, set(state.grads.values()))


def _trainable(state: CompileState) -> list[str]:
    """Parameters marked trainable and, when the job has an optimizer, updated by it (in its order)."""
    job = state.job
    marked = {p.tensor for p in job.parameters if p.trainable}
    order = job.optimizer.parameters if job.optimizer is not None else tuple(p.tensor for p in job.parameters)
    return [p for p in order if p in marked]


def _on_a_path(g: Graph, ops: list[OpNode], sources: set[str], loss: str) -> set[str]:
    """Floating tensors that depend on ``sources`` and that the loss depends on: those that take a gradient."""
    reached = set(sources)
    for node in ops:
        if any(i in reached for i in node.inputs):
            reached.update(o for o in node.outputs if g.tensors[o].meta.dtype.is_floating)
    needed = {loss}
    for node in reversed(ops):
        if any(o in needed for o in node.outputs):
            needed.update(node.inputs)
    return reached & needed


@dataclass
class _Accumulator:
    """Gradient contributions per tensor, summed as they arrive; ``refs`` counts who holds each name."""

    builder: GraphBuilder
    total: dict[str, str] = field(default_factory=dict)
    refs: Counter[str] = field(default_factory=Counter)

    def add(self, at: GraphBuilder, tensor: str, grad: str) -> None:
        if tensor in self.total:
            old = self.total[tensor]
            self.refs[old] -= 1
            (grad,) = at.call("add", old, grad)
        self.total[tensor] = grad
        self.refs[grad] += 1

    def final(self, tensor: str, kind: TensorKind | None = None) -> str | None:
        """The summed gradient of ``tensor``, renamed ``grad/<tensor>`` when no one else holds that name."""
        grad = self.total.get(tensor)
        if grad is None:
            return None
        name = GRAD + tensor
        if self.refs[grad] == 1 and self.builder.rename(grad, name, kind):
            self.refs[grad] -= 1
            self.refs[name] += 1
            self.total[tensor] = grad = name
        return grad


def _backward_of(node: OpNode, g: Graph, acc: _Accumulator, wanted: set[str]) -> None:
    """Emit the backward ops of one forward op and hand its input gradients to the accumulator."""
    dys = tuple(acc.final(o) if o in wanted else None for o in node.outputs)
    if all(d is None for d in dys):
        return  # its outputs are on a path, but no consumer passed a gradient back (a None from a rule)
    op = get_op(node.op_type)
    if isinstance(op.grad, NoGrad):
        raise GraphError(
            f"op {node.name!r} ({node.op_type}) takes no gradient ({op.grad.reason}), but it lies between "
            f"trainable parameters and the loss (its outputs {list(node.outputs)} feed the loss); detach "
            "its input or replace it by a differentiable op"
        )
    at = acc.builder.at(GRAD + node.name, stage=node.stage, placement=node.placement, scope=node.scope)
    ctx = GradContext(
        at,
        node.inputs,
        node.outputs,
        dys,
        tuple(g.tensors[i].meta for i in node.inputs),
        tuple(g.tensors[o].meta for o in node.outputs),
        op.normalize_attrs(node.attrs),
    )
    grads = list(op.grad(ctx))
    if len(grads) != len(node.inputs):
        raise GraphError(
            f"gradient rule of {node.op_type!r} returned {len(grads)} gradients for the {len(node.inputs)} "
            f"inputs of op {node.name!r}; fix the rule"
        )
    for name, grad in zip(node.inputs, grads, strict=True):
        if grad is None or name not in wanted:
            continue
        if g.tensors[grad].meta != g.tensors[name].meta:
            raise GraphError(
                f"gradient rule of {node.op_type!r} (op {node.name!r}) gives {name!r} {g.tensors[name].meta} "
                f"a gradient {grad!r} of {g.tensors[grad].meta}; a gradient has its tensor's shape and dtype"
            )
        acc.add(at, name, grad)


def _first_use_stage(ops: list[OpNode], params: list[str]) -> dict[str, int]:
    """The stage of each parameter's first reader: where its gradient is complete last under 1F1B."""
    stage: dict[str, int] = {}
    for node in ops:
        for i in node.inputs:
            stage.setdefault(i, node.stage)
    return {p: stage.get(p, 0) for p in params}


def _parameter_grad(at: GraphBuilder, acc: _Accumulator, param: str, scale: float, inv: str | None) -> str:
    if inv is not None:  # dynamic loss scaling: times 1 / the scale variable
        return loss_scaling.unscale(at, acc.total[param], inv, GRAD + param)
    if scale == 1.0:
        grad = acc.final(param, TensorKind.gradient)
        assert grad is not None  # every trainable parameter is on a path: checked before the walk
        if grad != GRAD + param:  # the sum is held elsewhere too (a pass-through rule): copy it out
            (grad,) = at.emit("identity", (grad,), {}, name=GRAD + param, kind=TensorKind.gradient)
        return grad
    scaled = acc.total[param]
    (grad,) = at.emit(
        "mul_scalar", (scaled,), {"value": 1.0 / scale}, name=GRAD + param, kind=TensorKind.gradient
    )
    return grad


def _eliminate_dead(g: Graph, builder: GraphBuilder, roots: set[str]) -> None:
    """Drop emitted ops none of whose outputs lead to a root (e.g. the gradient of an input batch)."""
    emitted = set(builder.emitted)
    live = set(roots)
    keep: list[OpNode] = []
    for node in reversed(g.ops):
        if node.name in emitted and not any(o in live for o in node.outputs):
            for o in node.outputs:
                del g.tensors[o]
            continue
        live.update(node.inputs)
        keep.append(node)
    g.ops[:] = reversed(keep)
