"""The automatic plan search at scale: price one block, multiply (a GPT-175B-shaped job on 1,024 devices).

Compiling every layout of a 96-layer model whole is minutes each. Here a layout's pipeline stage is
priced from two *probes*, the job cut to one and to two blocks (``make(blocks, batch)``), each laid out on
one stage's ``dp x tp`` mesh with one micro-batch's sequences (``batch / M``), compiled through the graph
passes (``pipeline.compile(lower="none")``: no lowering, and no verifier: a probe is priced, never
run) and priced by the cost model. The difference of
the two is one block; what is left of the first, the ends (embeddings, head, loss, update). Then, with
``n = blocks / pp`` blocks a stage and ``M`` micro-batches under 1F1B:

* a micro-batch on the busiest stage: ``t = n * block + ends`` (the ends counted on it, an upper bound);
  the step ``(M + pp - 1) * t``: the schedule's ``pp - 1`` slots of bubble;
* memory per device: ``n`` blocks' parameters, gradients and optimizer state plus the ends', the kept
  activations of ``n`` blocks for ``min(pp, M)`` micro-batches in flight on the first stage and the
  ends' for one (local shard bytes of each forward activation a backward op reads; no register reuse,
  the backward's temporaries left out).

So the step's update and gradient synchronisation are counted once per micro-batch slot (pessimistic
for large ``M``), and the stages' point-to-point transfers are left out. Probes are shared by every
layout with the same stage mesh, ZeRO stage and micro-batch size, and ZeRO stages are tried in order
only until one fits (each saves memory and adds collectives). Only power-of-two degrees, and tensor
parallelism up to ``max_tp`` (one NVLink domain's 8 GPUs by default).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.cost import cost_model
from sbpflow.control_plane.compiler.cost.cost_model import DeviceProfile, StepEstimate
from sbpflow.control_plane.compiler.lowering.tasks import shard_shape
from sbpflow.control_plane.compiler.search.auto_layouts import Layout, relayout
from sbpflow.control_plane.compiler.search.auto_plan import Candidate, NoPlanFits, Search
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import SbpflowError
from sbpflow.graph import TensorKind
from sbpflow.job import Job

MakeJob = Callable[[int, int], Job]  # (blocks, batch) -> the job, traced on any placement
_STATIC = (TensorKind.parameter, TensorKind.optimizer_state)


@dataclass(frozen=True)
class Probe:
    """A probe's modelled step, and its memory on rank 0: variables (parameters, gradients, optimizer
    state) and every activation of one micro-batch."""

    est: StepEstimate
    static: int
    activations: int


def memory(state: CompileState) -> tuple[int, int]:
    """Rank 0's local bytes (mesh coordinate 0: the largest shard) of the variables (parameters, their
    gradients, optimizer state) and of the forward's activations that a backward op reads, which a
    micro-batch keeps until its backward; the backward's own temporaries are left out."""
    grads = set(state.grads.values())
    traced = {o.name for o in state.job.graph.ops}  # the forward: the ops the job was traced with
    forward = {t for o in state.graph.ops if o.name in traced for t in o.outputs}
    kept = {t for o in state.graph.ops if o.name not in traced for t in o.inputs if t in forward}
    static = act = 0
    for t in state.graph.tensors.values():
        if t.placement is None or t.sbp is None or 0 not in t.placement.ranks:
            continue
        coord = (0,) * t.placement.ndim
        n = math.prod(shard_shape(t.meta.shape, t.placement.shape, t.sbp, coord)) * t.meta.dtype.itemsize
        if t.kind in _STATIC or t.name in grads:
            static += n
        elif t.name in kept:
            act += n
    return static, act


