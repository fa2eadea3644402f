"""Reverse-mode autodiff on whole arrays, for the one-device reference (sbpflow/oracle/reference.py).

A :class:`Tape` runs ops eagerly (:class:`~sbpflow.ops.eager.EagerBuilder`) and keeps every value and
every op it ran. :func:`backward` then walks the tape from the loss back, calling each op's gradient
rule eagerly on the kept values, and returns the gradients of the requested sources. It shares the
op library's gradient rules with the compiler and nothing else: which tensors take a gradient, how
contributions are summed and what is an error are decided here, independently of the compiler's pass.

* Only floating tensors that depend on a source and that the loss depends on take a gradient; an
  op none of whose outputs is one is skipped, and a rule's gradient for any other input is dropped.
* A tensor read several times gets the sum of the contributions, added in the order they arrive
  (``(d1 + d2) + d3``, latest reader first).
* Random ops' rules redraw their forward's numbers: the backward runs with the forward's builder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sbpflow.dtype import as_dtype
from sbpflow.errors import GraphError, ShapeError
from sbpflow.ops.base import AttrValue, GradContext, NoGrad, get_op
from sbpflow.ops.eager import EagerBuilder, meta_of

Arrays = dict[str, Any]


@dataclass(frozen=True)
class Applied:
    """One op as the tape ran it: ``outputs = op_type(*inputs, **attrs)``, values named as on the tape."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, AttrValue]


@dataclass
class Tape:
    """Values by name, and the ops that made them, in the order they ran."""

    builder: EagerBuilder
    values: Arrays
    ops: list[Applied] = field(default_factory=list)

    def apply(
        self,
        name: str,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[str],
        attrs: Mapping[str, AttrValue],
    ) -> None:
        try:
            outs = self.builder.call(op_type, *(self.values[i] for i in inputs), **attrs)
        except ShapeError as e:
            raise ShapeError(f"op {name!r} ({op_type}): {e}") from None
        self.values.update(zip(outputs, outs, strict=True))
        self.ops.append(Applied(name, op_type, tuple(inputs), tuple(outputs), attrs))


def backward(tape: Tape, loss: str, sources: Sequence[str], seed: float = 1.0) -> Arrays:
    """d ``loss`` / d each source, the loss's own gradient seeded with ``seed`` (a loss scale, or 1)."""
    y = tape.values[loss]
    if y.size != 1 or not as_dtype(y.dtype).is_floating:
        raise GraphError(
            f"loss {loss!r} is {meta_of(y)}; autodiff needs a floating scalar: reduce it with mean() or sum()"
        )
    if not any(loss in op.outputs for op in tape.ops):
        raise GraphError(f"loss {loss!r} is not computed by any op; the loss must be an op's output")
    wanted = _taking_gradients(tape, set(sources), loss)
    missing = [s for s in sources if s not in wanted]
    if missing:
        raise GraphError(
            f"trainable parameter(s) {missing} do not affect the loss {loss!r} (no differentiable path "
            "leads from them to it); use them in the model, or exclude them from training "
            "(requires_grad=False, or leave them out of the optimizer)"
        )
    grads: Arrays = {loss: tape.builder.xp.full(y.shape, seed, dtype=y.dtype)}
    for op in reversed(tape.ops):
        if wanted.isdisjoint(op.outputs):
            continue
        # a tensor's gradient is complete once the walk reaches its producer: every reader came later
        dys = tuple(grads.pop(o, None) for o in op.outputs)
        if all(d is None for d in dys):
            continue  # its outputs lead to the loss, but no reader passed a gradient back
        for name, dx in zip(op.inputs, _input_gradients(tape, op, dys), strict=True):
            if dx is None or name not in wanted:
                continue
            _check_like(op, name, dx, tape.values[name])
            grads[name] = grads[name] + dx if name in grads else dx
    return {s: grads[s] for s in sources}


def _taking_gradients(tape: Tape, sources: set[str], loss: str) -> set[str]:
    """Floating values that depend on a source and that the loss depends on (sources included)."""
    reached = set(sources)
    for op in tape.ops:
        if not reached.isdisjoint(op.inputs):
            reached.update(o for o in op.outputs if as_dtype(tape.values[o].dtype).is_floating)
    feeds_loss = {loss}
    for op in reversed(tape.ops):
        if not feeds_loss.isdisjoint(op.outputs):
            feeds_loss.update(op.inputs)
    return reached & feeds_loss


def _input_gradients(tape: Tape, op: Applied, dys: tuple[Any, ...]) -> list[Any]:
    """The op's gradient rule, run eagerly on the values the forward kept."""
    opdef = get_op(op.op_type)
    if isinstance(opdef.grad, NoGrad):
        raise GraphError(
            f"op {op.name!r} ({op.op_type}) takes no gradient ({opdef.grad.reason}), but it lies between "
            f"trainable parameters and the loss (its outputs {list(op.outputs)} feed the loss); detach "
            "its input or replace it by a differentiable op"
        )
    ins = tuple(tape.values[i] for i in op.inputs)
    outs = tuple(tape.values[o] for o in op.outputs)
    ctx = GradContext(
        tape.builder,
        ins,
        outs,
        dys,
        tuple(map(meta_of, ins)),
        tuple(map(meta_of, outs)),
        opdef.normalize_attrs(op.attrs),
    )
    grads = list(opdef.grad(ctx))
    if len(grads) != len(ins):
        raise GraphError(
            f"gradient rule of {op.op_type!r} returned {len(grads)} gradients for the {len(ins)} inputs "
            f"of op {op.name!r}; fix the rule"
        )
    return grads


def _check_like(op: Applied, name: str, grad: Any, value: Any) -> None:
    if meta_of(grad) != meta_of(value):
        raise GraphError(
            f"gradient rule of {op.op_type!r} (op {op.name!r}) gives {name!r} {meta_of(value)} a gradient "
            f"of {meta_of(grad)}; a gradient has its tensor's shape and dtype"
        )
