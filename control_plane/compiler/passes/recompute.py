"""Activation checkpointing: checkpointed forward segments are recomputed in backward, not kept.

``run(state)`` finds the checkpointed forward ops, groups them into *segments*, and for every op after
the forward (backward, optimizer, their boxing) that reads an output of a checkpointed op, emits a copy
of the producing ops right before it — ``recompute/<op>`` writing ``recompute/<tensor>`` — and rewires
that reader (and every later one) to the copy. The forward's own outputs then die with their last
forward reader, so a segment keeps only its inputs alive across the backward. Decisions:

* **Which ops.** An op with ``checkpoint=True`` (traced inside a module with ``activation_checkpointing``)
  and, with ``JobConfig.activation_checkpointing``, every forward op of a segment that owns parameters:
  every transformer block (``model.blocks.3``), every layer of a Sequential (``model.net.0``), every
  other module with weights (an embedding); glue outside them (a loss) is kept as it is.
* **Segments** are scopes cut after their first numeric component: ``model.blocks.3.attn.c_attn`` lies in
  segment ``model.blocks.3``; a scope without one (``model.wte``) is its own segment. A module flagged
  by the user that holds several numbered children (a Sequential) is thus checkpointed layer by layer:
  the trace records only the flag, not which module set it. Recomputation never crosses a segment: a
  tensor a segment reads from outside (the previous block's output) is the checkpoint that is kept.
  Without this the residual stream would chain every block's recomputation back to the embedding.
* **On demand.** A tensor is recomputed when the first later op needs it, together with what it needs
  from its own segment (depth first, producers first); the copy then serves every later reader. Ops whose
  outputs no backward op reads are not recomputed at all.
* **Randomness.** A copy keeps the attrs (``rng_id``) and, for the runtime, the stage of its original;
  random streams are keyed by (seed, rng_id, step), so dropout recomputes the very mask it drew.
* **Boxing nodes** made before SBP inference (ZeRO-3's per-use all-gathers) are copied with their plan,
  so a recomputed op re-gathers its weight instead of keeping the forward's gathered copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sbpflow.control_plane.compiler.passes.autodiff import is_backward
from sbpflow.control_plane.compiler.passes.optimizer import PREFIX as OPTIMIZER
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, Graph, OpNode

PREFIX = "recompute/"


def segment(scope: str) -> str:
    """``model.blocks.3.attn`` -> ``model.blocks.3``; a scope with no numeric component is its own segment."""
    parts = scope.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return scope


def forward_end(g: Graph) -> int:
    """Index of the first op after the forward: the first emitted by autodiff or the optimizer pass."""
    return next(
        (i for i, o in enumerate(g.ops) if is_backward(o) or o.name.startswith(OPTIMIZER)), len(g.ops)
    )


def checkpointed(state: CompileState) -> dict[str, str]:
    """Forward op name -> its segment, for every op whose outputs are recomputed."""
    g = state.graph
    forward = g.ops[: forward_end(g)]
    owners = {segment(p.tensor.rpartition(".")[0]) for p in state.job.parameters}
    every = state.job.config.activation_checkpointing
    return {
        o.name: segment(o.scope) for o in forward if o.checkpoint or (every and segment(o.scope) in owners)
    }


@dataclass
class _Recomputer:
    state: CompileState
    segments: dict[str, str]  # checkpointed op -> segment
    producer: dict[str, OpNode]  # forward tensor -> its op
    copies: dict[str, str] = field(default_factory=dict)  # forward tensor -> recomputed tensor
    out: list[OpNode] = field(default_factory=list)

    @property
    def graph(self) -> Graph:
        return self.state.graph

    def _recomputable(self, t: str) -> OpNode | None:
        node = self.producer.get(t)
        return node if node is not None and node.name in self.segments else None

    def tensor(self, t: str) -> str:
        """The name a post-forward op should read for forward tensor ``t``; emits its recomputation."""
        if t in self.copies:
            return self.copies[t]
        node = self._recomputable(t)
        if node is None:
            return t  # kept: not checkpointed
        seg = self.segments[node.name]
        ins = []
        for i in node.inputs:
            inner = self._recomputable(i)
            ins.append(self.tensor(i) if inner is not None and self.segments[inner.name] == seg else i)
        outs = []
        for o in node.outputs:
            decl = self.graph.tensors[o]
            self.graph.add_tensor(replace(decl, name=PREFIX + o))
            outs.append(PREFIX + o)
            self.copies[o] = PREFIX + o
        copy = replace(
            node, name=PREFIX + node.name, inputs=tuple(ins), outputs=tuple(outs), checkpoint=False
        )
        if node.op_type == BOXING:
            self.state.boxings[copy.name] = self.state.boxings[node.name]
        self.out.append(copy)
        return self.copies[t]


def run(state: CompileState) -> None:
    g = state.graph
    segments = checkpointed(state)
    if not segments:
        return
    end = forward_end(g)
    producer = {o: node for node in g.ops[:end] for o in node.outputs}
    rc = _Recomputer(state, segments, producer, out=list(g.ops[:end]))
    for node in g.ops[end:]:
        ins = tuple(rc.tensor(i) for i in node.inputs)
        rc.out.append(replace(node, inputs=ins) if ins != node.inputs else node)
    g.ops = rc.out
