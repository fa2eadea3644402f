"""The cost model of SBP inference: what one op's choice depends on, and how a candidate is priced.

**Cost.** For a candidate signature: the bytes of ``plan_boxing`` from each distinct (input, required
SBP) to what the signature needs, plus the bytes to box each targeted output to its target -- what the
op pays *here* (``Choice.cost``). Candidates are ranked by that plus what each untargeted output costs
its *readers*: a one-op lookahead prices every reader's cheapest signature given the candidate's output
and the reader's other inputs as they stand (an input a later op produces is priced at nothing; one
boxing serves every reader that wants the same layout). A partial output owes at least half an
all-reduce of itself (a reduce-scatter, the least any reader pays to use it nonlinearly) even when its
reader is linear and keeps it partial; without that floor the walk turns column-split weights into row
splits to emit ``P`` and leaves the sum to a later, larger tensor. The lookahead is what gives Megatron
its one all-reduce per block: a layer norm reading a partial residual could reduce-scatter it (half the
bytes now) but its reader, a column-split matmul, would all-gather it back; priced together the two
collectives cost what one all-reduce does and take an extra step, so the all-reduce wins.

**Tie-breaker** (lexicographic, after the bytes here and downstream): (1) fewer boxing steps, here and
downstream (zero-byte slices and zero fills count: fewer nodes to run); (2) fewer bytes paid here (pay
late: a later op may reduce the tensor first); (3) fewer bytes touched per rank, the sum over inputs and
outputs of the largest local shard -- a proxy for per-rank compute and memory that prefers signatures
that split large tensors, so ``S`` beats ``B``; (4) the order of the op's rows (einsum rows list letters
in order, so ``"mk,kn->mn"`` tries the batch split first). The result is deterministic.

**Speed.** The choice for an op depends only on a nameless :class:`_Context` (op type, attributes, shapes,
the layouts of its inputs, its outputs' targets and readers), so the layers of a deep model share one
evaluation: a 96-layer model costs about what one layer does, plus the walk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod

from sbpflow.boxing import boxing_cost, plan_boxing
from sbpflow.control_plane.compiler.state import Choice
from sbpflow.ops.base import AttrValue, NdSignature, get_op
from sbpflow.ops.flops import work
from sbpflow.placement import Placement
from sbpflow.sbp import B, Broadcast, NdSbp, PartialSum, Split
from sbpflow.tensor_meta import TensorMeta

# ---- what a choice depends on: no names, so repeated layers share one evaluation ------------------


@dataclass(frozen=True)
class Fixed:
    """A tensor whose layout is known: annotated, or chosen with its producer."""

    placement: Placement
    sbp: NdSbp


@dataclass(frozen=True)
class Free:
    """A source nobody has laid out yet: stored as its first reader wants, at ``home`` if it has one."""

    home: Placement | None


@dataclass(frozen=True)
class Pending:
    """Made by a later op: its layout is not known yet, so a reader's lookahead prices it at nothing."""


@dataclass(frozen=True)
class Own:
    """Output ``k`` of the op being chosen, as one of its readers sees it."""

    k: int


State = Fixed | Free | Pending | Own
Attrs = tuple[tuple[str, str, AttrValue], ...]


@dataclass(frozen=True)
class Call:
    op_type: str
    attrs: Attrs
    placement: Placement
    metas: tuple[TensorMeta, ...]
    same: tuple[int, ...]  # per input, the index of its first occurrence: x * x boxes x once
    states: tuple[State, ...]


@dataclass(frozen=True)
class Out:
    placed: Placement
    goal: NdSbp | int | None  # the SBP it must end up with; int i: that of the free variable read as input i
    readers: tuple[Call, ...]  # priced by the lookahead when there is no goal


@dataclass(frozen=True)
class Context:
    call: Call
    outs: tuple[Out, ...]
    micro: tuple[Attrs, tuple[TensorMeta, ...]] | None = None  # the call on one micro-batch, if cut


@dataclass(frozen=True, order=True)
class _Key:
    """What a candidate signature is ranked by (smallest first); see the module docstring."""

    ranked: int  # boxing bytes here plus what the outputs cost their readers
    steps: int  # boxing steps, here and downstream
    bytes: int  # boxing bytes here
    touched: int
    index: int


@lru_cache(maxsize=65536)
def signatures(
    op_type: str, attrs: Attrs, metas: tuple[TensorMeta, ...], mesh: tuple[int, ...]
) -> tuple[tuple[TensorMeta, ...], tuple[NdSignature, ...]]:
    """The op's output metas and valid nd-signatures, cached: deep models repeat the same calls."""
    op, plain = get_op(op_type), {k: v for k, _, v in attrs}
    return op.run_infer(metas, plain), tuple(op.nd_signatures(metas, plain, mesh))


