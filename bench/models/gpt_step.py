"""A GPT training step on 1 rank in-process against the same model in PyTorch eager, side by side.

    python bench/models/gpt_step.py                 # the main job, then the GPT-small-shaped block (~3 min)
    python bench/models/gpt_step.py --quick         # the main job only, fewer steps (a smoke run, ~30 s)
    python bench/models/gpt_step.py --only small    # the GPT-small block only
    python bench/models/gpt_step.py --only ddp      # the main job on 2 Ray workers against PyTorch DDP (gloo)
    python bench/models/gpt_step.py --only memory   # RSS held during the steps, sbpflow against PyTorch
    python bench/models/gpt_step.py --only ddp --unbucketed
                                                    # and sbpflow with one all-reduce a gradient beside
    python bench/models/gpt_step.py --fusion        # any of these with JobConfig.fusion on
                                                    # (--grad-bucket-bytes N too)

Two models, each trained with AdamW (betas 0.9/0.95, weight decay 0.1), global-norm clipping to 1.0
and the warmup-cosine schedule, float32, one device, one BLAS / intra-op thread for both:

* ``main``: the README's main job, ``examples/charlm.py`` (GPT, 2 layers, 4 heads, width 64, seq 64,
  batch 16, vocabulary 128);
* ``small``: a GPT-small-shaped block (width 768, 12 heads, seq 256, batch 8; ``--small-layers``
  blocks, 1 by default so that a repetition stays in seconds on this machine).

sbpflow runs ``sf.run(job, backend="inprocess", threads=1)``; its step time (wall and process CPU time)
is the span of its loss reports (``on_step``) over the measured steps (warm-up, the engine's start-up
and the last ``DRAIN`` steps, which finish faster than the steady state, excluded); the trace costs
~0.3 us an act, so one more run with ``trace=True`` gives the per-op breakdown only. PyTorch runs the
same model written as nanoGPT writes it, with the attention spelled out (q k^T * scale, causal mask, softmax, @ v: the
ops sbpflow runs; no fused scaled_dot_product_attention), ``torch.optim.AdamW`` (its CPU default, the
for-loop implementation) and ``clip_grad_norm_``. The two alternate ``--repeat`` times; the medians are
compared. Then sbpflow's step is broken down by op type from the trace (time inside kernels, per step).

``ddp``: the main job data-parallel on 2 workers (batch 8 each): ``sf.run(job, backend="ray")`` on a local
Ray with a bounded object store, its step time from the span of the driver's step reports, against the
same model under ``DistributedDataParallel`` over gloo in 2 spawned processes, 1 thread each.
``memory``: each side in a fresh process, its libraries loaded first (``import torch``; numba's LLVM and
one cached loop for sbpflow); the RSS it holds during the measured steps above its RSS before the run
(peak), its private memory (RssAnon) likewise, its growth from the end of warm-up to the last step and
the process's whole-life peak; and sbpflow once more with numba loaded inside the run, as a first run
loads it (~85 MB of llvmlite's code pages and ~35 MB of LLVM's own memory, once a process).

BLAS threads are pinned to one before numpy is imported. This machine sets OPENBLAS_CORETYPE; run the
figures in bench/README.md with it unset for this command alone (see there). Benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy (here or by sbpflow) and torch are imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sbpflow as sf  # noqa: E402
from bench._ray_timing import run_timed  # noqa: E402
from bench._shared import blas_kernel  # noqa: E402
from sbpflow.control_plane.compiler import pipeline  # noqa: E402
from sbpflow.job import WarmupCosine  # noqa: E402

TARGET = 1.0


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    heads: int
    width: int
    seq_len: int
    batch: int
    vocab: int = 128  # the character corpus's vocabulary (charlm)


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Steps run after the measured ones and not measured: the engine starts a step's sources and forward while
# the last one's backward runs, so the run's last steps drain faster than the steady state (their loss
# reports came 10.5 and 0.1 ms after the ones before, against ~16.5 a step; --quick measured 2 of them in
# its 5 steps and read ~28 % fast, the full run ~7 %).
DRAIN = 2

# JobConfig fields set on every sbpflow job of this run (--fusion, --grad-bucket-bytes)
CONFIG: dict[str, Any] = {}


def make_job(s: Shape, steps: int, ranks: int = 1) -> sf.Job:
    """charlm's job (its data, its optimizer and schedule) at shape ``s`` on ``ranks`` ranks, with
    :data:`CONFIG`'s settings."""
    job = _example("charlm").make_job(
        ranks=ranks, layers=s.layers, heads=s.heads, width=s.width, seq_len=s.seq_len, batch_size=s.batch,
        steps=steps,
    )  # fmt: skip
    return dataclasses.replace(job, config=dataclasses.replace(job.config, **CONFIG))


