"""The plan as a picture a person can read: one node per block, forward, backward and optimizer in bands.

The blocks and their edges are ``plan_blocks.py``'s. Each phase is a band of its own (Graphviz clusters
side by side), a boxing is a red node labelled with its collective and the bytes it moves per step, and
an edge carries the SBP of the tensor on it (or how many tensors it stands for); edges between bands are
left out (they would cross the picture; a block's table lists what comes in). Clicking a block opens its ops below the
picture: their own layered picture with every SBP, and a table (CSS ``:target``, no script).

The layout is Graphviz's ``dot`` when it is on the PATH (Debian's ``graphviz``); without it a built-in
layered layout draws the same nodes and bands (``plan_layout.py``), so a picture never needs it.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess

from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.render import plan_layout
from sbpflow.control_plane.render.plan_blocks import (
    BOXING_FILL,
    BOXING_STROKE,
    PHASE_FILL,
    PHASES,
    BlockGraph,
    Node,
    anchor,
    block_graph,
)
from sbpflow.sbp import format_nd

DOT_TIMEOUT = 30.0  # seconds for one dot run
CSS = (
    ".plan{overflow:auto}.block{display:none;border:1px solid #ccc;padding:8px;margin:8px 0}"
    ".block:target{display:block}.plan a{cursor:pointer}"
)


def quote(s: str) -> str:
    """A Graphviz quoted string."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def overview_dot(bg: BlockGraph) -> str:
    """Graphviz text of the overview: a cluster per phase, a clickable node per block."""
    ids = {k: i for i, k in enumerate(bg.nodes)}
    lines = [
        "digraph plan {",
        '  rankdir=TB; newrank=true; nodesep=0.25; ranksep=0.35; fontname="sans-serif";',
        '  node [shape=box, style="filled,rounded", fontname="sans-serif", fontsize=10];',
        '  edge [fontname="sans-serif", fontsize=9, color="#777777", arrowsize=0.6];',
    ]
    for phase in PHASES:
        members = [k for k, n in bg.nodes.items() if n.phase == phase]
        if not members:
            continue
        lines.append(f'  subgraph cluster_{phase} {{ label="{phase}"; color="#bbbbbb"; fontsize=12;')
        for k in members:
            lines.append("    " + _node_line(bg.nodes[k], ids[k]))
        lines.append("  }")
    for e in bg.edges:  # an edge between bands (an activation kept for backward, a gradient) is left out
        if not e.cross:
            lines.append(
                f"  n{ids[e.src]} -> n{ids[e.dst]} [label={quote(e.label)}, tooltip={quote(e.label)}];"
            )
    lines.append("}")
    return "\n".join(lines)


def _node_line(n: Node, i: int) -> str:
    if n.boxing:
        op = n.ops[0]
        look = f'fillcolor="{BOXING_FILL}", color="{BOXING_STROKE}", penwidth=2, style=filled, shape=box'
        return f'n{i} [label={quote(n.label)}, tooltip={quote(op.name)}, {look}, URL="#{anchor(i)}"];'
    kinds = sorted({o.op_type for o in n.ops})
    detail = f"{n.label} ({n.phase}): {len(n.ops)} ops: {', '.join(kinds)}"
    stages = sorted({o.stage for o in n.ops})
    where = f" · stage {', '.join(map(str, stages))}" if stages != [0] else ""  # a pipeline's stage
    label = quote(f"{n.label}\n{len(n.ops)} op{'s' if len(n.ops) > 1 else ''}{where}")
    return (
        f'n{i} [label={label}, tooltip={quote(detail)}, fillcolor="{PHASE_FILL[n.phase]}", '
        f'URL="#{anchor(i)}"];'
    )


