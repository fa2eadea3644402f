"""How an op is declared: shape/dtype inference, SBP rows, kernel and gradient rule, side by side.

An op family module declares each op once with :func:`defop`. Everything else (tracing, the compiler's
autodiff and SBP inference, the runtime, the tests) reads the declaration through :data:`OPS`.

* ``infer(metas, attrs)`` returns the logical output metas or raises :class:`ShapeError`.
* ``rows(metas, attrs)`` lists the valid 1-d signatures for one mesh axis; n-d signatures are their
  per-axis product, filtered so that no rank holds an empty shard (and, for ops that need it, so that
  every split divides evenly). Uneven splits are legal.
* ``kernel(ctx, *arrays)`` computes one rank's local outputs with ``ctx.xp`` (numpy or cupy).
* ``grad(g)`` emits the backward ops through ``g`` and returns one gradient per input (``None`` where an
  input takes none); ops that are themselves backward ops say so with :class:`NoGrad`.
* ``flops`` is the op's work for the cost model (``ops/flops.py``'s :func:`~sbpflow.ops.flops.work`): FLOPs
  per element of its largest operand (an int), or ``flops(ins, outs, attrs)`` for an exact count (a
  contraction, a convolution); ``view=True`` says its output is an input's bytes, so it moves none.
* ``fp32=True``: under mixed precision it computes in fp32 (``sbpflow/precision.py``'s ``FP32_OPS``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import product
from types import ModuleType
from typing import Any, Protocol, TypeAlias

from sbpflow.dtype import DType
from sbpflow.errors import ShapeError
from sbpflow.registry import Registry
from sbpflow.sbp import NdSbp, Sbp, Split
from sbpflow.sharding import Index, divides, min_split_size
from sbpflow.tensor_meta import Shape, TensorMeta

AttrValue: TypeAlias = int | float | str | bool | tuple[int, ...] | tuple[float, ...] | DType | None
# Kernels and rules read attrs freely; their types are checked where they enter (normalize_attrs, wire).
Attrs: TypeAlias = Mapping[str, Any]
Metas: TypeAlias = tuple[TensorMeta, ...]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True, slots=True)
class Signature:
    """One row of an op's SBP table for one mesh axis: an SBP per input and per output."""

    ins: tuple[Sbp, ...]
    outs: tuple[Sbp, ...]

    def __repr__(self) -> str:
        return f"{', '.join(map(repr, self.ins))} -> {', '.join(map(repr, self.outs))}"


@dataclass(frozen=True, slots=True)
class NdSignature:
    """A signature on an n-d placement: an nd-SBP per input and per output."""

    ins: tuple[NdSbp, ...]
    outs: tuple[NdSbp, ...]

    def __repr__(self) -> str:
        def fmt(nd: NdSbp) -> str:
            return repr(nd[0]) if len(nd) == 1 else "(" + ", ".join(map(repr, nd)) + ")"

        return f"{', '.join(map(fmt, self.ins))} -> {', '.join(map(fmt, self.outs))}"


def sig(ins: Sequence[Sbp], outs: Sequence[Sbp]) -> Signature:
    return Signature(tuple(ins), tuple(outs))


