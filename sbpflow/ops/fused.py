"""``fused_elementwise``: a chain of elementwise ops run as one kernel (the compiler's fusion pass makes it).

The chain is data, never code: ``attrs["chain"]`` is a JSON list of steps ``[op_type, attrs, refs]``, where
each ref names a fused input (``"in0"``) or an earlier step's result (``"s0"``); the last step's result is
the op's first output, and ``attrs["exports"]`` lists earlier steps (ascending) whose results are its
further outputs, in that order: intermediates that ops outside the chain read too (batch norm's
``var + eps`` and ``sqrt``, which its backward reads), so that the chain need not stop there. Only the
ops of :data:`FUSABLE` may appear: elementwise ops whose kernels read nothing but their arrays and attrs
(no shard offsets, no random streams; batch norm's ``running_stat`` too, whose result the compiler
assigns to its variable), and, as the last step only, a reduction of :data:`TERMINAL` (a gradient's
``pow_scalar`` and ``sum`` for the clipping norm are one act).

* Inference runs each step's own inference in order.
* Rows are the composition of the steps' rows: a signature of the fused inputs for which every step has a
  row agreeing on every intermediate. So splits pass where every step splits alike, and ``P`` passes only
  along inputs through which every step on the way is linear (a ``P`` into ``gelu`` has no row).
* The kernel runs the steps on ``xp``; a simple step writes with ``out=`` into an intermediate that dies
  there (the chain owns it), so a chain of k simple steps allocates one array, not k. An exported
  result never dies within the chain (it is an output): nothing writes over it.
* The gradient is the steps' gradient rules composed in reverse, on intermediates the rule recomputes
  with the unfused ops. The pass runs after autodiff, so a compiled job never uses it; eager mode and the
  op tests do.

``sum_squares`` is the clipping norm's other fold: ``sum(x ** 2)`` of every input, added up in input
order, the same ``pow_scalar`` and ``sum`` kernels and the same adds as the unfused ops run (one act for
the main job's 29 gradients, not 29 and a chain of adds). Its ``P`` rows cannot list each input's own
split (2^n rows for n inputs), so ``attrs["split_axes"]`` names them: per ``P`` row, one split axis an
input (the fusion pass copies the gradients' splits, one row per mesh axis that splits them all).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import ShapeError
from sbpflow.ops.base import (
    REQUIRED,
    Attrs,
    GradContext,
    KernelContext,
    Metas,
    NoGrad,
    Signature,
    defop,
    get_op,
    sig,
)
from sbpflow.ops.elementwise import power, scalar_of
from sbpflow.ops.flops import work
from sbpflow.ops.kernels.rowwise import jit_rows, loop_into
from sbpflow.ops.reduction import sum_all
from sbpflow.sbp import B, P, S, Sbp
from sbpflow.tensor_meta import TensorMeta

# An in-place writer: (xp, args, attrs, out) -> result, with ``out`` an owned buffer of the result's shape
# and dtype, or None (allocate).
Writer = Callable[[Any, Sequence[Any], Attrs, Any], Any]


def _ufunc(name: str) -> Writer:
    return lambda xp, args, a, out: getattr(xp, name)(*args, out=out)


def _scalar(name: str, reverse: bool = False) -> Writer:
    def write(xp: Any, args: Sequence[Any], a: Attrs, out: Any) -> Any:
        (x,) = args
        v = scalar_of(x.dtype, a["value"])
        return getattr(xp, name)(v, x, out=out) if reverse else getattr(xp, name)(x, v, out=out)

    return write


def _relu(xp: Any, args: Sequence[Any], a: Attrs, out: Any) -> Any:
    return xp.maximum(args[0], args[0].dtype.type(0), out=out)


def _loop(loop: str, fallback: Writer) -> Writer:
    """The op's own kernel's path, so a chain keeps the unfused op's bits: elementwise_jit's ``loop``
    where it takes the input (exp, log, relu), else ``fallback``."""

    def write(xp: Any, args: Sequence[Any], a: Attrs, out: Any) -> Any:
        y = loop_into(xp, loop, args, out)
        return fallback(xp, args, a, out) if y is None else y

    return write


# Steps written in place; every other fusable op runs its own registered kernel.
_WRITERS: dict[str, Writer] = {
    "add": _ufunc("add"),
    "sub": _ufunc("subtract"),
    "mul": _ufunc("multiply"),
    "div": _ufunc("divide"),
    "neg": _ufunc("negative"),
    "exp": _loop("exp_all", _ufunc("exp")),
    "log": _loop("log_all", _ufunc("log")),
    "sqrt": _ufunc("sqrt"),
    "tanh": _ufunc("tanh"),
    "relu": _loop("relu_all", _relu),
    "add_scalar": _scalar("add"),
    "mul_scalar": _scalar("multiply"),
    "rsub_scalar": _scalar("subtract", reverse=True),
    "rdiv_scalar": _scalar("divide", reverse=True),
}

# Reductions a chain may end with, never continue after: later steps' rows composed with a reduction's
# would multiply the fused op's signatures by every fused input's own choice of split.
TERMINAL: frozenset[str] = frozenset({"sum"})

FUSABLE: frozenset[str] = frozenset(
    {
        *_WRITERS,
        "pow_scalar",
        "gelu",
        "gelu_grad",
        "relu_grad",
        "sigmoid",
        "gelu_erf",
        "gelu_erf_grad",
        "cast",
        "eq_scalar",
        "ne_scalar",
        "running_stat",
        *TERMINAL,
    }
)


@dataclass(frozen=True)
class Step:
    op: str
    attrs: dict[str, Any]
    refs: tuple[str, ...]  # "in<i>" or "s<k>"


def encode(steps: Sequence[tuple[str, Attrs, Sequence[str]]]) -> str:
    """The ``chain`` attribute for steps ``(op_type, attrs, refs)``: JSON, a dtype by its name."""
    out = []
    for op, attrs, refs in steps:
        plain = {
            k: (v.value if isinstance(v, DType) else list(v) if isinstance(v, tuple) else v)
            for k, v in attrs.items()
        }
        out.append([op, plain, list(refs)])
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


@lru_cache(maxsize=512)
def parse(chain: str) -> tuple[Step, ...]:
    """The steps of a ``chain`` attribute, each op checked fusable and each ref checked to point back."""
    try:
        raw = json.loads(chain)
        steps = [Step(str(op), dict(attrs), tuple(str(r) for r in refs)) for op, attrs, refs in raw]
    except (ValueError, TypeError) as e:
        raise ShapeError(
            f"op 'fused_elementwise' has a malformed chain ({e}); the fusion pass writes it"
        ) from None
    if not steps:
        raise ShapeError("op 'fused_elementwise' needs a chain of at least one step")
    for k, s in enumerate(steps):
        if s.op not in FUSABLE:
            raise ShapeError(f"op 'fused_elementwise' cannot fuse {s.op!r}; fusable ops: {sorted(FUSABLE)}")
        if s.op in TERMINAL and k != len(steps) - 1:
            raise ShapeError(
                f"op 'fused_elementwise': step {k} ({s.op}) is a reduction, which only a chain's last step "
                "may be; end the chain there"
            )
        if "dtype" in s.attrs:
            s.attrs["dtype"] = as_dtype(s.attrs["dtype"])
        s.attrs.update(get_op(s.op).normalize_attrs(s.attrs))
        for r in s.refs:
            if not (r.startswith("in") and r[2:].isdigit()) and not (
                r.startswith("s") and int(r[1:] or k) < k
            ):
                raise ShapeError(
                    f"op 'fused_elementwise': step {k} ({s.op}) reads {r!r}, not an input or earlier step"
                )
    return tuple(steps)


Exports = tuple[int, ...]  # the steps whose results are outputs after the last step's (``attrs["exports"]``)


def exports_of(attrs: Attrs, n: int) -> Exports:
    """``attrs["exports"]`` checked against a chain of ``n`` steps: ascending steps before the last."""
    ex = tuple(int(e) for e in attrs.get("exports", ()))  # type: ignore[union-attr]
    if any(not 0 <= e < n - 1 for e in ex) or list(ex) != sorted(set(ex)):
        raise ShapeError(
            f"op 'fused_elementwise' exports steps {list(ex)} of a chain of {n}; give distinct steps in "
            f"ascending order, each before the last (0 .. {n - 2}): the last step's result is output 0 already"
        )
    return ex


def _metas(steps: tuple[Step, ...], ins: Metas, exports: Exports = ()) -> list[Metas]:
    """Each step's input metas; the last entry is the output metas (the last step's, then the exports')."""
    outs: list[TensorMeta] = []
    per_step: list[Metas] = []
    for s in steps:
        args = tuple(ins[int(r[2:])] if r.startswith("in") else outs[int(r[1:])] for r in s.refs)
        per_step.append(args)
        (out,) = get_op(s.op).run_infer(args, s.attrs)
        outs.append(out)
    return [*per_step, (outs[-1], *(outs[e] for e in exports))]


