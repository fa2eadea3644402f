"""Mixed precision: the forward and backward in fp16 or bf16, fp32 master weights, loss scaling.

``run(state)`` (``JobConfig.precision`` fp16 or bf16) rewrites the forward op by op, as autocast does:
each op computes in the dtype its policy gives (the table below), a floating input of another dtype is
cast first (``cast`` ops named ``<tensor>.<dtype>``, one per tensor and dtype, emitted right before
their first reader), and the op's outputs are re-inferred (same names, new dtypes). Then it discards
the backward and the optimizer that the earlier passes built for the fp32 forward and runs ``autodiff``
and ``optimizer`` again on the new forward. Decisions:

* **Re-deriving the backward** rather than re-typing it: gradient rules read their forward's metas
  (a cast's gradient casts back to its input's dtype, a loss seed takes the loss's dtype), so the
  backward of the low-precision forward is exactly what the rules give for it. Each parameter's
  gradient comes out fp32 through the gradient of its cast (the "cast gradients back" step), and the
  optimizer then updates the fp32 variables in fp32; optimizer state is fp32.
* **Policy** (autocast's, with fp16 flowing): ``FP32_OPS`` — reductions over many terms and the ops whose
  range or accuracy fp16 cannot hold (softmax, log-softmax, cross-entropy, layer norm, exp, log, sum,
  mean) — compute in fp32, and their parameters (a layer norm's scale) are read in fp32 as they are. Any
  other op that reads a parameter or a low-precision tensor computes in low precision (a weight's matmul,
  then the bias add, the activation, the residual add, ... until the next fp32 op); the rest — glue on
  fp32 values such as a loss's division by a token count, which would overflow fp16 past 65504 — runs
  in the widest dtype of its inputs. A user's ``cast`` is left as written; integer and bool tensors
  (token ids, masks) are never cast.
* **Casts carry their reader's** stage, placement, scope and checkpoint flag: the fp16 copy of a weight in
  a checkpointed block is recomputed with the block rather than kept.
* **Loss scaling** is autodiff's and the optimizer pass's, which this pass runs again: with
  ``loss_scale > 0`` the loss gradient is seeded with the scale and each parameter's fp32 gradient is
  unscaled before clipping and the update. An fp16 job with ``loss_scale = 0`` scales dynamically, as
  torch.cuda.amp.GradScaler does (``JobConfig.loss_scaling``; :mod:`.loss_scaling`): the scale is
  replicated optimizer state, a step whose gradients hold an inf or NaN is skipped on every rank (no
  parameter or state moves) and backs the scale off, and clean steps grow it. bf16 has fp32's range and
  is not scaled.
* **Where the dtype exists.** bf16 runs on numpy with ml_dtypes' bfloat16 (``DType.to_numpy``), and on
  cupy where cupy has it (the same dtype); NCCL moves it as ``ncclBfloat16``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sbpflow.control_plane.compiler.passes import autodiff, optimizer
from sbpflow.control_plane.compiler.passes.recompute import forward_end
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.dtype import DType
from sbpflow.errors import GraphError, ShapeError
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.ops.base import get_op
from sbpflow.precision import FP32_OPS, KEEP_OPS, LOW  # the policy, declared once in the core


@dataclass
class _Caster:
    graph: Graph
    low: DType
    casts: dict[tuple[str, DType], str] = field(default_factory=dict)
    ops: list[OpNode] = field(default_factory=list)

    def read(self, t: str, dtype: DType, by: OpNode) -> str:
        """``t`` as ``dtype``: itself, or a cast emitted before ``by`` (reused by later readers)."""
        decl = self.graph.tensors[t]
        if not decl.meta.dtype.is_floating or decl.meta.dtype == dtype:
            return t
        key = (t, dtype)
        if key not in self.casts:
            name = f"{t}.{dtype.value}"
            if name in self.graph.tensors:
                raise GraphError(
                    f"mixed precision: the cast of {t!r} would be named {name!r}, which is taken"
                )
            meta = replace(decl.meta, dtype=dtype)
            self.graph.add_tensor(TensorDecl(name, meta, TensorKind.activation, decl.placement))
            self.ops.append(
                OpNode(
                    name,
                    "cast",
                    (t,),
                    (name,),
                    {"dtype": dtype},
                    by.placement,
                    by.stage,
                    by.checkpoint,
                    by.scope,
                )
            )
            self.casts[key] = name
        return self.casts[key]

    def dtype_of(self, node: OpNode) -> DType:
        """The dtype ``node`` computes in: see the policy in the module docstring."""
        if node.op_type in FP32_OPS:
            return DType.float32
        floats = [self.graph.tensors[t] for t in node.inputs]
        floats = [t for t in floats if t.meta.dtype.is_floating]
        if any(t.meta.dtype == self.low or t.kind == TensorKind.parameter for t in floats):
            return self.low
        return max((t.meta.dtype for t in floats), key=lambda d: d.itemsize, default=DType.float32)

    def visit(self, node: OpNode) -> None:
        if node.op_type in KEEP_OPS:
            self.ops.append(node)
            return
        dtype = self.dtype_of(node)
        ins = tuple(self.read(t, dtype, node) for t in node.inputs)
        op = get_op(node.op_type)
        try:
            metas = op.run_infer(
                tuple(self.graph.tensors[t].meta for t in ins), op.normalize_attrs(node.attrs)
            )
        except ShapeError as e:
            raise GraphError(
                f"mixed precision: op {node.name!r} ({node.op_type}) cannot run in {dtype}: {e}. Cast its "
                "inputs explicitly (sf cast) or add the op to sbpflow.precision.KEEP_OPS"
            ) from None
        for name, meta in zip(node.outputs, metas, strict=True):
            self.graph.set_tensor(replace(self.graph.tensors[name], meta=meta))
        self.ops.append(replace(node, inputs=ins))


def run(state: CompileState) -> None:
    low = LOW.get(state.job.config.precision)
    if low is None:
        return
    g = state.graph
    end = forward_end(g)
    _drop(state, g.ops[end:])
    caster = _Caster(g, low)
    for node in g.ops[:end]:
        caster.visit(node)
    g.ops = caster.ops
    autodiff.run(state)
    optimizer.run(state)


def _drop(state: CompileState, ops: list[OpNode]) -> None:
    """Forget the backward and the optimizer of the fp32 forward: their ops, tensors and the state's maps."""
    g = state.graph
    for node in ops:
        for o in node.outputs:
            del g.tensors[o]
    for name in state.state_vars:
        del g.tensors[name]
    del g.ops[len(g.ops) - len(ops) :]
    state.grads.clear()
    state.updates.clear()
    state.state_vars.clear()
