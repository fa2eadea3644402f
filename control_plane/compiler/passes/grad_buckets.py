"""Gradient bucketing: the data-parallel gradient all-reduces of a step as a few big ones, in backward order.

After ``boxing_pass`` every gradient that data parallelism leaves partial is made whole by its own
boxing node (``P -> B``: an all-reduce). Each collective pays a round trip between the ranks and, on the
ordered communication stream, waits for the slowest rank, so a model with many small parameters spends
its step in latencies. PyTorch DDP packs gradients into ~25 MB buckets in the order backward produces
them and all-reduces each bucket as soon as it is full, while backward goes on. ``run(state)`` does the
same with the graph:

* a **candidate** is a boxing node that makes a gradient of ``state.grads`` whole on its own placement
  (every source entry ``P`` or ``B``, at least one ``P`` on a mesh axis of two or more ranks, every
  destination entry ``B``) from a partial value that nothing else reads;
* candidates are visited in op order, which is backward's (autodiff emits the gradient of the last
  forward op first, and ``boxing_pass`` puts each boxing right after its producer). They gather in one
  open bucket per (placement, SBP, dtype, stage); a bucket closes once it holds
  ``JobConfig.grad_bucket_bytes`` (its logical bytes) or before a candidate that would move it past an
  op reading one of its gradients;
* a bucket of two or more becomes ``pack`` (sbpflow/ops/training/packing.py: the partial gradients as one 1-d
  array, still ``P``), one boxing node of the packed array, and ``unpack`` into the whole gradients, which
  keep their names — so ``state.grads``, the clipping and the updates read them unchanged. The three
  ops sit where the bucket's last boxing was: the bucket's all-reduce is ready when its last gradient
  is, and runs on the communication stream while the compute stream goes on with backward.

Names: ``grad/bucket_<k>/pack`` writes ``grad/bucket_<k>.from_P``, the boxing ``grad/bucket_<k>.box`` writes
``grad/bucket_<k>``, ``grad/bucket_<k>/unpack`` writes the gradients (the ``grad/`` prefix puts them in the
backward phase for micro-batching, whose accumulation averages the packed array: one accumulation and
one all-reduce per bucket and step). The pack op's recorded choice names the bucket's gradients, so
``sbpflow plan`` shows every bucket. Summing a packed array is summing its parts in the same order, so
on two ranks (and with any transport that reduces in rank order) a bucketed run is bit-identical to an
unbucketed one; a ring all-reduce over more ranks may pair the additions of a bucket differently.

``grad_bucket_bytes = 0`` turns the pass off: one all-reduce per gradient, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sbpflow.control_plane.compiler.passes.boxing_pass import boxing_node
from sbpflow.control_plane.compiler.state import Choice, CompileState
from sbpflow.graph import BOXING, OpNode, TensorDecl, TensorKind
from sbpflow.ops.base import NdSignature
from sbpflow.ops.training.packing import shapes_attrs
from sbpflow.sbp import B, NdSbp, PartialSum
from sbpflow.tensor_meta import TensorMeta

PREFIX = "grad/bucket_"


@dataclass
class Bucket:
    """The candidates of one bucket, in backward order, and when the first of their readers runs."""

    boxes: list[OpNode] = field(default_factory=list)
    nbytes: int = 0
    first_read: int = 1 << 62  # op position of the earliest reader of any of its gradients


def candidate(state: CompileState, node: OpNode, reads: dict[str, int], grads: set[str]) -> bool:
    """Whether ``node`` is a boxing that all-reduces a gradient (of ``grads``) from a partial value that
    only it reads (module docstring)."""
    if node.op_type != BOXING or node.outputs[0] not in grads:
        return False
    src, dst = state.graph.tensors[node.inputs[0]], state.graph.tensors[node.outputs[0]]
    if src.placement != dst.placement or src.sbp is None or dst.sbp is None or reads[src.name] != 1:
        return False
    partial = [isinstance(s, PartialSum) for s in src.sbp]
    assert src.placement is not None
    return (
        # a partial value on a mesh axis of one rank is already whole: that boxing moves nothing (the
        # executor bypasses it), and packing it would copy every such gradient twice for no all-reduce
        any(p and n > 1 for p, n in zip(partial, src.placement.shape, strict=True))
        and all(p or s == B for p, s in zip(partial, src.sbp, strict=True))
        and all(s == B for s in dst.sbp)
    )


def buckets(state: CompileState, cap: int) -> list[list[OpNode]]:
    """The buckets of two or more boxing nodes each, in the order they close."""
    g = state.graph
    reads: dict[str, int] = {}
    first_read: dict[str, int] = {}
    for i, o in enumerate(g.ops):
        for t in o.inputs:
            reads[t] = reads.get(t, 0) + 1
            first_read.setdefault(t, i)
    open_: dict[tuple[object, ...], Bucket] = {}
    done: list[list[OpNode]] = []
    grads = set(state.grads.values())
    for i, o in enumerate(g.ops):
        if not candidate(state, o, reads, grads):
            continue
        src = g.tensors[o.inputs[0]]
        key = (src.placement, src.sbp, src.meta.dtype, o.stage, o.checkpoint)
        b = open_.get(key)
        if b is not None and b.first_read < i:  # one of its gradients is read before this one is ready
            done.append(open_.pop(key).boxes)
            b = None
        b = b or open_.setdefault(key, Bucket())
        b.boxes.append(o)
        b.nbytes += src.meta.nbytes
        b.first_read = min(b.first_read, first_read.get(o.outputs[0], 1 << 62))
        if b.nbytes >= cap:
            done.append(open_.pop(key).boxes)
    done += [b.boxes for b in open_.values()]
    return [d for d in done if len(d) > 1]


def run(state: CompileState) -> None:
    cap = state.job.config.grad_bucket_bytes
    if cap <= 0:
        return
    found = buckets(state, cap)
    if not found:
        return
    replaced: dict[str, list[OpNode]] = {}
    gone: set[str] = set()
    for k, boxes in enumerate(found):
        replaced[boxes[-1].name] = bucket_ops(state, k, boxes, cap)
        gone.update(b.name for b in boxes)
    g = state.graph
    g.ops[:] = [new for o in g.ops for new in replaced.get(o.name, [o] if o.name not in gone else [])]


def bucket_ops(state: CompileState, k: int, boxes: list[OpNode], cap: int) -> list[OpNode]:
    """pack, boxing and unpack for bucket ``k`` (its boxing nodes ``boxes``), declaring their tensors."""
    g = state.graph
    parts = [g.tensors[b.inputs[0]] for b in boxes]
    wholes = [g.tensors[b.outputs[0]] for b in boxes]
    for b in boxes:
        del state.boxings[b.name]
    first, last = parts[0], boxes[-1]
    assert first.placement is not None and first.sbp is not None and wholes[0].sbp is not None
    meta = TensorMeta((sum(p.meta.numel for p in parts),), first.meta.dtype)
    name = f"{PREFIX}{k}"
    flat_p = g.add_tensor(TensorDecl(f"{name}.from_P", meta, TensorKind.gradient, first.placement, first.sbp))
    flat_b = TensorDecl(name, meta, TensorKind.gradient, first.placement, wholes[0].sbp)
    g.add_tensor(flat_b)
    where = dict(placement=first.placement, stage=last.stage, checkpoint=last.checkpoint, scope=last.scope)
    pack = OpNode(f"{name}/pack", "pack", tuple(p.name for p in parts), (flat_p.name,), {}, **where)  # type: ignore[arg-type]
    box = boxing_node(state, flat_p.name, flat_b, last, last.checkpoint)
    unpack = OpNode(
        f"{name}/unpack",
        "unpack",
        (name,),
        tuple(w.name for w in wholes),
        shapes_attrs([w.meta.shape for w in wholes]),
        **where,  # type: ignore[arg-type]
    )
    _choose(state, pack, (first.sbp,) * len(parts), (first.sbp,), _reason(k, parts, meta, cap))
    _choose(state, unpack, (wholes[0].sbp,), (wholes[0].sbp,) * len(wholes), f"gradient bucket {k} unpacked")
    return [pack, box, unpack]


def _choose(
    state: CompileState, node: OpNode, ins: tuple[NdSbp, ...], outs: tuple[NdSbp, ...], why: str
) -> None:
    state.choices[node.name] = Choice(NdSignature(ins, outs), 0, why)


def _reason(k: int, parts: list[TensorDecl], meta: TensorMeta, cap: int) -> str:
    names = ", ".join(p.name.removesuffix(".from_P") for p in parts)
    return (
        f"gradient bucket {k}: {len(parts)} gradients, {meta.nbytes} B, one all-reduce "
        f"(grad_bucket_bytes={cap}), in backward order: {names}"
    )
