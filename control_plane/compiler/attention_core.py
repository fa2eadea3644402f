"""The attention core folded: the heads' layout ops around ``attention`` and ``attention_grad`` become one
``qkv_attention`` and one ``qkv_attention_grad`` (sbpflow/ops/attention_core.py).

The GPT block takes q, k and v from its fused projection ``qkv [B, T, 3 H Dh]`` and puts y back as

    reshape [B, T, H, 3, Dh] -> split (axis 3) -> 3 x (reshape [B, T, H, Dh] -> transpose (0, 2, 1, 3))
    -> attention -> transpose (0, 2, 1, 3) -> reshape [B, T, H Dh]

and autodiff mirrors it: reshape and transpose of dy, attention_grad, three transposes and reshapes,
concat on axis 3 and a reshape to qkv's shape. :func:`run` (called by the pipeline just before
``fusion.run``, and gated like it by ``JobConfig.fusion``) rewrites each such attention as

    y, probs = qkv_attention(qkv)              dqkv = qkv_attention_grad(qkv, probs, dy)

20 acts of the engine a layer fewer (the main job: 239 -> 199 a step), and no concat's copy. It folds only
the exact pattern: every forward piece on one placement, stage, checkpoint flag and phase, and every
backward piece likewise (``bn_grad.fold_key``); each intermediate read by nothing but the next piece (q,
k and v by attention and its gradient), none of them a tensor the job keeps; one attention_grad of the
same attributes, or none (a forward-only graph folds the forward); and on each mesh axis qkv ``B``,
``S(0)`` (the batch) or ``S(2)`` (whole heads, Megatron's layout), with y and the probabilities as
qkv_attention's rows make them, dy as y or ``P`` where y is ``B``. Anything else stays as autodiff made it.

The same GEMMs and softmax passes as attention's kernels on the same strided views, so a run is bit for
bit the unfolded graph's (``tests/control_plane/compiler/test_attention_core.py`` trains both in float64).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sbpflow.control_plane.compiler.bn_grad import fold_key
from sbpflow.control_plane.compiler.passes.fusion import protected
from sbpflow.control_plane.compiler.state import Choice, CompileState
from sbpflow.graph import Graph, OpNode
from sbpflow.ops.base import AttrValue, NdSignature
from sbpflow.sbp import B, NdSbp, P, Sbp, Split

HEADS = (0, 2, 1, 3)  # [B, T, H, Dh] <-> [B, H, T, Dh]
# qkv's SBP on a mesh axis -> y's and the probabilities' (qkv_attention's rows)
ROWS: dict[Sbp, tuple[Sbp, Sbp]] = {B: (B, B), Split(0): (Split(0), Split(0)), Split(2): (Split(2), Split(1))}


@dataclass(frozen=True)
class Core:
    """One attention's fold: the ops it replaces and the tensors the folded ops read and write."""

    forward: tuple[OpNode, ...]
    backward: tuple[OpNode, ...]  # empty where the graph has no attention_grad of it
    qkv: str
    y: str
    probs: str
    dy: str
    dqkv: str
    attrs: Mapping[str, AttrValue]


class _Graph:
    def __init__(self, g: Graph, keep: set[str]) -> None:
        self.g, self.keep = g, keep
        self.producer = {t: o for o in g.ops for t in o.outputs}
        self.reading: dict[str, list[OpNode]] = {}
        for o in g.ops:
            for i in o.inputs:
                self.reading.setdefault(i, []).append(o)

    def shape(self, t: str) -> tuple[int, ...]:
        return tuple(self.g.tensors[t].meta.shape)

    def made(self, t: str, op_type: str, **attrs: object) -> OpNode | None:
        """``t``'s producer, if an ``op_type`` of these attributes; else None."""
        o = self.producer.get(t)
        return o if o is not None and o.op_type == op_type and _has(o, attrs) else None

    def only(self, t: str, *readers: OpNode) -> bool:
        """``t`` is read by ``readers`` alone, once each, and kept by nothing."""
        rs = self.reading.get(t, [])
        return t not in self.keep and len(rs) == len(readers) and all(r in rs for r in readers)

    def reader(self, t: str, op_type: str, **attrs: object) -> OpNode | None:
        """The one reader of ``t``, if an ``op_type`` of these attributes that nothing else beside it reads
        ``t`` and ``t`` is not kept; else None."""
        rs = self.reading.get(t, [])
        ok = t not in self.keep and len(rs) == 1 and rs[0].op_type == op_type and _has(rs[0], attrs)
        return rs[0] if ok else None


