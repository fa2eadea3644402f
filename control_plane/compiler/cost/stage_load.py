"""What one rank of each pipeline stage holds and does beyond its ops' kernels and messages, for the cost
model (``cost_model.py``): its shards (``local_meta``, at mesh coordinate 0, the largest of an uneven
split), its data loading (where its inputs are placed: ``data_seconds``) and the acts of its plan that are no op of the graph (``loads``), the ranks of
each stage (``ranks_of``), a kernel call's key (``call_key``) and the memory figure when the plan has no
estimate (``peak_memory``: an upper bound).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from sbpflow.control_plane.compiler.cost.step_sim import Load, OpCost
from sbpflow.control_plane.compiler.lowering.tasks import shard_shape
from sbpflow.control_plane.compiler.memory import DeviceMemory
from sbpflow.control_plane.compiler.passes.micro_batching import Layout
from sbpflow.control_plane.compiler.passes.sbp_cost import attrs_key
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import SbpflowError
from sbpflow.graph import BOXING, OpNode, TensorDecl, TensorKind
from sbpflow.ops.base import Attrs, get_op
from sbpflow.sbp import NdSbp
from sbpflow.tensor_meta import TensorMeta


def loads(
    state: CompileState,
    lay: Layout,
    by_op: Sequence[OpCost],
    data: DataCost,
    mem_bytes_per_s: float,
    act_handoff_s: tuple[float, float],
    calls: Mapping[str, int],
) -> dict[int, Load]:
    """Each stage's :class:`~.step_sim.Load` on one rank: its ops' compute (``by_op``, a step's; ``calls``:
    each op's calls a step), the acts outside the graph and the hand-offs between its streams at
    ``act_handoff_s`` each (:func:`handoffs`: the rank's own, not the interpreter in-process ranks share),
    and its data loading (:func:`data_seconds`); what it holds of a shared interpreter is every op's
    ``python_s`` (a kernel's act and what its roofline does not explain, a collective's CPU), its data
    loading and the acts outside the graph (``step_sim``'s docstring)."""
    where = input_stage(state)
    tail = _plan_acts(state, lay, where)
    handed = handoffs(state, calls)
    act_s, handoff_s = act_handoff_s
    data_s = data_seconds(state, lay, data, mem_bytes_per_s, where)
    per_stage: dict[int, list[OpCost]] = {}
    for c in by_op:
        per_stage.setdefault(c.stage, []).append(c)
    out = {}
    for stage in sorted(set(per_stage) | set(data_s)):
        mine = per_stage.get(stage, [])
        extra = tail.get(stage, 0) * act_s
        woken = handed.get(stage, 0) * handoff_s
        out[stage] = Load(
            compute_s=sum(c.seconds for c in mine if not c.comm) + extra + woken,
            interpreter_s=sum(c.python_s for c in mine) + data_s.get(stage, 0.0) + extra,
            data_s=data_s.get(stage, 0.0),
            tail_s=extra,
        )
    return out


@dataclass(frozen=True)
class DataCost:
    """What reading a batch of the job's source costs one rank: a fixed ``read_s`` a read (the source's
    per-call work: its draws of fixed size, its Python) and ``row_s`` a sample row."""

    read_s: float = 0.0
    row_s: float = 0.0


def data_seconds(
    state: CompileState, lay: Layout, data: DataCost, mem_bytes_per_s: float, where: Mapping[str, int]
) -> dict[int, float]:
    """Per stage, one rank's data loading a step. Inputs load where they are placed (``where``: the
    search's pipelines place them all on stage 0, which sends the last stage its labels). A rank's
    loaders share one read of the source per row range (``RankContext.read_rows``), so each distinct
    local row count a stage's inputs take costs a read per micro-batch, its rows at ``data.row_s``; the
    inputs' bytes at memory bandwidth."""
    ranges: dict[int, set[int]] = {}
    nbytes: dict[int, int] = {}
    for t in state.graph.of_kind(TensorKind.input):
        stage, local = where.get(t.name, 0), local_meta(t)
        ranges.setdefault(stage, set()).add(local.shape[0] if local.shape else 1)
        nbytes[stage] = nbytes.get(stage, 0) + local.nbytes
    m = lay.micro_batches
    return {
        s: m * (sum(data.read_s + n * data.row_s for n in rows) + nbytes[s] / mem_bytes_per_s)
        for s, rows in ranges.items()
    }


def handoffs(state: CompileState, calls: Mapping[str, int]) -> dict[int, int]:
    """Per stage, one rank's registers a step handed from one stream to another (a thread woken): a
    boxing's messages run on the communication stream, an input's load on the data stream, every other
    op on compute, so each read across them, once a call of the reader (``calls``: an op's calls a
    step), wakes the reader's thread. On one thread an act costs the profile's ``op_overhead_s``; a
    hand-off costs several times that in CPU (the notify, the woken thread's wait for the lock and the
    GIL: ``DeviceProfile.handoff_s``), and a plan's count of them is what its task order implies. It is
    the rank's busy time, not the interpreter's that in-process ranks share (``step_sim``)."""
    g = state.graph
    stream = {t.name: "data" for t in g.of_kind(TensorKind.input)}
    for o in g.ops:
        stream.update(dict.fromkeys(o.outputs, "comm" if o.op_type == BOXING else "compute"))
    out: dict[int, int] = {}
    for o in g.ops:
        mine = "comm" if o.op_type == BOXING else "compute"
        n = sum(1 for i in set(o.inputs) if stream.get(i, "compute") != mine)
        if n:
            out[o.stage] = out.get(o.stage, 0) + n * calls.get(o.name, 0)
    return out


def input_stage(state: CompileState) -> dict[str, int]:
    """Each tensor -> the stage that holds it: an input the stage whose ranks its placement's first rank
    is among (the runtime loads an input where it is placed), any other its earliest reader's."""
    out = _first_reader_stage(state)
    stage_of = {r: s for s, ranks in ranks_of(state).items() for r in ranks}
    for t in state.graph.of_kind(TensorKind.input):
        if t.placement is not None and t.placement.ranks[0] in stage_of:
            out[t.name] = stage_of[t.placement.ranks[0]]
    return out


def _plan_acts(state: CompileState, lay: Layout, where: Mapping[str, int]) -> dict[int, int]:
    """Per stage, the acts of a step that run no op of the graph: each variable's write-back, each input's
    load and each accumulation per micro-batch (when there are several), the fetches."""
    g = state.graph
    producer = {t: o for o in g.ops for t in o.outputs}
    out: dict[int, int] = {}

    def add(tensor: str, n: int) -> None:
        op = producer.get(tensor)
        stage = where.get(tensor, 0) if op is None else op.stage
        out[stage] = out.get(stage, 0) + n

    m = lay.micro_batches
    for new in state.updates.values():
        add(new, 1)
    for t in g.of_kind(TensorKind.input):
        add(t.name, m)
    for t in lay.accumulate if m > 1 else ():
        add(t, m)
    for t in (state.job.loss, *state.job.fetches):
        if t:
            add(t, 1)
    return out


def _first_reader_stage(state: CompileState) -> dict[str, int]:
    """Each tensor read by an op -> the earliest stage that reads it (one pass: big graphs)."""
    out: dict[str, int] = {}
    for o in state.graph.ops:
        for t in o.inputs:
            out[t] = min(out.get(t, o.stage), o.stage)
    return out


def source_key(source: object) -> str:
    """A data source's key in ``DeviceProfile.data_row_s`` and ``data_read_s``: its class, and a synthetic source's kind."""
    kind = getattr(source, "kind", None)
    return type(source).__name__ + (f":{kind}" if isinstance(kind, str) else "")


def ranks_of(state: CompileState) -> dict[int, tuple[int, ...]]:
    """Each pipeline stage's ranks: those of its ops' placements."""
    out: dict[int, set[int]] = {}
    g = state.graph
    for o in g.ops:
        pl = o.placement or next((g.tensors[t].placement for t in o.outputs), None)
        if pl is not None:
            out.setdefault(o.stage, set()).update(pl.ranks)
    return {s: tuple(sorted(r)) for s, r in out.items()}


CallKey = tuple[str, Attrs, tuple[TensorMeta, ...]]  # (op, attributes, local inputs): one kernel call


def call_key(state: CompileState, o: OpNode) -> CallKey:
    """What a kernel's time depends on: its op, attributes and one rank's local inputs."""
    ins = tuple(local_meta(state.graph.tensors[t]) for t in o.inputs)
    return o.op_type, attrs_key(get_op(o.op_type).normalize_attrs(o.attrs)), ins


def local_meta(t: TensorDecl) -> TensorMeta:
    """``t``'s shard at mesh coordinate 0: the largest of an uneven split (a partial one is whole)."""
    if t.placement is None or t.sbp is None:
        raise SbpflowError(
            f"tensor {t.name!r} has no placement or SBP, so no shard to price: the cost model prices a plan "
            "after SBP inference (pipeline.compile), not a traced job"
        )
    return _shard(t.meta, t.placement.shape, t.sbp)


@lru_cache(maxsize=1 << 16)
def _shard(meta: TensorMeta, mesh: tuple[int, ...], sbp: NdSbp) -> TensorMeta:
    return TensorMeta(shard_shape(meta.shape, mesh, sbp, (0,) * len(mesh)), meta.dtype)


def peak_memory(state: CompileState, memory: Mapping[int, DeviceMemory], lay: Layout) -> tuple[int, bool]:
    """The plan's largest device total, or (none in the plan) the upper bound of the module docstring."""
    if memory:
        return max(m.total for m in memory.values()), True
    g = state.graph
    per_mb = {o for names in lay.slots.values() for o in names}
    held: dict[int, float] = {}
    for o in g.ops:
        if o.op_type == BOXING and o.name not in per_mb:
            continue
        for out in o.outputs:
            many = lay.schedule.in_flight(o.stage) if o.name in per_mb else 1
            held[o.stage] = held.get(o.stage, 0) + local_meta(g.tensors[out]).nbytes * many
    where = input_stage(state)
    for t in g.tensors.values():
        stage = where.get(t.name, 0)
        if t.kind in (TensorKind.parameter, TensorKind.optimizer_state):
            held[stage] = held.get(stage, 0) + local_meta(t).nbytes
        elif t.kind == TensorKind.input:  # the loader's buffer and its prefetch copy
            held[stage] = held.get(stage, 0) + 2 * local_meta(t).nbytes * lay.micro_batches
    return int(max(held.values(), default=0)), False
