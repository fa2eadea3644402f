"""SBP signature inference: an nd-SBP for every tensor, hence a signature for every op.

**The whole graph first** (:mod:`sbp_ilp`): when some weight is annotated split (tensor parallelism,
ZeRO-3) and the program fits its budget (the examples' meshes; on a 2-d mesh one mesh axis at a time, the
other held; not a 96-layer job), one integer program picks every op's signature and every free source's
layout at once,
minimising the bytes the boxing table prices, a step's latency and the FLOPs a replica repeats; the walk
below follows it: its sources are stored as the program chose, unannotated variables replicated, and
``choose`` takes the program's signature, saying what the one-op walk would have picked instead.
Otherwise (a data-parallel job, a program too large, or none proven optimal in time) the walk decides
alone. Annotations, targets and micro-batch fits bind both alike.

``run(state)`` walks the ops in topological order and, for each, picks one of
``op.nd_signatures(metas, attrs, mesh)`` on the op's placement (``OpNode.placement``, else the placement
of its first input, else of its first output). The op's placement is written back onto the node, every
tensor gets a placement and an nd-SBP, and ``state.choices[op]`` records the signature, its cost and why.

**Constraints.** An SBP present on a tensor before this pass (``to_global``, ``Parameter.to_global``, a
data input's ``input_sbp``, or one that an earlier pass set) is *hard*: an input is boxed from it, and an
annotated op output is boxed to it (boxing_pass renames the op's own output and boxes it). Three more
tensors are given a target: each fetched tensor and the loss are all-``B`` (so any rank can report them;
a scalar all-reduce costs a few bytes), and the new value of a variable in ``state.updates`` takes the
variable's own SBP (so the next step reads the variable as this one did).

**Free sources.** A tensor that no op produces and nobody annotated (a parameter, optimizer state, a
data input without ``input_sbp``, a constant) is stored the way its *first* consumer wants it, at no
cost; that choice then fixes it for every later consumer. Partial entries are never stored (a ``P`` a
consumer wants is stored as ``B`` and zero-filled, which costs nothing): a variable is a value, not a
pending sum. Unannotated data inputs are free in the same way rather than defaulting to ``S(0)``: with
nothing annotated, the tie-breaker's row order gives the batch split ``S(0)``; next to column-split
weights (tensor parallelism) they come out ``B`` with no gather.

**Cost** (:mod:`sbp_cost`): each candidate signature is priced by the bytes it boxes here plus what
its outputs cost their readers (a one-op lookahead), ties broken by boxing steps; see that module.
A gradient is laid out like its parameter (the update reads it so; ZeRO annotates otherwise), and when
the step is cut into micro-batches a signature must also fit one micro-batch.

Known effects of the walk alone: a weight nobody annotated is stored as its forward reader wants it, which can cost its
gradient a gather; a partial activation that one reader all-reduces and a backward reader wants split is
reduce-scattered again from the partial source (boxing_pass boxes from the producer's layout, not from a
copy already made, which a local slice of the all-reduced copy would serve for free).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sbpflow.control_plane.compiler.passes import sbp_ilp
from sbpflow.control_plane.compiler.passes.rewrites import rewritten
from sbpflow.control_plane.compiler.passes.sbp_cost import (
    Attrs,
    Call,
    Context,
    Fixed,
    Free,
    Out,
    Own,
    Pending,
    State,
    attrs_key,
    canonical,
    evaluate,
    goal_of,
    overruled,
    signatures,
    store,
)
from sbpflow.control_plane.compiler.state import Choice, CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import Job
from sbpflow.ops.base import NdSignature, get_op
from sbpflow.oracle.reference import micro_batch_job, micro_batches
from sbpflow.placement import Placement
from sbpflow.sbp import B, NdSbp, Split, format_nd
from sbpflow.sharding import min_split_size
from sbpflow.tensor_meta import TensorMeta

# ---- the walk --------------------------------------------------------------------------------------


@dataclass
class _Solver:
    graph: Graph
    fixed: dict[str, NdSbp]  # tensor -> its SBP (annotated, or chosen)
    placed: dict[str, Placement]
    targets: dict[str, NdSbp]  # op output -> the SBP it must end up with
    updates: dict[str, str]  # new value -> variable (state.updates inverted)
    grad_of: dict[str, str] = field(default_factory=dict)  # gradient -> its parameter (state.grads inverted)
    produced: set[str] = field(default_factory=set)
    readers: dict[str, list[OpNode]] = field(default_factory=dict)
    memo: dict[Context, tuple[NdSignature, Choice] | None] = field(default_factory=dict)
    micro: dict[str, tuple[Attrs, tuple[TensorMeta, ...]]] = field(default_factory=dict)  # see _micro_calls
    cut: int = 1  # micro-batches per step
    forced: dict[str, NdSignature] = field(default_factory=dict)  # the whole-graph program's choices

    def _state(self, t: str) -> State:
        if t in self.fixed:
            return Fixed(self.placed[t], self.fixed[t])
        return Free(self.placed.get(t)) if t not in self.produced else Pending()

    def _goal(self, node: OpNode, out: str) -> NdSbp | int | None:
        var = self.updates.get(out)
        if var is not None and var not in self.fixed and var in node.inputs:
            return node.inputs.index(var)
        if var is not None and var in self.fixed:
            return self._laid_as(var, out)
        if out in self.targets:
            return self.targets[out]
        param = self.grad_of.get(out)
        goal = self._laid_as(param, out) if param is not None else None
        placed = self.placed.get(out)
        if goal is None and placed is not None and node.placement is not None and placed != node.placement:
            return (B,) * placed.ndim  # an output placed apart from its op: boxed there, whole
        return goal

    def _laid_as(self, src: str, out: str) -> NdSbp | None:
        """``src``'s SBP as the goal of ``out`` (a variable's new value, a parameter's gradient) when the
        two lie on one placement; a variable placed apart (another mesh) leaves ``out`` to its readers."""
        if src not in self.fixed or self.placed.get(src) != self.placed.get(out):
            return None
        return self.fixed[src]

    def _call(self, node: OpNode, pl: Placement, states: tuple[State, ...]) -> Call:
        metas = tuple(self.graph.tensors[t].meta for t in node.inputs)
        same = tuple(node.inputs.index(t) for t in node.inputs)
        attrs = attrs_key(get_op(node.op_type).normalize_attrs(node.attrs))
        return Call(node.op_type, attrs, pl, metas, same, states)

    def _reader(self, r: OpNode, node: OpNode, goals: Sequence[NdSbp | int | None]) -> Call | None:
        pl = r.placement or next((self.placed[t] for t in (*r.inputs, *r.outputs) if t in self.placed), None)
        if pl is None:
            return None
        states: list[State] = []
        for t in r.inputs:
            k = node.outputs.index(t) if t in node.outputs else -1
            if k < 0:
                states.append(self._state(t))
            elif goals[k] is None:
                states.append(Own(k))
            else:  # a targeted output reads as its target; a variable's new value waits for the choice
                goal = goals[k]
                states.append(Fixed(self.placed[t], goal) if isinstance(goal, tuple) else Pending())
        return self._call(r, pl, tuple(states))

    def context(self, node: OpNode, pl: Placement) -> Context:
        states = tuple(
            Fixed(self.placed[t], self.fixed[t]) if t in self.fixed else Free(self.placed.get(t))
            for t in node.inputs
        )
        goals = [self._goal(node, o) for o in node.outputs]
        outs = []
        for out, goal in zip(node.outputs, goals, strict=True):
            readers = (
                () if goal is not None else (self._reader(r, node, goals) for r in self.readers.get(out, ()))
            )
            outs.append(Out(self.placed[out], goal, tuple(r for r in readers if r is not None)))
        return Context(self._call(node, pl, states), tuple(outs), self.micro.get(node.name))

    def choose(self, node: OpNode, pl: Placement) -> Choice:
        ctx = self.context(node, pl)
        key = canonical(ctx)
        if key not in self.memo:
            self.memo[key] = evaluate(key)
        found = self.memo[key]
        if found is None:
            ins = ", ".join(f"{t}: {self.graph.tensors[t].meta}" for t in node.inputs)
            cut = f" that also fits one of its {self.cut} micro-batches" if node.name in self.micro else ""
            raise GraphError(
                f"op {node.name!r} ({node.op_type}) with inputs {ins} has no valid SBP signature{cut} on the "
                f"{pl.shape} mesh of {pl}; use fewer ranks{', fewer micro-batches' if cut else ''} or larger tensors"
            )
        best, choice = found
        if node.name in self.forced:
            best, choice = self.forced[node.name], overruled(ctx, self.forced[node.name], choice)
        for t, want in zip(node.inputs, best.ins, strict=True):
            if t not in self.fixed:
                self.placed[t], self.fixed[t] = store(self.placed.get(t), pl, want)
        for out, spec, have in zip(node.outputs, ctx.outs, best.outs, strict=True):
            goal = goal_of(spec, best, ctx.call)
            self.fixed[out] = have if goal is None else goal
        return choice


# ---- the pass ------------------------------------------------------------------------------------


def run(state: CompileState) -> None:
    g = state.graph
    solver = _Solver(g, {}, {}, {}, {new: var for var, new in state.updates.items()})
    solver.grad_of = {grad: param for param, grad in state.grads.items()}
    solver.cut = micro_batches(state.job)
    if solver.cut > 1:
        solver.micro = _micro_calls(state.job, solver.cut)
    for node in g.ops:
        solver.produced.update(node.outputs)
        for t in dict.fromkeys(node.inputs):
            solver.readers.setdefault(t, []).append(node)
    for t in g.tensors.values():
        if t.placement is not None:
            solver.placed[t.name] = t.placement
        if t.sbp is not None:
            assert t.placement is not None  # Graph.verify: an SBP comes with its placement
            _check_annotation(g, t)
            # an annotated source is read as it is; an annotated op output is boxed to it
            (solver.targets if t.name in solver.produced else solver.fixed)[t.name] = t.sbp
    for name in (state.job.loss, *state.job.fetches):
        if name in solver.produced and name not in solver.targets:
            solver.targets[name] = (B,) * _placement_of(g, solver, name).ndim
    for var, new in state.updates.items():
        _check_update(g, var, new)

    placements = _placements(g, solver)
    whole = _whole_graph(state, solver, placements) if sbp_ilp.ENABLED and _programmable(g) else None
    if whole is not None:
        solver.forced = whole.signatures
        for t, (pl, sbp) in whole.stored.items():
            solver.placed[t], solver.fixed[t] = pl, sbp
        for t in g.tensors.values():  # the variables the program held replicated
            if t.kind in _REPLICATED and t.name not in solver.fixed and t.name in solver.placed:
                solver.fixed[t.name] = (B,) * solver.placed[t.name].ndim
    ops = []
    for node in g.ops:
        node = replace(node, placement=placements[node.name])
        if node.op_type == BOXING:  # already boxed (a rerun): the node keeps its endpoints
            for o in node.outputs:
                solver.fixed.setdefault(o, g.tensors[o].sbp or (B,) * node.placement.ndim)
        else:
            state.choices[node.name] = solver.choose(node, node.placement)
        ops.append(node)
    g.ops = ops

    for t in g.tensors.values():
        pl = solver.placed.get(t.name) or _placement_of(g, solver, t.name)
        sbp = solver.fixed.get(t.name, (B,) * pl.ndim)  # nobody reads it: keep it whole
        g.set_tensor(replace(t, placement=pl, sbp=sbp))
    for var, new in state.updates.items():
        if g.tensors[var].sbp != g.tensors[new].sbp:
            raise GraphError(
                f"variable {var!r} {g.tensors[var].meta} is {format_nd(g.tensors[var].sbp or ())} but its new "
                f"value {new!r} is annotated {format_nd(g.tensors[new].sbp or ())}; annotate them alike"
            )


def _micro_calls(job: Job, m: int) -> dict[str, tuple[Attrs, tuple[TensorMeta, ...]]]:
    """Each op's attrs and input metas on one of ``m`` micro-batches. micro_batching cuts the batch after
    this pass and keeps the signatures chosen here, so a split that is valid on the whole step's batch but
    not on a micro-batch (96 rows over an 8 x 8 mesh, evenly, for a reshape) must not be chosen. The
    passes before this one are deterministic, so the twin's op names match."""
    g = rewritten(micro_batch_job(job, m)).graph
    return {
        o.name: (
            attrs_key(get_op(o.op_type).normalize_attrs(o.attrs)),
            tuple(g.tensors[t].meta for t in o.inputs),
        )
        for o in g.ops
        if o.op_type != BOXING  # ZeRO's, placed before this pass: not chosen here (see run)
    }