def _has(o: OpNode, attrs: dict[str, object]) -> bool:
    return all(_plain(o.attrs.get(k)) == v for k, v in attrs.items())


def _axis(o: OpNode) -> int:
    """A split's or concat's axis of the 5-d [B, T, H, 3, Dh] array, non-negative."""
    axis = o.attrs.get("axis")
    return axis % 5 if isinstance(axis, int) else -1


def _plain(v: object) -> object:
    return tuple(v) if isinstance(v, list | tuple) else v  # type: ignore[arg-type]


def _heads_of(gr: _Graph, a: OpNode) -> tuple[list[OpNode], str, int, int] | None:
    """qkv's reshape, the split and q, k and v's reshapes and transposes (program pieces of the
    forward before ``a``), qkv, the heads and their width; else None."""
    pieces: list[OpNode] = []
    splits: set[str] = set()
    for i, t in enumerate(a.inputs):
        tr = gr.made(t, "transpose", perm=HEADS)
        rs = gr.made(tr.inputs[0], "reshape") if tr is not None else None
        sp = gr.made(rs.inputs[0], "split", sizes=(1, 1, 1)) if rs is not None else None
        if tr is None or rs is None or sp is None or sp.outputs[i] != rs.inputs[0]:
            return None
        if not (gr.only(rs.inputs[0], rs) and gr.only(tr.inputs[0], tr)):
            return None
        pieces += [rs, tr]
        splits.add(sp.name)
    sp = gr.producer[pieces[0].inputs[0]]
    r0 = gr.made(sp.inputs[0], "reshape")
    if len(splits) != 1 or r0 is None or not gr.only(r0.outputs[0], sp):
        return None
    qkv = r0.inputs[0]
    *lead, h, three, d = gr.shape(r0.outputs[0])
    if three != 3 or len(lead) != 2 or gr.shape(qkv) != (*lead, 3 * h * d) or _axis(sp) != 3:
        return None
    if any(gr.shape(rs.outputs[0]) != (*lead, h, d) for rs in pieces[::2]):
        return None
    return [r0, sp, *pieces], qkv, h, d


def _backward(gr: _Graph, grad: OpNode, qkv: str, y: str) -> tuple[list[OpNode], str, str] | None:
    """attention_grad's pieces (dy's reshape and transpose, itself, dq, dk and dv's transposes and
    reshapes, the concat and its reshape), dy and dqkv; else None."""
    t_dy = gr.made(grad.inputs[4], "transpose", perm=HEADS)
    r_dy = gr.made(t_dy.inputs[0], "reshape") if t_dy is not None else None
    if (
        t_dy is None
        or r_dy is None
        or not (gr.only(t_dy.outputs[0], grad) and gr.only(r_dy.outputs[0], t_dy))
    ):
        return None
    if gr.shape(r_dy.inputs[0]) != gr.shape(y):
        return None
    pieces: list[OpNode] = []
    cats: set[str] = set()
    for i, t in enumerate(grad.outputs):
        tr = gr.reader(t, "transpose", perm=HEADS)
        rs = gr.reader(tr.outputs[0], "reshape") if tr is not None else None
        cat = gr.reader(rs.outputs[0], "concat") if rs is not None else None
        if tr is None or rs is None or cat is None or cat.inputs[i] != rs.outputs[0]:
            return None
        pieces += [tr, rs]
        cats.add(cat.name)
    cat = gr.reading[pieces[1].outputs[0]][0]
    out = gr.reader(cat.outputs[0], "reshape")
    if len(cats) != 1 or len(cat.inputs) != 3 or _axis(cat) != 3 or out is None:
        return None
    if gr.shape(out.outputs[0]) != gr.shape(qkv):
        return None
    return [r_dy, t_dy, grad, *pieces, cat, out], r_dy.inputs[0], out.outputs[0]