def block_dot(state: CompileState, n: Node) -> str:
    """Graphviz text of one block's ops, with the tensors that come in from outside as plain ellipses."""
    g = state.graph
    mine = {o for op in n.ops for o in op.outputs}
    lines = [
        "digraph block {",
        '  rankdir=TB; node [shape=box, style="filled", fontname="sans-serif", fontsize=10, fillcolor="#eeeeee"];',
        '  edge [fontname="sans-serif", fontsize=9, color="#777777", arrowsize=0.6];',
    ]
    producer = {o: op.name for op in n.ops for o in op.outputs}
    for op in n.ops:
        lines.append(f"  {quote(op.name)} [label={quote(op.op_type)}, tooltip={quote(repr(op))}];")
    for t in {t for op in n.ops for t in op.inputs if t not in mine}:
        lines.append(
            f'  {quote("in:" + t)} [label={quote(_tail(t))}, tooltip={quote(repr(g.tensors[t]))}, shape=ellipse, fillcolor="#ffffff"];'
        )
    for op in n.ops:
        for t in op.inputs:
            src = producer.get(t, "in:" + t)
            sbp = g.tensors[t].sbp
            lines.append(
                f"  {quote(src)} -> {quote(op.name)} [label={quote('?' if sbp is None else format_nd(sbp))}];"
            )
    lines.append("}")
    return "\n".join(lines)


def _tail(name: str, n: int = 30) -> str:
    return name if len(name) <= n else "…" + name[-(n - 1) :]


def have_dot() -> bool:
    return shutil.which("dot") is not None


def _unflatten(source: str) -> str:
    """Graphviz's ``unflatten`` staggers a wide fan-out (every optimizer block reads the clip
    coefficient) over a few rows; the text unchanged where the tool is missing."""
    exe = shutil.which("unflatten")
    if exe is None:
        return source
    done = subprocess.run(
        [exe, "-l", "4", "-f", "-c", "4"], input=source, capture_output=True, text=True, timeout=DOT_TIMEOUT
    )
    return done.stdout if done.returncode == 0 and done.stdout.strip() else source


def run_dot(sources: list[str]) -> list[str]:
    """Each dot text as an inline SVG element: one ``dot -Tsvg`` run for all of them."""
    exe = shutil.which("dot")
    if exe is None:
        raise FileNotFoundError("Graphviz's dot is not on the PATH (apt-get install graphviz)")
    done = subprocess.run(
        [exe, "-Tsvg"],
        input="\n".join(sources),
        capture_output=True,
        text=True,
        timeout=DOT_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"dot failed ({done.returncode}): {done.stderr.strip()[:2000]}")
    svgs = re.findall(r"<svg.*?</svg>", done.stdout, flags=re.S)
    if len(svgs) != len(sources):
        raise RuntimeError(f"dot gave {len(svgs)} pictures for {len(sources)} graphs")
    return svgs


def picture(state: CompileState) -> str:
    """The plan picture as an HTML fragment: the overview, then every block's ops (opened on click)."""
    bg = block_graph(state)
    nodes = list(bg.nodes.values())
    if have_dot():
        svgs = run_dot([_unflatten(overview_dot(bg))] + [block_dot(state, n) for n in nodes])
        overview, details = svgs[0], svgs[1:]
    else:
        overview, details = plan_layout.overview_svg(bg), ["" for _ in nodes]
    sections = []
    for i, (n, svg) in enumerate(zip(nodes, details, strict=True)):
        sections.append(
            f"<section class='block' id='{anchor(i)}'><h4>{html.escape(n.label)} · {n.phase} "
            f"<a href='#plan'>close</a></h4>{svg}{plan_layout.ops_table(state, n)}</section>"
        )
    legend = " ".join(
        f"<span style='background:{c};padding:1px 8px;border:1px solid #999'>{p}</span>"
        for p, c in PHASE_FILL.items()
    )
    return (
        f"<div class='plan' id='plan'><style>{CSS}</style><p>{legend} "
        f"<span style='background:{BOXING_FILL};border:2px solid {BOXING_STROKE};padding:1px 8px'>boxing: "
        "collective, bytes per step</span> · click a block for its ops</p>"
        f"{overview}{''.join(sections)}</div>"
    )
