"""Batch norm's backward folded: the full-size terms of dx become one ``channel_input_grad`` pass.

autodiff gives ``F.batch_norm``'s input three full-size terms and adds them: channel_affine's
``channel_affine(dy, 0, scale, 0)`` (a ``full`` zeros [C] for its mean and shift), channel_var_grad's dx
(with its [C] dmean) and mean_grad's broadcast of the mean's gradient (through a boxing where SBP
inference chose another layout), then ``add(add(., .), .)``: about 11 full-size reads and writes where
one pass suffices. :func:`run` (called by ``fusion.run``, so ``JobConfig.fusion`` gates it) rewrites

    (dx2, dm2) = channel_var_grad(x, mean, dvar)     ->  dm2 = channel_var_dmean(x, mean, dvar)
    dx = dx1 + dx2 + dx3                             ->  dx = channel_input_grad(dy, x, mean, scale, dvar, dmean)

with dx = dy scale + (x - mean) 2 dvar / count + dmean / count by channel, and drops channel_affine,
mean_grad, their boxing, the adds and the zeros no op reads any more. Where ``mean`` is x's own mean over
every axis but the channels (``F.batch_norm``'s, through boxings), dm2 = dvar sum(-2 (x - mean)) / count
is zero but for rounding, as PyTorch's formula has it: channel_var_dmean goes too, with autodiff's ``add``
of it to the mean's other gradient (:meth:`_Fold.adding`), whose readers read that other term instead:
one pass over x and one act a batch norm fewer (ResNet-18: 437 -> 417 compute acts a step, ~2.1 ms CPU).
It folds only the exact pattern: every piece on one placement, stage, checkpoint flag and phase, each
intermediate read once and by nothing the job keeps, one shape and dtype, mean_grad over every axis but
the channels of x's shape; dy, x and dx of one SBP, each mesh axis a split or ``B``; and the four [C]
vectors ``B`` on a mesh axis that splits x other than on the channels or not at all, ``S(0)`` on one that
splits the channels (``S(1)``), or boxed so where only mesh axes of one rank differ (such a boxing moves
nothing and the executor bypasses it). Anything else stays as autodiff made it.

Not bit-identical to the unfused graph: the three terms are summed in another order and in one
expression (fused multiply-adds where numba makes them); ``tests/control_plane/compiler/passes/
test_bn_grad.py`` trains both in float64 to a tight tolerance.
"""

from __future__ import annotations

import dataclasses

from sbpflow.control_plane.compiler.passes.autodiff import GRAD
from sbpflow.control_plane.compiler.passes.boxing_pass import boxing_node, slug
from sbpflow.control_plane.compiler.passes.optimizer import PREFIX as OPTIMIZER
from sbpflow.control_plane.compiler.state import Choice, CompileState
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl
from sbpflow.ops.base import NdSignature
from sbpflow.sbp import B, NdSbp, Split

ZERO_DMEAN = True  # drop channel_var_grad's dmean where the mean is x's own (the module's docstring); the A/B


def fold_key(o: OpNode) -> tuple[object, ...]:
    """Placement, stage, checkpoint flag and phase (forward, ``grad/`` or ``optimizer/``): ops fold into
    one only within one key (this pass and fusion's)."""
    phase = GRAD if o.name.startswith(GRAD) else OPTIMIZER if o.name.startswith(OPTIMIZER) else ""
    return (o.placement, o.stage, o.checkpoint, phase)


def _zeros(producer: dict[str, OpNode], name: str) -> OpNode | None:
    f = producer.get(name)
    return f if f is not None and f.op_type == "full" and float(f.attrs.get("value", 1.0)) == 0.0 else None  # type: ignore[arg-type]


def _channels_sbp(x: NdSbp) -> NdSbp:
    """The [C] vectors' SBP beside an x of SBP ``x``: S(0) on a mesh axis that splits the channels, else B."""
    return tuple(Split(0) if s == Split(1) else B for s in x)


def _as_is_or_free(g: Graph, name: str, want: NdSbp, pl: object) -> bool | None:
    """True: ``name`` has SBP ``want``; False: it differs only on mesh axes of one rank (a boxing there
    moves nothing); None: neither."""
    decl = g.tensors[name]
    if decl.sbp is None or decl.placement != pl:
        return None
    if tuple(decl.sbp) == tuple(want):
        return True
    shape = decl.placement.shape  # type: ignore[union-attr]
    return (
        False
        if all(s == w or shape[k] == 1 for k, (s, w) in enumerate(zip(decl.sbp, want, strict=True)))
        else None
    )


