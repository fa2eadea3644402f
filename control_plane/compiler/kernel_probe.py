"""A plan's kernels timed on this machine, for the cost model: ``estimate(plan, profile, kernels=...)``.

The roofline of ``cost_model`` prices an op by its FLOPs and bytes; on a CPU with the small shards of a
small model most of a kernel's time is neither, but the fixed cost of its several numpy calls, which no
table of FLOPs sees. ``measure_kernels(plan)`` runs every distinct kernel call of the plan once as the
runtime would on rank 0 (coordinate 0 of its placement: the logical metas, that rank's shard indices,
arrays of its local shapes: floats drawn from |N(0, 1)|, integers zero so that every index is valid) and
keeps the fastest of ``repeat`` calls. Non-negative floats, as the second moments and variances a
kernel takes the root of are: a negative one makes a NaN, and numpy's floating-point error path is
several times slower than the math (AdamW's update of a 2 MB table: 3.8 ms against 0.8 ms). The estimate then takes a measured call's time in place of its
roofline, and counts what the roofline does not explain as the interpreter's (a small kernel's Python and
numpy dispatch hold the GIL). What cannot run on such inputs is left to the roofline. Calls are keyed by
``stage_load.call_key`` (op, attributes, local shapes and dtypes) and cached per process, so the
candidates of a plan search share their repeated layers' timings.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from sbpflow.actor_workers.runtime.threads import limited
from sbpflow.control_plane.compiler.stage_load import CallKey, call_key, local_meta
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, OpNode, TensorDecl
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.sharding import Index, shard_index
from sbpflow.tensor_meta import TensorMeta

ROUNDS = 3  # a kernel's rounds of calls, its fastest kept
_TIMED: dict[tuple[int, CallKey], float | None] = {}  # (threads, call); None: cannot run on probe inputs


def measure_kernels(state: CompileState, threads: int = 1, repeat: int = 7) -> dict[CallKey, float]:
    """Seconds of each distinct kernel call of ``state``'s graph on this machine with ``threads`` BLAS
    threads (a CPU profile's: 1, as Ray runs a CPU rank; 0: the process's setting; module docstring).
    The calls not timed yet are timed in ``ROUNDS`` rounds, each call ``repeat`` times a round, and each
    keeps its fastest: a spell of load on this shared machine slows one round's calls, not all of a
    kernel's (one round each: a kernel read up to 2.3x from one process to the next)."""
    with limited(threads):
        todo: dict[CallKey, OpNode] = {}
        for o in state.graph.ops:
            key = call_key(state, o) if o.op_type != BOXING else None
            if key is not None and (threads, key) not in _TIMED:
                todo.setdefault(key, o)
        best: dict[CallKey, float | None] = dict.fromkeys(todo, float("inf"))
        for _ in range(ROUNDS):
            rng = np.random.default_rng(0)
            for key, o in todo.items():
                if best[key] is not None:
                    t = _time(state, o, rng, repeat)
                    best[key] = None if t is None else min(t, best[key] or t)
        _TIMED.update({(threads, k): t for k, t in best.items()})
    out: dict[CallKey, float] = {}
    for o in state.graph.ops:
        if o.op_type != BOXING and (seconds := _TIMED[(threads, call_key(state, o))]) is not None:
            out[call_key(state, o)] = seconds
    return out


def _time(state: CompileState, o: OpNode, rng: np.random.Generator, repeat: int) -> float | None:
    g = state.graph
    op = get_op(o.op_type)
    ins, outs = [g.tensors[t] for t in o.inputs], [g.tensors[t] for t in o.outputs]
    ctx = KernelContext(
        np,
        op.normalize_attrs(o.attrs),
        tuple(t.meta for t in ins),
        tuple(t.meta for t in outs),
        tuple(_index(t) for t in ins),
        tuple(_index(t) for t in outs),
    )
    arrays = [probe_array(local_meta(t), rng) for t in ins]
    best = float("inf")
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            for _ in range(repeat):
                t0 = time.perf_counter()
                op.run_kernel(ctx, arrays)
                best = min(best, time.perf_counter() - t0)
    except Exception:  # noqa: BLE001  (a kernel that needs real data: the roofline prices it)
        return None
    return best


def _index(t: TensorDecl) -> Index:
    assert t.placement is not None and t.sbp is not None, f"tensor {t.name!r} has no layout"
    return shard_index(t.meta.shape, t.placement.shape, t.sbp, (0,) * t.placement.ndim)


def probe_array(meta: TensorMeta, rng: np.random.Generator) -> np.ndarray:
    dtype = meta.dtype.to_numpy()
    if meta.dtype.is_floating:  # |N(0, 1)|: see the module docstring
        return np.abs(rng.standard_normal(meta.shape)).astype(dtype)
    return np.zeros(meta.shape, dtype)