def attrs_key(attrs: Mapping[str, AttrValue]) -> Attrs:
    """Normalised attributes as a hashable key (the type too: ``True`` and ``1`` hash alike)."""
    return tuple((k, type(v).__name__, v) for k, v in sorted(attrs.items()))


# ---- pricing a candidate ---------------------------------------------------------------------------


def store(home: Placement | None, pl: Placement, want: NdSbp) -> tuple[Placement, NdSbp]:
    """Where and how a free source is stored when a reader on ``pl`` wants ``want``."""
    home = home or pl
    if home != pl:
        return home, (B,) * home.ndim  # another stage's variable: whole there, sent point to point
    return home, tuple(B if isinstance(s, PartialSum) else s for s in want)


@lru_cache(maxsize=1 << 16)
def boxing_bytes_steps(
    meta: TensorMeta, src: Placement, have: NdSbp, pl: Placement, want: NdSbp
) -> tuple[int, int]:
    """(bytes, steps) of boxing ``meta`` from (src, have) to (pl, want); cached apart from the plans."""
    if have == want and src == pl:
        return 0, 0
    return boxing_cost(meta, src, have, pl, want)


_boxing = boxing_bytes_steps


@lru_cache(maxsize=1 << 16)
def boxing_bytes_collectives(
    meta: TensorMeta, src: Placement, have: NdSbp, pl: Placement, want: NdSbp
) -> tuple[int, int]:
    """(bytes, steps that move bytes): a local slice or a zero fill starts no collective, so it has no
    latency to pay."""
    if src != pl:
        return boxing_bytes_steps(meta, src, have, pl, want)  # point to point: every step sends
    if have == want:
        return 0, 0
    plan = plan_boxing(meta, src, have, pl, want)
    return plan.bytes, sum(1 for s in plan.steps if s.bytes)


def goal_of(out: Out, s: NdSignature, call: Call) -> NdSbp | None:
    if isinstance(out.goal, int):  # the variable is stored as this very signature reads it
        home = call.states[out.goal]
        assert isinstance(home, Free)
        placed, sbp = store(home.home, out.placed, s.ins[out.goal])
        return sbp if placed == out.placed else (B,) * out.placed.ndim  # a variable on another mesh
    return out.goal


def _owed(meta: TensorMeta, pl: Placement, have: NdSbp) -> int:
    """A partial tensor owes at least a reduce-scatter (half an all-reduce) to whoever uses it nonlinearly."""
    if not any(isinstance(x, PartialSum) for x in have):
        return 0
    whole = tuple(B if isinstance(x, PartialSum) else x for x in have)
    return _boxing(meta, pl, have, pl, whole)[0] // 2


_Wants = tuple[tuple[int, TensorMeta, NdSbp], ...]  # (own output k, its meta, the SBP a reader wants)


@lru_cache(maxsize=1 << 14)
def _options(call: Call) -> tuple[tuple[int, int, _Wants], ...]:
    """Per distinct ask of the chosen op's own outputs among ``call``'s signatures: the least (bytes, steps)
    of boxing its other inputs plus what its new partial outputs owe, and the ask; cheapest first (a
    reader's lookahead scans them in order). Without that floor a reader looks cheapest when it creates a
    large partial sum (a matmul contracting a split axis) for its own readers, whom the one-op lookahead
    does not see; a partial passed on from a partial input is owed where it was made."""
    out = []
    out_metas, sigs = signatures(call.op_type, call.attrs, call.metas, call.placement.shape)
    for s in sigs:
        total = steps = 0
        if not any(
            isinstance(x, PartialSum) for nd in s.ins for x in nd
        ):  # a new partial sum, not one passed on
            total = sum(_owed(m, call.placement, nd) for m, nd in zip(out_metas, s.outs, strict=True))
        wants: list[tuple[int, TensorMeta, NdSbp]] = []
        seen: set[tuple[int, NdSbp]] = set()
        for i, want in enumerate(s.ins):
            if (call.same[i], want) in seen:
                continue  # one boxing serves both uses of a tensor (x * x)
            seen.add((call.same[i], want))
            st = call.states[i]
            if isinstance(st, Own):
                wants.append((st.k, call.metas[i], want))
                continue
            if isinstance(st, Fixed):
                b, n = _boxing(call.metas[i], st.placement, st.sbp, call.placement, want)
            elif isinstance(st, Free):
                b, n = _boxing(call.metas[i], *store(st.home, call.placement, want), call.placement, want)
            else:
                continue
            total, steps = total + b, steps + n
        out.append((total, steps, tuple(wants)))
    cheapest: dict[_Wants, tuple[int, int, _Wants]] = {}  # per distinct ask of the own outputs, the best
    for o in sorted(out, key=lambda o: o[:2]):
        cheapest.setdefault(o[2], o)
    return tuple(cheapest.values())


