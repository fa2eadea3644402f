"""The tracer: records ops on symbolic tensors into a logical graph (it implements the ``Builder`` protocol).

Each call looks the op up, infers its outputs' metadata, declares them and appends an ``OpNode`` stamped
with where it was emitted: the module scope (``blocks.0.attn``), the pipeline stage, the activation
checkpointing flag and a placement. Names are readable and unique: ``<scope>.<op_type>_<n>`` with a
counter per scope and op type, so a name depends only on the order of ops inside one module's forward.

The placement of an op is the stage placement when it runs inside a module given one by ``set_stage``
(the user placed that code there; inputs from another stage are moved by the compiler), else the first
input's placement, else the graph's default placement (ops with no inputs, like ``full``).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import sbpflow.ops  # noqa: F401  (registers the op library)
from sbpflow.client.context import TracingError
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.tensor import Tensor
from sbpflow.errors import ShapeError, UnknownOpError
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.ops.base import AttrValue, get_op
from sbpflow.placement import Placement
from sbpflow.sbp import NdSbp
from sbpflow.tensor_meta import TensorMeta


@dataclass(frozen=True)
class Frame:
    """Where ops are being emitted: one per module call on the stack."""

    scope: str = ""
    stage: int = 0
    placement: Placement | None = None  # the stage's placement, if a module set one
    checkpoint: bool = False


class Tracer:
    def __init__(self, default_placement: Placement, module_paths: Mapping[int, str] | None = None) -> None:
        self.graph = Graph()
        self.default_placement = default_placement
        self.loss: Tensor | None = None
        self._frames = [Frame()]
        self._paths = dict(module_paths or {})  # id(module) -> its path from the graph
        self._params: dict[int, Tensor] = {}  # id(Parameter) -> its tensor
        self._counts: dict[tuple[str, str], int] = {}
        self._op_names: set[str] = set()

    # ---- declarations -------------------------------------------------------------------------------

    def declare(
        self,
        name: str,
        meta: TensorMeta,
        kind: TensorKind,
        placement: Placement,
        sbp: NdSbp | None = None,
        requires_grad: bool = False,
    ) -> Tensor:
        self.graph.add_tensor(TensorDecl(name, meta, kind, placement, sbp, requires_grad))
        return Tensor(name, meta, placement, sbp, self)

    def bind_parameter(self, param: Parameter, name: str, placement: Placement) -> Tensor:
        """Declare ``param`` as tensor ``name``; later uses of the same Parameter (tied weights) get it too."""
        if id(param) in self._params:
            return self._params[id(param)]
        t = self.declare(
            name, param.meta, TensorKind.parameter, placement, param.sbp, requires_grad=param.requires_grad
        )
        self._params[id(param)] = t
        return t

    def tensor_of(self, param: Parameter) -> Tensor | None:
        return self._params.get(id(param))

    def parameter_names(self) -> dict[int, str]:
        return {k: t.name for k, t in self._params.items()}

    def set_loss(self, t: Tensor) -> None:
        if t.meta.numel != 1:
            raise TracingError(
                f"backward() on tensor {t.name!r} {t.meta}: the loss must be a scalar; reduce it first "
                "(loss.mean() or loss.sum())"
            )
        if self.loss is not None and self.loss is not t:
            raise TracingError(
                f"backward() called on {t.name!r} after {self.loss.name!r}: a graph has one loss; "
                "add the losses and call backward() once on the sum"
            )
        self.loss = t

    # ---- scopes -------------------------------------------------------------------------------------

    @property
    def frame(self) -> Frame:
        return self._frames[-1]

    @contextmanager
    def module_scope(self, module: Any) -> Iterator[Frame]:
        """Ops emitted inside ``module``'s forward carry its path, stage and checkpointing flag."""
        cur = self.frame
        path = self._paths.get(id(module))
        if path is None:  # a module made inside build, not reachable from the graph's attributes
            own = type(module).__name__.lower()
            path = f"{cur.scope}.{own}" if cur.scope else own
        stage = getattr(module, "stage", None)
        frame = Frame(
            path,
            cur.stage if stage is None else stage[0],
            cur.placement if stage is None else stage[1],
            cur.checkpoint or bool(getattr(module, "activation_checkpointing", False)),
        )
        self._frames.append(frame)
        try:
            yield frame
        finally:
            self._frames.pop()

    def next_name(self, op_type: str) -> str:
        """The name the next ``op_type`` op in this scope will get (random ops key their draws on it)."""
        scope = self.frame.scope
        n = self._counts.get((scope, op_type), 0)
        while True:
            name = f"{scope}.{op_type}_{n}" if scope else f"{op_type}_{n}"
            if name not in self._op_names and name not in self.graph.tensors:
                return name
            n += 1

    # ---- the Builder protocol -----------------------------------------------------------------------

    def meta(self, value: Any) -> TensorMeta:
        return self.as_tensor(value, "meta").meta

    def call(self, op_type: str, *inputs: Any, **attrs: AttrValue) -> tuple[Tensor, ...]:
        return self.emit(op_type, inputs, attrs)

    def as_tensor(self, value: Any, op_type: str) -> Tensor:
        if isinstance(value, Tensor):
            return value
        if isinstance(value, Parameter):
            t = self.tensor_of(value)
            if t is None:
                raise TracingError(
                    f"op {op_type!r} uses parameter {value!r}, which no module of this graph owns; assign its "
                    "module as an attribute of the sf.Graph (self.model = model) in __init__"
                )
            return t
        raise TracingError(
            f"op {op_type!r} got {type(value).__name__} {value!r} as an input; inputs must be sbpflow tensors "
            "(a graph input, a parameter or an op's output). Python numbers go in the *_scalar ops"
        )

    def emit(
        self,
        op_type: str,
        inputs: Sequence[Any],
        attrs: Mapping[str, Any],
        *,
        placement: Placement | None = None,
        sbp: NdSbp | None = None,
        hint: str | None = None,
        name: str | None = None,
    ) -> tuple[Tensor, ...]:
        """Record one op. ``placement``/``sbp`` annotate its outputs (``to_global``); ``hint`` names the node."""
        ins = tuple(self.as_tensor(x, op_type) for x in inputs)
        node_name = name or self.next_name(hint or op_type)
        self._check_placements(node_name, op_type, ins)
        try:
            op = get_op(op_type)
            full = op.normalize_attrs(attrs)
            outs = op.run_infer(tuple(t.meta for t in ins), full)
        except UnknownOpError as e:
            raise UnknownOpError(f"{node_name}: {e}{_user_site()}") from None
        except ShapeError as e:
            raise ShapeError(f"{_describe(node_name, op_type, ins, op.inputs)}: {e}{_user_site()}") from None
        self._consume_name(node_name, hint or op_type)
        where = placement or self._placement(ins)
        names = [node_name] if len(outs) == 1 else [f"{node_name}:{i}" for i in range(len(outs))]
        results = tuple(
            self.declare(n, m, TensorKind.activation, where, sbp) for n, m in zip(names, outs, strict=True)
        )
        f = self.frame
        node = OpNode(node_name, op_type, tuple(t.name for t in ins), tuple(names), full, where)
        self.graph.add_op(replace(node, stage=f.stage, checkpoint=f.checkpoint, scope=f.scope))
        return results

    def _consume_name(self, node_name: str, op_type: str) -> None:
        self._op_names.add(node_name)
        count = node_name.rpartition("_")[2]
        if count.isdigit():
            self._counts[(self.frame.scope, op_type)] = int(count) + 1

    def _placement(self, ins: Sequence[Tensor]) -> Placement:
        if self.frame.placement is not None:
            return self.frame.placement
        return ins[0].placement if ins else self.default_placement

    def _check_placements(self, node: str, op_type: str, ins: Sequence[Tensor]) -> None:
        """Outside a pipeline stage, inputs on different placements need an explicit move."""
        if self.frame.placement is not None or len({t.placement for t in ins}) <= 1:
            return
        listing = ", ".join(f"{t.name} on {t.placement}" for t in ins)
        raise TracingError(
            f"op {node!r} ({op_type}) mixes placements: {listing}; move one input with "
            "x.to_global(placement, sbp), or run the code in a module given a placement by set_stage()"
        )


def _describe(node: str, op_type: str, ins: Sequence[Tensor], names: Sequence[str]) -> str:
    labels = list(names)
    if len(labels) == 1 and labels[0].startswith("*"):
        labels = [f"{labels[0][1:]}[{i}]" for i in range(len(ins))]
    args = ", ".join(f"{lab}={t.name} {t.meta}" for lab, t in zip(labels, ins, strict=False))
    return f"op {node!r} ({op_type}) with inputs {args}" if ins else f"op {node!r} ({op_type})"


_HERE = os.path.dirname(os.path.abspath(__file__))
_CORE = os.path.join(os.path.dirname(_HERE), "sbpflow")


def _user_site() -> str:
    """`` (at file:line)`` of the innermost user frame, so an error points at the model code."""
    for fs in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(fs.filename)
        if not (path.startswith(_HERE + os.sep) or path.startswith(_CORE + os.sep) or "contextlib" in path):
            return f" (at {fs.filename}:{fs.lineno}: {(fs.line or '').strip()})"
    return ""