# ---- sbpflow -------------------------------------------------------------------------------------------


@dataclass
class SbpflowRun:
    step_s: float
    cpu_s: float  # process CPU time per step (both streams' threads): what load on the machine leaves alone
    per_op: dict[str, float]  # op type -> seconds inside its kernels per step (traced runs only)
    acts_per_step: float
    losses: list[float]


def per_step(marks: list[tuple[float, float]], warmup: int, steps: int) -> tuple[float, float]:
    """Wall and CPU seconds per step from (perf_counter, process_time) marks taken after each step."""
    (w0, c0), (w1, c1) = marks[warmup - 1], marks[warmup + steps - 1]
    return (w1 - w0) / steps, (c1 - c0) / steps


def mark() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def op_types(job: sf.Job) -> dict[str, str]:
    """Op node name -> op type, from the compiled graph (the trace names acts by node)."""
    graph = pipeline.compile(job, lower="none").state.graph
    return {node.name: node.op_type for node in graph.ops}


def _kind(name: str, types: dict[str, str]) -> str:
    """An act's name (``kernel <node>``, ``optimizer <node>``, ``boxing ...``, ``source ...``) as the
    category of the breakdown: the op type for kernels and updates, the act kind otherwise."""
    kind, _, node = name.partition(" ")
    if kind in ("kernel", "optimizer"):
        return types.get(node) or re.sub(r"_\d+$", "", node.rsplit("/", 1)[-1])
    return f"({kind})"


def run_sbpflow(
    s: Shape, steps: int, warmup: int, types: dict[str, str] | None = None, trace: bool = False
) -> SbpflowRun:
    """Untraced: the step from the loss reports (wall and CPU). Traced: from the trace, with the per-op
    breakdown (the trace costs ~0.3 us an act, so the ratio is taken untraced)."""
    job = make_job(s, warmup + steps + DRAIN)
    types = op_types(job) if types is None else types
    marks: list[tuple[float, float]] = []
    result = sf.run(job, backend="inprocess", trace=trace, threads=1, on_step=lambda m: marks.append(mark()))
    step_s, cpu_s = per_step(marks, warmup, steps)
    if not trace:
        return SbpflowRun(step_s, cpu_s, {}, 0.0, list(result.losses))
    events = result.trace or []
    # Acts of one iteration spread over several steps (sources run ahead), so the step boundaries are
    # taken from one act that runs once per step: the loss's cross_entropy kernel.
    at = {e.iteration: e.start for e in events if _kind(e.name, types) == "cross_entropy"}
    t0, t1 = at[warmup - 1], at[warmup + steps - 1]
    measured = [e for e in events if t0 <= e.start < t1]
    per_op: dict[str, float] = {}
    for e in measured:
        k = _kind(e.name, types)
        per_op[k] = per_op.get(k, 0.0) + (e.end - e.start) / steps
    return SbpflowRun((t1 - t0) / steps, cpu_s, per_op, len(measured) / steps, list(result.losses))


# ---- PyTorch eager ---------------------------------------------------------------------------------------