Mine = tuple[tuple[Placement, NdSbp], ...]  # where and how the candidate lays out each output


def _downstream(out: Out, mine: Mine) -> tuple[int, int]:
    """What the readers of one output pay at best: each its cheapest signature, shared boxings once."""
    total = steps = 0
    shared: dict[tuple[int, Placement, NdSbp], tuple[int, int]] = {}
    for r in out.readers:
        best: tuple[int, int, dict[tuple[int, Placement, NdSbp], tuple[int, int]]] | None = None
        for others, others_steps, wants in _options(r):
            if best is not None and (others, others_steps) >= best[:2]:
                break  # sorted: no later signature can beat it
            own = {(k, r.placement, w): _boxing(m, *mine[k], r.placement, w) for k, m, w in wants}
            cost = (
                others + sum(b for b, _ in own.values()),
                others_steps + sum(n for _, n in own.values()),
            )
            if best is None or cost < best[:2]:
                best = (*cost, own)
        if best is not None:
            own = best[2]
            total += best[0] - sum(b for b, _ in own.values())
            steps += best[1] - sum(n for _, n in own.values())
            shared.update(own)
    return total + sum(b for b, _ in shared.values()), steps + sum(n for _, n in shared.values())


def _rank(ctx: Context, s: NdSignature, index: int, out_metas: Sequence[TensorMeta], later_of: dict) -> _Key:
    call, pl = ctx.call, ctx.call.placement
    here = steps = later = 0
    seen: set[tuple[int, NdSbp]] = set()
    for i, want in enumerate(s.ins):
        if (call.same[i], want) in seen:
            continue
        seen.add((call.same[i], want))
        st = call.states[i]
        src = (st.placement, st.sbp) if isinstance(st, Fixed) else store(getattr(st, "home", None), pl, want)
        b, n = _boxing(call.metas[i], *src, pl, want)
        here, steps = here + b, steps + n
    mine = tuple((out.placed, have) for out, have in zip(ctx.outs, s.outs, strict=True))
    for k, (out, have, meta) in enumerate(zip(ctx.outs, s.outs, out_metas, strict=True)):
        goal = goal_of(out, s, call)
        if goal is not None:
            b, n = _boxing(meta, pl, have, out.placed, goal)
            here, steps = here + b, steps + n
            continue
        if (k, mine) not in later_of:
            b, n = _downstream(out, mine)
            if any(isinstance(x, PartialSum) for x in have):
                b, n = max((b, n), (_owed(meta, pl, have), 1))
            later_of[k, mine] = b, n
        b, n = later_of[k, mine]
        later, steps = later + b, steps + n
    touched = sum(
        local_bytes(m, pl, nd) for m, nd in zip((*call.metas, *out_metas), (*s.ins, *s.outs), strict=True)
    )
    return _Key(here + later, steps, here, touched, index)


def canonical(ctx: Context) -> Context:
    """``ctx`` with its ranks renamed 0, 1, 2, ... in order of first appearance. Costs depend on ranks only
    through which placements share them, so this changes no price, and the middle stages of a pipeline
    (each its own ranks, the same neighbours) share one evaluation as the layers of one stage do."""
    ids: dict[int, int] = {}
    seen: dict[Placement, Placement] = {}

    def pl(p: Placement) -> Placement:
        if p not in seen:
            seen[p] = Placement(p.device_type, tuple(ids.setdefault(r, len(ids)) for r in p.ranks), p.shape)
        return seen[p]

    def state(st: State) -> State:
        if isinstance(st, Fixed):
            return Fixed(pl(st.placement), st.sbp)
        if isinstance(st, Free) and st.home is not None:
            return Free(pl(st.home))
        return st

    def call(c: Call) -> Call:
        return Call(c.op_type, c.attrs, pl(c.placement), c.metas, c.same, tuple(map(state, c.states)))

    head = call(ctx.call)
    outs = tuple(Out(pl(o.placed), o.goal, tuple(map(call, o.readers))) for o in ctx.outs)
    return Context(head, outs, ctx.micro)