def _placements(g: Graph, solver: _Solver) -> dict[str, Placement]:
    """Each op's placement, before any SBP is chosen: its own, else its tensors' (a source nobody placed
    takes its first reader's, as the walk stores it there)."""
    out = {}
    for node in g.ops:
        pl = out[node.name] = _op_placement(g, solver, node)
        for t in node.inputs:
            if t not in solver.produced:
                solver.placed.setdefault(t, pl)
        for o in node.outputs:
            solver.placed.setdefault(o, pl)
    return out


# An unannotated variable is replicated for the program, as the walk stores it for its forward reader:
# data parallelism is the default, and splitting a weight is what annotations (megatron) and ZeRO say.
_REPLICATED = (TensorKind.parameter, TensorKind.optimizer_state)


def _programmable(g: Graph) -> bool:
    """Whether the whole-graph program decides: when some parameter is annotated split (tensor
    parallelism, ZeRO-3), and not on a rerun (that keeps what boxing made). A job that splits no weight is
    data parallel, which the walk lays out as users expect (gradients all-reduced, then bucketed); an
    automatic search over such a job's layouts is ``--auto``'s, under a memory budget."""
    if any(o.op_type == BOXING for o in g.ops):
        return False
    return any(
        t.kind is TensorKind.parameter and t.sbp is not None and any(isinstance(x, Split) for x in t.sbp)
        for t in g.tensors.values()
    )


