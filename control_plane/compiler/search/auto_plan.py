"""The automatic plan search: the layouts a user could write by hand, each compiled and priced, the
fastest that fits a memory budget per device chosen, and why (issue 15, deliverable 3).

    found = search(job, 80 * 10**9, on_profile(load_profile("h200")), ranks=4)
    print(found.table()); print(found.why())
    compiled = found.compiled  # the winner's plan, as pipeline.compile would give it for that layout

**What is weighed** (:func:`layouts`): on ``ranks`` devices, every mesh of ``pp`` pipeline stages of
``tp x dp`` ranks (pipeline stages only where the model has as many repeated blocks, tensor parallelism
only where the graph has Megatron pairs: the layouts of :mod:`auto_layouts`), each
ZeRO stage 0-3 where there is data parallelism, for a pipeline ``pp`` or ``2 pp`` micro-batches, and
for a model with embedding tables each layout with its tables whole and split by rows.
Recompute is weighed only for a layout that does not fit without it: it adds a forward's compute and
saves only activations, so it never wins where the layout fits already. ``powers_of_two`` keeps only
power-of-two degrees (a 1,024-device search).

**How each is priced.** The candidate job (:func:`auto_layouts.relayout`) is compiled by
``pipeline.compile`` like any other, so an illegal layout is refused by the compiler itself (its error
shown in the table); the plan is priced by the cost model (``cost_model.estimate``: compute, comm,
exposed comm, step time and the plan's memory estimate): the search is given its price function, the
modelled one of a saved profile (:func:`on_profile`), or, on this machine's CPU profile, one that times the
plan's kernels and the job's data source here (``control_plane/profiling/pricing.py``, which also names a
profile and its budget for the callers: ``pricing.search``). A candidate whose peak per device is over the
budget is shown with what it needs; the winner is the fastest that fits (ties: less memory, then the
simpler layout). When nothing fits, :class:`NoPlanFits` names the smallest peak found and the budget.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.cost import cost_model
from sbpflow.control_plane.compiler.cost.cost_model import DeviceProfile, StepEstimate
from sbpflow.control_plane.compiler.passes.micro_batching import layout as slots
from sbpflow.control_plane.compiler.search.auto_layouts import Layout, block_of, relayout, tables, tp_pairs
from sbpflow.errors import SbpflowError
from sbpflow.job import Job

Price = Callable[[pipeline.Compiled], StepEstimate]


class NoPlanFits(SbpflowError):
    """No layout's plan fits the memory budget per device."""


@dataclass(frozen=True)
class Traffic:
    """A plan's communication a step: bytes, collectives, and the largest kinds of them."""

    bytes: int = 0
    collectives: int = 0
    largest: tuple[tuple[str, int], ...] = ()  # ("all-reduce of [4, 16, 128] float32", count), by bytes

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {what}" for what, n in self.largest[:2])
        return f"{_size(self.bytes)} in {self.collectives} collectives" + (
            f" ({kinds}, ...)" if kinds else ""
        )


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    estimate: StepEstimate | None = None  # None: the compiler refused the layout (``error``)
    traffic: Traffic = Traffic()
    error: str = ""

    @property
    def peak(self) -> int:
        return self.estimate.peak_memory_bytes if self.estimate is not None else 0

    def fits(self, budget: int) -> bool:
        return self.estimate is not None and self.peak <= budget

    def key(self) -> tuple[float, int, Layout]:
        assert self.estimate is not None
        return (self.estimate.step_s, self.peak, self.layout)


@dataclass(frozen=True)
class Search:
    budget: int
    candidates: tuple[Candidate, ...]
    winner: Candidate
    compiled: pipeline.Compiled | None = field(compare=False, repr=False)  # None: priced by blocks
    notes: tuple[str, ...] = ()

    def table(self) -> str:
        return table(self.candidates, self.budget, self.winner, self.notes)

    def why(self) -> str:
        return why(self.candidates, self.budget, self.winner)


