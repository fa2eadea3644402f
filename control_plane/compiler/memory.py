"""Memory planning: what each device must hold, by kind, estimated from the lowered plan.

* parameters, optimizer state: the LOCAL shard bytes of each variable on that rank (a replicated
  weight costs its full size on every rank, a split one its slice — uneven splits exact);
* gradients: the local bytes of each parameter's final gradient (``state.grads``), which lives from
  backward until the optimizer reads it;
* peak activations: every other register (activations, boxing buffers, data-loader buffers with their
  prefetch copy) is live from the task that writes it to the last task that reads it, in the rank's task
  order (a topological order); the peak is the largest sum of live ``bytes * count``. One micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import TensorKind
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
    gradients = 0
    activations = []
    for reg in d.registers:
        kind = kinds.get(reg.tensor)
        if kind in by_kind:
            by_kind[kind] += reg.bytes  # type: ignore[index]
        elif reg.tensor in grads:
            gradients += reg.bytes
        else:
            activations.append(reg)
    return DeviceMemory(
        parameters=by_kind[TensorKind.parameter],
        gradients=gradients,
        optimizer_state=by_kind[TensorKind.optimizer_state],
        peak_activations=peak_live(d, activations),
    )


def peak_live(d: pp.DevicePlan, registers: list[pp.RegisterDesc]) -> int:
    """Largest sum of ``bytes * count`` of ``registers`` live at once in ``d``'s task order."""
    index = {t.id: i for i, t in enumerate(d.tasks)}
    delta = [0] * (len(d.tasks) + 1)
    for reg in registers:
        born = index[reg.producer_task]
        dies = max((index[c] for c in reg.consumer_tasks), default=born)
        size = reg.bytes * max(reg.count, 1)
        delta[born] += size
        delta[dies + 1] -= size
    peak = live = 0
    for change in delta:
        live += change
        peak = max(peak, live)
    return peak