def _whole_graph(
    state: CompileState, solver: _Solver, placements: dict[str, Placement]
) -> sbp_ilp.Solution | None:
    """The program's choice. On a 2-d mesh every op has the product of its rows as candidates, too many
    for one program (GPT's 2 layers on 2 x 2: 178,000 variables), so each mesh axis in turn is solved
    exactly with the other held where the walk (then the previous solve) put it: never worse than the
    walk, by the program's price."""
    if len(state.graph.ops) > sbp_ilp.MAX_OPS:
        return None
    ndim = max(pl.ndim for pl in placements.values())
    if ndim == 1:
        return sbp_ilp.solve(_problem(state, solver, placements))
    if ndim > 2:
        return None
    ref, best = _walk(state, solver, placements), None
    for axis in range(ndim):
        found = sbp_ilp.solve(_problem(state, solver, placements, (axis, ref)))
        if found is None:
            break
        best, ref = found, found.signatures
    return best


def _walk(state: CompileState, solver: _Solver, placements: dict[str, Placement]) -> dict[str, NdSignature]:
    """The signatures the walk alone picks, on a copy of the solver (its memo shared: prices are pure)."""
    s = solver
    twin = _Solver(
        s.graph, dict(s.fixed), dict(s.placed), s.targets, s.updates, s.grad_of, s.produced, s.readers
    )
    twin.memo, twin.micro, twin.cut = s.memo, s.micro, s.cut
    return {
        o.name: twin.choose(o, placements[o.name]).signature for o in state.graph.ops if o.op_type != BOXING
    }


