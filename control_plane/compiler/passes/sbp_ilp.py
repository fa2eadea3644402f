"""The whole graph's SBP signatures at once: an integer program over every op's candidates (Alpa's
intra-operator formulation), solved by HiGHS through ``scipy.optimize.milp``.

The one-op walk of :mod:`sbp_inference` prices a choice by its own boxings and its readers' cheapest
reply. It cannot see that a reduce-scatter at the end of GPT's forward (half an all-reduce) leaves the
whole backward batch-split, so that every weight gradient all-gathers its activations: 2.5 MB a step
where Megatron's layout moves 1.6 MB. This program prices every choice together:

* ``x[o, s]`` (binary): op ``o`` runs signature ``s``; one per op. Its candidates are the walk's (valid on
  the op's placement, and on one micro-batch when the step is cut).
* ``z[t, l]`` (binary): an unannotated source ``t`` (a parameter, optimizer state, a data input) is stored
  as ``l``, one of the layouts its readers ask for (a partial ask stored whole); one per source.
* ``y[t, r, h, w]`` (continuous): tensor ``t`` is laid out ``h`` and reader ``r`` takes it as ``w``, with
  both marginals pinned: ``sum_w y = have[t, h]`` and ``sum_h y = ask[r, w]`` (the reader's ``x`` that ask
  ``w``). That makes the relaxation exact on chains and trees, which HiGHS then solves at the root.
* ``u[t, h, w] >= y[t, r, h, w]`` for every reader: the boxing ``h -> w`` runs once, however many readers
  take ``w`` (as ``boxing_pass`` inserts it); it costs its bytes by the boxing table plus ``STEP`` per
  step (a collective's latency), so that equal bytes in fewer collectives win.

A tensor's layout ``have[t, h]`` is the sum of its producer's ``x`` that output ``h``, a source's ``z``, or
its goal: an annotated op output, the loss and the fetches (``B``), a variable's new value (the
variable's layout) and a gradient (its parameter's) are boxed to the goal, and their readers read that.
Annotations stay hard constraints: an annotated source has one layout. Each ``x`` also pays for the work
it leaves a rank: a contraction's FLOPs (``FLOP`` bytes each), else the bytes it touches (``TOUCHED``),
then its row order; without that, replicating every op would be the cheapest data parallelism. The
result is optimal for that price, on chains and DAGs alike; it does not see overlap.

:func:`solve` returns ``None`` when the program is too large for its budget (deep models fall back to the
walk, whose memo makes a 96-layer job cost about one layer) or HiGHS does not prove a solution in time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from sbpflow.control_plane.compiler.passes.sbp_cost import (
    Attrs,
    boxing_bytes_collectives,
    flops_per_rank,
    local_bytes,
    store,
)
from sbpflow.ops.base import NdSignature
from sbpflow.placement import Placement
from sbpflow.sbp import NdSbp
from sbpflow.tensor_meta import TensorMeta

# within budget: not a deep model's thousands of ops; a 2-d mesh is solved one axis at a time
# (sbp_inference._whole_graph: all of GPT's 2 layers on 2 x 2 at once take 178,000 variables)
MAX_OPS = 4_000
ENABLED = True  # bench/compiler/plan_quality.py turns it off to run the walk's plans beside the program's
MAX_CHOICES = 60_000  # x, z, y and shared-boxing variables together: above this the walk decides
TIME_LIMIT_S = 10.0
SCALE = 1e-3  # the objective in kB moved: HiGHS's tolerances suit costs near 1
# work priced in bytes moved: a FLOP as 1/50 of a byte (a CPU rank's ~50 GFLOP/s against ~1 GB/s of
# collective bandwidth), so that a layout replicating a contraction pays for the bytes it saves (Megatron's
# replicated head stays: 3/4 of its FLOPs cost less than splitting it); the bytes a rank touches break ties
FLOP = 0.02
TOUCHED, ORDER = 1e-3, 1e-9
# a boxing step's latency in bytes moved (a few microseconds of a collective's start-up): an all-reduce
# beats the reduce-scatter and all-gather of the same bytes (sequence parallelism is a choice to annotate)
STEP = 4096

Layout = tuple[Placement, NdSbp]


@dataclass(frozen=True)
class OpCall:
    name: str
    op_type: str
    attrs: Attrs
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    placement: Placement
    signatures: tuple[NdSignature, ...]
    out_metas: tuple[TensorMeta, ...]


@dataclass(frozen=True)
class Problem:
    ops: tuple[OpCall, ...]
    metas: Mapping[str, TensorMeta]
    fixed: Mapping[str, Layout]  # annotated sources
    free: Mapping[str, Placement | None]  # unannotated sources, with their home placement if any
    goal: Mapping[str, Layout | str]  # produced tensor -> the layout it is boxed to, or a source's name


@dataclass(frozen=True)
class Solution:
    signatures: dict[str, NdSignature]
    stored: dict[str, Layout]  # free source -> its layout
    bytes: int  # what the chosen plan boxes, by the table
    price: float  # the program's objective, in bytes moved (boxing, latency, work)


# an expression: a constant 1 (None) or the sum of some variables (their column indices)
Expr = tuple[int, ...] | None


@dataclass
class _Program:
    cost: list[float] = field(default_factory=list)
    integral: list[int] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    moved: list[tuple[int | None, int]] = field(default_factory=list)  # (column or always, bytes)

    def var(self, cost: float, integral: bool) -> int:
        self.cost.append(cost)
        self.integral.append(int(integral))
        return len(self.cost) - 1

    def row(self, coef: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coef, lo, hi))

    def flows(
        self, have: Sequence[tuple[Layout, Expr]], asks: Mapping[Layout, Expr]
    ) -> dict[tuple[Layout, Layout], int]:
        """``y[h, w]``: the tensor is laid out ``h`` and one reader takes it as ``w``. Both marginals are
        pinned (``sum_w y[h, w] = have[h]``, ``sum_h y[h, w] = ask[w]``), which makes the relaxation exact
        on chains and trees, where the program is then solved without branching."""
        y = {(h, w): self.var(0.0, False) for h, _ in have for w in asks}
        for h, expr in have:
            self._equal({y[h, w]: 1.0 for w in asks}, expr)
        for w, expr in asks.items():
            self._equal({y[h, w]: 1.0 for h, _ in have}, expr)
        return y

    def _equal(self, coef: dict[int, float], expr: Expr) -> None:
        if expr is None:
            self.row(coef, 1.0, 1.0)
        else:
            for c in expr:
                coef[c] = coef.get(c, 0.0) - 1.0
            self.row(coef, 0.0, 0.0)

    def charge(self, meta: TensorMeta, ys: Sequence[dict[tuple[Layout, Layout], int]]) -> None:
        """Each boxing ``h -> w`` costs its bytes and steps once, however many readers take ``w``."""
        pairs = dict.fromkeys(k for y in ys for k in y)
        for h, w in pairs:
            b, n = boxing_bytes_collectives(meta, h[0], h[1], w[0], w[1])
            if b == 0 and n == 0:
                continue
            cols = [y[h, w] for y in ys if (h, w) in y]
            price = (b + STEP * n) * SCALE
            if len(cols) == 1:
                self.cost[cols[0]] = price
                self.moved.append((cols[0], b))
                continue
            u = self.var(price, False)
            for c in cols:
                self.row({u: 1.0, c: -1.0}, 0.0, np.inf)
            self.moved.append((u, b))


def solve(p: Problem) -> Solution | None:
    if sum(len(op.signatures) for op in p.ops) > MAX_CHOICES // 4:  # the flows would not fit either
        return None
    prog = _Program()
    x: dict[str, list[int]] = {}
    for op in p.ops:
        x[op.name] = [
            prog.var(SCALE * _work(p, op, s) + ORDER * i, True) for i, s in enumerate(op.signatures)
        ]
        prog.row(dict.fromkeys(x[op.name], 1.0), 1.0, 1.0)
    asks = _asks(p, x)
    stored = _stores(p, asks, prog)
    have, goals = _layouts(p, x, stored, prog)
    for t, flows in goals.items():
        prog.charge(p.metas[t], flows)
    for t, readers in asks.items():
        if t not in have:
            continue
        ys = []
        for wants in readers.values():
            ys.append(prog.flows(have[t], {w: tuple(cols) for w, cols in wants.items()}))
        prog.charge(p.metas[t], ys)
        if len(prog.cost) > MAX_CHOICES:
            return None
    return _run(p, prog, x, stored)


def _work(p: Problem, op: OpCall, s: NdSignature) -> float:
    ins = tuple(p.metas[t] for t in op.inputs)
    touched = sum(
        local_bytes(m, op.placement, nd)
        for m, nd in zip((*ins, *op.out_metas), (*s.ins, *s.outs), strict=True)
    )
    return FLOP * flops_per_rank(op.op_type, op.attrs, ins, op.out_metas, op.placement, s) + TOUCHED * touched


def _asks(p: Problem, x: Mapping[str, list[int]]) -> dict[str, dict[str, dict[Layout, list[int]]]]:
    """Per tensor, per reader, per layout it may ask for: the reader's ``x`` columns that ask it."""
    asks: dict[str, dict[str, dict[Layout, list[int]]]] = {}
    for op in p.ops:
        for i, s in enumerate(op.signatures):
            seen: set[tuple[str, NdSbp]] = set()
            for t, want in zip(op.inputs, s.ins, strict=True):
                if (t, want) not in seen:
                    seen.add((t, want))
                    reader = asks.setdefault(t, {}).setdefault(op.name, {})
                    reader.setdefault((op.placement, want), []).append(x[op.name][i])
    return asks


