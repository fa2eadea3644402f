"""Elementwise fusion: chains of elementwise ops become one ``fused_elementwise`` op (sbpflow/ops/fused.py).

Every op costs an actor act (~11 µs of engine overhead) and a register, and each simple step of a chain
allocates its result; one fused op acts once and writes its simple steps into the chain's own dying
intermediates. ``run(state)`` runs after ``boxing_pass``, so every SBP is fixed, and before
``micro_batching`` (which re-infers the fused op's metas per micro-batch from its inputs: the chain holds
no shapes). It walks the ops in order (:func:`chains`); an op joins every open chain whose results it
reads (merging them) where it

* is one of ``fused.FUSABLE``, on the same placement, stage, checkpoint flag and phase (forward,
  ``grad/`` or ``optimizer/``: micro-batching's layout tells them apart by name) as the chain, and every
  result that an op outside may read is of the fused op's class (on the batch or not, on a gradient or
  the loss or not: micro-batching runs the classes at different times, and a fused op's outputs are all of
  the class of its inputs together; :func:`_one_class`); a reduction of
  ``fused.TERMINAL`` ends its chain (the clipping norm's ``pow_scalar`` and ``sum`` of each gradient, a
  loss's token count's ``ne_scalar``, ``cast`` and ``sum``), as does a result that the job or a later
  pass keeps (a fetch, the loss, a gradient, an update or a variable: always a fused op's first output).

An op that reads a chain's result and does not join it (another op, a boxing: a chain never spans a
change of SBP) closes the chain: the fused op is put where the chain's last op was, so a reader outside
must come after that. Each result that an op outside reads becomes a further output of the fused op
(``attrs["exports"]``), under its own name and SBP, which the kernel never writes over: batch norm's
``var + eps``, ``sqrt``, reciprocal and ``* weight`` are one act, with the ``sqrt`` and the reciprocal
that its backward reads exported (ResNet-18, 32x32: 637 -> 597 acts a step). ``EXPORTS = False`` stops
a chain at such a result instead (one reader alone may continue it), as before.

An intermediate's SBP is the one its reader's signature asked for (boxing inserted nothing there), so the
fused op's signature is one of its composed rows; ``verify_compiled`` checks it after this pass. A fused
op is named after its first op with ``.fused`` (keeping the phase prefix, and a name no twin graph of
micro-batching knows), placed where its last op was, and the declarations of the intermediates that
nothing outside reads are dropped.

Before the chains, :func:`fold_clips` folds each gradient's clipping ``mul`` (the gradient times
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

Last, ``compiler/bn_grad.py`` folds each batch norm's input gradient into one ``channel_input_grad``
pass (its docstring): the one fold here that is not bit-identical (the terms are summed in another order).

On by default (``JobConfig.fusion``; a job message without the field reads as on): a fused chain runs the
same numpy calls in the same order as the ops it replaces, so a run is bit-identical either way (but for
batch norm's backward, above)
(``tests/control_plane/compiler/passes/test_fusion.py`` trains both). A job turns it off with
``JobConfig(fusion=False)`` (``GraphConfig.fusion``, ``self.config.fusion = False`` in a graph's
``__init__``) to see one act an op in a trace; the setting travels with the job, so a job compiles the
same wherever it is compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from sbpflow.control_plane.compiler import bn_grad
from sbpflow.control_plane.compiler.state import Choice, CompileState
from sbpflow.graph import BOXING, Graph, OpNode, TensorKind
from sbpflow.ops.base import AttrValue, NdSignature
from sbpflow.ops.fused import FUSABLE, TERMINAL, encode
from sbpflow.ops.training.optim import CLIPPED
from sbpflow.sbp import B, P, Split

FUSED = "fused_elementwise"
# Chains grow past an intermediate that ops outside read, which becomes an extra output (False: such a
# chain ends there, as before; the A/B of the acts a step in bench/models/resnet.py --trace)
EXPORTS = True


Class = tuple[bool, bool]  # (depends on the batch, depends on a gradient or the loss)


@dataclass
class _Chain:
    ops: list[OpNode] = field(default_factory=list)
    cls: Class = (False, False)  # its results' classes or'ed: the fused op's outputs' (:func:`_classes`)
    reads: dict[str, int] = field(default_factory=dict)  # per result, how many of its ops read it


def protected(state: CompileState) -> set[str]:
    """Tensors that must stay: read by the job or the passes after this one, whatever the graph says."""
    g, job = state.graph, state.job
    keep = {*job.fetches, job.loss, *state.grads.values(), *state.updates.values(), *state.state_vars}
    keep.update(
        t.name for t in g.tensors.values() if t.kind not in (TensorKind.activation, TensorKind.gradient)
    )
    return keep


def _classes(state: CompileState) -> dict[str, Class]:
    """Per tensor: whether it depends on the batch, and on a gradient or the loss. Micro-batching's layout
    runs an op once a step before the micro-batches, once a micro-batch, or once a step after averaging
    them, by these; a fused op's outputs take the class of all its inputs (:func:`_one_class`)."""
    g, job = state.graph, state.job
    data = {t.name for t in g.of_kind(TensorKind.input)}
    late = {*state.grads.values(), job.loss}
    for o in g.ops:
        for reached in (data, late):
            if any(i in reached for i in o.inputs):
                reached.update(o.outputs)
    return {t: (t in data, t in late) for o in g.ops for t in o.outputs}


