"""ZeRO stages 1-3 as SBP rewrites: optimizer state, gradients and parameters split over data parallelism.

``run(state)`` reads ``config.zero_stage`` and, for every parameter the optimizer updates, annotates
(annotations are hard constraints for SBP inference; boxing then inserts the communication):

    stage   optimizer state   gradient      parameter   what boxing does per step
    1       S(k)              B (forced)    B           all-reduce P -> B; update on slices; all-gather
    2       S(k)              S(k)          B           reduce-scatter P -> S(k); update; all-gather
    3       S(k)              S(k)          S(k)        all-gather before each use; reduce-scatter

``S(k)`` is the *shard* of a tensor: its own layout with the data-parallel mesh axis set to ``S(k)``.
Stage 1 annotates the gradient ``B`` so that it really differs from stage 2 (left free, inference would
reduce-scatter it). Decisions:

* **The data-parallel mesh axis** of a parameter is the first axis of its placement along which the
  parameter is not split (``B``, or unannotated) and along which the data is cut by batch: some data
  input on that placement is ``S(0)`` there, or none is annotated there (a pipeline stage that receives
  its activations). A parameter without one (pure tensor parallelism) is left alone. 2-d meshes shard
  along that one axis only: a Megatron ``(B, S(1))`` weight becomes ``(S(0), S(1))``.
* **The split axis** ``k`` is the first tensor axis not already split by another mesh axis whose size is
  at least the data-parallel group size (uneven splits are fine). A tensor too small for that (a bias of
  2 over 4 ranks, a TP-split bias) keeps its layout, so its state is replicated: ZeRO saves nothing on a
  tensor smaller than the group.
* **The update runs on slices.** Stages 1 and 2 make the update write its new parameter as the shard and
  add the all-gather to the whole layout here, as an explicit boxing node (``<new>.from_<shard>`` ->
  ``<new>``, plan in ``state.boxings``): with the gather left to inference, an SGD update whose only
  state is a momentum buffer costs the same bytes run whole (gather the buffer) as run on slices (gather
  the new parameter), and the tie-breaker (fewer steps) would gather the state, which ZeRO exists to
  avoid holding whole. An unannotated parameter is annotated whole (``B`` on every axis) to fix the gather's endpoint.
* **Stage 3 gathers before each use.** Every reader of a parameter other than its update (the forward
  op, and its backward ops that read it again) reads its own all-gathered copy, made by a boxing node
  right before it, as FSDP gathers in forward and again in backward; lowering frees that register after
  its one reader, so at most the parameters of a few ops are whole at once. Left to inference, one
  gather would serve forward and backward and keep the weight whole in between, and a cheaper layout
  (an all-to-all of the weight and a model-parallel op) may win on bytes; ZeRO-3 means gathering.
  The gather nodes carry their reader's stage, scope and checkpoint flag, so activation checkpointing
  re-gathers a weight for recomputation rather than keeping the forward's copy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sbpflow.control_plane.compiler.passes.boxing_pass import boxing_node, slug
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.ops.training.loss_scaling import GATED
from sbpflow.placement import Placement
from sbpflow.sbp import B, NdSbp, Split, format_nd

UPDATE_OPS = frozenset({"sgd_update", "adamw_update", *GATED.values()})


@dataclass(frozen=True)
class Layout:
    """How ZeRO lays out one parameter: its placement, whole layout, and shard (None: too small)."""

    placement: Placement
    whole: NdSbp
    shard: NdSbp | None
    axis: int | None  # the data-parallel mesh axis


def run(state: CompileState) -> None:
    stage = state.job.config.zero_stage
    spec = state.job.optimizer
    if stage == 0 or spec is None:
        return
    g = state.graph
    updates = {o.inputs[0]: o for o in g.ops if o.op_type in UPDATE_OPS}
    for p in spec.parameters:
        node = updates.get(p)
        if node is None:
            raise GraphError(
                f"ZeRO stage {stage}: parameter {p!r} has no update op; run the optimizer pass before zero"
            )
        lay = layout(g, p)
        if lay.shard is None:
            continue
        _annotate(g, p, lay, lay.whole if stage < 3 else lay.shard)
        for slot in node.inputs[2 : 1 + len(node.outputs)]:  # its state (not a gated update's scalars)
            _annotate(g, slot, lay, lay.shard)
        _annotate(g, state.grads[p], lay, lay.whole if stage == 1 else lay.shard)
        if stage < 3:
            _gather_new_value(state, node, lay)
        else:
            _gather_before_each_use(state, p, lay, node)


def layout(g: Graph, param: str) -> Layout:
    """The data-parallel axis and the ZeRO shard of ``param`` (see the module docstring)."""
    decl = g.tensors[param]
    pl = decl.placement
    if pl is None:
        raise GraphError(
            f"ZeRO needs the placement of parameter {param!r} {decl.meta} to split its optimizer state; place "
            "it (Parameter.to_global or trace with a placement)"
        )
    whole = decl.sbp or (B,) * pl.ndim
    axis = _dp_axis(g, pl, whole)
    if axis is None:
        return Layout(pl, whole, None, None)
    taken = {s.axis for s in whole if isinstance(s, Split)}
    size = pl.shape[axis]
    k = next((i for i, n in enumerate(decl.meta.shape) if i not in taken and n >= size), None)
    if k is None:
        return Layout(pl, whole, None, axis)
    return Layout(pl, whole, (*whole[:axis], Split(k), *whole[axis + 1 :]), axis)


def _dp_axis(g: Graph, pl: Placement, whole: NdSbp) -> int | None:
    batch_cut: set[int] = set()
    annotated: set[int] = set()
    for t in g.of_kind(TensorKind.input):
        if t.placement != pl or t.sbp is None:
            continue
        for m, s in enumerate(t.sbp):
            annotated.add(m)
            if s == Split(0):
                batch_cut.add(m)
    for m, s in enumerate(whole):
        if s == B and pl.shape[m] > 1 and (m in batch_cut or m not in annotated):
            return m
    return None


def _annotate(g: Graph, name: str, lay: Layout, sbp: NdSbp) -> None:
    """Set ``name``'s SBP; an annotation other than its parameter's own layout (which the optimizer pass
    copies onto the state) would be a user's constraint that ZeRO must not silently override."""
    decl = g.tensors[name]
    if decl.sbp is not None and decl.sbp not in (sbp, lay.whole):
        raise GraphError(
            f"ZeRO wants {decl.kind.value} {name!r} {decl.meta} laid out {format_nd(sbp)}, but it is annotated "
            f"{format_nd(decl.sbp)}; remove that annotation or set zero_stage=0"
        )
    g.set_tensor(replace(decl, sbp=sbp))