def torch_model(s: Shape) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(s.width, 3 * s.width), nn.Linear(s.width, s.width)
            self.register_buffer("mask", torch.ones(s.seq_len, s.seq_len, dtype=torch.bool).triu(1))

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            h = s.heads
            qkv = self.c_attn(x).view(b, t, h, 3, d // h)  # sbpflow's layout: heads leading
            q, k, v = (z.squeeze(3).transpose(1, 2) for z in qkv.split(1, dim=3))  # [B, H, T, Dh]
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
            att = F.softmax(att.masked_fill(self.mask[:t, :t], -1e30), dim=-1)
            return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(s.width), nn.LayerNorm(s.width)
            self.attn = Attention()
            self.fc, self.proj = nn.Linear(s.width, 4 * s.width), nn.Linear(4 * s.width, s.width)

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.ln_1(x))
            return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(s.vocab, s.width), nn.Embedding(s.seq_len, s.width)
            self.blocks = nn.ModuleList(Block() for _ in range(s.layers))
            self.ln_f = nn.LayerNorm(s.width)
            self.lm_head = nn.Linear(s.width, s.vocab, bias=False)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, 0.0, 0.02)

        def forward(self, idx: Any, targets: Any) -> Any:
            x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, s.vocab), targets.reshape(-1))

    return GPT()


def run_torch(s: Shape, steps: int, warmup: int, on_step: Any = None) -> tuple[float, float, list[float]]:
    """Wall and CPU seconds per step, and the losses."""
    import torch

    torch.manual_seed(0)
    model = torch_model(s)
    total = warmup + steps
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    factor = WarmupCosine(10, total, 0.1).factor
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, s.vocab, (s.batch, s.seq_len + 1), generator=gen) for _ in range(4)]
    losses, marks = [], []
    for i in range(total):
        losses.append(torch_step(model, opt, sched, batches[i % len(batches)]))
        marks.append(mark())
        if on_step is not None:
            on_step()
    return (*per_step(marks, warmup, steps), losses)


def torch_step(model: Any, opt: Any, sched: Any, data: Any) -> float:
    """One PyTorch training step as the main job's (AdamW, clip at 1.0, the schedule); its loss."""
    import torch

    loss = model(data[:, :-1], data[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.item())


# ---- 2 workers: sbpflow on Ray against PyTorch DDP over gloo ---------------------------------------------

WORKERS = 2


def run_sbpflow_ray(s: Shape, steps: int, warmup: int) -> tuple[float, float]:
    """The main job on ``WORKERS`` Ray workers: seconds per step and CPU seconds per step per worker,
    from the workers' side (bench/_ray_timing.py)."""
    return run_timed(make_job(s, warmup + steps, ranks=WORKERS), warmup, steps, WORKERS)


def _ddp_worker(rank: int, port: int, s: Shape, steps: int, warmup: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch_model(s))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(10, warmup + steps, 0.1).factor)
    gen = torch.Generator().manual_seed(rank)
    per = s.batch // WORKERS
    batches = [torch.randint(0, s.vocab, (per, s.seq_len + 1), generator=gen) for _ in range(4)]
    marks = []
    for i in range(warmup + steps):
        torch_step(model, opt, sched, batches[i % len(batches)])
        marks.append((time.perf_counter(), _process_cpu()))
    dist.destroy_process_group()
    (w0, c0), (w1, c1) = marks[warmup - 1], marks[-1]
    out.put((rank, (w1 - w0) / steps, (c1 - c0) / steps))


def _process_cpu() -> float:
    """This process's CPU seconds, all its threads (gloo's included)."""
    t = os.times()
    return t.user + t.system


