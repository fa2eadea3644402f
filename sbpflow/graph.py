"""The logical graph: declared tensors and the ops between them, in topological order.

This is the IR that tracing produces, that the compiler's passes rewrite, and that converts losslessly
to and from the wire ``Job`` (sbpflow/codec/wire.py). ``verify`` rejects a malformed graph at the first bad
node, naming it, and is run after every compiler pass in tests: undeclared or unordered tensors, op names
or outputs used twice, an op whose declared outputs its shape inference does not give, and degenerate
tensors (a size-0 axis: a zero-width layer). A tensor no op reads is legal (a fetched activation, a
frozen branch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from sbpflow.errors import GraphError, ShapeError, UnknownOpError
from sbpflow.ops.base import AttrValue, get_op
from sbpflow.placement import Placement
from sbpflow.sbp import NdSbp, check_axes, format_nd
from sbpflow.tensor_meta import TensorMeta

# The compiler's boxing nodes: logically the identity, physically a change of SBP or placement. They are
# not in the op registry (no kernel runs them; the runtime executes their BoxingPlan).
BOXING = "boxing"


class TensorKind(StrEnum):
    activation = "activation"
    parameter = "parameter"
    input = "input"  # fed by the data source
    constant = "constant"
    gradient = "gradient"
    optimizer_state = "optimizer_state"


@dataclass(frozen=True)
class TensorDecl:
    """A named global tensor. ``sbp`` set by the user is a hard constraint; ``None`` leaves it to inference."""

    name: str
    meta: TensorMeta
    kind: TensorKind = TensorKind.activation
    placement: Placement | None = None
    sbp: NdSbp | None = None
    requires_grad: bool = False

    def __repr__(self) -> str:
        where = "" if self.placement is None else f" on {self.placement}"
        sbp = "" if self.sbp is None else f" {format_nd(self.sbp)}"
        return f"{self.name}: {self.meta}{sbp}{where}"


@dataclass(frozen=True)
class OpNode:
    """One op call: ``outputs = op_type(*inputs, **attrs)`` on ``placement`` in pipeline ``stage``."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, AttrValue] = field(default_factory=dict)
    placement: Placement | None = None
    stage: int = 0
    checkpoint: bool = False  # recompute this op's outputs in backward instead of keeping them
    scope: str = ""  # the module path that emitted it, e.g. "blocks.0.attn"

    def __repr__(self) -> str:
        attrs = ", ".join(f"{k}={v!r}" for k, v in sorted(self.attrs.items()))
        return f"{', '.join(self.outputs)} = {self.op_type}({', '.join(self.inputs)}{', ' if attrs else ''}{attrs})"


@dataclass
class Graph:
    tensors: dict[str, TensorDecl] = field(default_factory=dict)
    ops: list[OpNode] = field(default_factory=list)

    def add_tensor(self, decl: TensorDecl) -> TensorDecl:
        if decl.name in self.tensors:
            raise GraphError(f"tensor {decl.name!r} is declared twice; tensor names must be unique")
        self.tensors[decl.name] = decl
        return decl

    def set_tensor(self, decl: TensorDecl) -> None:
        """Replace an existing declaration (e.g. when a pass fixes its SBP)."""
        if decl.name not in self.tensors:
            raise GraphError(f"tensor {decl.name!r} is not declared")
        self.tensors[decl.name] = decl

    def add_op(self, node: OpNode) -> OpNode:
        names = self._names()
        if node.name in names:
            raise GraphError(f"op name {node.name!r} is used twice; op names must be unique")
        self.ops.append(node)
        names.add(node.name)
        return node

    def _names(self) -> set[str]:
        """Op names, indexed so that building a large graph stays linear; rebuilt when a pass has
        replaced or edited ``ops`` behind the index's back."""
        cache = self.__dict__.get("_name_index")
        if cache is None or cache[0] is not self.ops or len(cache[1]) != len(self.ops):
            cache = (self.ops, {o.name for o in self.ops})
            self.__dict__["_name_index"] = cache
        return cache[1]

    def producer(self, tensor: str) -> OpNode | None:
        return next((o for o in self.ops if tensor in o.outputs), None)

    def consumers(self, tensor: str) -> list[OpNode]:
        return [o for o in self.ops if tensor in o.inputs]

    def producers_and_readers(self) -> tuple[dict[str, OpNode], dict[str, int]]:
        """Each tensor's producing op, and how many op inputs read it (an op reading it twice counts twice):
        one sweep, for passes that look up many tensors."""
        readers: dict[str, int] = {}
        for o in self.ops:
            for i in o.inputs:
                readers[i] = readers.get(i, 0) + 1
        return {t: o for o in self.ops for t in o.outputs}, readers

    def of_kind(self, kind: TensorKind) -> list[TensorDecl]:
        return [t for t in self.tensors.values() if t.kind == kind]

    def copy(self) -> Graph:
        return Graph(dict(self.tensors), list(self.ops))

    def verify(self) -> None:
        """Check the graph; raise GraphError at the first bad node."""
        produced: set[str] = {
            t.name
            for t in self.tensors.values()
            if t.kind != TensorKind.activation and t.kind != TensorKind.gradient
        }
        for t in self.tensors.values():
            _verify_tensor(t)
        seen: set[str] = set()
        for node in self.ops:
            if node.name in seen:
                raise GraphError(f"op name {node.name!r} is used twice; op names must be unique")
            seen.add(node.name)
            _verify_op(self, node, produced)
            produced.update(node.outputs)
        dangling = [t for t in self.tensors if t not in produced]
        if dangling:
            raise GraphError(f"tensor(s) {dangling} are declared but no op produces them")

    def dump(self) -> str:
        """A readable listing, one tensor or op per line; golden files diff this."""
        lines = [f"tensor {t!r} [{t.kind.value}]" for t in self.tensors.values()]
        lines += [
            f"op {o.name} (stage {o.stage}{', checkpoint' if o.checkpoint else ''}): {o!r}" for o in self.ops
        ]
        return "\n".join(lines)


