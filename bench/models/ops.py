"""Every op's kernel against the PyTorch CPU op, forward and backward, on the examples' own shapes.

    python bench/models/ops.py              # every op of the registry, one ratio per op (~1 min on 2 cores)
    python bench/models/ops.py --cases      # and one row per (op, shapes, attrs) case
    python bench/models/ops.py --only gelu --only gelu_grad --repeat 11
    python bench/models/ops.py --quick      # 3 repetitions of ~1 ms blocks: a smoke run
    python bench/models/ops.py --clock cpu  # this thread's CPU time, not wall: what a loaded machine
                                            # leaves alone

The cases are the op calls of the compiled graphs (``pipeline.compile``, autodiff and optimizer passes
included, so the backward ops the gradient rules emit and the updates are there) of the README's main
job (``examples/charlm.py`` on 1 rank: GPT, 2 layers, width 64, seq 64, batch 16) and of
``examples/mlp.py``, each distinct (op, input shapes and dtypes, attrs) once, weighted by how often the
graph calls it. An op of the registry that neither graph calls is timed on the GPT's MLP activation
[16, 64, 256] (marked ``*``). Boxing is not an op of the registry (bench/runtime/transport_*.py time it).

Each case times ``op.run_kernel`` (the kernel alone, the engine excluded) on a fixed KernelContext, and
the PyTorch op that does the same work (``torch.set_num_threads(1)``, float32 like the graph): the
functional op for a forward op, the ATen backward function autograd would call for a backward op (with
what autograd saves, e.g. layer norm's mean and rstd, computed beforehand), ``torch.optim`` for an
update. The two alternate in blocks of ~``--block-ms`` for ``--repeat`` repetitions; the per-call
medians are compared. An op's ratio is its cases' summed sbpflow time over their summed torch time,
each case weighted by its count; ratios over ``FLAG`` are flagged. Where PyTorch returns a view
(reshape, transpose, split, expand) its time is a view's, and so is numpy's where the kernel returns one.

BLAS threads are pinned to one before numpy is imported. This machine sets OPENBLAS_CORETYPE, which
slows a current numpy's GEMM; the figures in bench/README.md unset it for this command alone.
A benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy (here or by sbpflow) and torch are imported

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sbpflow.ops  # noqa: E402, F401  (registers every op)
from bench._shared import blas_kernel  # noqa: E402
from bench.models.ops_more import EXTRA_MORE, INDEX_HIGH, POSITIVE, PROBABILITIES, torch_peer  # noqa: E402
from sbpflow.control_plane.compiler import pipeline  # noqa: E402
from sbpflow.dtype import DType  # noqa: E402
from sbpflow.ops.base import OPS, KernelContext, get_op  # noqa: E402
from sbpflow.ops.eager import full_index  # noqa: E402
from sbpflow.tensor_meta import TensorMeta  # noqa: E402

FLAG = 1.25
F32 = DType.float32


@dataclass(frozen=True)
class Case:
    op: str
    metas: tuple[TensorMeta, ...]
    attrs: tuple[tuple[str, Any], ...]
    source: str  # the example it comes from, or "*" for a shape chosen here
    count: int = 1

    def label(self) -> str:
        shapes = " ".join("x".join(map(str, m.shape)) or "()" for m in self.metas)
        skip = {"lr", "beta1", "beta2", "eps", "weight_decay", "schedule", "warmup_steps", "total_steps",
                "min_lr_ratio", "momentum", "nesterov", "plan"}  # fmt: skip
        attrs = ",".join(f"{k}={v}" for k, v in self.attrs if k not in skip and v not in (False, None))
        return f"{shapes} {attrs}".strip()


def _example_job(name: str, **kwargs: Any) -> Any:
    spec = importlib.util.spec_from_file_location(f"bench_example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_job(**kwargs)


def graph_cases() -> list[Case]:
    """Distinct op calls of the examples' compiled graphs, with their counts."""
    found: dict[tuple[Any, ...], Case] = {}
    for name in ("charlm", "mlp"):
        graph = pipeline.compile(_example_job(name, ranks=1), lower="none").state.graph
        for node in graph.ops:
            if node.op_type not in OPS:
                continue  # boxing
            metas = tuple(graph.tensors[t].meta for t in node.inputs)
            attrs = tuple(sorted(get_op(node.op_type).normalize_attrs(node.attrs).items()))
            key = (node.op_type, metas, attrs)
            old = found.get(key)
            found[key] = Case(node.op_type, metas, attrs, name, (old.count if old else 0) + 1)
    return list(found.values())