def layouts(job: Job, ranks: int, powers_of_two: bool = False) -> Iterator[Layout]:
    """The layouts weighed on ``ranks`` devices (module docstring), recompute off."""
    g = job.graph
    blocks = len(set(block_of(g).values()))
    pairs = bool(tp_pairs(g))
    splits = (False, True) if tables(g) else (False,)
    batch = job.data.batch_size if job.data is not None else ranks
    for pp in _degrees(ranks, powers_of_two):
        if pp > 1 and pp > blocks:
            continue
        for tp in _degrees(ranks // pp, powers_of_two):
            if tp > 1 and not pairs:
                continue
            dp = ranks // (pp * tp)
            cuts = (pp, 2 * pp) if pp > 1 else (job.config.micro_batches,)
            for m in cuts:
                if batch % m or batch // m < dp:  # every micro-batch splits over the data-parallel ranks
                    continue
                for split, zero in itertools.product(splits, range(4) if dp > 1 else (0,)):
                    yield Layout(pp=pp, tp=tp, dp=dp, zero=zero, micro_batches=m, tables=split)


def _degrees(n: int, powers_of_two: bool) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (not powers_of_two or d & (d - 1) == 0)]


def weigh(job: Job, lay: Layout, price: Price) -> tuple[Candidate, pipeline.Compiled | None]:
    """``job`` compiled as ``lay`` and priced; a layout the compiler refuses is a candidate with its error."""
    try:
        compiled = pipeline.compile(relayout(job, lay))
    except SbpflowError as e:
        return Candidate(lay, error=f"{type(e).__name__}: {e}"), None
    return Candidate(lay, price(compiled), traffic(compiled)), compiled


def search(
    job: Job,
    memory_per_device: int,
    price: Price,
    ranks: int | None = None,
    powers_of_two: bool = False,
    only: Sequence[Layout] = (),
) -> Search:
    """The fastest layout of ``job`` on ``ranks`` devices (default: the ranks it is placed on) whose peak
    memory per device is at most ``memory_per_device`` bytes, each candidate priced by ``price`` (a
    saved profile's: :func:`on_profile`; this machine's: ``profiling.pricing.pricer``); ``only`` weighs
    just those layouts."""
    if memory_per_device <= 0:
        raise SbpflowError(
            f"memory_per_device={memory_per_device}: give each device's memory in bytes, e.g. 80 GB"
        )
    n = ranks or _world_size(job)
    best: tuple[Candidate, pipeline.Compiled] | None = None
    out: list[Candidate] = []
    for lay in only or list(layouts(job, n, powers_of_two)):
        for c, compiled in _weighed(job, lay, price, memory_per_device):
            out.append(c)
            if compiled is not None and c.fits(memory_per_device):
                if best is None or c.key() < best[0].key():
                    best = (c, compiled)
    if best is None:
        raise NoPlanFits(_nothing_fits(out, memory_per_device))
    notes = ("recompute weighed only where a layout does not fit without it (it only adds compute)",)
    return Search(memory_per_device, tuple(out), best[0], best[1], notes)


def on_profile(profile: DeviceProfile, link: str | None = None) -> Price:
    """``cost_model.estimate`` on ``profile`` over ``link`` (default: the profile's): the modelled price."""
    return lambda compiled: cost_model.estimate(compiled, profile, link)


def budget(profile: DeviceProfile, memory_per_device: int | None) -> int:
    """``memory_per_device``, or the profile's device memory where it says; else what to give."""
    if memory_per_device is not None:
        return memory_per_device
    if not profile.memory_bytes:
        raise SbpflowError(
            f"the {profile.name!r} profile does not say how much memory a device has: give the budget "
            "per device (memory_per_device=, --memory-per-device 80GB)"
        )
    return profile.memory_bytes


def _weighed(
    job: Job, lay: Layout, price: Price, budget: int
) -> Iterator[tuple[Candidate, pipeline.Compiled | None]]:
    c, compiled = weigh(job, lay, price)
    yield c, compiled
    if compiled is not None and not c.fits(budget) and not lay.recompute:
        yield weigh(job, dataclasses.replace(lay, recompute=True), price)


def _world_size(job: Job) -> int:
    pls = [t.placement for t in job.graph.tensors.values()] + [o.placement for o in job.graph.ops]
    return len({r for pl in pls if pl is not None for r in pl.ranks}) or 1


def _nothing_fits(out: Sequence[Candidate], budget: int) -> str:
    legal = [c for c in out if c.estimate is not None]
    if not legal:
        first = out[0].error if out else "no layout divides the ranks and the batch"
        return f"the compiler refused every layout weighed ({len(out)}); the first: {first}"
    small = min(legal, key=lambda c: (c.peak, c.layout))
    return (
        f"no layout fits {_size(budget)} per device: the smallest peak found is {small.layout}'s "
        f"{_size(small.peak)}, {_size(small.peak - budget)} over; give more memory per device "
        f"(--memory-per-device), more ranks, or a smaller model or batch ({len(legal)} layouts weighed)"
    )


