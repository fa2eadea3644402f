"""What the executor reads off one rank's DevicePlan before it builds the rank's actors.

* :func:`folded_assigns` — the SINK assigns folded into the act of the update (or kernel) that makes
  their value, so that a step has no act that only stores a value;
* :func:`loop_edges` — the register from each assign (its SINK, or the task it is folded into) to the
  SOURCE of the same variable, carrying the value into the next step (its initial value is the store's);
* :func:`donations` — the inputs a kernel may overwrite because nobody else ever holds that array;
* :func:`recyclers` — the updates that may write a variable's new value into last step's buffer, and
  the readers to watch so that no view of that buffer outlives the step;
* :func:`no_op_boxings` — boxing steps that move nothing, to run on the compute stream.

Each is decided from the plan alone, so every rank decides the same (``loop_edges`` also takes the
initial values from the store, and appends the registers it adds to the rank's list). Also here:
:class:`ExecutorError` for a plan the executor cannot run.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from sbpflow.actor_workers.execution import boxing_tasks, tasks
from sbpflow.actor_workers.execution.variables import Store
from sbpflow.actor_workers.runtime.actors import RegisterSpec
from sbpflow.codec import wire
from sbpflow.errors import SbpflowError
from sbpflow.ops.base import get_op
from sbpflow.v1 import plan_pb2 as pp

KIND = {v: k.removeprefix("TASK_KIND_").lower() for k, v in pp.TaskKind.items()}


class ExecutorError(SbpflowError, ValueError):
    """A plan the executor cannot turn into actors (a task it does not know, a missing op or tensor)."""


@dataclass(frozen=True)
class Loop:
    """A loop edge: the register from a SINK assign to the SOURCE of its variable at the next step."""

    register: int
    initial: Any  # the value the SOURCE reads at step 0


# Fold each SINK assign that only stores one kernel's output into that kernel's act (False: every assign
# acts on its own, as before; the A/B of bench/models/gpt_step.py and resnet.py)
FOLD_ASSIGNS = True
# An update whose op may write its new value over the old does so once nothing else holds the value
# (tasks.Recycler; False: into the array of two steps back, as before; the A/B of the tests and benches)
IN_PLACE_UPDATES = True
MAKERS = (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER)


@dataclass(frozen=True)
class Folded:
    """A SINK assign of ``variable`` folded into its ``producer``: the act that makes the value stores it
    (and runs the assign hooks) and writes it into the loop edge itself; the value's ``register``, which
    only the SINK read, and the SINK's actor are gone."""

    sink: int
    producer: int
    register: int
    variable: str
    steps: tuple[int, ...] = ()  # the no-op boxing steps between them, gone too
    passed: tuple[int, ...] = ()  # the registers after ``register`` those steps hand the value on in


