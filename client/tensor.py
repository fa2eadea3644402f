"""The symbolic global tensor of a trace: a name in the logical graph, with its metadata and SBP.

A ``Tensor`` holds no numbers. Every operator on it emits an op into the trace that made it (see
``client/tracing.py``) and returns the op's output tensor, so ``build`` reads like eager PyTorch code
while it records the Job's graph. ``sbp`` is the user's annotation (a hard constraint for the compiler)
or ``None``, which leaves the layout to SBP inference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sbpflow.client import context
from sbpflow.client.context import TracingError
from sbpflow.client.indexing import box
from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import ShapeError
from sbpflow.placement import Placement
from sbpflow.sbp import NdSbp, Sbp, as_nd, check_axes, format_nd
from sbpflow.tensor_meta import Shape, TensorMeta

Scalar = int | float


class Tensor:
    __slots__ = ("name", "meta", "placement", "sbp", "tracer")

    def __init__(
        self, name: str, meta: TensorMeta, placement: Placement, sbp: NdSbp | None, tracer: Any
    ) -> None:
        self.name, self.meta, self.placement, self.sbp, self.tracer = name, meta, placement, sbp, tracer

    # ---- metadata -----------------------------------------------------------------------------------

    @property
    def shape(self) -> Shape:
        return self.meta.shape

    @property
    def dtype(self) -> DType:
        return self.meta.dtype

    @property
    def ndim(self) -> int:
        return self.meta.ndim

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of the 0-d tensor {self.name!r}")
        return self.shape[0]

    def __repr__(self) -> str:
        sbp = "" if self.sbp is None else f" {format_nd(self.sbp)}"
        return f"Tensor({self.name!r}: {self.meta}{sbp} on {self.placement})"

    def __bool__(self) -> bool:
        raise TracingError(
            f"the truth value of tensor {self.name!r} is unknown while tracing (it has no numbers); "
            "control flow cannot depend on tensor values — use masked_fill or where instead of `if`"
        )

    __hash__ = object.__hash__  # __eq__ builds a comparison op, tensors still key dicts by identity

    # ---- annotations --------------------------------------------------------------------------------

    def to_global(self, placement: Placement, sbp: Sbp | Sequence[Sbp]) -> Tensor:
        """An identity op whose output lies on ``placement`` with ``sbp``: a hard constraint for inference."""
        nd = as_nd(sbp, placement.ndim)  # type: ignore[arg-type]
        check_axes(nd, self.ndim, f"tensor {self.name!r} {self.meta}")
        tracer = tracer_of((self,), "to_global")
        return tracer.emit("identity", (self,), {}, placement=placement, sbp=nd, hint="to_global")[0]

    def backward(self) -> None:
        """Mark this scalar as the loss: the compiler differentiates it and the optimizer steps on it."""
        tracer_of((self,), "backward").set_loss(self)

    def to(self, dtype: Any) -> Tensor:
        dt = as_dtype(dtype)
        return self if dt is self.dtype else _op("cast", self, dtype=dt)

    cast = to

    def float(self) -> Tensor:
        return self.to(DType.float32)

    # ---- arithmetic ---------------------------------------------------------------------------------

    def __add__(self, other: Tensor | Scalar) -> Tensor:
        if isinstance(other, Tensor):
            return _binary("add", self, other)
        return _op("add_scalar", self, value=_scalar(other, "+"))

    __radd__ = __add__

    def __sub__(self, other: Tensor | Scalar) -> Tensor:
        if isinstance(other, Tensor):
            return _binary("sub", self, other)
        return _op("add_scalar", self, value=-_scalar(other, "-"))

    def __rsub__(self, other: Scalar) -> Tensor:
        return _op("rsub_scalar", self, value=_scalar(other, "-"))

    def __mul__(self, other: Tensor | Scalar) -> Tensor:
        if isinstance(other, Tensor):
            return _binary("mul", self, other)
        return _op("mul_scalar", self, value=_scalar(other, "*"))

    __rmul__ = __mul__

    def __truediv__(self, other: Tensor | Scalar) -> Tensor:
        if isinstance(other, Tensor):
            return _binary("div", self, other)
        return _op("mul_scalar", self, value=1.0 / _scalar(other, "/"))

    def __rtruediv__(self, other: Scalar) -> Tensor:
        return _op("rdiv_scalar", self, value=_scalar(other, "/"))

    def __pow__(self, exponent: Scalar) -> Tensor:
        if isinstance(exponent, Tensor):
            raise ShapeError(f"tensor {self.name!r} ** tensor is not supported; use exp(log(x) * y)")
        return _op("pow_scalar", self, exponent=exponent)

    def __neg__(self) -> Tensor:
        return _op("neg", self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return contract(self, other)

    def __eq__(self, other: object) -> Tensor:  # type: ignore[override]
        if isinstance(other, Tensor):
            return _op("eq_scalar", _binary("sub", self, other), value=0)
        return _op("eq_scalar", self, value=_scalar(other, "=="))

    def __ne__(self, other: object) -> Tensor:  # type: ignore[override]
        if isinstance(other, Tensor):
            return _op("ne_scalar", _binary("sub", self, other), value=0)
        return _op("ne_scalar", self, value=_scalar(other, "!="))

    # ---- shape --------------------------------------------------------------------------------------

    def reshape(self, *shape: Any) -> Tensor:
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        dims = tuple(int(d) for d in dims)
        return self if dims == self.shape else _op("reshape", self, shape=dims)

    view = reshape

    def flatten(self, start: int = 0, end: int = -1) -> Tensor:
        s, e = start % self.ndim, end % self.ndim
        merged = 1
        for d in self.shape[s : e + 1]:
            merged *= d
        return self.reshape(*self.shape[:s], merged, *self.shape[e + 1 :])

    def permute(self, *dims: Any) -> Tensor:
        perm = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
        perm = tuple(int(p) % self.ndim for p in perm)
        return self if perm == tuple(range(self.ndim)) else _op("transpose", self, perm=perm)

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        perm = list(range(self.ndim))
        a, b = dim0 % self.ndim, dim1 % self.ndim
        perm[a], perm[b] = perm[b], perm[a]
        return self.permute(*perm)

    @property
    def T(self) -> Tensor:  # noqa: N802 - numpy's name
        if self.ndim != 2:
            raise ShapeError(
                f"tensor {self.name!r} {self.meta}: .T is for 2-d tensors; use .transpose(i, j) or .permute"
            )
        return self.permute(1, 0)

    def __getitem__(self, index: Any) -> Tensor:
        kept = box(self, index)
        out = self if kept.whole(self.shape) else _op("slice", self, starts=kept.starts, stops=kept.stops)
        return out.reshape(*kept.shape)

    # ---- reductions and elementwise functions -------------------------------------------------------

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return _op("sum", self, axes=_axes(axis, self.ndim), keepdims=keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return _op("mean", self, axes=_axes(axis, self.ndim), keepdims=keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return _op("max", self, axes=_axes(axis, self.ndim), keepdims=keepdims)

    def exp(self) -> Tensor:
        return _op("exp", self)

    def log(self) -> Tensor:
        return _op("log", self)

    def sqrt(self) -> Tensor:
        return _op("sqrt", self)

    def tanh(self) -> Tensor:
        return _op("tanh", self)

    def relu(self) -> Tensor:
        return _op("relu", self)

    def gelu(self) -> Tensor:
        return _op("gelu", self)

    def softmax(self, axis: int = -1) -> Tensor:
        return _op("softmax", self, axis=axis % self.ndim)

    def log_softmax(self, axis: int = -1) -> Tensor:
        return _op("log_softmax", self, axis=axis % self.ndim)


# ---- emitting ops ---------------------------------------------------------------------------------------


def tracer_of(tensors: Sequence[Any], what: str) -> Any:
    """The running tracer, checked to be the one that made every tensor."""
    tracer = context.active()
    for t in tensors:
        if not isinstance(t, Tensor):
            continue
        if tracer is None or t.tracer is not tracer:
            raise TracingError(
                f"{what} on tensor {t.name!r} {t.meta}, which was made by a trace that is not running: "
                "tensors are symbolic and live only inside the sf.Graph.build() call that made them; "
                "keep all tensor code inside build()"
            )
    if tracer is None:
        return context.require(what)
    return tracer


def emit(op_type: str, *inputs: Any, **attrs: Any) -> tuple[Tensor, ...]:
    """Record ``op_type(*inputs, **attrs)`` in the running trace; returns its output tensors."""
    tracer = tracer_of(inputs, f"op {op_type!r}")
    return tracer.emit(op_type, inputs, attrs)


def _op(op_type: str, *inputs: Any, **attrs: Any) -> Tensor:
    (out,) = emit(op_type, *inputs, **attrs)
    return out


def contract(a: Tensor, b: Any, transpose_a: bool = False, transpose_b: bool = False) -> Tensor:
    """``a @ b``: ``matmul`` for a 2-d ``b`` (a weight shared by every row), else ``batch_matmul``."""
    b_ndim = len(b.shape)
    if b_ndim == 2:
        return _op("matmul", a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    if b_ndim != len(a.shape):
        raise ShapeError(
            f"matmul of {getattr(a, 'name', a)!r} {list(a.shape)} and {getattr(b, 'name', b)!r} "
            f"{list(b.shape)}: b must be 2-d or have a's batch axes; reshape or broadcast_to first"
        )
    return _op("batch_matmul", a, b, transpose_a=transpose_a, transpose_b=transpose_b)


def _binary(op_type: str, a: Tensor, b: Any) -> Tensor:
    if not isinstance(b, Tensor):
        raise ShapeError(f"op {op_type!r}: {b!r} is not a tensor or a Python number")
    return _op(op_type, a, b)


def _scalar(value: object, what: str) -> Scalar:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise ShapeError(
        f"tensor {what} {type(value).__name__} {value!r}: the other operand must be an sbpflow tensor or a "
        "Python int/float (numpy arrays are not tensors: make them a graph input)"
    )


def _axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...] | None:
    """Axes as non-negative ints (None = all); out-of-range axes are left for the op to name."""
    if axis is None:
        return None
    raw = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(int(a) % ndim if -ndim <= a < ndim else int(a) for a in raw)