X = TensorMeta((16, 64, 256), F32)  # the GPT's MLP activation
ROW = TensorMeta((16, 64, 1), F32)
BOOL = TensorMeta((16, 64, 256), DType.bool)

# ops that neither example's graph calls: inputs and attrs on the activation shape
EXTRA: dict[str, tuple[tuple[TensorMeta, ...], dict[str, Any]]] = {
    "add_scalar": ((X,), {"value": 1.5}),
    "rsub_scalar": ((X,), {"value": 1.0}),
    "rdiv_scalar": ((X,), {"value": 1.0}),
    "sub": ((X, X), {}),
    "div": ((X, X), {}),
    "tanh": ((X,), {}),
    "exp": ((X,), {}),
    "log": ((X,), {}),
    "sqrt": ((X,), {}),
    "neg": ((X,), {}),
    "identity": ((X,), {}),
    "relu": ((X,), {}),
    "relu_grad": ((X, X), {}),
    "log_softmax": ((X,), {"axis": 2}),
    "log_softmax_grad": ((X, X), {"axis": 2}),
    "max": ((X,), {"axes": (2,), "keepdims": True}),
    "max_grad": ((ROW, X, ROW), {"axes": (2,), "keepdims": True}),
    "mean": ((X,), {"axes": (2,), "keepdims": True}),
    "mean_grad": ((ROW,), {"shape": X.shape, "axes": (2,), "keepdims": True}),
    "masked_fill": ((X, BOOL), {"value": 0.0}),
    "where": ((BOOL, X, X), {}),
    "dropout": ((X,), {"rate": 0.1, "rng_id": 7}),
    "broadcast_to": ((ROW,), {"shape": X.shape}),
    "slice": ((X,), {"starts": (0, 0, 0), "stops": (16, 64, 128)}),
    "slice_grad": ((TensorMeta((16, 64, 128), F32),), {"shape": X.shape, "starts": (0, 0, 0)}),
    "sgd_update": ((X, X, X), {"lr": 0.01, "momentum": 0.9}),
    # what the fusion pass (JobConfig.fusion) makes of the GPT's c_proj bias add and residual add
    "fused_elementwise": (
        (TensorMeta((16, 64, 64), F32), TensorMeta((64,), F32), TensorMeta((16, 64, 64), F32)),
        {"chain": '[["add",{},["in0","in1"]],["add",{},["in2","s0"]]]'},
    ),
}


def extra_cases(have: set[str]) -> tuple[list[Case], list[str]]:
    """Cases for the ops neither example calls, and the names of those with no EXTRA case (not timed:
    printed, so that a new op shows up here until it gets a case and a PyTorch peer)."""
    out, missing = [], []
    for name in sorted(set(OPS) - have):
        if name not in EXTRA and name not in EXTRA_MORE:
            missing.append(name)
            continue
        metas, attrs = EXTRA.get(name) or EXTRA_MORE[name]
        out.append(Case(name, metas, tuple(sorted(get_op(name).normalize_attrs(attrs).items())), "*"))
    return out, missing


# ---- inputs --------------------------------------------------------------------------------------------


def make_inputs(case: Case, rng: np.random.Generator) -> list[np.ndarray]:
    attrs = dict(case.attrs)
    arrays: list[np.ndarray] = []
    for i, m in enumerate(case.metas):
        if m.dtype is DType.bool:
            arrays.append(np.asarray(rng.random(m.shape) < 0.3))
        elif not m.dtype.is_floating:  # ids or labels: in range of the table they index
            high = {
                "embedding": case.metas[0].shape[0] if case.metas else 1,
                "embedding_grad": attrs.get("num_embeddings", 1),
                **INDEX_HIGH,
            }.get(case.op, case.metas[0].shape[-1])
            arrays.append(np.asarray(rng.integers(0, high, m.shape), dtype=m.dtype.to_numpy()))
        else:
            a = np.asarray(rng.standard_normal(m.shape), dtype=m.dtype.to_numpy())
            if case.op in ("log", "sqrt", "rdiv_scalar", "clip_coef") or (case.op == "div" and i == 1):
                a = np.abs(a) + a.dtype.type(0.5)
            if case.op.removeprefix("clipped_") in ("adamw_update", "sgd_update") and i == 3:
                a = np.abs(a)  # v >= 0
            if (case.op, i) in POSITIVE:  # a sum of exponentials
                a = np.abs(a) + a.dtype.type(0.5)
            if (case.op, i) in PROBABILITIES:
                a = np.asarray(rng.random(m.shape), dtype=a.dtype)
            arrays.append(np.asarray(a))
    if case.op == "max_grad":  # y is the max of x, so that the maxima are hit
        arrays[2] = arrays[1].max(axis=attrs["axes"], keepdims=bool(attrs["keepdims"]))
    return arrays


