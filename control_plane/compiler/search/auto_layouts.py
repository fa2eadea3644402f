"""The layouts the automatic plan search weighs, and a job re-laid out as one of them.

A :class:`Layout` is what a user writes by hand: a mesh of ``pp`` pipeline stages of ``dp x tp`` ranks,
a ZeRO stage, recompute on or off and the micro-batches a step is cut into. :func:`relayout` turns any
traced job (its placements and annotations ignored) into that layout, as data, the way the examples'
``--dp/--tp/--pp`` flags and ``sf.nn.parallel.megatron`` write it:

* **data parallel**: every op and tensor on the mesh, the data inputs ``S(0)`` over the data-parallel
  axis (``B`` over the tensor axis), the parameters left to SBP inference (replicated);
* **tensor parallel** (Megatron's pairs, found in the graph): a matmul whose weight is a parameter is
  *column*-parallel (weight split by output features, its bias too) unless its activation comes from an
  open column-parallel matmul, which makes it that one's *row*-parallel partner (weight split by input
  features, bias ``B``): GPT's qkv/proj and fc/proj, an MLP's hidden layer. A column left without a
  partner (GPT's head) stays replicated. Every other parameter is ``B``. With pipeline stages each
  stage is its own ``dp x tp`` mesh (compile_scale.py's TP x PP x DP);
* **embedding tables** (``tables``): every parameter an ``embedding`` op reads rows of, split by rows
  ``S(0)`` over a 1-d mesh (over the data-parallel axis of a 2-d one): each rank holds and looks up a
  slice of the vocabulary, the lookups partial sums (OneFlow's Wide & Deep layout, Megatron's
  vocabulary-parallel embedding);
* **pipeline stages**: the model's repeated blocks (the scope path with the most numbered children,
  ``model.blocks.<i>``) cut into ``pp`` consecutive runs, block ``i`` of ``n`` in stage ``i * pp // n``
  (the examples' ``stage_blocks``); what comes before the first block runs in the first stage and
  everything after a block in that block's stage; each stage on its own consecutive ranks, data parallel
  inside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from sbpflow.errors import SbpflowError
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import Job
from sbpflow.placement import Placement
from sbpflow.sbp import B, NdSbp, Sbp, Split


@dataclass(frozen=True, order=True)
class Layout:
    pp: int = 1
    tp: int = 1
    dp: int = 1
    zero: int = 0
    recompute: bool = False
    micro_batches: int = 1
    tables: bool = False  # embedding tables split by rows (OneFlow's model-parallel embedding)

    @property
    def ranks(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def mesh(self) -> str:
        """``DP4``, ``TP2xDP2``, ``PP2xDP2``: the parallelism of the ranks, degrees of 1 left out."""
        parts = [f"{k}{n}" for k, n in (("PP", self.pp), ("TP", self.tp), ("DP", self.dp)) if n > 1]
        return "x".join(parts) or "DP1"

    def __str__(self) -> str:
        extra = ["tables-S(0)"] * self.tables + [f"ZeRO-{self.zero}"] * (self.zero > 0)
        extra += ["recompute"] * self.recompute
        extra += [f"M{self.micro_batches}"] * (self.micro_batches > 1)
        return " ".join([self.mesh, *extra])


# ---- what the graph offers -------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """A Megatron pair's parameters: the column-parallel weight and bias, the row-parallel weight and bias."""

    column: tuple[str, str | None]
    row: tuple[str, str | None]


def tp_pairs(g: Graph) -> list[Pair]:
    """Megatron's column/row pairs of weighted matmuls, in forward order (module docstring)."""
    params = {t.name for t in g.of_kind(TensorKind.parameter)}
    from_col: dict[str, str] = {}  # activation -> the open column matmul it comes from
    open_cols: dict[str, tuple[str, str | None]] = {}
    pairs: list[Pair] = []
    for node in g.ops:
        weight = _weight(g, node, params)
        came = {from_col[i] for i in node.inputs if i in from_col and from_col[i] in open_cols}
        if weight is None:
            for o in node.outputs:
                if came:
                    from_col[o] = min(came)
            continue
        bias = _bias(g, node, params)
        if came:  # the row-parallel partner of the column it reads
            pairs.append(Pair(open_cols.pop(min(came)), (weight, bias)))
        else:
            open_cols[node.name] = (weight, bias)
            from_col.update(dict.fromkeys(node.outputs, node.name))
    return pairs


def _weight(g: Graph, node: OpNode, params: set[str]) -> str | None:
    """The 2-d parameter a plain matmul reads as its right operand (``x @ W``), else None."""
    if node.op_type != "matmul" or len(node.inputs) != 2 or node.attrs.get("transpose_a"):
        return None
    w = node.inputs[1]
    if w not in params or g.tensors[w].meta.ndim != 2 or node.attrs.get("transpose_b"):
        return None
    return w


def _bias(g: Graph, node: OpNode, params: set[str]) -> str | None:
    """The 1-d parameter added to ``node``'s output by its reader, if one is."""
    out = node.outputs[0]
    for r in g.consumers(out):
        if r.op_type == "add":
            other = [i for i in r.inputs if i != out]
            if other and other[0] in params and g.tensors[other[0]].meta.ndim == 1:
                return other[0]
    return None