@lru_cache(maxsize=512)
def _plan(chain: str, ins: Metas, exports: Exports) -> tuple[list[Metas], list[int], list[int | None]]:
    """Per chain, input metas and exports: the step metas, each step result's last reader (an output:
    len), and per step the position of an argument whose buffer it may write into (an intermediate dying
    there with the result's meta, never an exported one), or None."""
    steps = parse(chain)
    metas = _metas(steps, ins)
    last = [len(steps)] * len(steps)
    for k, s in enumerate(steps):
        for r in s.refs:
            if r.startswith("s"):
                last[int(r[1:])] = k
    for e in (*exports, len(steps) - 1):
        last[e] = len(steps)
    reuse: list[int | None] = []
    for k, s in enumerate(steps):
        out_meta = metas[k + 1][0] if k + 1 == len(steps) else _result_meta(metas, steps, k)
        pos = None
        if s.op in _WRITERS:
            for j, r in enumerate(s.refs):
                if (
                    r.startswith("s")
                    and last[int(r[1:])] == k
                    and metas[k][j] == out_meta
                    and s.refs.count(r) == 1
                ):
                    pos = j
                    break
        reuse.append(pos)
    return metas, last, reuse


def _result_meta(metas: list[Metas], steps: tuple[Step, ...], k: int) -> TensorMeta:
    (out,) = get_op(steps[k].op).run_infer(metas[k], steps[k].attrs)
    return out