class _Fold:
    def __init__(self, state: CompileState, keep: set[str]) -> None:
        self.state, self.g, self.keep = state, state.graph, keep
        self.producer, self.readers = self.g.producers_and_readers()

    def once(self, t: str) -> bool:
        return self.readers.get(t) == 1 and t not in self.keep

    def adds(self, dx2: str) -> tuple[list[OpNode], list[str]] | None:
        """The two adds that sum ``dx2`` with two other terms, and those terms; else None."""
        reader = [o for o in self.g.ops if dx2 in o.inputs]
        if len(reader) != 1 or reader[0].op_type != "add":
            return None
        a = reader[0]
        other = [i for i in a.inputs if i != dx2]
        if len(other) != 1:
            return None
        up = [o for o in self.g.ops if a.outputs[0] in o.inputs]
        if self.once(a.outputs[0]) and len(up) == 1 and up[0].op_type == "add":
            rest = [i for i in up[0].inputs if i != a.outputs[0]]
            return ([a, up[0]], [other[0], *rest]) if len(rest) == 1 else None
        below = self.producer.get(other[0])
        if below is not None and below.op_type == "add" and self.once(other[0]):
            return [below, a], list(below.inputs)
        return None

    def own_mean(self, x: str, mean: str) -> bool:
        """Whether ``mean`` is ``x``'s mean over every axis but the channels (1), each through a boxing or
        not (a boxing keeps the logical value): then sum(x - mean) over those axes is zero."""

        def under(t: str) -> str:
            p = self.producer.get(t)
            return p.inputs[0] if p is not None and p.op_type == BOXING else t

        m = self.producer.get(under(mean))
        if m is None or m.op_type != "mean" or m.attrs.get("keepdims") or under(m.inputs[0]) != x:
            return False
        nd = self.g.tensors[x].meta.ndim
        axes = sorted(a % nd for a in (m.attrs.get("axes") or ()))  # type: ignore[union-attr]
        return axes == [a for a in range(nd) if a != 1]

    def adding(self, dm2: str) -> tuple[OpNode, str, OpNode | None] | None:
        """The ``add`` (autodiff's sum of the mean's gradients) of ``dm2``, or of its boxing read by nothing
        else, and one other term of the same meta, SBP and placement as the sum; that term; the boxing.
        Else None."""
        t, box = dm2, None
        readers = [o for o in self.g.ops if t in o.inputs]
        if len(readers) == 1 and readers[0].op_type == BOXING and self.once(t):
            box, t = readers[0], readers[0].outputs[0]
            readers = [o for o in self.g.ops if t in o.inputs]
        if len(readers) != 1 or not self.once(t) or readers[0].op_type != "add":
            return None
        add = readers[0]
        other = [i for i in add.inputs if i != t]
        total = self.g.tensors[add.outputs[0]]
        if len(other) != 1 or total.name in self.keep:
            return None
        term = self.g.tensors[other[0]]
        if (term.meta, term.sbp, term.placement) != (total.meta, total.sbp, total.placement):
            return None
        return add, other[0], box

    def match(self, v: OpNode, key: object) -> dict[str, object] | None:  # noqa: C901 - one pattern, in order
        g = self.g
        x, mean, dvar = v.inputs
        dx2 = v.outputs[0]
        if not self.once(dx2) or (found := self.adds(dx2)) is None:
            return None
        adds, terms = found
        top = adds[-1]
        inner = [a.outputs[0] for a in adds[:-1]]
        if any(not self.once(t) for t in (*terms, *inner)):
            return None
        affine = grad = box = None
        for t in terms:
            p = self.producer.get(t)
            if p is not None and p.op_type == "channel_affine":
                affine = p
            elif p is not None and p.op_type == BOXING and (q := self.producer.get(p.inputs[0])) is not None:
                box, grad = p, q
            elif p is not None and p.op_type == "mean_grad":
                grad = p
        if affine is None or grad is None or grad.op_type != "mean_grad":
            return None
        if box is not None and not self.once(grad.outputs[0]):
            return None
        dy, zm, scale, zs = affine.inputs
        if _zeros(self.producer, zm) is None or zm != zs:
            return None
        xm = g.tensors[x].meta
        axes = tuple(a % xm.ndim for a in (grad.attrs.get("axes") or ()))  # type: ignore[union-attr]
        if tuple(grad.attrs["shape"]) != xm.shape or axes != tuple(a for a in range(xm.ndim) if a != 1):  # type: ignore[arg-type]
            return None
        if grad.attrs.get("keepdims") or any(g.tensors[t].meta != xm for t in (dy, top.outputs[0], *terms)):
            return None
        ops = [v, affine, grad, *adds] + ([box] if box else [])
        if any(fold_key(o) != key for o in ops):
            return None
        sbp = g.tensors[x].sbp
        if sbp is None or any(g.tensors[t].sbp != sbp for t in (dy, top.outputs[0], dx2)):
            return None
        if not all(s == B or isinstance(s, Split) for s in sbp):
            return None
        cs = (mean, scale, dvar, grad.inputs[0])
        if any(_as_is_or_free(g, c, _channels_sbp(sbp), v.placement) is None for c in cs):
            return None
        return {"ops": ops, "affine": affine, "grad": grad, "box": box, "adds": adds, "top": top,
                "dy": dy, "cs": cs, "zeros": zm, "inner": inner}  # fmt: skip