def traffic(compiled: pipeline.Compiled) -> Traffic:
    """The boxings' bytes and collectives a step: one inside a micro-batch slot runs once per micro-batch."""
    st = compiled.state
    lay = slots(st)
    kinds: Counter[str] = Counter()
    weight: Counter[str] = Counter()
    total = calls = 0
    for name, plan in st.boxings.items():
        times = lay.micro_batches if name in lay.slot_of else 1
        for step in plan.steps:
            if not step.bytes:
                continue
            what = f"{step.collective.value} of {plan.meta}"
            kinds[what] += times
            weight[what] += step.bytes * times
            total, calls = total + step.bytes * times, calls + times
    largest = tuple((what, kinds[what]) for what, _ in weight.most_common(3))
    return Traffic(total, calls, largest)


# ---- what it prints -------------------------------------------------------------------------------


def _size(n: float) -> str:
    """Bytes as a person reads them: decimal units (80 GB is 80e9), three significant figures."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:,.0f}" if ms >= 1000 else f"{ms:.3g}"


def table(cands: Sequence[Candidate], budget: int, winner: Candidate, notes: Sequence[str] = ()) -> str:
    """One row per priced candidate, fastest first: layout, modelled step, compute, comm, exposed comm
    (ms), peak per device, fits; then the refused layouts, grouped by the compiler's error."""
    head = f"{'layout':30s} {'step ms':>8s} {'compute':>8s} {'comm':>8s} {'exposed':>8s} {'peak/device':>12s}"
    lines = [head + f"  fits {_size(budget)}?", "-" * (len(head) + 12)]
    for c in sorted((c for c in cands if c.estimate is not None), key=Candidate.key):
        e, mark = c.estimate, "*" if c is winner else " "
        assert e is not None
        fits = "yes" if c.fits(budget) else f"no: {_size(c.peak - budget)} over"
        lines.append(
            f"{mark}{str(c.layout):29s} {_ms(e.step_s):>8s} {_ms(e.compute_s):>8s} {_ms(e.comm_s):>8s} "
            f"{_ms(e.exposed_comm_s):>8s} {_size(c.peak):>12s}  {fits}"
        )
    refused: dict[str, list[str]] = {}
    for c in cands:
        if c.estimate is None:
            refused.setdefault(c.error, []).append(str(c.layout))
    for error, names in refused.items():
        lines.append(f" refused by the compiler ({', '.join(names)}): {error[:200]}")
    return "\n".join([*lines, *(f"({n})" for n in notes)])


def why(cands: Sequence[Candidate], budget: int, winner: Candidate) -> str:
    """Why the winner won: against the next fastest that fits, and any faster one that does not."""
    assert winner.estimate is not None
    w = winner.estimate
    lines = [
        f"{winner.layout} wins: {_ms(w.step_s)} ms a step modelled (compute {_ms(w.compute_s)} ms, comm "
        f"{_ms(w.comm_s)} ms of which {_ms(w.exposed_comm_s)} ms exposed), {_size(winner.peak)} per device"
        + _moves(winner)
    ]
    fitting = sorted((c for c in cands if c.fits(budget) and c is not winner), key=Candidate.key)
    other = next((c for c in fitting if c.layout.mesh != winner.layout.mesh), None) or next(
        iter(fitting), None
    )
    if other is not None:
        lines.append(_against(other, winner))
    faster = [c for c in cands if c.estimate is not None and not c.fits(budget) and c.key() < winner.key()]
    if faster:
        f = min(faster, key=Candidate.key)
        lines.append(
            f"{f.layout} would take {_ms(f.estimate.step_s)} ms but needs {_size(f.peak)} per device, "  # type: ignore[union-attr]
            f"{_size(f.peak - budget)} over the {_size(budget)} budget."
        )
    return "\n".join(lines)


def _against(other: Candidate, winner: Candidate) -> str:
    o, w = other.estimate, winner.estimate
    assert o is not None and w is not None
    ratio = o.step_s / w.step_s if w.step_s > 0 else float("inf")
    parts = [f"compute {_ms(o.compute_s)} ms", f"exposed comm {_ms(o.exposed_comm_s)} ms"]
    return (
        f"The next, {other.layout}, {_ms(o.step_s)} ms, is {ratio:.2f}x slower ({', '.join(parts)})"
        + _moves(other)
    )


def _moves(c: Candidate) -> str:
    """``: it moves ...`` where the candidate's plan was compiled whole (a block-priced one has no traffic)."""
    return f"; it moves {c.traffic}." if c.traffic.collectives else "."
