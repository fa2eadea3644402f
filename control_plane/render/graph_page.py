"""Pictures of a compiled logical graph: a self-contained HTML page and Graphviz dot text of every op.

The page shows the block picture of ``plan_picture.py`` (a node per block, a band per phase, laid out by
Graphviz when it is installed), then the boxing table and the memory per device. It needs nothing from
the network and runs no script (a block opens through CSS ``:target``), so it opens offline and can be
attached to a report.

:func:`svg` and :func:`dot` draw every op, for a small graph or a tool: ops are boxes filled by
placement, with their pipeline stage; data inputs and variables are rounded boxes; every edge is
labelled with the SBP of the tensor it carries; boxing nodes are red with their collectives and bytes.
Their layout is layered: an op sits one row below the lowest of its producers; a variable or input sits
just above its first consumer.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass

from sbpflow.boxing import BoxingPlan
from sbpflow.control_plane.compiler.memory import DeviceMemory
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.render import plan_picture
from sbpflow.control_plane.render.plan_blocks import boxing_label
from sbpflow.graph import BOXING, Graph, OpNode
from sbpflow.placement import Placement
from sbpflow.sbp import format_nd

PALETTE = ("#cfe2f3", "#d9ead3", "#fff2cc", "#ead1dc", "#d0e0e3", "#fce5cd", "#d9d2e9", "#e6e6e6")
BOXING_FILL, BOXING_STROKE, SOURCE_FILL = "#f4cccc", "#cc0000", "#ffffff"
BOX_W, BOX_H, COL_W, ROW_H, MARGIN = 190, 34, 210, 72, 24


@dataclass(frozen=True)
class _Node:
    key: str  # op name, or "tensor:<name>" for a source tensor
    label: str
    detail: str
    fill: str
    stroke: str
    level: int
    boxing: bool = False
    source: bool = False


def _short(text: str, n: int = 28) -> str:
    return text if len(text) <= n else "…" + text[-(n - 1) :]


def _where(p: Placement | None) -> str:
    return "?" if p is None else f"{p.device_type}:{','.join(map(str, p.ranks))}"


class _Layout:
    def __init__(self, state: CompileState) -> None:
        g = state.graph
        self.g = g
        self.colors: dict[str, str] = {}
        producer = {o: op.name for op in g.ops for o in op.outputs}
        level: dict[str, int] = {}
        for op in g.ops:
            level[op.name] = 1 + max((level[producer[i]] for i in op.inputs if i in producer), default=0)
        self.nodes: dict[str, _Node] = {}
        for op in g.ops:
            self.nodes[op.name] = self._op_node(op, level[op.name], state.boxings.get(op.name))
        first_use: dict[str, int] = {}
        for op in g.ops:
            for i in op.inputs:
                if i not in producer:
                    first_use[i] = min(first_use.get(i, level[op.name]), level[op.name])
        for name, lvl in first_use.items():
            t = g.tensors[name]
            self.nodes[f"tensor:{name}"] = _Node(
                f"tensor:{name}",
                _short(name),
                f"{t!r} [{t.kind.value}]",
                SOURCE_FILL,
                "#888888",
                lvl - 1,
                source=True,
            )
        # edges: (from node, to node, tensor)
        self.edges = [(producer.get(i, f"tensor:{i}"), op.name, i) for op in g.ops for i in op.inputs]
        rows: dict[int, list[str]] = {}
        for key, n in self.nodes.items():
            rows.setdefault(n.level, []).append(key)
        _untangle(rows, self.edges)
        self.pos = {
            key: (MARGIN + col * COL_W, MARGIN + row * ROW_H)
            for row, lvl in enumerate(sorted(rows))
            for col, key in enumerate(rows[lvl])
        }
        self.width = MARGIN * 2 + max((len(r) for r in rows.values()), default=1) * COL_W
        self.height = MARGIN * 2 + len(rows) * ROW_H

    def _color(self, p: Placement | None) -> str:
        return self.colors.setdefault(_where(p), PALETTE[len(self.colors) % len(PALETTE)])

    def _op_node(self, op: OpNode, level: int, plan: BoxingPlan | None) -> _Node:
        where = op.placement or self.g.tensors[op.outputs[0]].placement
        if op.op_type == BOXING:
            detail = f"{op.name}: {plan!r}" if plan is not None else op.name
            return _Node(op.name, boxing_label(plan), detail, BOXING_FILL, BOXING_STROKE, level, boxing=True)
        stage = f" · s{op.stage}" if op.stage else ""
        label = f"{op.op_type}{stage}"
        detail = f"{op.name} on {where} stage {op.stage}\n{op!r}"
        return _Node(op.name, label, detail, self._color(where), "#555555", level)


def _untangle(rows: dict[int, list[str]], edges: list[tuple[str, str, str]]) -> None:
    """Order each row by the mean column of its neighbours (barycenter sweeps down, up, down): fewer crossings."""
    parents: dict[str, list[str]] = {}
    children: dict[str, list[str]] = {}
    for a, b, _ in edges:
        parents.setdefault(b, []).append(a)
        children.setdefault(a, []).append(b)
    levels = sorted(rows)
    for order, nbrs in ((levels, parents), (levels[::-1], children), (levels, parents)):
        col = {k: i for r in rows.values() for i, k in enumerate(r)}
        for lvl in order:
            row = rows[lvl]

            def key(k: str, nbrs: dict[str, list[str]] = nbrs, col: dict[str, int] = col) -> float:
                near = nbrs.get(k, [])
                return sum(col[n] for n in near) / len(near) if near else col[k]

            rows[lvl] = sorted(row, key=key)
            col.update({k: i for i, k in enumerate(rows[lvl])})


def svg(state: CompileState) -> str:
    """The logical graph as an SVG element."""
    lay = _Layout(state)
    g, esc = state.graph, html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{lay.width}" height="{lay.height}" font-family="sans-serif" font-size="11">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" orient="auto">'
        '<path d="M0,0 L10,5 L0,10 z" fill="#777"/></marker></defs>',
    ]
    for a, b, tensor in lay.edges:
        (ax, ay), (bx, y2) = lay.pos[a], lay.pos[b]
        x1, y1, x2 = ax + BOX_W / 2, ay + BOX_H, bx + BOX_W / 2
        t = g.tensors[tensor]
        sbp = "?" if t.sbp is None else format_nd(t.sbp)
        out.append(
            f'<g><title>{esc(repr(t))}</title><line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#999" '
            f'marker-end="url(#arrow)"/><text x="{(x1 + x2) / 2 + 3}" y="{(y1 + y2) / 2 + 4}" fill="#224" '
            f'style="paint-order:stroke;stroke:#fff;stroke-width:3px">{esc(sbp)}</text></g>'
        )
    for key, n in lay.nodes.items():
        x, y = lay.pos[key]
        rx = 12 if n.source else 3
        width = 2.5 if n.boxing else 1
        weight = ' font-weight="bold"' if n.boxing else ""
        out.append(
            f'<g><title>{esc(n.detail)}</title><rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="{rx}" '
            f'fill="{n.fill}" stroke="{n.stroke}" stroke-width="{width}"/>'
            f'<text x="{x + BOX_W / 2}" y="{y + BOX_H / 2 + 4}" text-anchor="middle"{weight}>{esc(n.label)}</text></g>'
        )
    out.append("</svg>")
    return "\n".join(out)


# a constant, so that a Content-Security-Policy can allow exactly this style by its hash
PAGE_STYLE = (
    "body{font-family:sans-serif;margin:16px} table{border-collapse:collapse;margin:8px 0}"
    "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:12px}"
)


def html_page(
    state: CompileState,
    memory: Mapping[int, DeviceMemory] | None = None,
    notes: tuple[str, ...] | list[str] = (),
    title: str = "",
) -> str:
    """A self-contained page: the block picture (``plan_picture``), the boxing table and the memory."""
    esc = html.escape
    title = title or f"sbpflow plan: {state.job.name}"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
        f"<style>{PAGE_STYLE}</style></head><body><h2>{esc(title)}</h2>",
        f"<p>{len(state.graph.ops)} ops, {len(state.boxings)} boxing nodes moving "
        f"{sum(p.bytes for p in state.boxings.values())} B per step.</p>",
        *(f"<p><em>{esc(n)}</em></p>" for n in notes),
        plan_picture.picture(state),
        _boxing_table(state),
        _memory_table(memory or {}),
        "</body></html>",
    ]
    return "\n".join(parts)


def _boxing_table(state: CompileState) -> str:
    esc = html.escape
    rows = []
    for op in state.graph.ops:
        if op.op_type == BOXING:
            plan = state.boxings.get(op.name)
            t = state.graph.tensors[op.inputs[0]]
            steps = "<br>".join(esc(repr(s)) for s in plan.steps) if plan else ""
            rows.append(
                f"<tr><td>{esc(op.name)}</td><td>{esc(str(t.meta))}</td><td>{steps}</td>"
                f"<td>{plan.bytes if plan else '?'}</td></tr>"
            )
    if not rows:
        return "<h3>Boxing</h3><p>none</p>"
    head = "<tr><th>boxing</th><th>tensor</th><th>steps</th><th>bytes</th></tr>"
    return f"<h3>Boxing</h3><table>{head}{''.join(rows)}</table>"


def _memory_table(memory: Mapping[int, DeviceMemory]) -> str:
    if not memory:
        return ""
    head = "<tr><th>rank</th><th>parameters</th><th>gradients</th><th>optimizer state</th><th>peak activations</th><th>total</th></tr>"
    rows = "".join(
        f"<tr><td>{r}</td><td>{m.parameters}</td><td>{m.gradients}</td><td>{m.optimizer_state}</td>"
        f"<td>{m.peak_activations}</td><td>{m.total}</td></tr>"
        for r, m in memory.items()
    )
    return f"<h3>Memory per device (bytes)</h3><table>{head}{rows}</table>"


def dot(state: CompileState) -> str:
    """Graphviz dot text of the same picture (render with ``dot -Tsvg``)."""
    lay = _Layout(state)
    g: Graph = state.graph

    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ["digraph plan {", "  rankdir=TB; node [shape=box, style=filled, fontname=sans];"]
    for key, n in lay.nodes.items():
        style = ', style="filled,rounded"' if n.source else (", penwidth=2.5" if n.boxing else "")
        lines.append(
            f"  {q(key)} [label={q(n.label)}, fillcolor={q(n.fill)}, color={q(n.stroke)}, tooltip={q(n.detail)}{style}];"
        )
    for a, b, tensor in lay.edges:
        t = g.tensors[tensor]
        lines.append(f"  {q(a)} -> {q(b)} [label={q('?' if t.sbp is None else format_nd(t.sbp))}];")
    lines.append("}")
    return "\n".join(lines)