def folded_assigns(device: pp.DevicePlan, through: Collection[int] = ()) -> dict[int, Folded]:
    """Per SINK assign (by id) that can be folded: its one input is an output of a kernel or an update on
    its stream and micro-batch, read by the SINK alone (an optimizer's new parameter and state, a running
    statistic), or reaches it through a chain of boxing steps that move nothing (``through``:
    :func:`no_op_boxings`, each handing its input array on unchanged), each its value's one reader (BERT's
    parameters and AdamW moments on a 1 x 1 mesh). A value that anything else reads, or that a boxing
    moves, keeps its SINK act."""
    if not FOLD_ASSIGNS:
        return {}
    by_id = {t.id: t for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    passes = frozenset(through)
    out: dict[int, Folded] = {}
    for sink in device.tasks:
        if sink.kind != pp.TASK_KIND_SINK or "assign" not in sink.attrs or len(set(sink.in_registers)) != 1:
            continue
        reg = regs[sink.in_registers[0]]
        if set(reg.consumer_tasks) != {sink.id}:
            continue
        passed: list[int] = []
        steps: list[int] = []
        while _passing(step := by_id.get(reg.producer_task), passes):
            assert step is not None
            before = regs[step.in_registers[0]]
            if set(before.consumer_tasks) != {step.id}:
                break
            passed.append(reg.id)
            steps.append(step.id)
            reg = before
        producer = by_id.get(reg.producer_task)
        if (
            producer is not None
            and producer.kind in MAKERS
            and (producer.stream, producer.micro_batch) == (sink.stream, sink.micro_batch)
        ):
            var = str(wire.attr_from_proto(sink.attrs["assign"]))
            out[sink.id] = Folded(sink.id, producer.id, reg.id, var, tuple(steps), tuple(passed))
    return out


def by_producer(folded: Mapping[int, Folded]) -> dict[int, list[Folded]]:
    """The folded assigns of each producer (an update makes a parameter and its optimizer state)."""
    out: dict[int, list[Folded]] = {}
    for f in folded.values():
        out.setdefault(f.producer, []).append(f)
    return out


def loop_edges(
    device: pp.DevicePlan,
    store: Store,
    registers: list[RegisterSpec],
    folded: Mapping[int, Folded] | None = None,
) -> dict[int, Loop]:
    """SINK assign of a variable -> SOURCE of the same variable at the next step: a register from the
    one (from the task it is folded into, in ``folded``) to the other whose initial value is the store's;
    keyed by both tasks' ids (the SINK's, also where it is folded)."""
    folded = folded or {}
    sources = {t.op_name: t for t in device.tasks if t.kind == pp.TASK_KIND_SOURCE}
    ids = itertools.count(max((r.id for r in device.registers), default=-1) + 1)
    loops: dict[int, Loop] = {}
    for sink in device.tasks:
        if sink.kind != pp.TASK_KIND_SINK or "assign" not in sink.attrs:
            continue
        var = str(wire.attr_from_proto(sink.attrs["assign"]))
        source = sources.get(var)
        if source is None:
            raise ExecutorError(
                f"rank {device.rank}: task {sink.id} assigns {var!r}, which no SOURCE task of this rank holds"
            )
        loop = Loop(next(ids), store[var])
        fold = folded.get(sink.id)
        registers.append(
            RegisterSpec(loop.register, sink.id if fold is None else fold.producer, (source.id,), 1)
        )
        loops[sink.id] = loops[source.id] = loop
    return loops


def no_op_boxings(device: pp.DevicePlan) -> set[int]:
    """Boxing tasks to run on the compute stream instead of the communication stream: steps that move
    nothing (an identity, or a group of one: every step on one device) between compute tasks and other
    such steps — a gradient's ``P -> B`` on one device, say, or the two steps of a 2-d boxing on a 1 x 1
    mesh, one a mesh axis. On the communication stream each would wake its thread and back for a no-op
    on the step's critical path (BERT on a 1 x 1 mesh: ~800 such acts a step). A step next to a task of
    another stream (a real collective, a data load) stays. The choice is made from the plan alone, so it
    is the same on every rank, and the collectives keep their order."""
    streams = {t.id: t.stream for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    neighbours: dict[int, list[int]] = {}
    for task in device.tasks:
        if task.kind != pp.TASK_KIND_BOXING or task.stream != pp.STREAM_KIND_COMMUNICATION:
            continue
        if boxing_tasks.moves_nothing(boxing_tasks.step_of(task, device.rank)):
            near = [regs[r].producer_task for r in task.in_registers]
            neighbours[task.id] = near + [c for r in task.out_registers for c in regs[r].consumer_tasks]
    out = set(neighbours)
    while True:  # drop a step next to anything but compute or a step still kept; until none is dropped
        dropped = {
            t
            for t in out
            if any(streams.get(n) != pp.STREAM_KIND_COMPUTE and n not in out for n in neighbours[t])
        }
        if not dropped:
            return out
        out -= dropped


def pass_through(device: pp.DevicePlan) -> set[int]:
    """The tasks that hand their one input on as their one output, which the executor bypasses: the
    boxing steps that move nothing (:func:`no_op_boxings`) and the copies of :func:`copies_to_hand_on`."""
    steps = no_op_boxings(device)
    return steps | copies_to_hand_on(device, steps)


def copies_to_hand_on(device: pp.DevicePlan, steps: Collection[int] = ()) -> set[int]:
    """``identity`` kernels to hand their input on as their output instead of copying it, so that the
    executor bypasses them as it does :func:`no_op_boxings`: a kernel's result between compute tasks.
    autodiff copies a parameter's gradient out under its own name where the sum is read elsewhere too
    (batch norm's bias: channel_affine_grad's second output, which the mean's gradient also reads); the
    readers of a gradient (an update, its clipping) never write into it, nor does any kernel into its
    inputs but for the optimizer states it is donated (:func:`donations`) and the buffers the memory plan
    lends, which sees through these steps as through the boxings. ResNet-18: 20 acts a step fewer. A copy
    next to a task of another stream (a collective, a fetch or an assign) or of a value no kernel made
    (through ``steps``, boxing steps that move nothing) stays a copy."""
    by_id = {t.id: t for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    out = set()
    for task in device.tasks:
        if (
            task.kind != pp.TASK_KIND_KERNEL
            or task.op_type != "identity"
            or task.stream != pp.STREAM_KIND_COMPUTE
        ):
            continue
        if len(task.in_registers) != 1 or len(task.out_registers) != 1:
            continue
        producer = by_id.get(regs[task.in_registers[0]].producer_task)
        while producer is not None and producer.id in steps and len(producer.in_registers) == 1:
            producer = by_id.get(regs[producer.in_registers[0]].producer_task)
        readers = [by_id.get(c) for c in regs[task.out_registers[0]].consumer_tasks]
        near = [producer, *readers]
        if producer is None or producer.kind != pp.TASK_KIND_KERNEL or not readers:
            continue
        if all(t is not None and t.stream == pp.STREAM_KIND_COMPUTE and t.kind in MAKERS for t in near):
            out.add(task.id)
    return out


def donations(device: pp.DevicePlan, through: Collection[int] = ()) -> dict[int, frozenset[int]]:
    """Per kernel task, the input positions whose arrays it may overwrite (an optimizer state's buffer).

    A variable's value is given away to the one kernel that reads it when nobody else ever holds that
    array: the kernel is the only consumer of the SOURCE's register (reading it once), and the value the
    SINK assigns (next step's SOURCE value) is an output of that same kernel that only the SINK reads. So
    the array circulates kernel -> SINK -> SOURCE -> kernel, read once per step, and the kernel can update
    it in place instead of allocating a new one. Unlooped sources (never assigned: the store's own array,
    re-read every step) are never donated. ``through``: boxing steps that move nothing
    (:func:`no_op_boxings`), each of which hands its one input on as its one output: a chain of them with
    one reader each may stand between the SOURCE and the kernel, and between the kernel and the SINK
    (BERT's AdamW moments on a 1 x 1 mesh: two 2-d boxings around every update).
    """
    by_id = {t.id: t for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    sinks = {
        str(wire.attr_from_proto(t.attrs["assign"])): t
        for t in device.tasks
        if t.kind == pp.TASK_KIND_SINK and "assign" in t.attrs
    }
    passes = frozenset(through)
    out: dict[int, set[int]] = {}
    for source in device.tasks:
        sink = sinks.get(source.op_name)
        if source.kind != pp.TASK_KIND_SOURCE or sink is None or len(sink.in_registers) != 1:
            continue
        back = _upstream(regs[sink.in_registers[0]], regs, by_id, passes)
        for first in source.out_registers:
            r = _downstream(regs[first], regs, by_id, passes)
            readers = set(r.consumer_tasks)
            if len(readers) != 1:
                continue
            reader = by_id[readers.pop()]
            ins = list(reader.in_registers)
            if (
                reader.kind in (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER)
                and ins.count(r.id) == 1
                and back.producer_task == reader.id
                and len(set(back.consumer_tasks)) == 1
            ):
                out.setdefault(reader.id, set()).add(ins.index(r.id))
    return {t: frozenset(p) for t, p in out.items()}


def _passing(task: pp.Task | None, passes: frozenset[int]) -> bool:
    return task is not None and task.id in passes and len(task.in_registers) == len(task.out_registers) == 1


def _downstream(
    reg: pp.RegisterDesc, regs: dict[int, pp.RegisterDesc], by_id: dict[int, pp.Task], passes: frozenset[int]
) -> pp.RegisterDesc:
    """The register a value reaches from ``reg`` through pass-through steps, each its one reader."""
    while len(set(reg.consumer_tasks)) == 1 and _passing(by_id.get(reg.consumer_tasks[0]), passes):
        reg = regs[by_id[reg.consumer_tasks[0]].out_registers[0]]
    return reg


def _upstream(
    reg: pp.RegisterDesc, regs: dict[int, pp.RegisterDesc], by_id: dict[int, pp.Task], passes: frozenset[int]
) -> pp.RegisterDesc:
    """The register whose value reaches ``reg`` through pass-through steps, each its value's one reader."""
    while _passing(step := by_id.get(reg.producer_task), passes):
        assert step is not None
        before = regs[step.in_registers[0]]
        if len(set(before.consumer_tasks)) != 1:
            break
        reg = before
    return reg


# Readers that never keep a variable's array past their act (a SINK fetch records it: not recyclable).
TRANSIENT_READERS = (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER, pp.TASK_KIND_BOXING, pp.TASK_KIND_SEND)


def recyclers(
    device: pp.DevicePlan, store: Store | None = None
) -> tuple[dict[int, tasks.Recycler], dict[int, list[tuple[tasks.Recycler, int]]]]:
    """Per update task, the :class:`~.tasks.Recycler` of the variable it updates (its input 0), where the
    variable's SOURCE is looped, emits into one-slot registers only, and only transient readers read them;
    and per reader task, the (recycler, register) pairs whose outputs to watch for views. ``store``: the
    rank's variables, given where its arrays are numpy's: an update whose op is ``in_place`` may then
    write over the value it reads (:data:`IN_PLACE_UPDATES`)."""
    by_id = {t.id: t for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    assigned = {
        str(wire.attr_from_proto(t.attrs["assign"]))
        for t in device.tasks
        if t.kind == pp.TASK_KIND_SINK and "assign" in t.attrs
    }
    recyclers: dict[int, tasks.Recycler] = {}
    guards: dict[int, list[tuple[tasks.Recycler, int]]] = {}
    for update in device.tasks:
        if update.kind != pp.TASK_KIND_OPTIMIZER or not update.in_registers:
            continue
        source = by_id.get(regs[update.in_registers[0]].producer_task)
        if source is None or source.kind != pp.TASK_KIND_SOURCE or source.op_name not in assigned:
            continue
        outs = [regs[r] for r in source.out_registers]
        readers = {c for r in outs for c in r.consumer_tasks}
        if any(r.count != 1 for r in outs) or any(by_id[c].kind not in TRANSIENT_READERS for c in readers):
            continue
        in_place = IN_PLACE_UPDATES and store is not None and get_op(update.op_type).in_place
        recycler = recyclers[update.id] = tasks.Recycler(
            0, in_place=in_place, store=store, name=source.op_name
        )
        for r in outs:
            for c in dict.fromkeys(r.consumer_tasks):
                if c != update.id:
                    guards.setdefault(c, []).append((recycler, r.id))
    return recyclers, guards