def sbpflow_call(case: Case, arrays: list[np.ndarray]) -> Callable[[], Any]:
    op = get_op(case.op)
    attrs = dict(case.attrs)
    outs = op.run_infer(case.metas, attrs)
    ctx = KernelContext(
        np, attrs, case.metas, outs, tuple(map(full_index, case.metas)), tuple(map(full_index, outs)), 0, 3
    )
    return lambda: op.run_kernel(ctx, arrays)


# ---- the PyTorch side ------------------------------------------------------------------------------------


def _torch_chain(chain: str, t: list[Any]) -> Callable[[], Any]:
    import torch
    from torch.nn import functional as F

    # a step's torch call from its arrays and attrs: the ops the examples' fused chains hold
    fns: dict[str, Callable[..., Any]] = {
        "add": lambda a, x, y: torch.add(x, y),
        "mul": lambda a, x, y: torch.mul(x, y),
        "sub": lambda a, x, y: torch.sub(x, y),
        "div": lambda a, x, y: torch.div(x, y),
        "gelu": lambda a, x: F.gelu(x, approximate="tanh"),
        "tanh": lambda a, x: torch.tanh(x),
        "mul_scalar": lambda a, x: torch.mul(x, a["value"]),
        "add_scalar": lambda a, x: torch.add(x, a["value"]),
        "pow_scalar": lambda a, x: torch.pow(x, a["exponent"]),
        "ne_scalar": lambda a, x: torch.ne(x, a["value"]),
        "eq_scalar": lambda a, x: torch.eq(x, a["value"]),
        "cast": lambda a, x: x.to(getattr(torch, str(a["dtype"]))),
        "sum": lambda a, x: torch.sum(x),
        "relu": lambda a, x: torch.relu(x),
        "neg": lambda a, x: torch.neg(x),
        "exp": lambda a, x: torch.exp(x),
        "log": lambda a, x: torch.log(x),
        "sqrt": lambda a, x: torch.sqrt(x),
        "sigmoid": lambda a, x: torch.sigmoid(x),
        "gelu_erf": lambda a, x: F.gelu(x),
        "rsub_scalar": lambda a, x: torch.rsub(x, a["value"]),
        "rdiv_scalar": lambda a, x: torch.reciprocal(x).mul_(a["value"]),
        "relu_grad": lambda a, dy, y: torch.ops.aten.threshold_backward(dy, y, 0),
        "gelu_grad": lambda a, dy, x: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"),
        "gelu_erf_grad": lambda a, dy, x: torch.ops.aten.gelu_backward(dy, x),
    }
    steps = json.loads(chain)
    missing = sorted({op for op, _, _ in steps} - set(fns))
    if missing:
        raise SystemExit(
            f"ops.py: no PyTorch call for fused steps {missing}; add them to _torch_chain's table"
        )

    def run() -> Any:
        vals: list[Any] = []
        for op, attrs, refs in steps:
            args = (t[int(r[2:])] if r.startswith("in") else vals[int(r[1:])] for r in refs)
            vals.append(fns[op](attrs, *args))
        return vals[-1]

    return run