def _infer(metas: Metas, attrs: Attrs) -> Metas:
    steps = parse(attrs["chain"])
    return _metas(steps, metas, exports_of(attrs, len(steps)))[-1]


def _rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    """The composed rows: partial assignments (fused inputs' SBPs, step results' SBPs) grown step by step."""
    steps = parse(attrs["chain"])
    exports = exports_of(attrs, len(steps))
    step_metas = _metas(steps, metas)
    states: list[tuple[tuple[Sbp | None, ...], tuple[Sbp, ...]]] = [((None,) * len(metas), ())]
    for k, s in enumerate(steps):
        grown: dict[tuple[tuple[Sbp | None, ...], tuple[Sbp, ...]], None] = {}
        for row in get_op(s.op).rows(step_metas[k], s.attrs):
            for ins, outs in states:
                new = list(ins)
                ok = True
                for r, want in zip(s.refs, row.ins, strict=True):
                    if r.startswith("s"):
                        ok = ok and outs[int(r[1:])] == want
                    else:
                        i = int(r[2:])
                        ok = ok and new[i] in (None, want)
                        new[i] = want
                if ok:
                    grown[(tuple(new), (*outs, row.outs[0]))] = None
        states = list(grown)
    return [
        Signature(tuple(i for i in ins if i is not None), (outs[-1], *(outs[e] for e in exports)))
        for ins, outs in states
        if None not in ins
    ]


@lru_cache(maxsize=512)
def _program(
    chain: str, ins: Metas, exports: Exports
) -> tuple[tuple[Step, Writer | None, tuple[int, ...], int | None, int | None, Metas, Metas], ...]:
    """Per chain, input metas and exports, what the kernel does per step: the step, its writer (None:
    its own kernel), where its arguments lie in [inputs..., step results...], the argument it writes
    into, the output whose lent buffer it may write into (it is that output's :func:`_root`), and its
    input and output metas."""
    steps = parse(chain)
    metas, _, reuse = _plan(chain, ins, exports)
    n = len(ins)
    roots = {
        r: j for j, k in enumerate((len(steps) - 1, *exports)) if (r := _root(steps, reuse, k)) is not None
    }
    out = []
    for k, s in enumerate(steps):
        where = tuple(int(r[2:]) if r.startswith("in") else n + int(r[1:]) for r in s.refs)
        res = (_result_meta(metas, steps, k),)
        out.append((s, _WRITERS.get(s.op), where, reuse[k], roots.get(k), metas[k], res))
    return tuple(out)