def run_ddp(s: Shape, steps: int, warmup: int) -> tuple[float, float]:
    """Rank 0's seconds per step and the workers' mean CPU seconds per step."""
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_ddp_worker, args=(r, port, s, steps, warmup, out)) for r in range(WORKERS)]
    for proc in procs:
        proc.start()
    got = [out.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join(60)
    wall = next(w for r, w, _ in got if r == 0)
    return wall, statistics.mean(c for _, _, c in got)


def _spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.1f} ms/step (range {min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def bench_ddp(s: Shape, steps: int, warmup: int, repeat: int, unbucketed: bool = False) -> float:
    """sbpflow on Ray against DDP, alternating; with ``unbucketed`` also sbpflow with one all-reduce a
    gradient (``grad_bucket_bytes=0``) in the same rounds: the bucketing's own effect, side by side. Wall
    time per step (the target) and CPU time per step per worker (what a loaded machine leaves alone)."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(
        num_cpus=WORKERS, object_store_memory=256 * 1024 * 1024, include_dashboard=False,
        _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False,
    )  # fmt: skip
    print(
        f"\nddp: the main job on {WORKERS} workers x batch {s.batch // WORKERS}; {warmup} + {steps} steps x {repeat}; "
        f"sbpflow config {CONFIG or 'as the job has it'}"
    )
    variants = {"sbpflow (ray)": dict(CONFIG)}
    if unbucketed:
        variants["sbpflow unbucketed"] = {**CONFIG, "grad_bucket_bytes": 0}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in (*variants, "torch DDP")}
    try:
        for _ in range(repeat):
            for name, config in variants.items():
                saved = dict(CONFIG)
                CONFIG.clear()
                CONFIG.update(config)
                try:
                    got[name].append(run_sbpflow_ray(s, steps, warmup))
                finally:
                    CONFIG.clear()
                    CONFIG.update(saved)
            got["torch DDP"].append(run_ddp(s, steps, warmup))
            print(
                "    "
                + "   ".join(
                    f"{k} {v[-1][0] * 1e3:7.1f} ms/step (CPU {v[-1][1] * 1e3:5.1f})" for k, v in got.items()
                )
                + f"   load {os.getloadavg()[0]:.1f}"
            )
    finally:
        ray.shutdown()
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in got.items()
    }
    for name, xs in got.items():
        print(f"  {name}: {_spread([w for w, _ in xs])}; CPU per worker {med[name][1] * 1e3:.1f} ms/step")
    pt = med["torch DDP"]
    ratio = med["sbpflow (ray)"][0] / pt[0]
    per_round = [a[0] / b[0] for a, b in zip(got["sbpflow (ray)"], got["torch DDP"], strict=True)]
    print(
        f"  ratio sbpflow / DDP {ratio:.2f} (target <= {TARGET}) {'MET' if ratio <= TARGET else 'NOT MET'}; per "
        f"round {', '.join(f'{r:.2f}' for r in per_round)}; CPU time ratio {med['sbpflow (ray)'][1] / pt[1]:.2f}"
        + (
            f"; unbucketed / DDP {med['sbpflow unbucketed'][0] / pt[0]:.2f} (CPU {med['sbpflow unbucketed'][1] / pt[1]:.2f})"
            if unbucketed
            else ""
        )
    )
    return ratio


# ---- memory: the RSS held during the steps, each side in a fresh process ----------------------------------


def status_mb() -> dict[str, float]:
    """This process's memory from /proc/self/status, in MB: VmRSS (resident now), VmHWM (its peak resident
    set since it started), RssAnon (private memory: the heap, arrays) and RssFile (mapped files: the code
    of the shared libraries touched, clean pages the kernel may drop and processes share)."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                got[key] = int(value.split()[0]) / 1024
    return got


def load_numba_kernels() -> None:
    """Load what sbpflow's kernels load on their first call (numba, llvmlite's LLVM, one cached row loop),
    as ``import torch`` loads torch's before its base is taken: the held figure is then the run's own."""
    import numpy as np

    from sbpflow.ops.kernels import rows_jit

    x = np.ones((2, 4), np.float32)
    rows_jit.softmax_rows(x, np.empty_like(x))


def probe_memory(side: str, s: Shape, steps: int, warmup: int, libraries_first: bool) -> dict[str, float]:
    """Memory (MB) during the measured steps: the peak RSS and RssAnon above the process's own before the
    run, and the process's peak RSS over its whole life (VmHWM: imports, compile and steps)."""
    gc.collect()
    samples: list[dict[str, float]] = []
    if side == "sbpflow":
        job = make_job(s, warmup + steps)
        if libraries_first:
            load_numba_kernels()
        base = status_mb()
        sf.run(job, backend="inprocess", threads=1, on_step=lambda m: samples.append(status_mb()))
    else:
        import torch

        torch.set_num_threads(1)
        base = status_mb()
        run_torch(s, steps, warmup, on_step=lambda: samples.append(status_mb()))
    held = samples[warmup:]
    return {
        "peak_mb": max(m["VmRSS"] for m in held) - base["VmRSS"],
        "anon_mb": max(m["RssAnon"] for m in held) - base["RssAnon"],
        "growth_mb": held[-1]["VmRSS"] - held[0]["VmRSS"],
        "process_mb": status_mb()["VmHWM"],
    }


def _probe(side: str, steps: int, warmup: int, libraries_first: bool) -> dict[str, float]:
    cmd = [
        sys.executable,
        __file__,
        "--probe-memory",
        side,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        *(["--libraries-first"] if libraries_first else []),
        *(["--fusion"] if CONFIG.get("fusion") else []),
        *([f"--grad-bucket-bytes={CONFIG['grad_bucket_bytes']}"] if "grad_bucket_bytes" in CONFIG else []),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def bench_memory(s: Shape, steps: int, warmup: int) -> float:
    """Each side in a fresh process. The target's figure is the peak RSS held during the steps above the
    RSS before the run, each side's libraries loaded first; the process's whole-life peak and the held
    figure with numba loaded inside the run (as a user's first run loads it) are printed beside it."""
    torch_ = _probe("torch", steps, warmup, libraries_first=True)
    first = _probe("sbpflow", steps, warmup, libraries_first=True)
    lazy = _probe("sbpflow", steps, warmup, libraries_first=False)
    print(
        f"\nmemory: the main job, MB held during {steps} steps after {warmup} warm-up above the process's own"
        " before the run (RSS, and RssAnon: private memory), and the process's whole-life peak RSS"
    )
    rows = (("sbpflow", first), ("torch", torch_), ("sbpflow, numba loaded in the run", lazy))
    for name, m in rows:
        print(
            f"    {name:32s} held RSS {m['peak_mb']:7.1f}  RssAnon {m['anon_mb']:7.1f}"
            f"  growth {m['growth_mb']:+6.1f}  process peak {m['process_mb']:7.1f}"
        )
    ratio = first["peak_mb"] / max(torch_["peak_mb"], 1e-9)
    others = {
        "RssAnon held": first["anon_mb"] / max(torch_["anon_mb"], 1e-9),
        "process peak": first["process_mb"] / max(torch_["process_mb"], 1e-9),
        "held with numba loaded in the run": lazy["peak_mb"] / max(torch_["peak_mb"], 1e-9),
    }
    print(
        f"  held RSS ratio {ratio:.2f} (target <= 1.2) {'MET' if ratio <= 1.2 else 'NOT MET'}; "
        + ", ".join(f"{k} {v:.2f}" for k, v in others.items())
    )
    return ratio


# ---- side by side ----------------------------------------------------------------------------------------


def bench(s: Shape, steps: int, warmup: int, repeat: int, top: int) -> float:
    import torch

    torch.set_num_threads(1)
    print(
        f"\n{s.name}: GPT {s.layers} layer(s), {s.heads} heads, width {s.width}, seq {s.seq_len}, batch "
        f"{s.batch}, vocab {s.vocab}; {warmup} warm-up + {steps} measured steps x {repeat} repetitions"
    )
    types = op_types(make_job(s, warmup + steps))
    sb: list[SbpflowRun] = []
    pt: list[tuple[float, float]] = []
    for _ in range(repeat):
        gc.collect()
        sb.append(run_sbpflow(s, steps, warmup, types))
        gc.collect()
        pt.append(run_torch(s, steps, warmup)[:2])
        print(
            f"    sbpflow {sb[-1].step_s * 1e3:8.1f} ms/step (CPU {sb[-1].cpu_s * 1e3:6.1f})   "
            f"torch {pt[-1][0] * 1e3:8.1f} ms/step (CPU {pt[-1][1] * 1e3:6.1f})"
        )
    sb_s, pt_s = statistics.median(r.step_s for r in sb), statistics.median(t for t, _ in pt)
    cpu_ratio = statistics.median(r.cpu_s for r in sb) / statistics.median(c for _, c in pt)
    ratio = sb_s / pt_s
    print(
        f"  median: sbpflow {sb_s * 1e3:.1f} ms/step, PyTorch eager {pt_s * 1e3:.1f} ms/step: "
        f"ratio {ratio:.2f} (target <= {TARGET}) {'MET' if ratio <= TARGET else 'NOT MET'}; CPU time ratio "
        f"{cpu_ratio:.2f}"
    )
    print(f"  first losses: sbpflow {sb[0].losses[0]:.3f} (ln V = {math.log(s.vocab):.3f})")
    traced = run_sbpflow(s, steps, warmup, types, trace=True)
    per_op, tr_s = traced.per_op, traced.step_s
    busy = sum(per_op.values())
    print(
        f"  sbpflow per-op breakdown (one traced run: {tr_s * 1e3:.1f} ms/step; time inside acts, ms/step; "
        f"{traced.acts_per_step:.0f} acts/step, {busy * 1e3:.1f} ms in acts, {(tr_s - busy) * 1e3:.1f} ms "
        "outside them):"
    )
    for k, t in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {t * 1e3:8.2f} ms  {100 * t / tr_s:5.1f} %  {k}")
    return ratio


SHAPES = {
    "main": Shape("main (examples/charlm.py)", layers=2, heads=4, width=64, seq_len=64, batch=16),
    "small": Shape("GPT-small block", layers=1, heads=12, width=768, seq_len=256, batch=8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the main job only, 5 steps x 3 repetitions")
    ap.add_argument(
        "--only", choices=[*sorted(SHAPES), "ddp", "memory"], action="append", help="default: all"
    )
    ap.add_argument("--probe-memory", choices=("sbpflow", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--libraries-first", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--small-layers", type=int, default=1)
    ap.add_argument("--top", type=int, default=14, help="op types shown in the breakdown")
    ap.add_argument("--fusion", action="store_true", help="JobConfig.fusion: fuse elementwise chains")
    ap.add_argument(
        "--grad-bucket-bytes",
        type=int,
        default=None,
        help="JobConfig.grad_bucket_bytes (0 = one all-reduce a gradient)",
    )
    ap.add_argument("--unbucketed", action="store_true", help="ddp: also sbpflow with grad_bucket_bytes=0")
    args = ap.parse_args()
    CONFIG.update({"fusion": True} if args.fusion else {})
    if args.grad_bucket_bytes is not None:
        CONFIG["grad_bucket_bytes"] = args.grad_bucket_bytes
    if args.probe_memory:
        print(
            json.dumps(
                probe_memory(args.probe_memory, SHAPES["main"], args.steps, args.warmup, args.libraries_first)
            )
        )
        return
    names = args.only or (["main"] if args.quick else ["main", "small", "ddp", "memory"])
    print(
        f"1 thread (OMP/OPENBLAS/MKL_NUM_THREADS=1, torch.set_num_threads(1)); OPENBLAS_CORETYPE="
        f"{os.environ.get('OPENBLAS_CORETYPE', '(unset)')} ({blas_kernel()}); load {os.getloadavg()[0]:.1f}"
    )
    ratios = {}
    for name in names:
        if name in ("ddp", "memory"):
            steps, warmup = (5, 3) if args.quick else (20, 5)
            if name == "ddp":
                ratios[name] = bench_ddp(SHAPES["main"], steps, warmup, args.repeat or 3, args.unbucketed)
            else:
                ratios[name] = bench_memory(SHAPES["main"], steps, warmup)
            continue
        s = SHAPES[name]
        if name == "small":
            s = Shape(s.name, args.small_layers, s.heads, s.width, s.seq_len, s.batch)
        quick = args.quick or name == "small"
        steps, warmup = (5, 3) if quick else (20, 5)
        ratios[name] = bench(s, steps, warmup, args.repeat or 3, args.top)
    print(
        "\nratios: "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
        + " (targets: memory <= 1.2, else <= 1.0)"
    )


if __name__ == "__main__":
    main()
