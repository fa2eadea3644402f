"""Runtime overhead: an sbpflow training step against a hand-written numpy step doing the same math.

    python bench/runtime/overhead.py              # the issue's MLP, 7 repetitions of 4 steps, ~1 min on
                                                  # 2 cores
    python bench/runtime/overhead.py --quick      # a small MLP, a few seconds (a smoke run: its kernels
                                                  # are tiny, so the engine's ~20 us per act shows; not
                                                  # the target's figure)
    python bench/runtime/overhead.py --breakdown  # and where sbpflow's step goes (slowest acts, engine time)

The model: an MLP 1024 -> 4096 -> 4096 -> 1024 (ReLU), MSE loss, batch 128, float32, one device, one
BLAS thread, in-memory data (:class:`sbpflow.data.sources.ArraySource`), trained by SGD without momentum and
with momentum 0.9. sbpflow's step time is ``sf.run`` over N steps, compile excluded (the run's own
wall time, ``RunResult.seconds``: engine start to last act; compile is timed separately and reported,
once, beside it). The baseline is a numpy step written by hand: forward, backward, and an in-place SGD
update, on the same data in the same dtype. Both start from the same initial parameters, and their
losses are checked to agree, so both do the same math. The two are measured alternately in one
process, ``--repeat`` times, and the medians compared. Target: sbpflow / numpy <= 1.05. Beside it:
the CPU time of both (all threads), the best repetition of each, and every repetition's ratio: on a
2-core machine shared with other work, single repetitions vary by +-30 %.

The initial parameters are drawn once and copied into every run (the counter-based generator takes
~8 s for 25M parameters, all before the engine starts, so outside the measured time anyway), and the
garbage of the previous run is collected before each measurement, for both sides.

BLAS threads are pinned to one before numpy is imported (OMP/OPENBLAS/MKL_NUM_THREADS), so the
comparison measures the runtime, not how two BLAS thread pools share this machine's cores.
This is a benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy is imported (here or by sbpflow)

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sbpflow as sf  # noqa: E402
from sbpflow.actor_workers.execution import executor  # noqa: E402
from sbpflow.actor_workers.execution import variables as store_module  # noqa: E402
from sbpflow.actor_workers.execution.plan_tables import PlanTables  # noqa: E402
from sbpflow.actor_workers.execution.variables import Store  # noqa: E402
from sbpflow.control_plane.compiler import pipeline  # noqa: E402
from sbpflow.data.sources import ArraySource  # noqa: E402
from sbpflow.oracle import reference  # noqa: E402

TARGET = 1.05
LR = 0.01


class Regression(sf.nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.net = sf.nn.MLP(widths, activation="relu")

    def forward(self, x: sf.Tensor, y: sf.Tensor) -> sf.Tensor:
        return sf.nn.functional.mse_loss(self.net(x), y)


class Train(sf.Graph):
    def __init__(self, model: Regression, momentum: float, steps: int) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.SGD(model.parameters(), lr=LR, momentum=momentum))
        self.config.steps = steps

    def build(self, x: sf.Tensor, y: sf.Tensor) -> sf.Tensor:
        loss = self.model(x, y)
        loss.backward()
        return loss


def make_job(widths: list[int], batch: int, momentum: float, steps: int, batches: int = 4) -> sf.Job:
    """The MLP on one device, fed ``batches`` distinct in-memory batches (cycled)."""
    rng = np.random.default_rng(0)
    n = batch * batches
    data = ArraySource(
        batch_size=batch,
        arrays={
            "x": rng.standard_normal((n, widths[0]), dtype=np.float32),
            "y": rng.standard_normal((n, widths[-1]), dtype=np.float32),
        },
    )
    graph = Train(Regression(widths), momentum, steps)
    return graph.trace(data, placement=sf.placement("cpu", ranks=[0]), input_sbp=None)


# ---- initial values, drawn once --------------------------------------------------------------------

_INIT: dict[int, dict[str, Any]] = {}
_STORES: dict[tuple[Any, ...], Store] = {}


def initial_parameters(job: sf.Job) -> dict[str, Any]:
    if id(job) not in _INIT:
        _INIT[id(job)] = reference.init_parameters(job)
    return _INIT[id(job)]


def cached_init_store(tables: PlanTables, rank: int, xp: ModuleType = np, source: Any = None) -> Store:
    """:func:`init_store`, drawn once per job and copied into each run: drawing 25M parameters with the
    counter-based generator takes seconds, all of it before the engine starts (outside the measured
    time), so this only shortens the benchmark."""
    key = (rank, tables.config.seed, tuple(sorted(tables.tensors)))  # each sf.run compiles a new graph
    if key not in _STORES:
        _STORES[key] = store_module.init_store(tables, rank, xp)
    return Store(rank, {k: v.copy() for k, v in _STORES[key].values().items()})


executor.init_store = cached_init_store  # type: ignore[assignment]


# ---- the hand-written numpy step ---------------------------------------------------------------------


class NumpyMLP:
    """Forward, backward and SGD (torch.optim.SGD: buf = m * buf + g; p -= lr * buf) in plain numpy."""

    def __init__(self, job: sf.Job, momentum: float) -> None:
        init = initial_parameters(job)
        n = len(self.layer_names(job))
        self.w = [init[f"model.net.{2 * i}.weight"].copy() for i in range(n)]
        self.b = [init[f"model.net.{2 * i}.bias"].copy() for i in range(n)]
        self.momentum = np.float32(momentum)
        self.bufs = [np.zeros_like(p) for p in (*self.w, *self.b)] if momentum else []
        self.data = job.data

    @staticmethod
    def layer_names(job: sf.Job) -> list[str]:
        return [p.tensor for p in job.parameters if p.tensor.endswith(".weight")]

    def step(self, step: int) -> float:
        assert self.data is not None
        batch = self.data.read(step)
        x, y = batch["x"], batch["y"]
        acts = [x]  # the input of each layer
        for i, (w, b) in enumerate(zip(self.w, self.b, strict=True)):
            h = acts[-1] @ w + b
            if i < len(self.w) - 1:
                h = np.maximum(h, np.float32(0))
            acts.append(h)
        d = acts[-1] - y
        loss = float(np.mean(d * d))
        g = d * np.float32(2.0 / d.size)  # d loss / d out
        grads_w, grads_b = [], []
        for i in reversed(range(len(self.w))):
            grads_w.append(acts[i].T @ g)
            grads_b.append(g.sum(axis=0))
            if i:
                g = g @ self.w[i].T
                g *= acts[i] > 0
        grads = [*reversed(grads_w), *reversed(grads_b)]
        lr = np.float32(LR)
        for k, (p, gr) in enumerate(zip((*self.w, *self.b), grads, strict=True)):
            if self.momentum:
                buf = self.bufs[k]
                buf *= self.momentum
                buf += gr
                gr = buf
            p -= lr * gr
        return loss


# ---- measurement -------------------------------------------------------------------------------------


@dataclass
class Timing:
    step_s: float  # wall seconds per step
    cpu_s: float  # CPU seconds per step, all threads of the process (robust to other processes' load)
    losses: list[float]
    call_s: float = 0.0  # the whole sf.run call: compile, build, run, results


_ENGINE_CPU: list[float] = []
_execute = executor.execute_ranks


def _timed_execute(*args: Any, **kwargs: Any) -> Any:
    """``executor.execute_ranks`` (the engines' run, which ``RunResult.seconds`` times; the launcher and
    ``executor.execute`` call it by the module's name) and its CPU time."""
    c0 = time.process_time()
    try:
        return _execute(*args, **kwargs)
    finally:
        _ENGINE_CPU.append(time.process_time() - c0)


executor.execute_ranks = _timed_execute


def run_sbpflow(job: sf.Job, steps: int) -> Timing:
    gc.collect()  # a finished run's engine is cyclic garbage holding its arrays: free it before, not during
    t0 = time.perf_counter()
    result = sf.run(job, steps=steps, backend="inprocess")
    call = time.perf_counter() - t0
    return Timing(result.seconds / steps, _ENGINE_CPU[-1] / steps, result.losses, call)


def run_numpy(job: sf.Job, momentum: float, steps: int) -> Timing:
    model = NumpyMLP(job, momentum)
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    losses = [model.step(s) for s in range(steps)]
    return Timing((time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps, losses)


def compile_seconds(job: sf.Job, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        pipeline.compile(job)
        best = min(best, time.perf_counter() - t0)
    return best


def bench(widths: list[int], batch: int, momentum: float, steps: int, repeat: int) -> float:
    job = make_job(widths, batch, momentum, steps)
    compile_s = compile_seconds(job)
    run_sbpflow(job, 1), run_numpy(job, momentum, 1)  # warm-up: imports, first-touch of the caches
    sb: list[Timing] = []
    npy: list[Timing] = []
    for r in range(repeat):
        # alternate which goes first, so neither always runs on a warmer (or more fragmented) heap
        for who in ("sbpflow", "numpy") if r % 2 == 0 else ("numpy", "sbpflow"):
            if who == "sbpflow":
                sb.append(run_sbpflow(job, steps))
            else:
                npy.append(run_numpy(job, momentum, steps))
        np.testing.assert_allclose(sb[-1].losses, npy[-1].losses, rtol=2e-3, err_msg="sbpflow != numpy")
    s, n = statistics.median(t.step_s for t in sb), statistics.median(t.step_s for t in npy)
    s_cpu, n_cpu = statistics.median(t.cpu_s for t in sb), statistics.median(t.cpu_s for t in npy)
    ratio = s / n
    print(
        f"SGD momentum={momentum:<4}: sbpflow {s * 1e3:7.1f} ms/step   numpy {n * 1e3:7.1f} ms/step   "
        f"ratio {ratio:.3f} ({'ok' if ratio <= TARGET else 'over'} target {TARGET})"
    )
    pairs = " ".join(f"{a.step_s / b.step_s:.2f}" for a, b in zip(sb, npy, strict=True))
    s_min, n_min = min(t.step_s for t in sb), min(t.step_s for t in npy)
    print(
        f"    CPU time: sbpflow {s_cpu * 1e3:.1f} ms/step, numpy {n_cpu * 1e3:.1f} ms/step, ratio "
        f"{s_cpu / n_cpu:.3f}; best of each: {s_min * 1e3:.1f} / {n_min * 1e3:.1f} ms = {s_min / n_min:.3f}\n"
        f"    per repetition (wall): {pairs}\n"
        f"    compile {compile_s * 1e3:.0f} ms (excluded); the whole sf.run call "
        f"{statistics.median(t.call_s for t in sb):.2f} s for {steps} steps"
    )
    return ratio


def breakdown(widths: list[int], batch: int, momentum: float, steps: int, top: int = 12) -> None:
    """Where sbpflow's step goes, from the act trace: the slowest acts, and the engine's own time (the
    step's wall time less the time inside acts on the compute stream, the critical path here)."""
    job = make_job(widths, batch, momentum, steps)
    result = sf.run(job, steps=steps, trace=True, backend="inprocess")
    assert result.trace is not None
    per_act: dict[str, float] = {}
    busy: dict[str, float] = {}
    for e in result.trace:
        per_act[e.name] = per_act.get(e.name, 0.0) + (e.end - e.start) / steps
        busy[e.stream] = busy.get(e.stream, 0.0) + (e.end - e.start) / steps
    step = result.seconds / steps
    print(
        f"breakdown, momentum={momentum}: {step * 1e3:.1f} ms/step, {len(result.trace) / steps:.0f} acts/step"
    )
    for name, t in sorted(per_act.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {t * 1e3:8.2f} ms  {name}")
    print("    busy per stream: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(busy.items())))
    print(f"    outside acts on the compute stream: {(step - busy.get('compute', 0.0)) * 1e3:.2f} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="MLP 256 -> 1024 -> 1024 -> 256, batch 64")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 4; 8 with --quick)")
    ap.add_argument("--repeat", type=int, default=None, help="repetitions (default 7; 5 with --quick)")
    ap.add_argument("--momentum", type=float, action="append", help="default: 0 and 0.9")
    ap.add_argument("--breakdown", action="store_true", help="and where sbpflow's step time goes (act trace)")
    args = ap.parse_args()
    widths, batch = ([256, 1024, 1024, 256], 64) if args.quick else ([1024, 4096, 4096, 1024], 128)
    steps = args.steps or (8 if args.quick else 4)
    repeat = args.repeat or (5 if args.quick else 7)
    print(
        f"MLP {' -> '.join(map(str, widths))}, batch {batch}, float32, 1 device, 1 BLAS thread, "
        f"{steps} steps x {repeat} repetitions (median)"
    )
    ratios = [bench(widths, batch, m, steps, repeat) for m in (args.momentum or [0.0, 0.9])]
    if args.breakdown:
        breakdown(widths, batch, (args.momentum or [0.9])[-1], steps)
    load = os.getloadavg()[0]
    print(f"worst ratio {max(ratios):.3f}, target <= {TARGET}")
    if load > (os.cpu_count() or 1) - 1:
        print(
            f"note: load average {load:.1f} on {os.cpu_count()} cores: other processes compete, wall times "
            "are noisy; the CPU-time ratio is the steadier figure"
        )


if __name__ == "__main__":
    main()