def tables(g: Graph) -> list[str]:
    """The parameters an ``embedding`` op looks rows up in, in forward order."""
    params = {t.name for t in g.of_kind(TensorKind.parameter)}
    found = [o.inputs[0] for o in g.ops if o.op_type == "embedding" and o.inputs[0] in params]
    return list(dict.fromkeys(found))


def block_of(g: Graph) -> dict[str, int]:
    """Each op in one of the model's repeated blocks -> the block's index (``{}``: none repeat)."""
    found: dict[str, dict[str, int]] = {}
    for node in g.ops:
        scope = node.scope
        for m in _numbered_prefixes(scope):
            found.setdefault(m[0], {})[node.name] = m[1]
    if not found:
        return {}
    best = max(found, key=lambda k: (len(set(found[k].values())), -len(k)))
    return found[best] if len(set(found[best].values())) > 1 else {}


def _numbered_prefixes(scope: str) -> Iterator[tuple[str, int]]:
    """``model.blocks.3.attn`` -> (``model.blocks``, 3); every numbered component of the path."""
    parts = scope.split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit():
            yield ".".join(parts[:i]), int(parts[i])


def stage_of(g: Graph, pp: int) -> dict[str, int]:
    """Each op -> its pipeline stage when ``g``'s blocks are cut into ``pp`` runs (module docstring)."""
    blocks = block_of(g)
    n = len(set(blocks.values()))
    if pp > 1 and n < pp:
        raise SbpflowError(
            f"{n} repeated blocks cannot fill {pp} pipeline stages; the search cuts only between blocks"
        )
    index = {b: i for i, b in enumerate(sorted(set(blocks.values())))}
    out: dict[str, int] = {}
    current = 0
    for node in g.ops:
        if node.name in blocks:
            current = index[blocks[node.name]] * pp // max(n, 1)
        out[node.name] = current
    return out


# ---- the job as a layout --------------------------------------------------------------------------


def device_type(job: Job) -> str:
    pls = [t.placement for t in job.graph.tensors.values()] + [o.placement for o in job.graph.ops]
    return next((pl.device_type for pl in pls if pl is not None), "cpu")


def _stage_placements(dev: str, lay: Layout) -> list[Placement]:
    per = lay.tp * lay.dp
    shape = (lay.dp, lay.tp) if lay.tp > 1 and lay.dp > 1 else (per,)
    return [Placement(dev, tuple(range(s * per, (s + 1) * per)), shape) for s in range(lay.pp)]


def _axis_sbp(pl: Placement, lay: Layout, tp_entry: Sbp, dp_entry: Sbp) -> NdSbp:
    """The nd-SBP with ``tp_entry`` on the tensor axis and ``dp_entry`` on the data-parallel one."""
    if pl.ndim == 2:
        return (dp_entry, tp_entry)
    return (tp_entry,) if lay.tp > 1 else (dp_entry,)


def tp_annotations(g: Graph, where: Mapping[str, Placement], lay: Layout) -> dict[str, NdSbp]:
    """Every parameter's nd-SBP on its placement (``where``) under tensor parallelism: Megatron's pairs
    split over the tensor axis, everything else ``B``."""
    out: dict[str, NdSbp] = {t.name: (B,) * where[t.name].ndim for t in g.of_kind(TensorKind.parameter)}
    for pair in tp_pairs(g):
        for (w, b), (w_sbp, b_sbp) in ((pair.column, (Split(1), Split(0))), (pair.row, (Split(0), B))):
            out[w] = _axis_sbp(where[w], lay, w_sbp, B)
            if b is not None:
                out[b] = _axis_sbp(where[b], lay, b_sbp, B)
    return out


def relayout(job: Job, lay: Layout) -> Job:
    """``job`` laid out as ``lay`` on ranks ``0 .. lay.ranks-1`` (module docstring); its own placements,
    stages and SBP annotations are replaced."""
    g = job.graph
    stages = _stage_placements(device_type(job), lay)
    stage = stage_of(g, lay.pp) if lay.pp > 1 else dict.fromkeys((o.name for o in g.ops), 0)
    ops = [dataclasses.replace(o, placement=stages[stage[o.name]], stage=stage[o.name]) for o in g.ops]
    where: dict[str, Placement] = {}
    for o in ops:  # an op's outputs where it runs, a source where its first reader runs
        where.update(dict.fromkeys(o.outputs, stages[o.stage]))
        for name in o.inputs:
            where.setdefault(name, stages[o.stage])
    sbps = tp_annotations(g, where, lay) if lay.tp > 1 else {}
    for name in tables(g) if lay.tables else ():  # rows over the whole of a 1-d mesh, else over DP
        pl = where[name]
        sbps[name] = _axis_sbp(pl, lay, Split(0) if pl.ndim == 1 else B, Split(0))
    tensors: dict[str, TensorDecl] = {}
    for name, t in g.tensors.items():
        pl, sbp = where.get(name, stages[0]), sbps.get(name)
        if t.kind is TensorKind.input:
            pl, sbp = stages[0], _axis_sbp(stages[0], lay, B, Split(0))
        tensors[name] = dataclasses.replace(t, placement=pl, sbp=sbp)
    config = dataclasses.replace(
        job.config,
        zero_stage=lay.zero,
        activation_checkpointing=lay.recompute,
        micro_batches=lay.micro_batches,
    )
    return dataclasses.replace(job, graph=Graph(tensors, ops), config=config)