# why a tensor with a size-0 axis is refused, by its kind: it holds no values, so every op on it computes
# nothing and every gradient through it is zero, and a split of it leaves ranks with empty shards
EMPTY_AXIS = {
    TensorKind.parameter: "a zero-width layer (e.g. Linear(d, 0), Embedding(n, 0)) learns nothing",
    TensorKind.input: "an input with no values feeds nothing (a data field's sample shape or batch of 0?)",
}


def _verify_tensor(t: TensorDecl) -> None:
    if 0 in t.meta.shape:
        why = EMPTY_AXIS.get(t.kind, "a tensor with no values makes every op after it compute nothing")
        raise GraphError(
            f"{t.kind.value} tensor {t.name!r} {t.meta} has size 0 on axis {t.meta.shape.index(0)}: {why}; "
            "give every axis a size of at least 1"
        )
    if t.sbp is not None:
        if t.placement is None:
            raise GraphError(f"tensor {t.name!r} has SBP {format_nd(t.sbp)} but no placement; give both")
        if len(t.sbp) != t.placement.ndim:
            raise GraphError(
                f"tensor {t.name!r} has nd-SBP {format_nd(t.sbp)} ({len(t.sbp)} entries) on a "
                f"{t.placement.ndim}-d placement; give one SBP per mesh axis"
            )
        check_axes(t.sbp, t.meta.ndim, f"tensor {t.name!r} {t.meta}")


def _verify_op(g: Graph, node: OpNode, produced: set[str]) -> None:
    for name in (*node.inputs, *node.outputs):
        if name not in g.tensors:
            raise GraphError(
                f"op {node.name!r} ({node.op_type}) names tensor {name!r}, which is not declared"
            )
    for name in node.inputs:
        if name not in produced:
            raise GraphError(
                f"op {node.name!r} ({node.op_type}) reads {name!r} before any op produces it; ops must be in "
                "topological order"
            )
    for name in node.outputs:
        if name in produced:
            raise GraphError(f"tensor {name!r} is produced twice (again by op {node.name!r})")
    metas = tuple(g.tensors[i].meta for i in node.inputs)
    if node.op_type == BOXING:
        if len(node.inputs) != 1 or len(node.outputs) != 1 or metas[0] != g.tensors[node.outputs[0]].meta:
            raise GraphError(
                f"boxing op {node.name!r} must map one tensor to one tensor of the same shape and dtype"
            )
        return
    try:
        op = get_op(node.op_type)
    except UnknownOpError as e:
        raise GraphError(f"op {node.name!r}: {e}") from None
    try:
        outs = op.run_infer(metas, op.normalize_attrs(node.attrs))
    except ShapeError as e:
        ins = ", ".join(f"{i}: {g.tensors[i].meta}" for i in node.inputs)
        raise GraphError(f"op {node.name!r} ({node.op_type}) with inputs {ins}: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, ArithmeticError) as e:  # attrs of the wrong kind
        given = {k: type(v).__name__ for k, v in node.attrs.items()}
        raise GraphError(
            f"op {node.name!r} ({node.op_type}) has attributes its shape inference cannot use ({given}: "
            f"{type(e).__name__}: {str(e)[:200]}); give the attributes the op declares, of their types"
        ) from None
    declared = tuple(g.tensors[o].meta for o in node.outputs)
    if outs != declared:
        raise GraphError(
            f"op {node.name!r} ({node.op_type}) declares outputs {list(declared)}, inference gives {list(outs)}"
        )