def _root(steps: tuple[Step, ...], reuse: list[int | None], k: int) -> int | None:
    """The step whose new array the chain's later steps write into until it is step ``k``'s result (``k``
    writing in place into a dying intermediate, that one into another, ...), where that step allocates
    and is written in place (a writer); else None. The runtime's dead buffer of the output that ``k``
    makes can stand in for it (each intermediate dies at one step, so no two outputs share a root)."""
    while (pos := reuse[k]) is not None:
        k = int(steps[k].refs[pos][1:])
    return k if steps[k].op in _WRITERS else None


def _kernel(ctx: KernelContext, *arrays: Any) -> Any:
    xp, pool, exports = ctx.xp, list(arrays), tuple(ctx.attrs.get("exports", ()))
    for s, writer, where, pos, lend, in_metas, out_metas in _program(
        ctx.attrs["chain"], ctx.in_metas, exports
    ):
        args = [pool[i] for i in where]
        if writer is not None:  # a 0-d step result may be a numpy scalar, which cannot be written into
            buf = None if pos is None or not isinstance(args[pos], xp.ndarray) else args[pos]
            if lend is not None:  # the array that becomes output ``lend``: the runtime's dead buffer if lent
                buf = ctx.out_array(lend)
            pool.append(writer(xp, args, s.attrs, buf))
        else:
            inner = KernelContext(xp, s.attrs, in_metas, out_metas, ctx.in_index[:0], ctx.out_index[:1])
            pool.append(get_op(s.op).run_kernel(inner, args)[0])
    if not exports:
        return pool[-1]
    n = len(arrays)
    return (pool[-1], *(pool[n + e] for e in exports))


def _grad(g: GradContext) -> list[Any]:
    """The steps' rules in reverse (an export's gradient joining its step's); intermediates recomputed
    with the unfused ops, but for the outputs."""
    steps = parse(g.attrs["chain"])
    metas = _metas(steps, g.in_metas)
    given = {k: j for j, k in enumerate((len(steps) - 1, *exports_of(g.attrs, len(steps))))}
    vals: list[Any] = []
    for k, s in enumerate(steps):
        args = [g.inputs[int(r[2:])] if r.startswith("in") else vals[int(r[1:])] for r in s.refs]
        vals.append(g.outputs[given[k]] if k in given else g.call(s.op, *args, **s.attrs))
    grads = {f"s{k}": g.grads[j] for k, j in given.items() if g.grads[j] is not None}
    for k in reversed(range(len(steps))):
        s, dy = steps[k], grads.get(f"s{k}")
        rule = get_op(s.op).grad
        if dy is None or isinstance(rule, NoGrad):
            continue
        xs = tuple(g.inputs[int(r[2:])] if r.startswith("in") else vals[int(r[1:])] for r in s.refs)
        out_meta = (metas[k + 1][0],) if k + 1 == len(steps) else (_result_meta(metas, steps, k),)
        inner = GradContext(g.builder, xs, (vals[k],), (dy,), metas[k], out_meta, s.attrs)
        for r, d in zip(s.refs, rule(inner), strict=True):
            if d is not None:
                grads[r] = d if r not in grads else g.call("add", grads[r], d)
    return [grads.get(f"in{i}") for i in range(len(g.inputs))]


def _flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    """The steps' FLOPs, each step's as its own op counts them on that step's tensors."""
    steps = parse(str(attrs["chain"]))
    metas = _metas(steps, ins)
    return sum(
        work(s.op, metas[k], (_result_meta(metas, steps, k),), s.attrs).flops for k, s in enumerate(steps)
    )


defop(
    "fused_elementwise",
    inputs=("*xs",),
    outputs=("*ys",),
    attrs={"chain": REQUIRED, "exports": ()},
    infer=_infer,
    rows=_rows,
    kernel=_kernel,
    grad=_grad,
    doc="a chain of elementwise ops as one kernel (attrs['chain']: JSON steps [op, attrs, refs]; "
    "attrs['exports']: earlier steps whose results are further outputs); made by the compiler's fusion pass",
    flops=_flops,
)


def _split_rows(metas: Metas, attrs: Attrs) -> list[tuple[int, ...]]:
    """``split_axes`` as one tuple of split axes a ``P`` row, each checked against its input's rank."""
    axes, n = tuple(attrs["split_axes"]), len(metas)
    if len(axes) % n:
        raise ShapeError(
            f"op 'sum_squares' takes split_axes in groups of one axis an input ({n}), not {len(axes)}"
        )
    groups = [axes[k : k + n] for k in range(0, len(axes), n)]
    for row in groups:
        bad = [i for i, (a, m) in enumerate(zip(row, metas, strict=True)) if not 0 <= a < m.ndim]
        if bad:
            raise ShapeError(f"op 'sum_squares': split_axes {row} name no axis of input(s) {bad}")
    return groups


