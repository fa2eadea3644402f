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

Then :func:`siblings` puts small chains and single fusable ops (every result of at most ``SMALL``
elements: per-channel vectors, whose act overhead is their cost) side by side into one fused op, each
unit's results its outputs, where the program order allows (the function's docstring).

Before the chains, ``compiler/folds.py`` folds each gradient's clipping ``mul`` into its update, each
weight gradient's reshapes and ``matmul`` into one ``rows_matmul`` and the clipping norm into one
``sum_squares`` (its docstring).

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
from collections.abc import Collection
from dataclasses import dataclass, field

from sbpflow.control_plane.compiler import bn_grad
from sbpflow.control_plane.compiler.folds import (
    fold_clips,
    fold_row_contractions,
    fold_squared_norms,
    protected,
)
from sbpflow.control_plane.compiler.state import Choice, CompileState
from sbpflow.graph import Graph, OpNode, TensorKind
from sbpflow.ops.base import AttrValue, NdSignature
from sbpflow.ops.fused import FUSABLE, TERMINAL, encode
from sbpflow.oracle.reference import micro_batches

FUSED = "fused_elementwise"
# Chains grow past an intermediate that ops outside read, which becomes an extra output (False: such a
# chain ends there, as before; the A/B of the acts a step in bench/models/resnet.py --trace)
EXPORTS = True
# Fusable ops and chains whose every result has at most SMALL elements go side by side into one op where
# they may (:func:`siblings`; False: the A/B), of at most MAX_INPUTS inputs
SIBLINGS = True
SMALL = 4096
MAX_INPUTS = 8


Class = tuple[bool, bool]  # (depends on the batch, depends on a gradient or the loss)


@dataclass
class _Chain:
    ops: list[OpNode] = field(default_factory=list)
    cls: Class = (False, False)  # its results' classes or'ed: the fused op's outputs' (:func:`_classes`)
    reads: dict[str, int] = field(default_factory=dict)  # per result, how many of its ops read it


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


@dataclass
class _Group:
    """Small units (a chain, or one fusable op) fused side by side (:func:`siblings`)."""

    units: list[list[OpNode]]
    kept: list[list[OpNode]]  # the units whose results the job keeps: their ops go last (one result first)
    made: set[str]  # every result of the units
    anchor: str  # the last unit's last op: where the fused op goes
    inputs: set[str]
    first_read: int  # the earliest position of an op outside that reads a result

    def ops(self) -> list[OpNode]:
        kept = {id(u) for u in self.kept}
        return [o for u in self.units if id(u) not in kept for o in u] + [o for u in self.kept for o in u]


def _small(state: CompileState, unit: list[OpNode]) -> bool:
    return all(math.prod(state.graph.tensors[o.outputs[0]].meta.shape) <= SMALL for o in unit)