def evaluate(ctx: Context) -> tuple[NdSignature, Choice] | None:
    c = ctx.call
    out_metas, sigs = signatures(c.op_type, c.attrs, c.metas, c.placement.shape)
    if ctx.micro is not None:  # micro_batching runs the choice on 1/M of the batch: it must fit there too
        small = set(signatures(c.op_type, *ctx.micro, c.placement.shape)[1])
        sigs = tuple(s for s in sigs if s in small)
    if not sigs:
        return None
    later_of: dict = {}  # (output, candidate layouts) -> what its readers pay; candidates share many
    keyed = sorted((_rank(ctx, s, i, out_metas, later_of), s) for i, s in enumerate(sigs))
    key, best = keyed[0]
    return best, Choice(best, key.bytes, _reason(key, keyed))


def overruled(ctx: Context, s: NdSignature, walk: Choice) -> Choice:
    """``s``, the whole-graph program's choice (:mod:`sbp_ilp`), priced here, and why it beats the walk's."""
    if s == walk.signature:
        return Choice(s, walk.cost, f"whole-graph optimum, as the walk finds: {walk.reason}")
    c = ctx.call
    out_metas, sigs = signatures(c.op_type, c.attrs, c.metas, c.placement.shape)
    key = _rank(ctx, s, sigs.index(s), out_metas, {})
    return Choice(
        s,
        key.bytes,
        f"whole-graph optimum at {key.bytes} B here: the one-op walk would pick {walk.signature!r} "
        f"({walk.reason.split(';')[0]}), which costs more further on",
    )


def _reason(key: _Key, keyed: Sequence[tuple[_Key, NdSignature]]) -> str:
    if len(keyed) == 1:
        return "the only valid signature"
    runner = keyed[1][0]
    later = key.ranked - key.bytes
    at = f"{key.bytes} B" + (f" + {later} B for its readers" if later else "")
    if key.ranked < runner.ranked:
        why = f"cheapest boxing ({at}; next best {runner.ranked} B)"
    elif key.steps < runner.steps:
        why = f"fewest boxing steps at {at} ({key.steps}; next best {runner.steps})"
    elif key.bytes < runner.bytes:
        why = f"pays least here at {at} (next best pays {runner.bytes} B here)"
    elif key.touched < runner.touched:
        why = f"splits the most work at {at} ({key.touched} B per rank)"
    else:
        why = f"first of equal signatures at {at}"
    return f"{why}; {len(keyed)} candidates"


def local_bytes(meta: TensorMeta, pl: Placement, nd: NdSbp) -> int:
    """Bytes of the largest shard one rank holds (uneven splits round up)."""
    shape = list(meta.shape)
    for s, parts in zip(nd, pl.shape, strict=True):
        if isinstance(s, Split):
            shape[s.axis] = -(-shape[s.axis] // parts)
    return prod(shape) * meta.dtype.itemsize


# ---- work per rank: what a signature leaves each rank to compute ----------------------------------


def _contraction(
    op_type: str, attrs: Mapping[str, AttrValue], metas: Sequence[TensorMeta], outs: Sequence[TensorMeta]
) -> int:
    a = metas[0]
    return 2 * prod(outs[0].shape) * (a.shape[-2] if attrs.get("transpose_a") else a.shape[-1])


def _counted(
    op_type: str, attrs: Mapping[str, AttrValue], metas: Sequence[TensorMeta], outs: Sequence[TensorMeta]
) -> int:
    return work(op_type, tuple(metas), tuple(outs), attrs).flops


# op -> its logical FLOPs (the GEMMs, and attention's around its scores); the others are priced by the bytes
# they touch
_CONTRACTIONS = {
    "matmul": _contraction,
    "batch_matmul": _contraction,
    "attention": _counted,
    "attention_grad": _counted,
}


def flops_per_rank(
    op_type: str,
    attrs: Attrs,
    metas: Sequence[TensorMeta],
    out_metas: Sequence[TensorMeta],
    pl: Placement,
    s: NdSignature,
) -> int:
    """A contraction's FLOPs on one rank under ``s``: its logical FLOPs over the ranks of every mesh axis
    whose row splits the work (any entry S or P); an all-``B`` row repeats it on every rank of that axis.
    0 for an op that is not a contraction."""
    total_of = _CONTRACTIONS.get(op_type)
    if total_of is None:
        return 0
    total = total_of(op_type, {k: v for k, _, v in attrs}, metas, out_metas)
    split = prod(
        n
        for axis, n in enumerate(pl.shape)
        if not all(isinstance(nd[axis], Broadcast) for nd in (*s.ins, *s.outs))
    )
    return total // split
