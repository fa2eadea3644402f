"""The folds the fusion pass makes before its chains (``compiler/passes/fusion.py``), each bit for bit the ops it
replaces.

:func:`fold_clips` folds each gradient's clipping ``mul`` (the gradient times
``clip_coef``'s factor, one value ``B`` everywhere) into the update that alone reads it, as
``optim.CLIPPED``'s form of that update, which multiplies each element as it reads it: one act and one
pass over the gradient fewer a parameter, the same product in the same dtype. Where boxing moved the
clipped gradient to the update's SBP, the update does not read the ``mul``'s result and nothing folds;
a loss-scaled job's gated updates keep their ``mul`` too.

Then :func:`fold_row_contractions` folds each weight gradient's two reshapes to rows and its
``matmul(transpose_a)`` into one ``rows_matmul`` of the unflattened arrays (the same GEMM call): two
acts fewer a weight.

And :func:`fold_squared_norms` folds the clipping norm, each gradient's ``pow_scalar`` and ``sum`` and
the adds of their sums, into one ``sum_squares`` (sbpflow/ops/fused.py) that runs the same kernels and
adds in the same order: one act, not one a gradient and a chain of adds (the main job: 30 acts fewer).
It folds only where no boxing, cast or other placement, stage or reader comes between: under a pipeline
the sums travel to the first stage and stay; on a mesh axis that splits some gradients and not others
the adds box and stay. Where every gradient is split along an axis, the sum is ``P`` there, as each
unfused sum was.
"""

from __future__ import annotations

import math
from dataclasses import replace

from sbpflow.control_plane.compiler import bn_grad
from sbpflow.control_plane.compiler.state import Choice, CompileState
from sbpflow.graph import BOXING, Graph, OpNode, TensorKind
from sbpflow.ops.base import NdSignature
from sbpflow.ops.training.optim import CLIPPED
from sbpflow.sbp import B, P, Split


def protected(state: CompileState) -> set[str]:
    """Tensors that must stay: read by the job or the passes after this one, whatever the graph says."""
    g, job = state.graph, state.job
    keep = {*job.fetches, job.loss, *state.grads.values(), *state.updates.values(), *state.state_vars}
    keep.update(
        t.name for t in g.tensors.values() if t.kind not in (TensorKind.activation, TensorKind.gradient)
    )
    return keep


def _one_broadcast_value(state: CompileState, name: str) -> bool:
    decl = state.graph.tensors[name]
    return math.prod(decl.meta.shape) == 1 and decl.sbp is not None and all(s == B for s in decl.sbp)


def fold_clips(state: CompileState) -> int:
    """Fold each clipping ``mul`` into the update that alone reads its result (the module's docstring);
    returns how many were folded."""
    g = state.graph
    producer, readers = g.producers_and_readers()
    keep = protected(state)
    folded: dict[str, OpNode] = {}  # the update's name -> its clipped form
    gone: set[str] = set()
    for u in g.ops:
        grad = u.inputs[1] if u.op_type in CLIPPED else ""
        mul = producer.get(grad)
        if (
            mul is None
            or mul.op_type != "mul"
            or readers[grad] != 1
            or grad in keep
            or bn_grad.fold_key(mul) != bn_grad.fold_key(u)
        ):
            continue
        scalar = [i for i in mul.inputs if _one_broadcast_value(state, i)]
        others = [i for i in mul.inputs if i not in scalar]
        if len(scalar) != 1 or len(others) != 1 or g.tensors[others[0]].sbp != g.tensors[grad].sbp:
            continue
        inputs = (u.inputs[0], others[0], *u.inputs[2:], scalar[0])
        folded[u.name] = replace(u, op_type=CLIPPED[u.op_type], inputs=inputs)
        gone.add(mul.name)
        del g.tensors[grad]
        choice = state.choices[u.name]
        sig = choice.signature
        ins = (sig.ins[0], g.tensors[others[0]].sbp, *sig.ins[2:], g.tensors[scalar[0]].sbp)
        cost = choice.cost + (state.choices.pop(mul.name).cost if mul.name in state.choices else 0)
        state.choices[u.name] = Choice(NdSignature(ins, sig.outs), cost, choice.reason + " + clip folded")  # type: ignore[arg-type]
    g.ops[:] = [folded.get(o.name, o) for o in g.ops if o.name not in gone]
    return len(folded)