def _may_join(c: _Chain, o: OpNode, owner: dict[str, _Chain], readers: dict[str, int]) -> bool:
    """Whether ``o``, reading results of the open chain ``c``, may join it: within one fold key; without
    ``EXPORTS``, only through its tail, which nothing else reads."""
    if bn_grad.fold_key(c.ops[-1]) != bn_grad.fold_key(o):
        return False
    return EXPORTS or all(readers[i] == 1 for i in o.inputs if owner.get(i) is c)


def _one_class(joined: list[_Chain], o: OpNode, readers: dict[str, int], cls: dict[str, Class]) -> bool:
    """Whether ``o`` merged with ``joined`` leaves every result that an op outside may still read in the
    fused op's class (an op taking a parameter-only value into a batch's chain would move that value's
    other readers into every micro-batch). A chain only its own ops read always passes."""
    u = cls[o.outputs[0]]
    for c in joined:
        u = (u[0] or c.cls[0], u[1] or c.cls[1])
    ins = set(o.inputs)
    for c in joined:
        for op in c.ops:
            r = op.outputs[0]
            if cls[r] != u and readers.get(r, 0) > c.reads.get(r, 0) + (r in ins):
                return False
    return cls[o.outputs[0]] == u or not readers.get(o.outputs[0])


def _joined(
    read: list[_Chain], o: OpNode, owner: dict[str, _Chain], readers: dict[str, int], cls: dict[str, Class]
) -> list[_Chain]:
    """The chains among ``read`` that ``o`` joins: all it may where they keep one class, else those it
    reads only the tail of, which nothing else reads (as without ``EXPORTS``), else none."""
    if o.op_type not in FUSABLE or len(o.outputs) != 1:
        return []
    may = [c for c in read if _may_join(c, o, owner, readers)]
    if not EXPORTS or not may or _one_class(may, o, readers, cls):
        return may
    tails = [
        c
        for c in may
        if all(readers[i] == 1 and i == c.ops[-1].outputs[0] for i in o.inputs if owner.get(i) is c)
    ]
    return tails if tails and _one_class(tails, o, readers, cls) else []


def chains(state: CompileState) -> list[list[OpNode]]:
    """The chains of two or more ops to fuse, each in program order. An op joins every open chain whose
    results it reads where it may (:func:`_joined`), merging them; an op that reads a chain's result and
    does not join closes it (the fused op is put where its last op is, so a reader outside must come
    after that: the result becomes an extra output), as does a result the job keeps or a reduction."""
    g = state.graph
    readers: dict[str, int] = {}
    for o in g.ops:
        for i in set(o.inputs):
            readers[i] = readers.get(i, 0) + 1
    cls = _classes(state)
    keep = protected(state)
    owner: dict[str, _Chain] = {}  # each open chain's results -> the chain
    every: list[_Chain] = []
    for o in g.ops:
        read = list({id(c): c for i in o.inputs if (c := owner.get(i)) is not None}.values())
        joined = _joined(read, o, owner, readers, cls)
        for c in read:
            if not any(c is j for j in joined):
                _close(c, owner)
        if o.op_type not in FUSABLE or len(o.outputs) != 1:
            continue
        chain = _merge(joined, o, owner, cls) if joined else _Chain([o], cls[o.outputs[0]])
        if not joined:
            every.append(chain)
        elif len(joined) > 1:
            gone = {id(c) for c in joined[1:]}
            every = [c for c in every if id(c) not in gone]
        if o.op_type in TERMINAL or o.outputs[0] in keep:
            _close(chain, owner)
        else:
            owner[o.outputs[0]] = chain
    at = {o.name: i for i, o in enumerate(g.ops)}
    return [sorted(c.ops, key=lambda o: at[o.name]) for c in every if len(c.ops) > 1]


