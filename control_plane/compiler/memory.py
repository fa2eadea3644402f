"""Memory planning: what each device must hold, by kind, estimated from the lowered plan.

* parameters, optimizer state: the LOCAL shard bytes of each variable on that rank (a replicated
  weight costs its full size on every rank, a split one its slice — uneven splits exact);
* gradients: the local bytes of each parameter's final gradient (``state.grads``), which lives from
  backward until the optimizer reads it; with micro-batches, the accumulation buffer of each averaged
  gradient (the ACCUMULATE tasks' registers, one buffer per tensor: the running sum is updated in place)
  and, where the sum is boxed on its way to the optimizer (accumulated ``P`` before the all-reduce), the
  final gradient too, which lives from that boxing until the update; each micro-batch's own gradient
  counts as an activation until it is accumulated;
* peak activations: every other register (activations, boxing buffers, data-loader buffers with their
  prefetch copy) is live from the task that writes it to the last task that reads it, in the rank's task
  order; the peak is the largest sum of live ``bytes * count``. Lowering orders a pipelined rank's tasks
  by the schedule and gives every micro-batch its own registers, so the activations a stage keeps for
  backward count once per micro-batch in flight there: ``S - s`` under 1F1B, ``M`` under GPipe.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sbpflow.control_plane.compiler.lowering.boxing import plan_of
from sbpflow.control_plane.compiler.lowering.tasks import shard_shape
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, TensorKind
from sbpflow.placement import Placement
from sbpflow.sbp import NdSbp
from sbpflow.tensor_meta import Shape
from sbpflow.v1 import plan_pb2 as pp


@dataclass(frozen=True)
class DeviceMemory:
    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    peak_activations: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.peak_activations

    def to_proto(self) -> pp.MemoryEstimate:
        return pp.MemoryEstimate(
            parameters=self.parameters,
            gradients=self.gradients,
            optimizer_state=self.optimizer_state,
            peak_activations=self.peak_activations,
            total=self.total,
        )


def run(state: CompileState, plan: pp.Plan) -> dict[int, DeviceMemory]:
    """Fill ``DevicePlan.memory`` of every device of ``plan``; return the estimates by rank."""
    estimates = estimate(state, plan)
    for device in plan.devices:
        device.memory.CopyFrom(estimates[device.rank].to_proto())
    return estimates


def estimate(state: CompileState, plan: pp.Plan) -> dict[int, DeviceMemory]:
    """Per rank, in the plan's device order."""
    kinds = {name: t.kind for name, t in state.graph.tensors.items()}
    grads = set(state.grads.values())
    return {d.rank: _device(d, kinds, grads) for d in plan.devices}


def _device(d: pp.DevicePlan, kinds: dict[str, TensorKind], grads: set[str]) -> DeviceMemory:
    by_kind = {TensorKind.parameter: 0, TensorKind.optimizer_state: 0}
    index = {t.id: i for i, t in enumerate(d.tasks)}
    held: dict[str, tuple[int, int, int]] = {}  # gradient buffer -> (born, dies, bytes), one per tensor
    activations = []
    producer = {t.id: t for t in d.tasks}
    for reg in d.registers:
        kind, task = kinds.get(reg.tensor), producer[reg.producer_task]
        if kind in by_kind:
            by_kind[kind] += reg.bytes  # type: ignore[index]
        elif (task.kind == pp.TASK_KIND_ACCUMULATE and kind == TensorKind.gradient) or (
            reg.tensor in grads and task.micro_batch < 0
        ):
            # the running sum (one buffer for every micro-batch, updated in place), and the final gradient,
            # which lives from the step's backward, or from the boxing of its accumulated sum, until the
            # update reads it: both at once while the sum (P x S(1) of a replicated weight, say, half the
            # size) is boxed into it
            born, dies = _lifetime(index, reg)
            was = held.get(reg.tensor, (born, dies, reg.bytes))
            held[reg.tensor] = (min(born, was[0]), max(dies, was[1]), reg.bytes)
        else:
            activations.append(reg)
    return DeviceMemory(
        parameters=by_kind[TensorKind.parameter],
        gradients=_peak(len(d.tasks), held.values()),
        optimizer_state=by_kind[TensorKind.optimizer_state],
        peak_activations=peak_live(d, activations),
    )


