"""``GraphBuilder``: the :class:`~sbpflow.ops.base.Builder` protocol on tensor names, for compiler passes.

The same gradient rules that :class:`~sbpflow.ops.eager.EagerBuilder` runs on arrays run here
symbolically: ``call(op_type, *names, **attrs)`` infers the outputs, declares them and appends an
``OpNode`` to the graph, and returns the output names. Every node a builder emits is stamped with the
builder's stage, placement and scope — the forward op's, for the backward ops derived from it, so that the
backward of a stage-k op runs in stage k on its placement.

Names are readable and unique: ops are ``<prefix>/<op_type>_<n>`` (``grad/blocks.0.mlp.gelu_0/gelu_grad_0``),
a single output takes its op's name and several take ``<op>:<i>``, as the tracer does. Builders made by
:meth:`GraphBuilder.at` share one bookkeeping record (names in use, what they emitted, what has been read),
so a pass can move between contexts and still :meth:`rename` a fresh result (``grad/<tensor>``) safely.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sbpflow.errors import GraphError, ShapeError
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.ops.base import AttrValue, get_op
from sbpflow.placement import Placement
from sbpflow.tensor_meta import TensorMeta


@dataclass
class _Record:
    """What every builder over one graph shares: names taken, ops emitted (by index), tensors read."""

    names: set[str]
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    produced_at: dict[str, int] = field(default_factory=dict)  # emitted tensor -> index in graph.ops
    read: set[str] = field(default_factory=set)
    emitted: list[str] = field(default_factory=list)  # op names, in emission order

    @classmethod
    def of(cls, graph: Graph) -> _Record:
        return cls(set(graph.tensors) | {o.name for o in graph.ops})


class GraphBuilder:
    """Emits ops into ``graph`` under ``prefix``, on ``stage``/``placement``/``scope``, outputs of ``kind``."""

    def __init__(
        self,
        graph: Graph,
        prefix: str,
        *,
        stage: int = 0,
        placement: Placement | None = None,
        scope: str = "",
        kind: TensorKind = TensorKind.activation,
        _record: _Record | None = None,
    ) -> None:
        self.graph, self.prefix = graph, prefix
        self.stage, self.placement, self.scope, self.kind = stage, placement, scope, kind
        self._rec = _record or _Record.of(graph)

    def at(
        self,
        prefix: str,
        *,
        stage: int = 0,
        placement: Placement | None = None,
        scope: str = "",
        kind: TensorKind | None = None,
    ) -> GraphBuilder:
        """A builder for another context over the same graph, sharing this one's bookkeeping."""
        return GraphBuilder(
            self.graph,
            prefix,
            stage=stage,
            placement=placement,
            scope=scope,
            kind=self.kind if kind is None else kind,
            _record=self._rec,
        )

    # ---- the Builder protocol -------------------------------------------------------------------------

    def meta(self, value: Any) -> TensorMeta:
        decl = self.graph.tensors.get(value)
        if decl is None:
            raise GraphError(f"builder {self.prefix!r}: tensor {value!r} is not declared in the graph")
        return decl.meta

    def call(self, op_type: str, *inputs: Any, **attrs: AttrValue) -> tuple[str, ...]:
        return self.emit(op_type, inputs, attrs)

    # ---- beyond the protocol --------------------------------------------------------------------------

    def emit(
        self,
        op_type: str,
        inputs: Sequence[str],
        attrs: Mapping[str, AttrValue],
        *,
        name: str | None = None,
        kind: TensorKind | None = None,
    ) -> tuple[str, ...]:
        """Append one op; ``name`` fixes the op's (and its single output's) name, ``kind`` the outputs' kind."""
        ins = tuple(inputs)
        op = get_op(op_type)
        try:
            full = op.normalize_attrs(attrs)
            outs = op.run_infer(tuple(self.meta(i) for i in ins), full)
        except ShapeError as e:
            args = ", ".join(f"{i}: {self.meta(i)}" for i in ins)
            raise GraphError(
                f"{self.prefix}: emitting {op_type}({args}) failed: {e}. The rule that emits it (a gradient "
                "or optimizer rule) disagrees with the op's inference; fix the rule"
            ) from None
        node_name = self._claim(name) if name is not None else self._next_name(op_type)
        outputs = (
            (node_name,)
            if len(outs) == 1
            else tuple(self._claim(f"{node_name}:{i}") for i in range(len(outs)))
        )
        out_kind = self.kind if kind is None else kind
        for out, meta in zip(outputs, outs, strict=True):
            self.graph.add_tensor(TensorDecl(out, meta, out_kind, self.placement))
            self._rec.produced_at[out] = len(self.graph.ops)
        node = OpNode(node_name, op_type, ins, outputs, full, self.placement, self.stage, False, self.scope)
        self.graph.add_op(node)
        self._rec.read.update(ins)
        self._rec.emitted.append(node_name)
        return outputs

    def rename(self, tensor: str, new: str, kind: TensorKind | None = None) -> bool:
        """Give a tensor this builder family emitted, and no op has read yet, the name ``new``.

        Returns False (and changes nothing) when that is not safe: the tensor came from elsewhere, an op
        already reads it, or ``new`` is taken. Callers keep the old name then.
        """
        at = self._rec.produced_at.get(tensor)
        if at is None or tensor in self._rec.read or new in self._rec.names:
            return False
        node = self.graph.ops[at]
        self.graph.ops[at] = replace(node, outputs=tuple(new if o == tensor else o for o in node.outputs))
        decl = self.graph.tensors.pop(tensor)
        self.graph.tensors[new] = replace(decl, name=new, kind=decl.kind if kind is None else kind)
        self._rec.names.add(new)
        self._rec.produced_at[new] = self._rec.produced_at.pop(tensor)
        return True

    @property
    def emitted(self) -> tuple[str, ...]:
        """Names of every op emitted by this builder family, in order."""
        return tuple(self._rec.emitted)

    def _next_name(self, op_type: str) -> str:
        key = (self.prefix, op_type)
        n = self._rec.counts.get(key, 0)
        while f"{self.prefix}/{op_type}_{n}" in self._rec.names:
            n += 1
        self._rec.counts[key] = n + 1
        return self._claim(f"{self.prefix}/{op_type}_{n}")

    def _claim(self, name: str) -> str:
        if name in self._rec.names:
            raise GraphError(f"builder {self.prefix!r}: the name {name!r} is already used in the graph")
        self._rec.names.add(name)
        return name
