"""The plan picture without Graphviz: the same block nodes, laid out here, and each block's table of ops.

Each phase is a column band; inside it a node sits one row below the lowest of its producers in the
same band, and each row is ordered by the mean column of its neighbours (three barycenter sweeps) so
that edges cross less. Edges between bands are left out (the block tables list what comes in).
"""

from __future__ import annotations

import html

from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.render.plan_blocks import (
    BOXING_FILL,
    BOXING_STROKE,
    PHASE_FILL,
    PHASES,
    BlockGraph,
    Node,
    anchor,
)
from sbpflow.sbp import format_nd

BOX_W, BOX_H, COL_W, ROW_H, MARGIN, BAND_GAP = 170, 34, 186, 58, 20, 30


def _levels(bg: BlockGraph, members: list[str]) -> dict[str, int]:
    inside = set(members)
    parents: dict[str, list[str]] = {k: [] for k in members}
    for e in bg.edges:
        if e.src in inside and e.dst in inside:
            parents[e.dst].append(e.src)
    level: dict[str, int] = {}

    def depth(k: str, seen: frozenset[str] = frozenset()) -> int:
        if k not in level:
            level[k] = 1 + max((depth(p, seen | {k}) for p in parents[k] if p not in seen), default=-1)
        return level[k]

    for k in members:
        depth(k)
    return level


def _order(rows: dict[int, list[str]], bg: BlockGraph) -> None:
    near: dict[str, list[str]] = {}
    for e in bg.edges:
        near.setdefault(e.dst, []).append(e.src)
        near.setdefault(e.src, []).append(e.dst)
    for _ in range(3):
        col = {k: i for r in rows.values() for i, k in enumerate(r)}
        for lvl in sorted(rows):
            row = rows[lvl]

            def key(k: str, col: dict[str, int] = col) -> float:
                ns = [col[n] for n in near.get(k, []) if n in col]
                return sum(ns) / len(ns) if ns else col[k]

            rows[lvl] = sorted(row, key=key)
            col.update({k: i for i, k in enumerate(rows[lvl])})


def overview_svg(bg: BlockGraph) -> str:
    """The overview as an SVG element: a column band per phase, a linked box per node."""
    ids = {k: i for i, k in enumerate(bg.nodes)}
    pos: dict[str, tuple[float, float]] = {}
    bands, x = [], float(MARGIN)
    for phase in PHASES:
        members = [k for k, n in bg.nodes.items() if n.phase == phase]
        if not members:
            continue
        rows: dict[int, list[str]] = {}
        for k, lvl in _levels(bg, members).items():
            rows.setdefault(lvl, []).append(k)
        _order(rows, bg)
        width = max(len(r) for r in rows.values()) * COL_W
        for lvl, row in rows.items():
            for c, k in enumerate(row):
                pos[k] = (x + c * COL_W, MARGIN + 20 + lvl * ROW_H)
        bands.append((phase, x, width, len(rows)))
        x += width + BAND_GAP
    height = MARGIN * 2 + 20 + max((b[3] for b in bands), default=1) * ROW_H
    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{x}" height="{height}" font-family="sans-serif" font-size="10">'
    ]
    for phase, bx, width, _ in bands:
        out.append(
            f'<rect x="{bx - 6}" y="{MARGIN - 6}" width="{width}" height="{height - MARGIN}" fill="none" '
            f'stroke="#bbb"/><text x="{bx}" y="{MARGIN + 8}" font-size="12">{phase}</text>'
        )
    for e in bg.edges:
        if e.cross:
            continue
        (ax, ay), (bx2, by) = pos[e.src], pos[e.dst]
        out.append(
            f'<line x1="{ax + BOX_W / 2}" y1="{ay + BOX_H}" x2="{bx2 + BOX_W / 2}" y2="{by}" stroke="#999">'
            f"<title>{esc(e.label)}</title></line>"
        )
    for k, n in bg.nodes.items():
        px, py = pos[k]
        fill, stroke = (BOXING_FILL, BOXING_STROKE) if n.boxing else (PHASE_FILL[n.phase], "#555")
        label = n.label if n.boxing else f"{n.label} ({len(n.ops)})"
        out.append(
            f'<a href="#{anchor(ids[k])}"><g><title>{esc(label)}</title><rect x="{px}" y="{py}" width="{BOX_W}" '
            f'height="{BOX_H}" rx="4" fill="{fill}" stroke="{stroke}"/><text x="{px + BOX_W / 2}" '
            f'y="{py + BOX_H / 2 + 4}" text-anchor="middle">{esc(label[-30:])}</text></g></a>'
        )
    out.append("</svg>")
    return "".join(out)


def ops_table(state: CompileState, n: Node) -> str:
    """A block's ops: name, type, and each input and output with its SBP and shape."""
    g, esc = state.graph, html.escape

    def tensor(t: str) -> str:
        d = g.tensors[t]
        sbp = "?" if d.sbp is None else format_nd(d.sbp)
        return f"{esc(t)} <b>{esc(sbp)}</b> {esc(str(list(d.meta.shape)))}"

    rows = "".join(
        f"<tr><td>{esc(op.name)}</td><td>{esc(op.op_type)}</td>"
        f"<td>{'<br>'.join(tensor(t) for t in op.inputs)}</td>"
        f"<td>{'<br>'.join(tensor(t) for t in op.outputs)}</td></tr>"
        for op in n.ops
    )
    return f"<table><tr><th>op</th><th>type</th><th>inputs</th><th>outputs</th></tr>{rows}</table>"