def torch_call(case: Case, arrays: list[np.ndarray]) -> Callable[[], Any]:
    import torch
    from torch.nn import functional as F

    aten = torch.ops.aten
    a = dict(case.attrs)
    t = [torch.from_numpy(x.copy()) for x in arrays]
    op = case.op
    if op in EXTRA_MORE:
        peer = torch_peer(op, a, t)
        if peer is not None:
            return peer
    if op == "sum_squares":  # clip_grad_norm_'s own reduction: a norm per tensor, then their norm
        return lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(t))) ** 2
    if op == "rows_matmul":  # a weight's gradient: PyTorch's linear backward flattens to rows, a^T b
        return lambda: torch.mm(t[0].reshape(-1, t[0].shape[-1]).t(), t[1].reshape(-1, t[1].shape[-1]))
    simple: dict[str, Callable[[], Any]] = {}
    if op in ("add", "sub", "mul", "div"):
        fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[op]
        return lambda: fn(t[0], t[1])
    if op in ("add_scalar", "mul_scalar", "rsub_scalar", "rdiv_scalar", "pow_scalar"):
        v = float(a.get("value", a.get("exponent", 0.0)))
        x = t[0]
        return {
            "add_scalar": lambda: x + v,
            "mul_scalar": lambda: x * v,
            "rsub_scalar": lambda: v - x,
            "rdiv_scalar": lambda: v / x,
            "pow_scalar": lambda: x**v,
        }[op]
    if op == "fused_elementwise":  # PyTorch eager runs the chain op by op
        return _torch_chain(str(a["chain"]), t)
    if len(t) >= 1:
        x = t[0]
        simple = {
            "relu": lambda: torch.relu(x),
            "gelu": lambda: F.gelu(x, approximate="tanh"),
            "tanh": lambda: torch.tanh(x),
            "exp": lambda: torch.exp(x),
            "log": lambda: torch.log(x),
            "sqrt": lambda: torch.sqrt(x),
            "neg": lambda: torch.neg(x),
            "identity": lambda: x.clone(),
            "dropout": lambda: F.dropout(x, float(a.get("rate", 0.0)), training=True),
            "softmax": lambda: torch.softmax(x, int(a.get("axis", -1))),
            "log_softmax": lambda: torch.log_softmax(x, int(a.get("axis", -1))),
            "cast": lambda: x.to(getattr(torch, a["dtype"].value) if "dtype" in a else x.dtype),
            "ne_scalar": lambda: x != a.get("value"),
            "eq_scalar": lambda: x == a.get("value"),
            "clip_coef": lambda: torch.clamp(float(a.get("max_norm", 1.0)) / (torch.sqrt(x) + 1e-6), max=1.0),
            "reshape": lambda: x.reshape(a.get("shape", ())),
            "transpose": lambda: x.permute(a.get("perm", ())),
            "concat": lambda: torch.cat(t, int(a.get("axis", 0))),
        }
    if op in simple:
        return simple[op]
    if op in ("relu_grad", "gelu_grad"):
        dy, other = t
        if op == "relu_grad":
            return lambda: aten.threshold_backward(dy, other, 0)
        return lambda: aten.gelu_backward(dy, other, approximate="tanh")
    if op in ("softmax_grad", "log_softmax_grad"):
        y, dy = t
        axis = int(a["axis"])
        if op == "softmax_grad":
            y = torch.softmax(y, axis)
            return lambda: torch._softmax_backward_data(dy, y, axis, y.dtype)
        y = torch.log_softmax(y, axis)
        return lambda: torch._log_softmax_backward_data(dy, y, axis, y.dtype)
    if op in ("matmul", "batch_matmul"):
        ta, tb = bool(a["transpose_a"]), bool(a["transpose_b"])
        aa = t[0].transpose(-1, -2) if ta else t[0]
        bb = t[1].transpose(-1, -2) if tb else t[1]
        return lambda: torch.matmul(aa, bb)
    if op == "layer_norm":
        d = (t[0].shape[-1],)
        return lambda: F.layer_norm(t[0], d, t[1], t[2], float(a["eps"]))
    if op == "layer_norm_grad":
        dy, x, w = t
        d = [x.shape[-1]]
        b = torch.zeros_like(w)
        _, mean, rstd = aten.native_layer_norm(x, d, w, b, float(a["eps"]))  # what autograd saves
        return lambda: aten.native_layer_norm_backward(dy, x, d, mean, rstd, w, b, [True, True, True])
    if op == "cross_entropy":
        logits, labels = t[0].reshape(-1, t[0].shape[-1]), t[1].reshape(-1)
        ii = int(a["ignore_index"])
        return lambda: F.cross_entropy(logits, labels, reduction="none", ignore_index=ii)
    if op == "cross_entropy_grad":  # autograd: nll_loss's backward, then log_softmax's
        logits, labels, dy = t[0].reshape(-1, t[0].shape[-1]), t[1].reshape(-1), t[2].reshape(-1)
        lsm = torch.log_softmax(logits, 1)
        ii, total = int(a["ignore_index"]), torch.tensor(0.0)

        def ce_grad() -> Any:
            g = aten.nll_loss_backward(dy, lsm, labels, None, 0, ii, total)
            return torch._log_softmax_backward_data(g, lsm, 1, lsm.dtype)

        return ce_grad
    if op in ("sum", "mean", "max"):
        x = t[0]
        dims = tuple(range(x.dim())) if a["axes"] is None else tuple(a["axes"])
        keep = bool(a["keepdims"])
        if op == "max":
            return lambda: torch.amax(x, dims, keep)
        fn = torch.sum if op == "sum" else torch.mean
        return lambda: fn(x, dims, keep)
    if op in ("sum_grad", "mean_grad"):  # autograd expands dy (a view)
        shape = tuple(a["shape"])
        dims = tuple(range(len(shape))) if a["axes"] is None else tuple(a["axes"])
        ones = tuple(1 if i in dims else d for i, d in enumerate(shape))
        n = float(np.prod([shape[i] for i in dims]))
        if op == "sum_grad":
            return lambda: t[0].reshape(ones).expand(shape)
        return lambda: (t[0] / n).reshape(ones).expand(shape)
    if op == "max_grad":  # autograd's amax backward: the grad split evenly among the maxima
        dy, x, y = t
        dims = tuple(a["axes"])

        def max_grad() -> Any:
            hit = (x == y).to(x.dtype)
            return hit * (dy / hit.sum(dims, keepdim=True))

        return max_grad
    if op == "sum_to":
        x = t[0]
        shape = tuple(a["shape"])
        lead = x.dim() - len(shape)
        dims = (*range(lead), *(lead + k for k, s in enumerate(shape) if s == 1))
        return lambda: x.sum(dims, keepdim=True).reshape(shape)
    if op == "broadcast_to":
        return lambda: t[0].expand(tuple(a["shape"]))
    if op in ("causal_mask", "masked_fill"):
        x = t[0]
        if op == "causal_mask":
            tq, tk = x.shape[-2:]
            mask = torch.ones(tq, tk, dtype=torch.bool).triu(1)  # nanoGPT keeps it as a buffer
        else:
            mask = t[1]
        v = float(a["value"])
        return lambda: x.masked_fill(mask, v)
    if op == "where":
        return lambda: torch.where(t[0], t[1], t[2])
    if op == "full":
        return lambda: torch.full(tuple(a["shape"]), float(a["value"]), dtype=torch.float32)
    if op == "split":
        sizes, axis = list(a["sizes"]), int(a["axis"])
        return lambda: torch.split(t[0], sizes, axis)
    if op == "slice":
        cut = tuple(slice(lo, hi) for lo, hi in zip(a["starts"], a["stops"], strict=True))
        return lambda: t[0][cut]
    if op == "slice_grad":
        shape, starts = list(a["shape"]), a["starts"]

        def slice_grad() -> Any:
            out = t[0].new_zeros(shape)
            out[tuple(slice(lo, lo + n) for lo, n in zip(starts, t[0].shape, strict=True))] = t[0]
            return out

        return slice_grad
    if op == "embedding":
        w, ids = t
        return lambda: F.embedding(ids, w)
    if op == "embedding_grad":
        dy, ids = t
        num = int(a["num_embeddings"])
        return lambda: aten.embedding_dense_backward(dy, ids, num, -1, False)
    if op.removeprefix("clipped_") in ("adamw_update", "sgd_update"):
        p = torch.nn.Parameter(t[0])
        p.grad = t[1]
        if op.endswith("adamw_update"):
            opt: Any = torch.optim.AdamW(
                [p], lr=float(a["lr"]), betas=(float(a["beta1"]), float(a["beta2"])), eps=float(a["eps"]),
                weight_decay=float(a["weight_decay"]), foreach=False,
            )  # fmt: skip
        else:
            opt = torch.optim.SGD(
                [p], lr=float(a["lr"]), momentum=float(a["momentum"]), weight_decay=float(a["weight_decay"]),
                nesterov=bool(a["nesterov"]), foreach=False,
            )  # fmt: skip
        opt.step()  # the state exists, as in a step of training
        if not op.startswith("clipped_"):
            return lambda: opt.step()
        one = torch.ones(())  # clip_grad_norm_'s in-place mul of each gradient (by 1: no drift over repeats)
        return lambda: (p.grad.mul_(one), opt.step())  # type: ignore[union-attr]
    raise SystemExit(f"bench/models/ops.py: no PyTorch counterpart for op {op!r}; add one to torch_call")


