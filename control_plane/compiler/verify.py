"""The SBP-level verifier of a compiled graph: run after boxing_pass (tests run it after every config).

``verify_compiled(state)`` checks, beyond ``Graph.verify``:

* every tensor has a placement and an nd-SBP;
* every op other than a boxing node runs on a placement, reads and writes tensors on that placement,
  and their nd-SBPs form one of ``op.nd_signatures(...)`` on its mesh (so no mismatch is left unboxed);
* every boxing node has a plan in ``state.boxings`` equal to ``plan_boxing`` of its endpoints, and its
  ``plan`` attribute prints that plan; every recorded plan belongs to a node, so the bytes the boxing
  nodes move add up to what ``state.boxings`` records.

It raises ``GraphError`` at the first bad node, naming it, its tensors and their SBPs.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from sbpflow.boxing import plan_boxing
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import BOXING, Graph, OpNode
from sbpflow.ops.base import AttrValue, NdSignature, get_op
from sbpflow.sbp import format_nd
from sbpflow.tensor_meta import TensorMeta


def verify_compiled(state: CompileState) -> None:
    g = state.graph
    g.verify()
    for t in g.tensors.values():
        if t.placement is None or t.sbp is None:
            raise GraphError(
                f"tensor {t.name!r} {t.meta} has no {'placement' if t.placement is None else 'SBP'}"
            )
    boxed = 0
    for node in g.ops:
        if node.op_type == BOXING:
            boxed += _check_boxing(state, node)
        else:
            _check_op(g, node)
    extra = sorted(set(state.boxings) - {o.name for o in g.ops if o.op_type == BOXING})
    if extra:
        raise GraphError(
            f"state.boxings records plan(s) for {extra}, which are not boxing nodes of the graph"
        )
    recorded = sum(p.bytes for p in state.boxings.values())
    if boxed != recorded:
        raise GraphError(f"the boxing nodes move {boxed} B but state.boxings records {recorded} B")


def _describe(g: Graph, names: tuple[str, ...]) -> str:
    parts = []
    for n in names:
        t = g.tensors[n]
        parts.append(f"{n}: {t.meta} {format_nd(t.sbp) if t.sbp else '?'}")
    return ", ".join(parts)


def _check_op(g: Graph, node: OpNode) -> None:
    pl = node.placement
    if pl is None:
        raise GraphError(f"op {node.name!r} ({node.op_type}) has no placement; run sbp_inference")
    for t in (*node.inputs, *node.outputs):
        if g.tensors[t].placement != pl:
            raise GraphError(
                f"op {node.name!r} ({node.op_type}) runs on {pl} but tensor {t!r} lies on "
                f"{g.tensors[t].placement}; a point-to-point boxing is missing"
            )
    metas = tuple(g.tensors[t].meta for t in node.inputs)
    have = NdSignature(
        tuple(g.tensors[t].sbp or () for t in node.inputs),
        tuple(g.tensors[t].sbp or () for t in node.outputs),
    )
    if have not in _valid(
        node.op_type, _attrs(get_op(node.op_type).normalize_attrs(node.attrs)), metas, pl.shape
    ):
        raise GraphError(
            f"op {node.name!r} ({node.op_type}) reads and writes {have!r} ({_describe(g, node.inputs)} -> "
            f"{_describe(g, node.outputs)}), which is not a signature of {node.op_type} on the {pl.shape} mesh; "
            "a boxing is missing or the chosen signature is invalid"
        )


Attrs = tuple[tuple[str, str, AttrValue], ...]


def _attrs(attrs: Mapping[str, AttrValue]) -> Attrs:
    return tuple((k, type(v).__name__, v) for k, v in sorted(attrs.items()))


@lru_cache(maxsize=1 << 14)
def _valid(
    op_type: str, attrs: Attrs, metas: tuple[TensorMeta, ...], mesh: tuple[int, ...]
) -> frozenset[NdSignature]:
    """The op's valid signatures, cached: the layers of a deep model repeat the same calls."""
    return frozenset(get_op(op_type).nd_signatures(metas, {k: v for k, _, v in attrs}, mesh))


def _check_boxing(state: CompileState, node: OpNode) -> int:
    g = state.graph
    plan = state.boxings.get(node.name)
    if plan is None:
        raise GraphError(f"boxing node {node.name!r} has no plan in state.boxings")
    src, dst = g.tensors[node.inputs[0]], g.tensors[node.outputs[0]]
    assert src.placement and src.sbp and dst.placement and dst.sbp  # checked for every tensor above
    want = plan_boxing(src.meta, src.placement, src.sbp, dst.placement, dst.sbp)
    if plan != want:
        raise GraphError(
            f"boxing node {node.name!r} records plan {plan!r}, but its endpoints {_describe(g, node.inputs)} -> "
            f"{_describe(g, node.outputs)} need {want!r}"
        )
    if node.attrs.get("plan") != repr(plan):
        raise GraphError(f"boxing node {node.name!r} prints plan {node.attrs.get('plan')!r}, not {plan!r}")
    if node.placement != dst.placement:
        raise GraphError(
            f"boxing node {node.name!r} runs on {node.placement}, not on its output's {dst.placement}"
        )
    return plan.bytes