def _merge(joined: list[_Chain], o: OpNode, owner: dict[str, _Chain], cls: dict[str, Class]) -> _Chain:
    """The first of ``joined`` grown by the others and ``o``."""
    chain = joined[0]
    for c in joined[1:]:
        chain.ops += c.ops
        for r, n in c.reads.items():
            chain.reads[r] = chain.reads.get(r, 0) + n
        chain.cls = (chain.cls[0] or c.cls[0], chain.cls[1] or c.cls[1])
        owner.update((op.outputs[0], chain) for op in c.ops if owner.get(op.outputs[0]) is c)
    for i in set(o.inputs):
        if owner.get(i) is chain:
            chain.reads[i] = chain.reads.get(i, 0) + 1
    chain.ops.append(o)
    mine = cls[o.outputs[0]]
    chain.cls = (chain.cls[0] or mine[0], chain.cls[1] or mine[1])
    return chain


def _close(c: _Chain, owner: dict[str, _Chain]) -> None:
    for op in c.ops:
        if owner.get(op.outputs[0]) is c:
            del owner[op.outputs[0]]


def fuse(state: CompileState, ops: list[OpNode], read_by: dict[str, set[str]] | None = None) -> OpNode:
    """The fused op for the chain ``ops`` (in program order): its intermediates' declarations and the
    ops' choices are replaced, but for the intermediates that an op outside reads (``read_by``: each
    tensor's readers' names, the graph's by default), which become the op's further outputs, in step
    order, with their SBPs; the caller puts the node where the last op was (:func:`run`)."""
    g = state.graph
    if read_by is None:
        read_by = _read_by(g)
    made = {o.outputs[0]: k for k, o in enumerate(ops)}
    names = {o.name for o in ops}
    exported = [t for t in list(made)[:-1] if read_by.get(t, set()) - names]
    inputs: list[str] = []
    steps = []
    for o in ops:
        refs = []
        for i in o.inputs:
            if i in made and made[i] < made[o.outputs[0]]:
                refs.append(f"s{made[i]}")
            else:
                if i not in inputs:
                    inputs.append(i)
                refs.append(f"in{inputs.index(i)}")
        steps.append((o.op_type, dict(o.attrs), refs))
    last = ops[-1]
    outputs = (*last.outputs, *exported)
    attrs: dict[str, AttrValue] = {"chain": encode(steps)}
    if exported:
        attrs["exports"] = tuple(made[t] for t in exported)
    node = OpNode(
        f"{ops[0].name}.fused",
        FUSED,
        tuple(inputs),
        outputs,
        attrs,
        last.placement,
        last.stage,
        last.checkpoint,
        last.scope,
    )
    for t in list(made)[:-1]:
        if t not in exported:
            del g.tensors[t]
    sbp = [g.tensors[t].sbp for t in (*inputs, *outputs)]
    assert all(s is not None for s in sbp)
    cost = sum(state.choices[o.name].cost for o in ops if o.name in state.choices)
    for o in ops:
        state.choices.pop(o.name, None)
    state.choices[node.name] = Choice(
        NdSignature(tuple(sbp[: len(inputs)]), tuple(sbp[len(inputs) :])),  # type: ignore[arg-type]
        cost,
        "fused: " + " + ".join(o.op_type for o in ops),
    )
    return node


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


def _read_by(g: Graph) -> dict[str, set[str]]:
    read_by: dict[str, set[str]] = {}
    for o in g.ops:
        for i in o.inputs:
            read_by.setdefault(i, set()).add(o.name)
    return read_by


def _one_broadcast_value(state: CompileState, name: str) -> bool:
    decl = state.graph.tensors[name]
    return math.prod(decl.meta.shape) == 1 and decl.sbp is not None and all(s == B for s in decl.sbp)


def run(state: CompileState) -> None:
    if not state.job.config.fusion:
        return
    fold_clips(state)
    fold_row_contractions(state)
    fold_squared_norms(state)
    bn_grad.run(state, protected(state))
    found = chains(state)
    if not found:
        return
    read_by = _read_by(state.graph)
    at_last = {ops[-1].name: fuse(state, ops, read_by) for ops in found}
    gone = {o.name for ops in found for o in ops}
    g = state.graph
    g.ops[:] = [at_last.get(o.name, o) for o in g.ops if o.name not in gone or o.name in at_last]
