"""A plan's kernels timed on this machine, for the cost model: ``estimate(plan, profile, kernels=...)``.

The roofline of ``cost_model`` prices an op by its FLOPs and bytes; on a CPU with the small shards of a
small model most of a kernel's time is neither, but the fixed cost of its several numpy calls, which no
table of FLOPs sees. ``measure_kernels(plan)`` runs every distinct kernel call of the plan as the runtime
would on rank 0 (coordinate 0 of its placement: the logical metas, that rank's shard indices, arrays of
its local shapes: floats drawn from |N(0, 1)|, integers zero so that every index is valid), and times it
as a run makes it: the plan's calls in the graph's order, ``ROUNDS`` times, each call's thread CPU, its
figure the median. With ``together`` (the ``inprocess`` link: the ranks are threads of one process) each
rank of the plan runs its stage's calls in a thread of its own, all at once; a call's figure is then the
median over its stage's ranks too. Probed one at a time, each call repeated back to back on warm caches,
the kernels of Wide & Deep's layouts read less than the same calls cost in its runs, and by a factor
that differs by layout: a ZeRO-1 layout's (mostly small kernels) 4.1x, a replicated one's (its 2 MB
AdamW) 2.2x; in plan order on four threads 1.9x and 1.6x. Non-negative floats, as the second moments and
variances a kernel takes the root of are: a negative one makes a NaN, and numpy's floating-point error
path is several times slower than the math (AdamW's update of a 2 MB table: 3.8 ms against 0.8 ms). The
estimate then takes a measured call's time in place of its roofline, and counts what the roofline does
not explain as the interpreter's (a small kernel's Python and numpy dispatch hold the GIL). What cannot
run on such inputs is left to the roofline. Calls are keyed by ``stage_load.call_key`` (op, attributes,
local shapes and dtypes) and cached per process, so the candidates of a plan search share their repeated
layers' timings (the first plan's order and threads time a call).
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings
from collections.abc import Sequence

import numpy as np

from sbpflow.actor_workers.runtime.threads import limited
from sbpflow.control_plane.compiler.cost.stage_load import CallKey, call_key, local_meta, ranks_of
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, OpNode, TensorDecl
from sbpflow.ops.base import KernelContext, OpDef, get_op
from sbpflow.sharding import Index, shard_index
from sbpflow.tensor_meta import TensorMeta

ROUNDS = 20  # the plan's calls run this many times (in each thread), each call's median kept
# (threads, together, call) -> seconds; None: cannot run on probe inputs
_TIMED: dict[tuple[int, bool, CallKey], float | None] = {}
Call = tuple[int, OpDef, KernelContext, list[np.ndarray]]  # (position in the plan, op, context, inputs)


def measure_kernels(state: CompileState, threads: int = 1, together: bool = False) -> dict[CallKey, float]:
    """Seconds of each distinct kernel call of ``state``'s graph on this machine with ``threads`` BLAS
    threads (a CPU profile's: 1, as Ray runs a CPU rank; 0: the process's setting), timed as a run makes
    them, its ranks ``together`` in one process or not (module docstring)."""
    stages: dict[int, dict[CallKey, OpNode]] = {}
    for o in state.graph.ops:
        if o.op_type != BOXING:
            stages.setdefault(o.stage, {}).setdefault(call_key(state, o), o)
    if any((threads, together, k) not in _TIMED for calls in stages.values() for k in calls):
        with limited(threads):
            _TIMED.update(_timed(state, stages, threads, together))
    out: dict[CallKey, float] = {}
    for calls in stages.values():
        for key in calls:
            if (seconds := _TIMED[(threads, together, key)]) is not None:
                out[key] = seconds
    return out


def _timed(
    state: CompileState, stages: dict[int, dict[CallKey, OpNode]], threads: int, together: bool
) -> dict[tuple[int, bool, CallKey], float | None]:
    """Every call of ``stages`` timed: a lane a rank (``together``) or one lane for the whole graph."""
    ranks = ranks_of(state)
    plan = [(s, key, o) for s, calls in sorted(stages.items()) for key, o in calls.items()]
    lanes: list[list[int]] = (  # a lane: positions in ``plan`` it calls, in order
        [
            [i for i, (s, _, _) in enumerate(plan) if s == stage]
            for stage, rs in sorted(ranks.items())
            for _ in rs
        ]
        if together
        else [list(range(len(plan)))]
    )
    runs = [_prepared(state, plan, lane) for lane in lanes]  # each lane its own arrays, as each rank has
    samples: list[list[float]] = [[] for _ in plan]
    with warnings.catch_warnings():  # the filters are the process's: the lanes' threads see them
        warnings.simplefilter("ignore")
        start = threading.Barrier(len(runs))  # the lanes start at once, as a run's ranks do
        workers = [threading.Thread(target=_lane, args=(run, samples, start), daemon=True) for run in runs]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    return {
        (threads, together, key): statistics.median(samples[i]) if samples[i] else None
        for i, (_, key, _) in enumerate(plan)
    }


def _prepared(
    state: CompileState, plan: Sequence[tuple[int, CallKey, OpNode]], lane: list[int]
) -> list[Call]:
    """The lane's calls (op, context, probe inputs) in order, each run once (numba's first call compiles);
    those that cannot run on probe inputs left out (a kernel that needs real data: the roofline prices
    it; no figure for it)."""
    rng = np.random.default_rng(0)
    out: list[Call] = []
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for i in lane:
            op, ctx, arrays = _call(state, plan[i][2], rng)
            try:
                op.run_kernel(ctx, arrays)
            except Exception:  # noqa: BLE001
                continue
            out.append((i, op, ctx, arrays))
    return out


def _lane(run: list[Call], samples: list[list[float]], start: threading.Barrier) -> None:
    """One rank's thread: its calls ``ROUNDS`` times in order, each call's thread CPU kept."""
    clock = time.thread_time
    start.wait()
    with np.errstate(all="ignore"):  # numpy's error state is a thread's own
        for _ in range(ROUNDS):
            for i, op, ctx, arrays in run:
                t0 = clock()
                op.run_kernel(ctx, arrays)
                samples[i].append(clock() - t0)  # list.append is atomic: lanes of one stage share a list


def _call(
    state: CompileState, o: OpNode, rng: np.random.Generator
) -> tuple[OpDef, KernelContext, list[np.ndarray]]:
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
    return op, ctx, [probe_array(local_meta(t), rng) for t in ins]


def _index(t: TensorDecl) -> Index:
    assert t.placement is not None and t.sbp is not None, f"tensor {t.name!r} has no layout"
    return shard_index(t.meta.shape, t.placement.shape, t.sbp, (0,) * t.placement.ndim)


def probe_array(meta: TensorMeta, rng: np.random.Generator) -> np.ndarray:
    dtype = meta.dtype.to_numpy()
    if meta.dtype.is_floating:  # |N(0, 1)|: see the module docstring
        return np.abs(rng.standard_normal(meta.shape)).astype(dtype)
    return np.zeros(meta.shape, dtype)