# ---- timing --------------------------------------------------------------------------------------------


# wall time, or this thread's CPU time (--clock cpu: what a loaded machine's preemption leaves alone; both
# sides run on this thread, torch with 1 intra-op thread)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK = [time.perf_counter]


def _per_call(fn: Callable[[], Any], n: int) -> float:
    clock = CLOCK[0]
    t0 = clock()
    for _ in range(n):
        fn()
    return (clock() - t0) / n


def calls_for(fn: Callable[[], Any], block_s: float) -> int:
    fn()  # warm: first-touch pages, caches
    once = _per_call(fn, 1)
    n = max(1, int(block_s / max(once, 1e-7)))
    return max(1, int(block_s / max(_per_call(fn, n), 1e-7)))


def time_case(case: Case, repeat: int, block_s: float, rng: np.random.Generator) -> tuple[float, float]:
    arrays = make_inputs(case, rng)
    sb, pt = sbpflow_call(case, arrays), torch_call(case, arrays)
    n_sb, n_pt = calls_for(sb, block_s), calls_for(pt, block_s)
    ts, tt = [], []
    for _ in range(repeat):  # interleaved, so that load on the machine hits both alike
        ts.append(_per_call(sb, n_sb))
        tt.append(_per_call(pt, n_pt))
    return statistics.median(ts), statistics.median(tt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=None, help="interleaved repetitions (default 11; 3 quick)")
    ap.add_argument("--block-ms", type=float, default=None, help="ms per timed block (default 2; 1 quick)")
    ap.add_argument("--only", action="append", help="op names (default: every op)")
    ap.add_argument("--cases", action="store_true", help="print every case, not only one row per op")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: this thread's CPU time")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    CLOCK[0] = CLOCKS[args.clock]
    import torch

    torch.set_num_threads(1)
    repeat = args.repeat or (3 if args.quick else 11)
    block_s = (args.block_ms or (1.0 if args.quick else 2.0)) / 1e3
    cases = graph_cases()
    extra, untimed = extra_cases({c.op for c in cases})
    cases += extra
    if untimed:
        print(f"not timed (no case on the examples' shapes and no PyTorch peer yet): {', '.join(untimed)}")
    if args.only:
        cases = [c for c in cases if c.op in args.only]
    print(
        f"{len(cases)} cases of {len({c.op for c in cases})} ops; float32, 1 thread; {args.clock} time; {repeat} interleaved "
        f"repetitions of ~{block_s * 1e3:.0f} ms blocks, medians; OPENBLAS_CORETYPE="
        f"{os.environ.get('OPENBLAS_CORETYPE', '(unset)')} ({blas_kernel()}); load {os.getloadavg()[0]:.1f}"
    )
    rng = np.random.default_rng(0)
    timed = [(c, *time_case(c, repeat, block_s, rng)) for c in cases]
    main_total = sum(c.count * s for c, s, _ in timed if c.source == "charlm")
    if args.cases:
        print(f"\n{'op':<20} {'source':<7} {'n':>3} {'sbpflow us':>11} {'torch us':>9} {'ratio':>6}  case")
        for c, s, t in sorted(timed, key=lambda r: (r[0].op, r[0].source)):
            flag = " <-" if s / t > FLAG else ""
            print(
                f"{c.op:<20} {c.source:<7} {c.count:>3} {s * 1e6:>11.1f} {t * 1e6:>9.1f} {s / t:>6.2f}  "
                f"{c.label()}{flag}"
            )
    print(
        f"\n{'op':<20} {'cases':>5} {'sbpflow us':>11} {'torch us':>9} {'ratio':>6} {'main job':>9}  "
        "(per step, weighted by count; main job = share of its kernel time)"
    )
    flagged = []
    for op in sorted({c.op for c in cases}):
        rows = [(c, s, t) for c, s, t in timed if c.op == op]
        s = sum(c.count * s for c, s, _ in rows)
        t = sum(c.count * t for c, _, t in rows)
        share = sum(c.count * s for c, s, _ in rows if c.source == "charlm") / (main_total or 1.0)
        star = "*" if all(c.source == "*" for c, _, _ in rows) else " "
        flag = f" > {FLAG}" if s / t > FLAG else ""
        if flag:
            flagged.append(op)
        print(
            f"{op + star:<20} {len(rows):>5} {s * 1e6:>11.1f} {t * 1e6:>9.1f} {s / t:>6.2f} {100 * share:>8.1f}%"
            f"{flag}"
        )
    print(f"\n{len(flagged)} op(s) over {FLAG}x: {', '.join(flagged) or 'none'}")


if __name__ == "__main__":
    main()