def _gather_new_value(state: CompileState, update: OpNode, lay: Layout) -> None:
    """The update writes the new parameter as the shard; an all-gather makes it whole (stages 1, 2)."""
    assert lay.shard is not None
    g = state.graph
    new = update.outputs[0]
    decl = g.tensors[new]
    raw = TensorDecl(f"{new}.from_{slug(lay.shard)}", decl.meta, decl.kind, lay.placement, lay.shard)
    g.add_tensor(raw)
    g.set_tensor(replace(decl, placement=lay.placement, sbp=lay.whole))
    at = g.ops.index(update)
    g.ops[at] = replace(update, outputs=(raw.name, *update.outputs[1:]))
    box = boxing_node(state, raw.name, g.tensors[new], update, update.checkpoint)
    g.ops.insert(at + 1, box)


def _gather_before_each_use(state: CompileState, param: str, lay: Layout, update: OpNode) -> None:
    """Every reader of ``param`` but its update reads a copy all-gathered right before it (stage 3)."""
    g = state.graph
    decl = g.tensors[param]
    ops: list[OpNode] = []
    n = 0
    for node in g.ops:
        if param in node.inputs and node is not update and node.op_type != BOXING:
            n += 1
            name = f"{param}.to_{slug(lay.whole)}" + ("" if n == 1 else f".{n}")
            copy = TensorDecl(name, decl.meta, TensorKind.activation, lay.placement, lay.whole)
            g.add_tensor(copy)
            ops.append(boxing_node(state, param, copy, node, node.checkpoint))
            node = replace(node, inputs=tuple(name if i == param else i for i in node.inputs))
        ops.append(node)
    g.ops = ops