def _squares_infer(metas: Metas, attrs: Attrs) -> Metas:
    dtypes = {m.dtype for m in metas}
    if len(dtypes) != 1 or not metas[0].dtype.is_floating:
        raise ShapeError(
            f"op 'sum_squares' takes inputs of one float dtype, not {sorted(d.value for d in dtypes)}; "
            "cast them first (the fusion pass folds only a norm without casts)"
        )
    _split_rows(metas, attrs)
    return (TensorMeta((), metas[0].dtype),)


def _squares_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    """All B gives B; the listed splits give P (each rank's sum of its shards' squares)."""
    whole = sig((B,) * len(metas), (B,))
    return [whole, *(sig(tuple(S(a) for a in row), (P,)) for row in _split_rows(metas, attrs))]


@lru_cache(maxsize=1)
def _whole_sum() -> dict[str, Any]:
    return get_op("sum").normalize_attrs({})


def _squares_kernel(ctx: KernelContext, *xs: Any) -> Any:
    """Each input's ``pow_scalar`` and ``sum``, added in order: the unfused bits. The square is
    ``pow_scalar``'s own function and the sum ``sum``'s one loop over a whole array, called directly (the
    registry's calls were ~3/4 of the act's time over the main job's 29 gradients); where that loop does
    not run (cupy, other dtypes), the ``sum`` kernel itself."""
    xp, total = ctx.xp, None
    if (jit := jit_rows(xp, *xs)) is not None:
        return _squares_jit(jit, xs)
    for x, m in zip(xs, ctx.in_metas, strict=True):
        sq = power(xp, x, 2.0)
        s = sum_all(xp, sq)
        if s is None:
            inner = KernelContext(xp, _whole_sum(), (m,), ctx.out_metas, ctx.in_index[:0], ctx.out_index[:1])
            (s,) = get_op("sum").run_kernel(inner, [sq])
        total = s if total is None else xp.add(total, s)
    return xp.asarray(total)


# elements of squares a scratch buffer holds at once (a gradient larger than this has one of its own size)
SQUARES_SCRATCH = 1 << 20


def _squares_jit(jit: Any, xs: Sequence[Any]) -> Any:
    """_squares_kernel where rows_jit takes every input: the same ops, so the same bits (pow_scalar's
    ``x * x``, ``sum_all``'s loop, the adds in order), without what each call made around them. The
    squares go one after another into a scratch buffer of up to SQUARES_SCRATCH elements; each time it
    is full, one call sums its runs (``sum_runs``, each run by sum_all's loop), and one more adds the
    sums in input order. The main job's 29 gradients: 318 us squaring into new arrays and summing each
    through the sum kernel, 240 with a sum_all call a gradient (an AMD EPYC with AVX2); on a Zen 4,
    bench/models/ops.py --clock cpu, 81-84 us with a call a gradient, 64 with a call a buffer."""
    dtype, sizes = xs[0].dtype, [x.size for x in xs]
    scratch = np.empty(min(sum(sizes), max(SQUARES_SCRATCH, *sizes)), dtype)
    sums, out = np.empty(len(xs), dtype), np.empty((), dtype)
    bounds, first = [0], 0  # the runs in the scratch; the index of the first input in it
    for k, x in enumerate(xs):
        if bounds[-1] + x.size > scratch.size:
            jit.sum_runs(scratch, np.asarray(bounds, np.int64), sums[first:k])
            bounds, first = [0], k
        at = bounds[-1]
        np.multiply(x, x, out=scratch[at : at + x.size].reshape(x.shape))
        bounds.append(at + x.size)
    jit.sum_runs(scratch, np.asarray(bounds, np.int64), sums[first:])
    jit.add_in_order(sums, out)
    return out


defop(
    "sum_squares",
    inputs=("*xs",),
    attrs={"split_axes": ()},
    infer=_squares_infer,
    rows=_squares_rows,
    kernel=_squares_kernel,
    grad=NoGrad("the clipping norm's sum: the fusion pass makes it after autodiff"),
    doc="sum(x ** 2) of every input, added in input order (the clipping norm); attrs['split_axes']: per P "
    "row, one split axis an input",
    flops=lambda ins, outs, a: sum(2 * m.numel for m in ins),
)