def _along(s: NdSignature, axis: int) -> tuple[object, ...]:
    return tuple(nd[axis] for nd in (*s.ins, *s.outs))


def _problem(
    state: CompileState,
    solver: _Solver,
    placements: dict[str, Placement],
    keep: tuple[int, dict[str, NdSignature]] | None = None,
) -> sbp_ilp.Problem:
    """The program over every op's candidates; with ``keep = (axis, signatures)`` only those that match
    ``signatures`` along that mesh axis."""
    g = state.graph
    calls = []
    for node in g.ops:
        pl = placements[node.name]
        metas = tuple(g.tensors[t].meta for t in node.inputs)
        attrs = attrs_key(get_op(node.op_type).normalize_attrs(node.attrs))
        out_metas, sigs = signatures(node.op_type, attrs, metas, pl.shape)
        if node.name in solver.micro:
            small = set(signatures(node.op_type, *solver.micro[node.name], pl.shape)[1])
            sigs = tuple(s for s in sigs if s in small)
        if keep is not None and keep[0] < pl.ndim and node.name in keep[1]:
            held = _along(keep[1][node.name], keep[0])
            sigs = tuple(s for s in sigs if _along(s, keep[0]) == held)
        calls.append(
            sbp_ilp.OpCall(node.name, node.op_type, attrs, node.inputs, node.outputs, pl, sigs, out_metas)
        )
    fixed = {t: (solver.placed[t], sbp) for t, sbp in solver.fixed.items()}
    read = {t for node in g.ops for t in node.inputs}
    free = {t: solver.placed.get(t) for t in read if t not in solver.produced and t not in fixed}
    for t in [t for t in free if g.tensors[t].kind in _REPLICATED]:
        pl = free.pop(t) or placements[next(o.name for o in g.ops if t in o.inputs)]
        fixed[t] = (pl, (B,) * pl.ndim)
    goal: dict[str, sbp_ilp.Layout | str] = {}
    for node in g.ops:
        for out in node.outputs:
            source = solver.updates.get(out) or (None if out in solver.targets else solver.grad_of.get(out))
            if source is not None:
                goal[out] = (solver.placed[out], fixed[source][1]) if source in fixed else source
            elif out in solver.targets:
                goal[out] = (solver.placed[out], solver.targets[out])
    return sbp_ilp.Problem(tuple(calls), {t: d.meta for t, d in g.tensors.items()}, fixed, free, goal)