def _flattened(g: Graph, producer: dict[str, OpNode], name: str, readers: dict[str, int]) -> OpNode | None:
    """The reshape of an [..., k] array to [rows, k] that alone makes ``name`` for one reader, else None."""
    r = producer.get(name)
    if r is None or r.op_type != "reshape" or readers.get(name) != 1:
        return None
    src, out = g.tensors[r.inputs[0]].meta, g.tensors[name].meta
    return r if src.ndim > 2 and out.shape == (src.numel // src.shape[-1], src.shape[-1]) else None


def fold_row_contractions(state: CompileState) -> int:
    """Fold each weight gradient's ``matmul(reshape(a), reshape(dy), transpose_a=True)`` (matmul's rule
    on a batched input: both operands flattened to rows) into one ``rows_matmul`` of the unflattened
    arrays, the same GEMM call on the same arrays, so the same bits: two acts fewer a weight (the main
    job's 18 reshapes a step). The SBPs are fixed by now; the new op's are its inputs' and output's, one
    of its einsum rows (a split leading axis in both: ``P``, as the flattened rows' split was)."""
    g = state.graph
    producer, readers = g.producers_and_readers()
    keep = protected(state)
    folded: dict[str, OpNode] = {}
    gone: set[str] = set()
    for o in g.ops:
        if o.op_type != "matmul" or not o.attrs.get("transpose_a") or o.attrs.get("transpose_b"):
            continue
        flat = [_flattened(g, producer, i, readers) for i in o.inputs]
        if any(r is None or r.outputs[0] in keep or bn_grad.fold_key(r) != bn_grad.fold_key(o) for r in flat):
            continue
        a, b = (r.inputs[0] for r in flat if r is not None)
        if g.tensors[a].meta.shape[:-1] != g.tensors[b].meta.shape[:-1] or flat[0] is flat[1]:
            continue
        # a name of its own: micro-batching takes the attrs of the op of its name in a twin graph
        node = replace(o, name=f"{o.name}.rows", op_type="rows_matmul", inputs=(a, b), attrs={})
        folded[o.name] = node
        choice = state.choices.pop(o.name)
        sbp = tuple(g.tensors[t].sbp for t in (a, b))
        cost = choice.cost + sum(
            state.choices.pop(r.name).cost for r in flat if r and r.name in state.choices
        )
        reason = choice.reason + " + rows folded"
        state.choices[node.name] = Choice(NdSignature(sbp, choice.signature.outs), cost, reason)  # type: ignore[arg-type]
        for r in flat:
            assert r is not None
            gone.add(r.name)
            del g.tensors[r.outputs[0]]
    g.ops[:] = [folded.get(o.name, o) for o in g.ops if o.name not in gone]
    return len(folded)


def _squared(
    g: Graph, producer: dict[str, OpNode], readers: dict[str, int], keep: set[str], name: str
) -> tuple[OpNode, OpNode] | None:
    """The ``pow_scalar(x, 2)`` and whole-array ``sum`` that alone make ``name``, else None."""
    s = producer.get(name)
    if s is None or s.op_type != "sum" or s.attrs.get("axes") is not None or s.attrs.get("keepdims"):
        return None
    p = producer.get(s.inputs[0])
    if p is None or p.op_type != "pow_scalar" or float(p.attrs["exponent"]) != 2.0:  # type: ignore[arg-type]
        return None
    if any(readers.get(t) != 1 or t in keep for t in (name, s.inputs[0])):
        return None
    return p, s


def _norm_sum(state: CompileState, total: str) -> tuple[list[OpNode], list[OpNode]] | None:
    """The squares (``pow_scalar`` and ``sum`` a gradient, in order) and the left-deep adds that make
    ``total``, all of one key and SBP, no cast or boxing between; else None."""
    g = state.graph
    producer, readers = g.producers_and_readers()
    keep = protected(state)
    leaves: list[tuple[OpNode, OpNode]] = []
    adds: list[OpNode] = []
    t = total
    while (leaf := _squared(g, producer, readers, keep, t)) is None:
        a = producer.get(t)
        if a is None or a.op_type != "add" or (t != total and (readers.get(t) != 1 or t in keep)):
            return None
        if (leaf := _squared(g, producer, readers, keep, a.inputs[1])) is None:
            return None
        leaves.append(leaf)
        adds.append(a)
        t = a.inputs[0]
    leaves.append(leaf)
    ops = [*adds, *(o for pair in leaves for o in pair)]
    sbps = {g.tensors[o.outputs[0]].sbp for o in (*adds, *(s for _, s in leaves))}
    if len(leaves) < 2 or len({bn_grad.fold_key(o) for o in ops}) != 1 or len(sbps) != 1:
        return None
    return [p for p, _ in reversed(leaves)] + [s for _, s in reversed(leaves)], adds[::-1]


def _split_axes(state: CompileState, xs: list[str], out: str) -> tuple[int, ...] | None:
    """sum_squares' split_axes for inputs ``xs`` writing ``out``: a row per mesh axis that splits every
    input (``out`` P there), none where all are B (``out`` B); None on any other mix."""
    g = state.graph
    nd = [g.tensors[x].sbp for x in xs]
    want = g.tensors[out].sbp
    assert want is not None and all(s is not None for s in nd)
    axes: list[int] = []
    for k, o in enumerate(want):
        on = [s[k] for s in nd]  # type: ignore[index]
        if all(isinstance(s, Split) for s in on) and o == P:
            axes += [s.axis for s in on]  # type: ignore[union-attr]
        elif not all(s == B for s in on) or o != B:
            return None
    return tuple(axes)


def fold_squared_norms(state: CompileState) -> int:
    """Fold each clipping norm's squares and adds into one ``sum_squares`` (the module's docstring);
    returns how many were folded."""
    g = state.graph
    folded: dict[str, OpNode] = {}
    gone: set[str] = set()
    producer, _ = g.producers_and_readers()
    for c in [o for o in g.ops if o.op_type == "clip_coef"]:
        total = c.inputs[0]
        if total in producer and producer[total].op_type == BOXING:  # the sum made whole (P -> B)
            total = producer[total].inputs[0]
        found = _norm_sum(state, total)
        if found is None:
            continue
        squares, adds = found
        n = len(squares) // 2
        xs = [p.inputs[0] for p in squares[:n]]
        axes = _split_axes(state, xs, total)
        if axes is None:
            continue
        last = adds[-1]
        node = OpNode(f"{last.name}.squares", "sum_squares", tuple(xs), (total,), {"split_axes": axes},
                      last.placement, last.stage, last.checkpoint, last.scope)  # fmt: skip
        folded[last.name] = node
        cost = sum(state.choices.pop(o.name).cost for o in (*squares, *adds) if o.name in state.choices)
        sbps = tuple(g.tensors[x].sbp for x in xs)
        want = g.tensors[total].sbp
        state.choices[node.name] = Choice(NdSignature(sbps, (want,)), cost, "squares folded")  # type: ignore[arg-type]
        for o in (*squares, *adds):
            gone.add(o.name)
            if o.outputs[0] != total:
                del g.tensors[o.outputs[0]]
    g.ops[:] = [folded.get(o.name, o) for o in g.ops if o.name not in gone or o.name in folded]
    return len(folded)