def match(gr: _Graph, a: OpNode) -> Core | None:
    """The fold of attention ``a`` (the module's docstring); None where the pattern is not exact."""
    found = _heads_of(gr, a)
    if found is None:
        return None
    forward, qkv, h, d = found
    y4, probs = a.outputs
    t3 = gr.reader(y4, "transpose", perm=HEADS)
    r4 = gr.reader(t3.outputs[0], "reshape") if t3 is not None else None
    if t3 is None or r4 is None or gr.shape(r4.outputs[0]) != (*gr.shape(qkv)[:2], h * d):
        return None
    forward += [a, t3, r4]
    grads = gr.reading.get(probs, [])
    grad = grads[0] if len(grads) == 1 and grads[0].op_type == "attention_grad" else None
    if probs in gr.keep or (grads and grad is None):
        return None
    if grad is not None and (grad.inputs[:4] != (*a.inputs, probs) or dict(grad.attrs) != dict(a.attrs)):
        return None
    if any(not gr.only(t, a, *([grad] if grad else [])) for t in a.inputs):
        return None
    back = _backward(gr, grad, qkv, r4.outputs[0]) if grad is not None else ([], "", "")
    if back is None or any(len({fold_key(o) for o in ops}) > 1 for ops in (forward, back[0])):
        return None
    attrs = {"head_dim": d, "scale": a.attrs["scale"], "causal": bool(a.attrs.get("causal", False))}
    return Core(tuple(forward), tuple(back[0]), qkv, r4.outputs[0], probs, back[1], back[2], attrs)


def signatures(g: Graph, c: Core) -> tuple[NdSignature, NdSignature | None] | None:
    """The folded ops' signatures from the SBPs the pieces chose; None where they are not the rows'."""
    sq = g.tensors[c.qkv].sbp
    if sq is None or any(s not in ROWS for s in sq):
        return None
    sy, sp = tuple(ROWS[s][0] for s in sq), tuple(ROWS[s][1] for s in sq)
    if tuple(g.tensors[c.y].sbp or ()) != sy or tuple(g.tensors[c.probs].sbp or ()) != sp:
        return None
    forward = NdSignature((tuple(sq),), (sy, sp))
    if not c.backward:
        return forward, None
    sdy = tuple(g.tensors[c.dy].sbp or ())
    if len(sdy) != len(sy) or any(
        s != w and not (s == P and q == B) for s, w, q in zip(sdy, sy, sq, strict=True)
    ):
        return None
    sdx: NdSbp = tuple(P if s == P else q for s, q in zip(sdy, sq, strict=True))
    if tuple(g.tensors[c.dqkv].sbp or ()) != sdx:
        return None
    return forward, NdSignature((tuple(sq), sp, sdy), (sdx,))


def _node(state: CompileState, ops: tuple[OpNode, ...], op_type: str, ins: tuple[str, ...], outs: tuple[str, ...],
          attrs: Mapping[str, AttrValue], signature: NdSignature) -> OpNode:  # fmt: skip
    first, last = ops[0], ops[-1]
    name = next(o.name for o in ops if o.op_type.startswith("attention")) + ".core"
    node = OpNode(name, op_type, ins, outs, attrs, last.placement, last.stage, last.checkpoint, first.scope)  # type: ignore[arg-type]
    cost = sum(state.choices.pop(o.name).cost for o in ops if o.name in state.choices)
    state.choices[name] = Choice(signature, cost, "attention core folded")
    for o in ops:
        for t in o.outputs:
            if t not in outs:
                del state.graph.tensors[t]
    return node


def run(state: CompileState) -> int:
    """Fold each attention core (the module's docstring) where ``JobConfig.fusion`` is on; returns how
    many attentions were folded."""
    if not state.job.config.fusion:
        return 0
    g = state.graph
    gr = _Graph(g, protected(state))
    order = {o.name: i for i, o in enumerate(g.ops)}
    at: dict[str, OpNode] = {}  # the last piece's name -> the folded op in its place
    gone: set[str] = set()
    for a in [o for o in g.ops if o.op_type == "attention"]:
        c = match(gr, a)
        sigs = signatures(g, c) if c is not None else None
        if c is None or sigs is None:
            continue
        fw = tuple(sorted(c.forward, key=lambda o: order[o.name]))
        at[fw[-1].name] = _node(state, fw, "qkv_attention", (c.qkv,), (c.y, c.probs), c.attrs, sigs[0])
        if c.backward and sigs[1] is not None:
            bw = tuple(sorted(c.backward, key=lambda o: order[o.name]))
            node = _node(state, bw, "qkv_attention_grad", (c.qkv, c.probs, c.dy), (c.dqkv,), c.attrs, sigs[1])
            at[bw[-1].name] = node
        gone.update(o.name for o in (*c.forward, *c.backward))
    g.ops[:] = [at.get(o.name, o) for o in g.ops if o.name not in gone or o.name in at]
    return len(at) - sum(1 for n in at.values() if n.op_type == "qkv_attention_grad")
