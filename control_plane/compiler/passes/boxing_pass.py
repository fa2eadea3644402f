"""Boxing insertion: a BOXING node wherever a tensor's layout differs from what its reader needs.

``run(state)`` reads the signatures that sbp_inference chose (``state.choices``) and, for each op:

* **inputs**: where the producer's (placement, nd-SBP) differs from the op's placement and the SBP its
  signature asks for, the op reads ``<tensor>.to_<sbp>`` instead, made by one boxing node (``<tensor>.to_<sbp>.box``) inserted just
  before the first op that needs it. Every later reader that needs the same (placement, SBP) reuses it.
  Different placements (pipeline stages, 2 ranks -> 4) get the point-to-point plan of ``plan_boxing``.
* **outputs**: where the signature produces an SBP other than the tensor's own (an annotated
  activation, a fetched loss made ``B``, an optimizer's new value that must match its variable), the op
  writes ``<tensor>.from_<sbp>`` and a boxing node right after it turns that into the tensor. The
  tensor keeps its name, so fetches, ``state.updates`` and ``state.grads`` still point at it.

Each boxing node has one input and one output of the same meta, the placement and stage of the op it
serves, ``attrs={"plan": repr(plan)}``, and its plan in ``state.boxings[node.name]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sbpflow.boxing import BoxingPlan, plan_boxing
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.placement import Placement
from sbpflow.sbp import NdSbp, PartialSum, Split


def slug(nd: NdSbp) -> str:
    """``(S(0), B)`` -> ``S0_B``: an SBP as a name suffix."""
    return "_".join(
        f"S{s.axis}" if isinstance(s, Split) else ("P" if isinstance(s, PartialSum) else "B") for s in nd
    )


def boxing_node(
    state: CompileState, src: str, dst: TensorDecl, by: OpNode, checkpoint: bool = False
) -> OpNode:
    """A boxing node turning tensor ``src`` into the declared ``dst`` for the reader ``by`` (its stage and
    scope), with its plan recorded in ``state.boxings``; the caller places it in the op list."""
    s = state.graph.tensors[src]
    assert s.placement is not None and s.sbp is not None and dst.placement is not None and dst.sbp
    plan = plan_boxing(s.meta, s.placement, s.sbp, dst.placement, dst.sbp)
    node = OpNode(
        f"{dst.name}.box",
        BOXING,
        (src,),
        (dst.name,),
        {"plan": repr(plan)},
        dst.placement,
        by.stage,
        checkpoint,
        by.scope,
    )
    state.boxings[node.name] = plan
    return node


@dataclass
class _Inserter:
    state: CompileState
    ops: list[OpNode] = field(default_factory=list)
    made: dict[tuple[str, Placement, NdSbp], str] = field(default_factory=dict)  # reuse per target

    @property
    def graph(self) -> Graph:
        return self.state.graph

    def _fresh(self, base: str) -> str:
        name, n = base, 1
        while name in self.graph.tensors:
            n += 1
            name = f"{base}.{n}"
        return name

    def _box(self, src: str, dst: TensorDecl, by: OpNode) -> None:
        self.ops.append(boxing_node(self.state, src, dst, by, checkpoint=False))

    def read(self, t: str, pl: Placement, want: NdSbp, by: OpNode) -> str:
        """The name ``by`` should read for ``t`` laid out as (pl, want); adds the boxing if needed."""
        decl = self.graph.tensors[t]
        if decl.placement == pl and decl.sbp == want:
            return t
        key = (t, pl, want)
        if key not in self.made:
            suffix = slug(want) if decl.placement == pl else f"{slug(want)}_on_{pl.ranks[0]}"
            out = TensorDecl(self._fresh(f"{t}.to_{suffix}"), decl.meta, _produced(decl.kind), pl, want)
            self.graph.add_tensor(out)
            self._box(t, out, by)
            self.made[key] = out.name
        return self.made[key]

    def visit(self, node: OpNode) -> None:
        if node.op_type == BOXING:
            self.ops.append(node)
            return
        choice = self.state.choices.get(node.name)
        if choice is None or node.placement is None:
            raise GraphError(
                f"op {node.name!r} ({node.op_type}) has no chosen signature; run sbp_inference first"
            )
        pl, sig = node.placement, choice.signature
        inputs = tuple(self.read(t, pl, want, node) for t, want in zip(node.inputs, sig.ins, strict=True))
        outputs, after = [], []
        for o, have in zip(node.outputs, sig.outs, strict=True):
            decl = self.graph.tensors[o]
            if decl.placement == pl and decl.sbp == have:
                outputs.append(o)
                continue
            raw = TensorDecl(self._fresh(f"{o}.from_{slug(have)}"), decl.meta, decl.kind, pl, have)
            self.graph.add_tensor(raw)
            outputs.append(raw.name)
            after.append((raw.name, decl))
        self.ops.append(replace(node, inputs=inputs, outputs=tuple(outputs)))
        for raw_name, decl in after:
            self._box(raw_name, decl, node)


def _produced(kind: TensorKind) -> TensorKind:
    """A boxed copy is made by an op: a parameter's copy is an activation, a gradient's stays a gradient."""
    return kind if kind is TensorKind.gradient else TensorKind.activation


def run(state: CompileState) -> None:
    ins = _Inserter(state)
    for node in state.graph.ops:
        ins.visit(node)
    state.graph.ops = ins.ops


def total_bytes(state: CompileState) -> int:
    """Bytes all inserted boxing moves per step (the sum of the plans' byte counts)."""
    return sum(p.bytes for p in state.boxings.values())


def plans(state: CompileState) -> list[tuple[str, BoxingPlan]]:
    """The boxing nodes in graph order with their plans."""
    return [(o.name, state.boxings[o.name]) for o in state.graph.ops if o.op_type == BOXING]