def siblings(state: CompileState, found: list[list[OpNode]]) -> list[tuple[list[OpNode], str]]:
    """``found``'s chains and the single fusable ops, with those of at most SMALL elements a result fused
    side by side: in program order, a unit joins the open group of its fold key and class (every result of
    one class; any class where a step is one micro-batch) where it reads no result of the group, the
    group's results are read by nothing outside before it, and the group keeps at most MAX_INPUTS inputs.
    The units whose results the job keeps (a
    gradient, a variable's update) go last, so that one of those is the fused op's first output (as a
    chain's is) and the others further outputs (:func:`fuse`'s ``keep``). Each group, or
    chain, as (its ops in the order to fuse, the op it replaces in the graph). Such ops are a few vector
    operations an act whose engine overhead is the cost: batch norm's backward, per channel, made two
    fused ops and a ``mul`` (the weight's gradient), now one (ResNet-18: 397 -> 357 compute acts a step;
    under micro-batches the gradient, of another class, stays apart); a running variance's update
    (``running_stat``, a kept result) goes beside the scale taken from the same variance, and the running
    mean's with them (-> 317). Without EXPORTS (or SIBLINGS) nothing goes side by side."""
    if not (SIBLINGS and EXPORTS):  # side by side, the units' results are the fused op's outputs
        return [(ops, ops[-1].name) for ops in found]
    g = state.graph
    at = {o.name: k for k, o in enumerate(g.ops)}
    read_by = _read_by(g)
    cls, keep = _classes(state), protected(state)
    whole = micro_batches(state.job) == 1  # one pass a step: micro-batching's classes do not apply
    chained = {o.name for ops in found for o in ops}
    units = [
        *found,
        *([o] for o in g.ops if o.name not in chained and o.op_type in FUSABLE and len(o.outputs) == 1),
    ]
    units.sort(key=lambda u: at[u[-1].name])
    open_: dict[tuple[object, ...], _Group] = {}
    groups: list[_Group] = []
    for u in units:
        names = {o.name for o in u}
        made = {o.outputs[0] for o in u}
        classes = {cls[t] for t in made}
        outside = [at[r] for t in made for r in read_by.get(t, set()) - names]
        kept = any(t in keep for t in made)
        mixed = len(classes) != 1 and not whole
        if any(o.op_type in TERMINAL for o in u) or mixed or not _small(state, u):
            groups.append(_Group([u], [], made, u[-1].name, set(), 0))
            continue
        inputs = {i for o in u for i in o.inputs} - made
        key = (bn_grad.fold_key(u[-1]), *(() if whole else classes))
        grp = open_.get(key)
        if (
            grp is not None
            and not inputs & grp.made
            and grp.first_read > at[u[-1].name]
            and len(grp.inputs | inputs) <= MAX_INPUTS
        ):
            grp.units.append(u)
            grp.made |= made
            grp.inputs |= inputs
            grp.anchor = u[-1].name
            grp.first_read = min([grp.first_read, *outside])
            grp.kept += [u] if kept else []
            continue
        grp = _Group([u], [u] if kept else [], made, u[-1].name, inputs, min(outside, default=len(g.ops)))
        open_[key] = grp
        groups.append(grp)
    fused = [(grp.ops(), grp.anchor) for grp in groups]
    return [(ops, anchor) for ops, anchor in fused if len(ops) > 1]


def fuse(
    state: CompileState,
    ops: list[OpNode],
    read_by: dict[str, set[str]] | None = None,
    keep: Collection[str] = (),
) -> OpNode:
    """The fused op for the chain ``ops`` (in program order): its intermediates' declarations and the
    ops' choices are replaced, but for the intermediates that an op outside reads (``read_by``: each
    tensor's readers' names, the graph's by default) or that the job keeps (``keep``: side by side, a
    variable's update that only its SINK reads), which become the op's further outputs, in step order,
    with their SBPs; the caller puts the node where the last op was (:func:`run`)."""
    g = state.graph
    if read_by is None:
        read_by = _read_by(g)
    made = {o.outputs[0]: k for k, o in enumerate(ops)}
    names = {o.name for o in ops}
    exported = [t for t in list(made)[:-1] if read_by.get(t, set()) - names or t in keep]
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


def _read_by(g: Graph) -> dict[str, set[str]]:
    read_by: dict[str, set[str]] = {}
    for o in g.ops:
        for i in o.inputs:
            read_by.setdefault(i, set()).add(o.name)
    return read_by


def run(state: CompileState) -> None:
    if not state.job.config.fusion:
        return
    fold_clips(state)
    fold_row_contractions(state)
    fold_squared_norms(state)
    bn_grad.run(state, protected(state))
    found = siblings(state, chains(state))
    if not found:
        return
    read_by = _read_by(state.graph)
    keep = protected(state)
    at_last = {anchor: fuse(state, ops, read_by, keep) for ops, anchor in found}
    gone = {o.name for ops, _ in found for o in ops}
    g = state.graph
    g.ops[:] = [at_last.get(o.name, o) for o in g.ops if o.name not in gone or o.name in at_last]
