"""SBP signature inference: an nd-SBP for every tensor, hence a signature for every op.

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
weights (tensor parallelism) they come out ``B`` with no gather. A source nobody consumes is all-``B``.

**Cost.** For a candidate signature: the bytes of ``plan_boxing`` from each distinct (input, required
SBP) to what the signature needs, plus the bytes to box each targeted output from the signature's SBP to
its target. Candidates are ranked by that plus what an untargeted *partial* output still owes: half an
all-reduce of it (a reduce-scatter, the least any reader pays to use it nonlinearly). Without that term
the greedy walk happily turns column-split weights into row splits to emit ``P`` and leaves the sum to a
later, larger tensor; ``Choice.cost`` reports the boxing bytes only.

Greedy in topological order, so a choice never looks past its own outputs. Known effects: after a
row-split matmul the partial residual is reduce-scattered and then all-gathered (sequence-parallel
style, the same bytes as Megatron's one all-reduce) rather than all-reduced; and a partial gradient read
by two ops (clipping's ``sum(g*g)``, then ``g*coef``) may be reduced twice.

**Tie-breaker** (lexicographic, after the bytes): (1) fewer boxing steps (zero-byte slices and zero
fills count: fewer nodes to run); (2) fewer bytes touched per rank, the sum over inputs and outputs of
the largest local shard -- a proxy for per-rank compute and memory that prefers signatures that split
large tensors, so ``S`` beats ``B``; (3) the order of the op's rows (einsum rows list letters in order,
so ``"mk,kn->mn"`` tries the batch split first). The result is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import prod

from sbpflow.control_plane.compiler.boxing import plan_boxing
from sbpflow.control_plane.compiler.state import Choice, CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.ops.base import NdSignature, get_op
from sbpflow.placement import Placement
from sbpflow.sbp import B, NdSbp, PartialSum, Split, format_nd
from sbpflow.sharding import min_split_size
from sbpflow.tensor_meta import TensorMeta

PRODUCED_KINDS = (TensorKind.activation, TensorKind.gradient)


@dataclass(frozen=True, order=True)
class _Key:
    """What a candidate signature is ranked by (smallest first); see the module docstring."""

    ranked: int  # boxing bytes plus what partial outputs still owe
    bytes: int
    steps: int
    touched: int
    index: int


@dataclass
class _Solver:
    graph: Graph
    fixed: dict[str, NdSbp]  # tensor -> its SBP (annotated, or chosen)
    placed: dict[str, Placement]
    targets: dict[str, NdSbp]  # op output -> the SBP it must end up with
    updates: dict[str, str]  # new value -> variable (state.updates inverted)

    # ---- costs ------------------------------------------------------------------------------------

    def _is_free(self, t: str) -> bool:
        return t not in self.fixed

    def _store(self, t: str, want: NdSbp, pl: Placement) -> tuple[Placement, NdSbp]:
        """Where and how a free source is stored when a consumer on ``pl`` wants ``want``."""
        home = self.placed.get(t, pl)
        if home != pl:
            return home, (B,) * home.ndim  # another stage's variable: whole there, sent point to point
        return home, tuple(B if isinstance(s, PartialSum) else s for s in want)

    def _boxing(self, t: str, src: tuple[Placement, NdSbp], pl: Placement, want: NdSbp) -> tuple[int, int]:
        if src == (pl, want):
            return 0, 0
        plan = plan_boxing(self.graph.tensors[t].meta, src[0], src[1], pl, want)
        return plan.bytes, len(plan.steps)

    def _source(self, t: str, pl: Placement, want: NdSbp) -> tuple[Placement, NdSbp]:
        if self._is_free(t):
            return self._store(t, want, pl)
        return self.placed[t], self.fixed[t]

    def _target(self, node: OpNode, s: NdSignature, k: int) -> NdSbp | None:
        out = node.outputs[k]
        var = self.updates.get(out)
        if var is not None and self._is_free(var) and var in node.inputs:
            # the variable is stored as this very signature reads it
            return self._store(var, s.ins[node.inputs.index(var)], self.placed[out])[1]
        if var is not None and not self._is_free(var):
            return self.fixed[var]
        return self.targets.get(out)

    def _owed(self, t: str, pl: Placement, have: NdSbp) -> int:
        """A partial output owes at least a reduce-scatter (half an all-reduce) to whoever reads it."""
        whole = tuple(B if isinstance(x, PartialSum) else x for x in have)
        return self._boxing(t, (pl, have), pl, whole)[0] // 2

    def rank(self, node: OpNode, pl: Placement, s: NdSignature, index: int) -> _Key:
        total = steps = 0
        seen: set[tuple[str, NdSbp]] = set()
        for t, want in zip(node.inputs, s.ins, strict=True):
            if (t, want) in seen:
                continue  # one boxing serves both uses of a tensor (x * x)
            seen.add((t, want))
            b, n = self._boxing(t, self._source(t, pl, want), pl, want)
            total, steps = total + b, steps + n
        owed = 0
        for k, (out, have) in enumerate(zip(node.outputs, s.outs, strict=True)):
            goal = self._target(node, s, k)
            if goal is not None:
                b, n = self._boxing(out, (pl, have), self.placed[out], goal)
                total, steps = total + b, steps + n
            elif any(isinstance(x, PartialSum) for x in have):
                owed += self._owed(out, pl, have)
        metas = [self.graph.tensors[t].meta for t in (*node.inputs, *node.outputs)]
        touched = sum(_local_bytes(m, pl, nd) for m, nd in zip(metas, (*s.ins, *s.outs), strict=True))
        return _Key(total + owed, total, steps, touched, index)

    # ---- choosing ---------------------------------------------------------------------------------

    def choose(self, node: OpNode, pl: Placement) -> Choice:
        op = get_op(node.op_type)
        attrs = op.normalize_attrs(node.attrs)
        metas = tuple(self.graph.tensors[t].meta for t in node.inputs)
        sigs = op.nd_signatures(metas, attrs, pl.shape)
        if not sigs:
            ins = ", ".join(f"{t}: {self.graph.tensors[t].meta}" for t in node.inputs)
            raise GraphError(
                f"op {node.name!r} ({node.op_type}) with inputs {ins} has no valid SBP signature on the "
                f"{pl.shape} mesh of {pl}; use fewer ranks or larger tensors"
            )
        keyed = sorted((self.rank(node, pl, s, i), s) for i, s in enumerate(sigs))
        key, best = keyed[0]
        for t, want in zip(node.inputs, best.ins, strict=True):
            if self._is_free(t):
                self.placed[t], self.fixed[t] = self._store(t, want, pl)
        for k, out in enumerate(node.outputs):
            goal = self._target(node, best, k)
            self.fixed[out] = best.outs[k] if goal is None else goal
        return Choice(best, key.bytes, _reason(node, best, key, keyed))


def _reason(node: OpNode, best: NdSignature, key: _Key, keyed: Sequence[tuple[_Key, NdSignature]]) -> str:
    if len(keyed) == 1:
        return "the only valid signature"
    runner = keyed[1][0]
    if key.bytes < runner.bytes:
        why = f"cheapest boxing ({key.bytes} B; next best {runner.bytes} B)"
    elif key.steps < runner.steps:
        why = f"fewest boxing steps at {key.bytes} B"
    elif key.touched < runner.touched:
        why = f"splits the most work at {key.bytes} B ({key.touched} B per rank)"
    else:
        why = f"first of equal signatures at {key.bytes} B"
    return f"{why}; {len(keyed)} candidates"


def _local_bytes(meta: TensorMeta, pl: Placement, nd: NdSbp) -> int:
    """Bytes of the largest shard one rank holds (uneven splits round up)."""
    shape = list(meta.shape)
    for s, parts in zip(nd, pl.shape, strict=True):
        if isinstance(s, Split):
            shape[s.axis] = -(-shape[s.axis] // parts)
    return prod(shape) * meta.dtype.itemsize


# ---- the pass ------------------------------------------------------------------------------------


def run(state: CompileState) -> None:
    g = state.graph
    solver = _Solver(g, {}, {}, {}, {new: var for var, new in state.updates.items()})
    produced = {o for node in g.ops for o in node.outputs}
    for t in g.tensors.values():
        if t.placement is not None:
            solver.placed[t.name] = t.placement
        if t.sbp is not None:
            assert t.placement is not None  # Graph.verify: an SBP comes with its placement
            _check_annotation(g, t)
            # an annotated source is read as it is; an annotated op output is boxed to it
            (solver.targets if t.name in produced else solver.fixed)[t.name] = t.sbp
    for name in (state.job.loss, *state.job.fetches):
        if name in produced and name not in solver.targets:
            solver.targets[name] = (B,) * _placement_of(g, solver, name).ndim
    for var, new in state.updates.items():
        _check_update(g, var, new)

    ops = []
    for node in g.ops:
        pl = _op_placement(g, solver, node)
        node = replace(node, placement=pl)
        for o in node.outputs:
            solver.placed.setdefault(o, pl)
        if node.op_type == BOXING:  # already boxed (a rerun): the node keeps its endpoints
            for o in node.outputs:
                solver.fixed.setdefault(o, g.tensors[o].sbp or (B,) * pl.ndim)
        else:
            state.choices[node.name] = solver.choose(node, pl)
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