@dataclass(frozen=True)
class KernelContext:
    """What a kernel knows beyond its local arrays: attrs, the logical metas, and where its shards lie.

    ``in_index``/``out_index`` are the slices of the logical tensors this rank holds (the whole tensor on
    one device); kernels that need offsets (a vocabulary shard, a causal mask on a query shard, random
    numbers) read them here. ``step`` keys random streams per (step, micro-batch).
    """

    xp: ModuleType
    attrs: Attrs
    in_metas: Metas
    out_metas: Metas
    in_index: tuple[Index, ...]
    out_index: tuple[Index, ...]
    seed: int = 0
    step: int = 0

    def out_shape(self, i: int = 0) -> Shape:
        return tuple(s.stop - s.start for s in self.out_index[i])

    def out_dtype(self, i: int = 0) -> Any:
        # numpy's dtype, which is cupy's too: bfloat16 is ml_dtypes' (DType.to_numpy says so if it is missing)
        return _numpy_dtype(self.out_metas[i].dtype)

    def out_array(self, i: int = 0) -> Any:
        """A dead array of output ``i``'s local shape and dtype that the kernel may write that output
        into, or None (allocate). The actor runtime lends a kernel its own previous value of that output
        once nobody holds it any more (``out_buffers``, actor_workers/execution/tasks.py); no other caller
        does, so a kernel that takes it returns the same values either way."""
        bufs = getattr(self, "out_buffers", ())
        b = bufs[i] if i < len(bufs) else None
        if b is None or b.shape != self.out_shape(i) or b.dtype != self.out_dtype(i):
            return None
        return b

    def out_contiguous(self, i: int = 0) -> Any:
        """:meth:`out_array` where it is C-contiguous (what a numba loop over flat planes or rows may write
        into), else None."""
        b = self.out_array(i)
        return b if b is not None and b.flags.c_contiguous else None

    def out_zeros(self, i: int = 0, dtype: Any = None) -> Any:
        """Output ``i`` as zeros of its local shape (in ``dtype``, the output's by default): the dead
        previous value :meth:`out_array` lends, cleared, or a new array. A scatter-add's table built
        afresh each call cost twice the clearing of a lent one in a run (Wide & Deep's 2 MB
        ``embedding_grad`` under DP4: 450 against 210 us a call; more of its pages faulted in)."""
        dtype = self.out_dtype(i) if dtype is None else dtype
        b = self.out_array(i)
        if b is None or b.dtype != dtype:
            return self.xp.zeros(self.out_shape(i), dtype=dtype)
        b.fill(0)
        return b

    def in_offset(self, i: int, axis: int) -> int:
        return self.in_index[i][axis].start


# What a kernel remembers per shape (functools.lru_cache's maxsize): bounded, since a long-lived server
# compiles job after job, each with shapes of its own.
SHAPE_CACHE_SIZE = 4096


@cache
def _numpy_dtype(dtype: DType) -> Any:
    """DType.to_numpy, remembered: built afresh it was a third of a microsecond a call, on every call of a
    kernel that asks for its output's dtype, and in every out_array."""
    return dtype.to_numpy()


class Builder(Protocol):
    """Emits ops: eagerly on arrays (tests, eager mode) or symbolically into a graph (tracing, autodiff)."""

    def call(self, op_type: str, *inputs: Any, **attrs: AttrValue) -> tuple[Any, ...]: ...

    def meta(self, value: Any) -> TensorMeta: ...


@dataclass(frozen=True)
class GradContext:
    """What a gradient rule sees: the forward values and metas, the output gradients, and a builder."""

    builder: Builder
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    grads: tuple[Any, ...]  # one per output; None where the output takes no gradient
    in_metas: Metas
    out_metas: Metas
    attrs: Attrs

    @property
    def dy(self) -> Any:
        return self.grads[0]

    def call(self, op_type: str, *inputs: Any, **attrs: AttrValue) -> Any:
        """Emit an op with one output and return it."""
        (out,) = self.builder.call(op_type, *inputs, **attrs)
        return out

    def call_n(self, op_type: str, *inputs: Any, **attrs: AttrValue) -> tuple[Any, ...]:
        return self.builder.call(op_type, *inputs, **attrs)

    def grads_or_zeros(self) -> list[Any]:
        """One gradient per output, zeros (``full``) for an output that took none: the parts of a
        gradient that an op with several outputs (split, unpack) joins back."""
        return [
            d if d is not None else self.call("full", shape=m.shape, dtype=m.dtype, value=0.0)
            for d, m in zip(self.grads, self.out_metas, strict=True)
        ]


@dataclass(frozen=True, slots=True)
class NoGrad:
    """Declares that an op takes no gradient, and why (a backward op, an integer result, ...)."""

    reason: str