def _stores(
    p: Problem, asks: Mapping[str, Mapping[str, Mapping[Layout, list[int]]]], prog: _Program
) -> dict[str, list[tuple[Layout, int]]]:
    """``z``: the layouts each free source may be stored as (what its readers ask, a partial ask whole)."""
    out: dict[str, list[tuple[Layout, int]]] = {}
    for t, home in p.free.items():
        wanted = (layout for reader in asks.get(t, {}).values() for layout in reader)
        options = list(dict.fromkeys(store(home, pl, want) for pl, want in wanted))
        if not options:
            continue
        out[t] = [(layout, prog.var(0.0, True)) for layout in options]
        prog.row({z: 1.0 for _, z in out[t]}, 1.0, 1.0)
    return out


def _layouts(
    p: Problem, x: Mapping[str, list[int]], stored: Mapping[str, list[tuple[Layout, int]]], prog: _Program
) -> tuple[dict[str, list[tuple[Layout, Expr]]], dict[str, list[dict[tuple[Layout, Layout], int]]]]:
    """What each tensor's readers box from, and when; and for a tensor with a goal, the flows from what
    its producer makes to the goal (charged like a reader's)."""
    have: dict[str, list[tuple[Layout, Expr]]] = {}
    goals: dict[str, list[dict[tuple[Layout, Layout], int]]] = {}
    for t, layout in p.fixed.items():
        have[t] = [(layout, None)]
    for t, options in stored.items():
        have[t] = [(layout, (z,)) for layout, z in options]
    for op in p.ops:
        for k, t in enumerate(op.outputs):
            made: dict[Layout, list[int]] = {}
            for i, s in enumerate(op.signatures):
                made.setdefault((op.placement, s.outs[k]), []).append(x[op.name][i])
            produced: list[tuple[Layout, Expr]] = [(layout, tuple(cols)) for layout, cols in made.items()]
            goal = p.goal.get(t)
            if goal is None:
                have[t] = produced
                continue
            if not isinstance(goal, str):
                targets: list[tuple[Layout, Expr]] = [(goal, None)]
            elif goal in p.fixed:
                targets = [((op.placement, p.fixed[goal][1]), None)]
            else:
                targets = [((op.placement, lay[1]), (z,)) for lay, z in stored.get(goal, [])]
            if targets:
                goals[t] = [prog.flows(produced, dict(targets))]
            have[t] = targets
    return have, goals