def _lifetime(index: Mapping[int, int], reg: pp.RegisterDesc) -> tuple[int, int]:
    born = index[reg.producer_task]
    return born, max((index[c] for c in reg.consumer_tasks), default=born)


def _peak(n_tasks: int, intervals: Iterable[tuple[int, int, int]]) -> int:
    """Largest sum of the sizes of the (born, dies, size) intervals live at one task."""
    delta = [0] * (n_tasks + 1)
    for born, dies, size in intervals:
        delta[born] += size
        delta[dies + 1] -= size
    peak = live = 0
    for change in delta:
        live += change
        peak = max(peak, live)
    return peak


def peak_live(d: pp.DevicePlan, registers: list[pp.RegisterDesc]) -> int:
    """Largest sum of ``bytes * count`` of ``registers`` live at once in ``d``'s task order."""
    index = {t.id: i for i, t in enumerate(d.tasks)}
    return _peak(len(d.tasks), ((*_lifetime(index, r), r.bytes * max(r.count, 1)) for r in registers))


# ---- one estimate per class of equal ranks (plans too big to materialise) ------------------------


def rank_classes(state: CompileState) -> list[tuple[int, ...]]:
    """The ranks grouped so that ranks of one group have equal estimates, each group lowest rank first.

    A rank's tasks and registers follow from the placements it is in (the same ops, micro-batches and
    schedule for every rank of a placement) and its coordinate there, which only matters through the
    shard shapes it gets; so ranks in the same placements with the same local shape of every (shape, SBP)
    there — and the same point-to-point pieces — run the same tasks on the same bytes. One stage of a
    pipeline with even splits is one class: its first rank's estimate is every rank's.
    """
    g = state.graph
    on: dict[Placement, dict[tuple[Shape, NdSbp], None]] = {}
    for t in g.tensors.values():
        assert t.placement is not None and t.sbp is not None
        on.setdefault(t.placement, {})[(t.meta.shape, t.sbp)] = None
    key: dict[int, list[object]] = defaultdict(list)
    for n, (pl, layouts) in enumerate(on.items()):
        for rank, coord in zip(pl.ranks, pl.coords(), strict=True):
            key[rank].append((n, tuple(shard_shape(s, pl.shape, sbp, coord) for s, sbp in layouts)))
    seen: set[int] = set()
    for op in g.ops:
        if op.op_type != BOXING:
            continue
        plan = state.boxings.get(op.name) or plan_of(g, op)
        if id(plan) in seen:
            continue
        seen.add(id(plan))
        for i, step in enumerate(plan.steps):
            for tr in step.transfers:
                key[tr.src].append(("send", len(seen), i, tr.numel))
                key[tr.dst].append(("recv", len(seen), i, tr.numel))
    classes: dict[tuple[object, ...], list[int]] = {}
    for rank in sorted(key):
        classes.setdefault(tuple(key[rank]), []).append(rank)
    return [tuple(c) for c in classes.values()]


def for_classes(
    state: CompileState, devices: Mapping[int, pp.DevicePlan], classes: Sequence[tuple[int, ...]]
) -> dict[int, DeviceMemory]:
    """Every rank's estimate from its class's first rank, whose DevicePlan ``devices`` holds (filled)."""
    kinds = {name: t.kind for name, t in state.graph.tensors.items()}
    grads = set(state.grads.values())
    out = {}
    for ranks in classes:
        d = devices[ranks[0]]
        m = _device(d, kinds, grads)
        d.memory.CopyFrom(m.to_proto())
        out.update(dict.fromkeys(ranks, m))
    return dict(sorted(out.items()))