@dataclass
class BlockSearch:
    make: MakeJob
    blocks: int
    batch: int
    profile: DeviceProfile
    probes: dict[tuple[int, Layout], Probe | str] = dataclasses.field(default_factory=dict)

    def probe(self, k: int, stage: Layout) -> Probe | str:
        """The ``k``-block probe on one stage's mesh (``stage``: pp 1, one micro-batch); an error text."""
        key = (k, stage)
        if key not in self.probes:
            try:
                job = relayout(
                    self.make(k, self.batch // stage.micro_batches),
                    dataclasses.replace(stage, micro_batches=1),
                )
                state = pipeline.compile(job, verify=False, lower="none").state  # priced, not run
                self.probes[key] = Probe(cost_model.estimate(state, self.profile), *memory(state))
            except SbpflowError as e:
                self.probes[key] = f"{type(e).__name__}: {e}"
        return self.probes[key]

    def price(self, lay: Layout) -> Candidate:
        stage = dataclasses.replace(lay, pp=1)
        one, two = self.probe(1, stage), self.probe(2, stage)
        if isinstance(one, str) or isinstance(two, str):
            return Candidate(lay, error=one if isinstance(one, str) else str(two))
        n, slots = self.blocks // lay.pp, lay.micro_batches + lay.pp - 1
        compose = {
            f: slots
            * (
                n * (getattr(two.est, f) - getattr(one.est, f))
                + 2 * getattr(one.est, f)
                - getattr(two.est, f)
            )
            for f in ("compute_s", "comm_s", "exposed_comm_s", "step_s")
        }
        static = n * (two.static - one.static) + 2 * one.static - two.static
        act = n * (two.activations - one.activations) + 2 * one.activations - two.activations
        ends_act = 2 * one.activations - two.activations  # the head's logits: on the last stage, 1 in flight
        peak = static + (act - ends_act) * min(lay.pp, lay.micro_batches) + ends_act
        est = StepEstimate(
            **compose, peak_memory_bytes=peak, profile=self.profile.name, memory_from_plan=False
        )
        return Candidate(lay, est)


def layouts(ranks: int, blocks: int, batch: int, max_tp: int) -> Iterator[Layout]:
    """Power-of-two ``pp x tp x dp`` meshes (pp up to the blocks, tp up to ``max_tp``), each with ``pp``
    and ``2 pp`` micro-batches where every data-parallel rank gets a sequence of each; ZeRO stage 0."""
    twos = [1 << i for i in range(ranks.bit_length()) if ranks % (1 << i) == 0]
    for pp in (p for p in twos if p <= blocks and blocks % p == 0):
        for tp in (t for t in twos if t <= max_tp and pp * t <= ranks):
            dp = ranks // (pp * tp)
            for m in sorted({pp, 2 * pp} if pp > 1 else {1}):
                if batch % m == 0 and batch // m >= dp and (batch // m) % dp == 0:
                    yield Layout(pp=pp, tp=tp, dp=dp, micro_batches=m)


def search(
    make: MakeJob,
    blocks: int,
    batch: int,
    ranks: int,
    memory_per_device: int | None = None,
    profile: DeviceProfile | str = "h200",
    max_tp: int = 8,
) -> Search:
    """The fastest layout of the ``blocks``-block job ``make`` builds (``batch`` sequences a step) on
    ``ranks`` devices whose modelled peak fits ``memory_per_device`` (default: the profile's memory)."""
    prof = profile if isinstance(profile, DeviceProfile) else cost_model.load_profile(profile)
    budget = memory_per_device if memory_per_device is not None else prof.memory_bytes
    if budget <= 0:
        raise SbpflowError(f"memory_per_device={budget}: give each device's memory in bytes, e.g. 80 GB")
    s = BlockSearch(make, blocks, batch, prof)
    out: list[Candidate] = []
    for lay in layouts(ranks, blocks, batch, max_tp):
        for zero in range(4) if lay.dp > 1 else (0,):  # in order, until one fits
            c = s.price(dataclasses.replace(lay, zero=zero))
            out.append(c)
            if c.estimate is None or c.fits(budget):
                break
    fitting = [c for c in out if c.fits(budget)]
    if not fitting:
        legal = [c for c in out if c.estimate is not None]
        small = min(legal, key=lambda c: c.peak, default=None)
        found = (
            f"the smallest modelled peak is {small.layout}'s {small.peak / 1e9:.3g} GB"
            if small
            else "none priced"
        )
        raise NoPlanFits(f"no layout fits {budget / 1e9:.3g} GB per device: {found}")
    notes = (
        f"each stage priced from {len(s.probes)} probes of 1 and 2 blocks and composed for the pipeline "
        "(auto_blocks.py); ZeRO stages tried in order until one fits",
    )
    return Search(budget, tuple(out), min(fitting, key=Candidate.key), None, notes)