def _run(
    p: Problem, prog: _Program, x: Mapping[str, list[int]], stored: Mapping[str, list[tuple[Layout, int]]]
) -> Solution | None:
    # scipy here, not at the module's top: 0.4 s of every `sbpflow run`'s start, for the solver few plans call
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    n = len(prog.cost)
    r, c, v, lo, hi = [], [], [], [], []
    for k, (coef, a, b) in enumerate(prog.rows):
        for col, val in coef.items():
            r.append(k)
            c.append(col)
            v.append(val)
        lo.append(a)
        hi.append(b)
    a_mat = coo_array((v, (r, c)), shape=(len(prog.rows), n)).tocsr()
    res = milp(
        np.asarray(prog.cost),
        integrality=np.asarray(prog.integral),
        bounds=Bounds(np.zeros(n), np.ones(n)),
        constraints=LinearConstraint(a_mat, np.asarray(lo), np.asarray(hi)),
        options={
            "time_limit": TIME_LIMIT_S,
            "mip_rel_gap": 0.0,
            "presolve": True,
            "disp": bool(__import__("os").environ.get("H15_DISP")),
        },
    )
    if res.status != 0:  # not proven optimal in time (or infeasible): the walk's plan is no worse a bet
        return None
    val = np.round(res.x).astype(int)
    sigs = {op.name: op.signatures[_one(val, x[op.name])] for op in p.ops}
    chosen = {t: options[_one(val, [z for _, z in options])][0] for t, options in stored.items()}
    moved = sum(b for col, b in prog.moved if col is None or val[col] > 0)
    return Solution(sigs, chosen, moved, float(res.fun) / SCALE)


def _one(val: np.ndarray, cols: Sequence[int]) -> int:
    picked = [i for i, col in enumerate(cols) if val[col] == 1]
    assert len(picked) == 1, picked
    return picked[0]
