"""The plan as a graph of blocks: the model of the plan picture (``plan_picture``, ``plan_layout`` draw it).

A *block* is a module of the model as its scope names it, cut at the layer: ``model.blocks.0.attn``
holds every op under it (``.c_attn``, ``.c_proj``, ...), ``model.wte`` is one, and an optimizer op goes
with its parameter's block. Each phase (forward, backward, optimizer) is a band of its own; a boxing is a
node of its own labelled with its collective and the bytes it moves per step, and an edge carries the SBP
of the tensor on it (or how many tensors it stands for). Edges between bands are marked ``cross``: the
pictures leave them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sbpflow.boxing import BoxingPlan
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, OpNode
from sbpflow.sbp import format_nd

PHASES = ("forward", "backward", "optimizer")
PHASE_PREFIX = {"grad/": "backward", "optimizer/": "optimizer"}  # op-name prefixes the passes give
PHASE_FILL = {"forward": "#cfe2f3", "backward": "#d9ead3", "optimizer": "#fff2cc"}
BOXING_FILL, BOXING_STROKE = "#f4cccc", "#cc0000"


@dataclass
class Node:
    key: str
    phase: str
    label: str
    ops: list[OpNode] = field(default_factory=list)
    boxing: bool = False


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    label: str
    cross: bool  # between two bands (drawn light, does not shape the layout)


def boxing_label(plan: BoxingPlan | None) -> str:
    """A boxing node's words: its collectives and the bytes it moves per step."""
    if plan is None:
        return "boxing"
    kinds = " + ".join(dict.fromkeys(s.collective.value for s in plan.steps)) or "identity"
    return f"{kinds}, {plan.bytes} B"


def phase_of(op: OpNode) -> str:
    return next((ph for prefix, ph in PHASE_PREFIX.items() if op.name.startswith(prefix)), "forward")


def block_of(op: OpNode) -> str | None:
    """The block an op belongs to: its scope cut after the layer index (``model.blocks.0``), else after
    two names (``model.wte``); an optimizer op goes with its parameter's block. None for an op at the
    top of the model (the loss, say), which is a node of its own."""
    scope = op.scope
    if not scope and op.name.startswith("optimizer/"):  # optimizer/<parameter>/...: the parameter's block
        param = op.name.split("/")[1]
        if "." not in param:
            return param  # global_norm, clip_coef: the optimizer's own steps
        scope = param.rsplit(".", 1)[0]
    parts = scope.split(".") if scope else []
    index = next((i for i, p in enumerate(parts) if p.isdigit()), -1)
    if index >= 0:
        return ".".join(parts[: index + 1])
    return ".".join(parts[:2]) if len(parts) >= 2 else None


@dataclass
class BlockGraph:
    nodes: dict[str, Node]
    edges: list[Edge]


def block_graph(state: CompileState) -> BlockGraph:
    """The nodes (blocks per phase, and every boxing) and the edges between them."""
    g = state.graph
    nodes: dict[str, Node] = {}
    where: dict[str, str] = {}  # op name -> node key
    for op in g.ops:
        phase = phase_of(op)
        if op.op_type == BOXING:
            key = f"box:{op.name}"
            nodes[key] = Node(key, phase, boxing_label(state.boxings.get(op.name)), [op], boxing=True)
        else:
            block = block_of(op)
            key = f"{phase}:{op.name if block is None else block}"
            nodes.setdefault(key, Node(key, phase, op.op_type if block is None else block)).ops.append(op)
        where[op.name] = key
    producer = {o: where[op.name] for op in g.ops for o in op.outputs}
    carried: dict[tuple[str, str], list[str]] = {}
    for op in g.ops:
        for t in op.inputs:
            src, dst = producer.get(t), where[op.name]
            if src is not None and src != dst:
                carried.setdefault((src, dst), []).append(t)
    edges = []
    for (src, dst), tensors in carried.items():
        sbp = {format_nd(g.tensors[t].sbp) if g.tensors[t].sbp is not None else "?" for t in tensors}
        label = sbp.pop() if len(sbp) == 1 else f"{len(set(tensors))} tensors"
        edges.append(Edge(src, dst, label, nodes[src].phase != nodes[dst].phase))
    return BlockGraph(nodes, edges)


def anchor(i: int) -> str:
    return f"block-{i}"