InferFn = Callable[[Metas, Attrs], Metas]
RowsFn = Callable[[Metas, Attrs], Sequence[Signature]]
KernelFn = Callable[..., Any]
GradFn = Callable[[GradContext], Sequence[Any]]
FlopFn = Callable[[Metas, Metas, Attrs], int]  # (input metas, output metas, attrs) -> FLOPs of one call


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    infer: InferFn
    rows: RowsFn
    kernel: KernelFn
    grad: GradFn | NoGrad
    attrs: Mapping[str, AttrValue] = field(default_factory=dict)
    even_splits: bool = False  # splits must divide evenly (reshape-like ops whose local shape is fixed)
    random: bool = False  # draws from the counter-based generator keyed by (seed, rng_id, step)
    doc: str = ""
    # FLOPs per element of the largest operand, or a function of the metas for an exact count (ops/flops.py)
    flops: int | FlopFn | None = None
    view: bool = False  # the output is (a view of) an input's bytes: the cost model counts no bytes moved
    fp32: bool = False  # computes in fp32 under mixed precision (sbpflow/precision.py)
    # an update whose kernel may write its new value over input 0 (the runtime lends that very array as
    # out_buffers[0] once nothing else holds it: tasks.Recycler); ops/training/optim.py's in_place
    in_place: bool = False

    def normalize_attrs(self, attrs: Attrs) -> dict[str, AttrValue]:
        unknown = sorted(set(attrs) - set(self.attrs))
        if unknown:
            raise ShapeError(
                f"op {self.name!r} has no attribute(s) {unknown}; its attributes are {sorted(self.attrs)}"
            )
        out = {**self.attrs, **attrs}
        missing = sorted(k for k, v in out.items() if v is REQUIRED)
        if missing:
            raise ShapeError(f"op {self.name!r} needs attribute(s) {missing}")
        return {k: (tuple(v) if isinstance(v, list) else v) for k, v in out.items()}

    @property
    def variadic(self) -> bool:
        """Inputs declared as ``("*xs",)`` take any positive number of tensors (concat)."""
        return len(self.inputs) == 1 and self.inputs[0].startswith("*")

    def output_name(self, i: int) -> str:
        return self.outputs[0].lstrip("*") + f"[{i}]" if self.outputs[0].startswith("*") else self.outputs[i]

    def check_arity(self, n: int) -> None:
        if self.variadic:
            if n < 1:
                raise ShapeError(f"op {self.name!r} needs at least one input {self.inputs[0][1:]!r}")
            return
        if n != len(self.inputs):
            raise ShapeError(
                f"op {self.name!r} takes {len(self.inputs)} input(s) {list(self.inputs)} but got {n}"
            )

    def run_infer(self, metas: Metas, attrs: Attrs) -> Metas:
        self.check_arity(len(metas))
        return tuple(self.infer(metas, attrs))

    def run_kernel(self, ctx: KernelContext, arrays: Sequence[Any]) -> tuple[Any, ...]:
        out = self.kernel(ctx, *arrays)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def nd_signatures(self, metas: Metas, attrs: Attrs, mesh: Sequence[int]) -> list[NdSignature]:
        """Every valid signature on a mesh: the per-axis product of the 1-d rows, filtered."""
        outs = self.run_infer(metas, attrs)
        rows = list(dict.fromkeys(self.rows(metas, attrs)))
        shapes = [m.shape for m in (*metas, *outs)]
        result = []
        for combo in product(rows, repeat=len(mesh)):
            nd = NdSignature(
                tuple(tuple(r.ins[i] for r in combo) for i in range(len(metas))),
                tuple(tuple(r.outs[i] for r in combo) for i in range(len(outs))),
            )
            if all(
                _fits(shape, mesh, s, self.even_splits)
                for shape, s in zip(shapes, (*nd.ins, *nd.outs), strict=True)
            ):
                result.append(nd)
        return result


def _fits(shape: Shape, mesh: Sequence[int], nd: NdSbp, even: bool) -> bool:
    if not any(isinstance(s, Split) for s in nd):
        return True
    if even and not divides(shape, mesh, nd):
        return False
    return min_split_size(shape, mesh, nd) >= 1


OPS: Registry[OpDef] = Registry("op")


def defop(
    name: str,
    *,
    inputs: Sequence[str],
    outputs: Sequence[str] = ("y",),
    infer: InferFn,
    rows: RowsFn,
    kernel: KernelFn,
    grad: GradFn | NoGrad,
    attrs: Mapping[str, AttrValue] | None = None,
    even_splits: bool = False,
    random: bool = False,
    doc: str = "",
    flops: int | FlopFn | None = None,
    view: bool = False,
    fp32: bool = False,
    in_place: bool = False,
) -> OpDef:
    """Declare and register an op; a second op of the same name is refused."""
    op = OpDef(
        name,
        tuple(inputs),
        tuple(outputs),
        infer,
        rows,
        kernel,
        grad,
        dict(attrs or {}),
        even_splits,
        random,
        doc,
        flops,
        view,
        fp32,
        in_place,
    )
    return OPS.register(name, op)


def get_op(name: str) -> OpDef:
    return OPS.get(name)
