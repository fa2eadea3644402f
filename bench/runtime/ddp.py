"""Data-parallel training on Ray worker processes against PyTorch DDP (gloo), side by side.

    python bench/runtime/ddp.py          # the issue's MLP, 3 alternating repetitions (~3 min on 2 cores)
    python bench/runtime/ddp.py --quick  # a small MLP, a smoke run

The model: an MLP 1024 -> 4096 -> 4096 -> 1024 (ReLU), MSE loss, float32, SGD (lr 0.01, no momentum),
2 workers x batch 64 (global batch 128), one BLAS thread per worker. sbpflow runs it with ``sf.run(job,
backend="ray")`` on 2 Ray worker processes over the CPU data plane (shared memory); PyTorch runs the same
model with DistributedDataParallel over gloo in 2 processes (``torch==2.13.0``, the ``bench`` extra),
and once more inside ``no_sync()``: the same step without any gradient communication, the floor a
data-parallel step could reach. Per-step times are means over the steps after a warm-up; the three
are run alternately ``--repeat`` times and the medians of the repetitions compared.

Targets (issue 5): sbpflow / DDP <= 0.9, from overlapping the gradient all-reduce with the backward pass.
This is a benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy/torch are imported here or in the workers

import argparse  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sbpflow as sf  # noqa: E402
from bench._ray_timing import run_timed  # noqa: E402
from bench.runtime.overhead import Regression, Train  # noqa: E402
from sbpflow.data.sources import ArraySource  # noqa: E402
from sbpflow.sbp import S  # noqa: E402

TARGET = 0.9
LR = 0.01
WORKERS = 2


def make_job(widths: list[int], batch: int, steps: int, batches: int = 4) -> sf.Job:
    """The MLP data-parallel over ``WORKERS`` ranks; ``batch`` samples per rank."""
    rng = np.random.default_rng(0)
    n = batch * WORKERS * batches
    data = ArraySource(
        batch_size=batch * WORKERS,
        arrays={
            "x": rng.standard_normal((n, widths[0]), dtype=np.float32),
            "y": rng.standard_normal((n, widths[-1]), dtype=np.float32),
        },
    )
    graph = Train(Regression(widths), 0.0, steps)
    where = sf.placement("cpu", ranks=list(range(WORKERS)))
    sf.nn.parallel.data_parallel(graph.model, where)
    return graph.trace(data, placement=where, input_sbp=(S(0),))


def run_sbpflow(widths: list[int], batch: int, steps: int, warmup: int) -> float:
    """Seconds per step from the workers' own step report times (bench/_ray_timing.py: workers batch
    their reports, so when they reach the driver says nothing)."""
    return run_timed(make_job(widths, batch, steps + warmup), warmup, steps, WORKERS)[0]


# ---- PyTorch DDP ---------------------------------------------------------------------------------------


def _torch_worker(
    rank: int, port: int, widths: list[int], batch: int, steps: int, warmup: int, no_sync: bool, out: Any
) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.randn(batch, widths[0])
    y = torch.randn(batch, widths[-1])
    times = []
    for step in range(steps + warmup):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if no_sync:
            with model.no_sync():
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
        else:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 0:
        out.put(sum(times) / len(times))


def run_ddp(widths: list[int], batch: int, steps: int, warmup: int, no_sync: bool) -> float:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_torch_worker, args=(r, port, widths, batch, steps, warmup, no_sync, out))
        for r in range(WORKERS)
    ]
    for p in procs:
        p.start()
    result = float(out.get(timeout=1800))
    for p in procs:
        p.join(60)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small MLP (smoke run)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    widths = [256, 512, 512, 256] if args.quick else [1024, 4096, 4096, 1024]
    batch, warmup = 64, 2
    rows: dict[str, list[float]] = {"sbpflow": [], "ddp": [], "ddp_no_sync": []}
    for rep in range(args.repeat):
        rows["ddp"].append(run_ddp(widths, batch, args.steps, warmup, no_sync=False))
        rows["sbpflow"].append(run_sbpflow(widths, batch, args.steps, warmup))
        rows["ddp_no_sync"].append(run_ddp(widths, batch, args.steps, warmup, no_sync=True))
        print(
            f"repetition {rep + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in rows.items()),
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nMLP {'->'.join(map(str, widths))}, {WORKERS} workers x batch {batch}, SGD, 1 BLAS thread each")
    for k, v in med.items():
        print(f"  {k:12s} {v * 1e3:8.1f} ms/step (median of {args.repeat})")
    ratio = med["sbpflow"] / med["ddp"]
    print(
        f"  sbpflow / DDP          {ratio:.3f}  (target <= {TARGET}) {'MET' if ratio <= TARGET else 'NOT MET'}"
    )
    print(
        f"  sbpflow / DDP no_sync  {med['sbpflow'] / med['ddp_no_sync']:.3f}  (1.0 = communication fully hidden)"
    )


if __name__ == "__main__":
    main()