def _op_placement(g: Graph, solver: _Solver, node: OpNode) -> Placement:
    if node.placement is not None:
        return node.placement
    for t in (*node.inputs, *node.outputs):
        if t in solver.placed:
            return solver.placed[t]
    raise GraphError(
        f"op {node.name!r} ({node.op_type}) has no placement and neither do its tensors "
        f"{list(node.inputs) + list(node.outputs)}; place the op or its inputs (to_global)"
    )


def _placement_of(g: Graph, solver: _Solver, name: str) -> Placement:
    if name in solver.placed:
        return solver.placed[name]
    users = [o for o in g.ops if name in o.inputs or name in o.outputs]
    for op in users:
        if op.placement is not None:
            return op.placement
    raise GraphError(f"tensor {name!r} has no placement and no placed op uses it; give it one (to_global)")


def _check_annotation(g: Graph, t: TensorDecl) -> None:
    """An annotated split must leave every rank a non-empty shard (uneven is fine, empty is not)."""
    assert t.placement is not None and t.sbp is not None
    if min_split_size(t.meta.shape, t.placement.shape, t.sbp) >= 1:
        return
    bad = [
        f"{s!r} on mesh axis {k} ({t.placement.shape[k]} ranks) cuts axis {s.axis} of size {t.meta.shape[s.axis]}"
        for k, s in enumerate(t.sbp)
        if isinstance(s, Split)
    ]
    raise GraphError(
        f"tensor {t.name!r} {t.meta} is annotated {format_nd(t.sbp)} on {t.placement}, which leaves some "
        f"rank an empty shard: {'; '.join(bad)}. Split an axis at least as large as the ranks it is cut "
        "over, or use sf.sbp.broadcast"
    )


def _check_update(g: Graph, var: str, new: str) -> None:
    for name in (var, new):
        if name not in g.tensors:
            raise GraphError(f"state.updates names tensor {name!r}, which the graph does not declare")
    if g.tensors[var].meta != g.tensors[new].meta:
        raise GraphError(
            f"variable {var!r} {g.tensors[var].meta} is updated by {new!r} {g.tensors[new].meta}; "
            "the new value must have the variable's shape and dtype"
        )


def dump(state: CompileState) -> str:
    """One line per op: its name, type, placement, chosen signature, boxing bytes and why."""
    lines = []
    for node in state.graph.ops:
        choice = state.choices.get(node.name)
        if choice is None:
            continue
        where = "" if node.placement is None else f" on ranks {list(node.placement.ranks)}"
        lines.append(
            f"{node.name} ({node.op_type}){where}: {choice.signature!r}  [{choice.cost} B] {choice.reason}"
        )
    return "\n".join(lines)
