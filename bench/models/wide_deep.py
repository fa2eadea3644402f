"""Wide & Deep training samples/s on CPU: sbpflow against PyTorch with a replicated embedding, side by side.

    python bench/models/wide_deep.py          # Criteo-shaped: 13 dense, 26 fields x 2000 ids, dim 16,
                                              # batch 512, 20 steps
    python bench/models/wide_deep.py --quick  # a smoke run

The model is examples/wide_deep.py's (wide: a [V, 1] table and a linear term; deep: a [V, 16] table,
a 2-layer ReLU tower; BCE with logits; Adam, no weight decay; float32). sbpflow runs it on one rank
and on 2 in-process ranks with both tables split by rows S(0) (vocabulary parallel, the dense tower
data parallel), one thread per rank. PyTorch (``torch==2.13.0``, the ``bench`` extra) runs the same
model eagerly in one process on one thread, every table whole (replicated: what DDP would hold on every
rank). Both read the same pre-generated click batches from memory (sbpflow through an ArraySource), so
the data generator is not timed. A step's time after ``WARMUP`` steps is, for sbpflow, the slope of a
least-squares line through its ``on_step`` reports' times against their steps, which holds where reports
come in bursts: before the loss fetch acted first among the ready acts, one rank's came four at a time
(within ~0.3 ms, then ~37 ms to the next four), and the median gap between consecutive reports, used
then, read 0.1-0.2 ms a step (a "ratio" of 80-160); for torch, the median of a timer around each step. The sides alternate ``--repeat`` times and the medians of the
repetitions are compared. A benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy/torch are imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sbpflow as sf  # noqa: E402
from bench._shared import load_example  # noqa: E402
from sbpflow.data.sources import ArraySource  # noqa: E402

WARMUP = 2
MIN_STEPS = WARMUP + 12  # after the warm-up, 12 reports: three bursts of four, were they to come so


def example() -> ModuleType:
    return load_example("wide_deep")


def batches(job: sf.Job, steps: int) -> dict[str, np.ndarray]:
    assert job.data is not None
    reads = [job.data.read(b) for b in range(steps)]
    return {k: np.concatenate([r[k] for r in reads]) for k in reads[0]}


def sbpflow_step_s(cfg: dict[str, Any], ranks: int, steps: int, data: dict[str, np.ndarray]) -> float:
    job = example().make_job(ranks=ranks, steps=steps, **cfg)
    job = dataclasses.replace(job, data=ArraySource(batch_size=cfg["batch_size"], arrays=data))
    marks: list[float] = []
    sf.run(job, backend="inprocess", threads=1, on_step=lambda m: marks.append(time.perf_counter()))
    times = np.asarray(marks[WARMUP:])
    return float(np.polyfit(np.arange(len(times)), times, 1)[0])  # bursts of reports: the staircase's slope


def torch_step_s(cfg: dict[str, Any], steps: int, data: dict[str, np.ndarray]) -> float:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows, f, d = cfg["fields"] * cfg["vocab"], cfg["fields"], cfg["dim"]
    wide, deep = nn.Embedding(rows, 1), nn.Embedding(rows, d)  # whole tables: replicated
    wide_dense = nn.Linear(cfg["dense"], 1)
    sizes = [f * d + cfg["dense"], *cfg["hidden"], 1]
    tower_layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        tower_layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    tower = nn.Sequential(*tower_layers)
    params = [*wide.parameters(), *deep.parameters(), *wide_dense.parameters(), *tower.parameters()]
    opt = torch.optim.Adam(params, lr=cfg["lr"])
    n = cfg["batch_size"]
    gaps = []
    for step in range(steps):
        at = slice(step * n, (step + 1) * n)
        x, ids, y = (torch.from_numpy(data[k][at]) for k in ("dense", "ids", "label"))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logit = wide(ids).reshape(n, f).sum(1) + wide_dense(x).reshape(n)
        logit = logit + tower(torch.cat([deep(ids).reshape(n, f * d), x], 1)).reshape(n)
        nn.functional.binary_cross_entropy_with_logits(logit, y).backward()
        opt.step()
        if step >= WARMUP:
            gaps.append(time.perf_counter() - t0)
    return statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=20, help=f"at least {MIN_STEPS}")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cfg: dict[str, Any] = {
        "dense": 13,
        "fields": 26,
        "vocab": 2000,
        "dim": 16,
        "hidden": (256, 128),
        "batch_size": 512,
        "lr": 1e-3,
    }
    if args.quick:
        cfg.update(fields=8, vocab=200, hidden=(64, 32), batch_size=128)
        args.steps, args.repeat = MIN_STEPS, 1
    if args.steps < MIN_STEPS:
        ap.error(
            f"--steps {args.steps}: give {MIN_STEPS} or more, so the slope spans three bursts of reports"
        )
    data = batches(example().make_job(ranks=1, steps=args.steps, **cfg), args.steps)
    runs: dict[str, list[float]] = {"sbpflow 1 rank": [], "sbpflow 2 ranks S(0)": [], "pytorch": []}
    for _ in range(args.repeat):
        runs["sbpflow 1 rank"].append(sbpflow_step_s(cfg, 1, args.steps, data))
        runs["sbpflow 2 ranks S(0)"].append(sbpflow_step_s(cfg, 2, args.steps, data))
        runs["pytorch"].append(torch_step_s(cfg, args.steps, data))
    n, med = cfg["batch_size"], {k: statistics.median(v) for k, v in runs.items()}
    print(f"Wide & Deep {cfg}, 1 thread a rank, median of {args.repeat} x {args.steps - WARMUP - 1}+ steps")
    print(f"{'':22} {'step':>10} {'samples/s':>10}")
    for k, s in med.items():
        print(f"{k:22} {s * 1e3:8.1f} ms {n / s:10.1f}")
    for k in ("sbpflow 1 rank", "sbpflow 2 ranks S(0)"):
        print(f"ratio {k} / pytorch samples/s: {med['pytorch'] / med[k]:.2f}")


if __name__ == "__main__":
    main()
