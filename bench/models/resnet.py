"""ResNet-18 training samples/s on CPU: sbpflow on one rank against PyTorch eager, side by side.

    python bench/models/resnet.py          # 32x32 images, width 16, batch 32, 12 steps each, 3 repeats
    python bench/models/resnet.py --quick  # 16x16, width 8, batch 16: a smoke run
    python bench/models/resnet.py --clock cpu  # the process's CPU time a step, not wall: what a loaded
                                               # machine's preemption leaves alone
    python bench/models/resnet.py --trace      # and one traced run: compute acts a step and the compute
                                               # thread's CPU a step in and outside them (thread CPU)

The model is examples/resnet.py's ResNet-18 (3x3 stride-1 stem, 3x3 stride-2 max pool, 4 stages of 2
basic blocks, batch norm with batch statistics, global average pool, a linear head), softmax cross
entropy, SGD with momentum 0.9, float32, generated images. PyTorch (``torch==2.13.0``, the ``bench``
extra) runs the same architecture eagerly. Both run on one thread (BLAS pinned before numpy and torch
load; ``sf.run(threads=1)``, ``torch.set_num_threads(1)``). A step's time is the median gap between
consecutive steps after ``WARMUP`` steps (sbpflow: its ``on_step`` reports; torch: a timer around each
step). Both sides' images are made outside the timed steps (sbpflow's drawn before the run and served
from memory by an ArraySource, torch's by ``torch.randn`` before each timer starts); the sides alternate ``--repeat`` times and the medians of the repetitions are compared.
DDP over 2 workers is not measured here (bench/runtime/ddp.py does it for the MLP). A benchmark, not a test.
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
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sbpflow as sf  # noqa: E402
from bench._shared import load_example  # noqa: E402
from sbpflow.data.sources import ArraySource  # noqa: E402

# wall time, or the process's CPU time (sbpflow's in-process run and torch's steps on one thread each)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
WARMUP = 2


def example() -> ModuleType:
    return load_example("resnet")


def sbpflow_job(cfg: dict[str, Any], steps: int) -> Any:
    job = example().make_job(ranks=1, steps=steps, **cfg)
    assert job.data is not None
    # the batches drawn before the run and served from memory, as torch's are made outside its timer
    reads = [job.data.read(b) for b in range(steps)]
    arrays = {k: np.concatenate([r[k] for r in reads]) for k in reads[0]}
    return dataclasses.replace(job, data=ArraySource(batch_size=cfg["batch_size"], arrays=arrays))


def sbpflow_step_s(cfg: dict[str, Any], steps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    job = sbpflow_job(cfg, steps)
    marks: list[float] = []
    sf.run(job, backend="inprocess", threads=1, on_step=lambda m: marks.append(clock()))
    gaps = [b - a for a, b in zip(marks[WARMUP:], marks[WARMUP + 1 :], strict=False)]
    return statistics.median(gaps)


def traced_run(job: Any) -> list[Any]:
    """One traced run's acts, each event's start and end in its thread's CPU time (the trace's clock
    swapped for this run: the engine reads time.perf_counter when its threads start), so an event is the
    CPU its act took, not the wall time a loaded machine stretches."""
    wall, time.perf_counter = time.perf_counter, time.thread_time
    try:
        return list(sf.run(job, backend="inprocess", threads=1, trace=True).trace or [])
    finally:
        time.perf_counter = wall


def sbpflow_trace(make: Callable[[int], Any], steps: int, top: int = 8) -> None:
    """Acts a step and the compute thread's CPU a step outside them, from one traced run: the thread's own
    CPU clock between the starts of the loss kernel's acts ``WARMUP`` and ``steps - 1`` against the acts in it.
    ``make(steps)``: the job (any job with a cross_entropy loss: bench/models/gpt_step.py's too)."""
    traced_run(make(WARMUP + 1))  # numba's caches and the imports warm
    events = traced_run(make(steps))
    compute = sorted((e for e in events if e.stream == "compute"), key=lambda e: e.start)
    # steps bounded by one act a step late in the forward (variables' sources and updates run ahead)
    loss = next(e.actor for e in compute if "cross_entropy" in e.name and "grad" not in e.name)
    mark = {e.iteration: e.start for e in compute if e.actor == loss}
    n = steps - 1 - WARMUP
    measured = [e for e in compute if mark[WARMUP] <= e.start < mark[steps - 1]]
    in_acts, thread = sum(e.end - e.start for e in measured) / n, (mark[steps - 1] - mark[WARMUP]) / n
    per_act: dict[str, float] = {}
    for e in measured:
        per_act[e.name] = per_act.get(e.name, 0.0) + (e.end - e.start) / n
    acts, out = len(measured) / n, thread - in_acts
    print(
        f"trace: {acts:.0f} compute acts/step, compute thread {thread * 1e3:.1f} ms CPU a step, "
        f"{in_acts * 1e3:.1f} in acts: {out * 1e3:.2f} ms outside them, {out / acts * 1e6:.1f} us an act "
        f"(load {os.getloadavg()[0]:.1f})"
    )
    for name, t in sorted(per_act.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t * 1e3:7.2f} ms  {name}")


def torch_model(cfg: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, c_in: int, c: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c)
            self.down = (
                nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))
                if stride != 1 or c_in != c
                else None
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    w = cfg["width"]
    layers: list[nn.Module] = [
        nn.Conv2d(3, w, 3, 1, 1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    c = w
    for stage in range(4):
        for i in range(2):
            layers.append(Block(c, w * 2**stage, 2 if stage and not i else 1))
            c = w * 2**stage
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, cfg["classes"])]
    return nn.Sequential(*layers)


def torch_step_s(cfg: dict[str, Any], steps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    n, s = cfg["batch_size"], cfg["image_size"]
    gaps = []
    for step in range(steps):
        x, y = torch.randn(n, 3, s, s), torch.randint(0, cfg["classes"], (n,))  # as the generated source
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= WARMUP:
            gaps.append(clock() - t0)
    return statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: the process's CPU time")
    ap.add_argument(
        "--trace", action="store_true", help="also one traced run: acts a step, time outside acts"
    )
    args = ap.parse_args()
    cfg = {"depth": 18, "width": 16, "image_size": 32, "batch_size": 32, "classes": 10, "lr": 0.05}
    if args.quick:
        cfg.update(width=8, image_size=16, batch_size=16)
        args.steps, args.repeat = 6, 1
    ours, theirs = [], []
    for _ in range(args.repeat):
        ours.append(sbpflow_step_s(cfg, args.steps, CLOCKS[args.clock]))
        theirs.append(torch_step_s(cfg, args.steps, CLOCKS[args.clock]))
    a, b = statistics.median(ours), statistics.median(theirs)
    n = cfg["batch_size"]
    print(
        f"ResNet-18 {cfg}, 1 thread, {args.clock} time, median of {args.repeat} x {args.steps - WARMUP - 1}+ "
        f"steps, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':10} {'step':>10} {'samples/s':>10}")
    print(f"{'sbpflow':10} {a * 1e3:8.1f} ms {n / a:10.1f}")
    print(f"{'pytorch':10} {b * 1e3:8.1f} ms {n / b:10.1f}")
    print(f"ratio sbpflow/pytorch samples/s: {b / a:.2f}  (step time {a / b:.2f}x)")
    if args.trace:
        sbpflow_trace(lambda n: sbpflow_job(cfg, n), args.steps)


if __name__ == "__main__":
    main()