def _drop_dmean(
    state: CompileState, fold: _Fold, dm2: str, add: OpNode, term: str, box: OpNode | None,
    cs: tuple[str, ...], gone: set[str],
) -> tuple[str, ...]:  # fmt: skip
    """Drop ``dm2``, its boxing and the ``add`` of it (:meth:`_Fold.adding`): the add's readers read
    ``term`` instead. Returns the fold's [C] vectors ``cs`` with the sum renamed so too."""
    g = state.graph
    total = add.outputs[0]
    g.ops[:] = [
        dataclasses.replace(o, inputs=tuple(term if i == total else i for i in o.inputs))
        if total in o.inputs
        else o
        for o in g.ops
    ]
    for o in (add, *([box] if box else [])):
        gone.add(o.name)
        state.boxings.pop(o.name, None)
        state.choices.pop(o.name, None)
        del g.tensors[o.outputs[0]]
    del g.tensors[dm2]
    fold.producer, fold.readers = g.producers_and_readers()
    return tuple(term if c == total else c for c in cs)


def run(state: CompileState, keep: set[str]) -> int:
    """Fold each batch norm's backward (the module's docstring); returns how many were folded."""
    g = state.graph
    fold = _Fold(state, keep)
    replaced: dict[str, list[OpNode]] = {}  # an op's name -> what takes its place
    gone: set[str] = set()
    zeros: set[str] = set()
    folded = 0
    for v in [o for o in g.ops if o.op_type == "channel_var_grad"]:
        m = fold.match(v, fold_key(v))
        if m is None:
            continue
        folded += 1
        x, mean, dvar = v.inputs
        dm2 = v.outputs[1]
        vsig = state.choices[v.name].signature
        dropped = fold.adding(dm2) if ZERO_DMEAN and fold.own_mean(x, mean) else None
        if dropped is not None:  # dm2 is zero: neither it nor its add
            m["cs"] = _drop_dmean(state, fold, dm2, *dropped, m["cs"], gone)  # type: ignore[arg-type]
            replaced[v.name] = []
        else:
            slim = OpNode(f"{v.name}.dmean", "channel_var_dmean", v.inputs, (dm2,), {}, v.placement, v.stage,
                          v.checkpoint, v.scope)  # fmt: skip
            state.choices[slim.name] = Choice(
                NdSignature(vsig.ins, vsig.outs[1:]), state.choices[v.name].cost, "dx folded"
            )  # type: ignore[arg-type]
            replaced[v.name] = [slim]
        top: OpNode = m["top"]  # type: ignore[assignment]
        boxes: list[OpNode] = []
        cs: list[str] = []
        for c in m["cs"]:  # type: ignore[attr-defined]
            want = _channels_sbp(g.tensors[x].sbp)  # type: ignore[arg-type]
            if _as_is_or_free(g, c, want, v.placement):
                cs.append(c)
                continue
            name = f"{c}.to_{slug(want)}"
            if name not in g.tensors:
                g.add_tensor(TensorDecl(name, g.tensors[c].meta, g.tensors[c].kind, v.placement, want))
                boxes.append(boxing_node(state, c, g.tensors[name], top))
            cs.append(name)
        dy: str = m["dy"]  # type: ignore[assignment]
        node = OpNode(f"{top.name}.bn", "channel_input_grad", (dy, x, *cs), top.outputs, {}, top.placement,
                      top.stage, top.checkpoint, top.scope)  # fmt: skip
        ops: list[OpNode] = m["ops"]  # type: ignore[assignment]
        cost = sum(state.choices.pop(o.name).cost for o in ops if o.name in state.choices)
        sbps = tuple(g.tensors[t].sbp for t in node.inputs)
        state.choices[node.name] = Choice(
            NdSignature(sbps, (g.tensors[top.outputs[0]].sbp,)), cost, "bn backward folded"
        )  # type: ignore[arg-type]
        replaced[top.name] = [*boxes, node]
        for o in ops:
            gone.add(o.name)
            if o.op_type == BOXING:
                state.boxings.pop(o.name, None)
            for t in o.outputs:
                if t not in (dm2, top.outputs[0]):
                    del g.tensors[t]
        zeros.add(m["zeros"])  # type: ignore[arg-type]
    g.ops[:] = [n for o in g.ops for n in replaced.get(o.name, [] if o.name in gone else [o])]
    producer, readers = g.producers_and_readers()
    unread = {t for t in zeros if not readers.get(t) and t not in keep}
    for t in unread:
        state.choices.pop(producer[t].name, None)
        del g.tensors[t]
    g.ops[:] = [o for o in g.ops if not (o.op_type == "full" and o.outputs[0] in unread)]
    return folded
