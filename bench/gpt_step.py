"""A GPT training step on 1 rank in-process against the same model in PyTorch eager, side by side.

    python bench/gpt_step.py                 # the main job, then the GPT-small-shaped block (~3 min)
    python bench/gpt_step.py --quick         # the main job only, fewer steps (a smoke run, ~30 s)
    python bench/gpt_step.py --only small    # the GPT-small block only

Two models, each trained with AdamW (betas 0.9/0.95, weight decay 0.1), global-norm clipping to 1.0
and the warmup-cosine schedule, float32, one device, one BLAS / intra-op thread for both:

* ``main``: the README's main job, ``examples/charlm.py`` (GPT, 2 layers, 4 heads, width 64, seq 64,
  batch 16, vocabulary 128);
* ``small``: a GPT-small-shaped block (width 768, 12 heads, seq 256, batch 8; ``--small-layers``
  blocks, 1 by default so that a repetition stays in seconds on this machine).

sbpflow runs ``sf.run(job, backend="inprocess", trace=True)``; its step time is taken from the act
trace: the span between the loss kernels (cross_entropy, one act per step) of the last warm-up step and
of the last step, over the steps between (warm-up and the engine's start-up excluded). PyTorch runs the same model written
as nanoGPT writes it, with the attention spelled out (q k^T * scale, causal mask, softmax, @ v: the
ops sbpflow runs; no fused scaled_dot_product_attention), ``torch.optim.AdamW`` (its CPU default, the
for-loop implementation) and ``clip_grad_norm_``. The two alternate ``--repeat`` times; the medians are
compared. Then sbpflow's step is broken down by op type from the trace (time inside kernels, per step).

BLAS threads are pinned to one before numpy is imported. This machine sets OPENBLAS_CORETYPE; run the
figures in bench/README.md with it unset for this command alone (see there). Benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy (here or by sbpflow) and torch are imported

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sbpflow as sf  # noqa: E402
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


def make_job(s: Shape, steps: int) -> sf.Job:
    """charlm's job (its data, its optimizer and schedule) at shape ``s`` on one rank."""
    return _example("charlm").make_job(
        ranks=1, layers=s.layers, heads=s.heads, width=s.width, seq_len=s.seq_len, batch_size=s.batch,
        steps=steps,
    )  # fmt: skip


# ---- sbpflow -------------------------------------------------------------------------------------------


@dataclass
class SbpflowRun:
    step_s: float
    per_op: dict[str, float]  # op type -> seconds inside its kernels per step
    acts_per_step: float
    losses: list[float]


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


def run_sbpflow(s: Shape, steps: int, warmup: int, types: dict[str, str] | None = None) -> SbpflowRun:
    job = make_job(s, warmup + steps)
    types = op_types(job) if types is None else types
    result = sf.run(job, backend="inprocess", trace=True)
    trace = result.trace or []
    # Acts of one iteration spread over several steps (sources run ahead), so the step boundaries are
    # taken from one act that runs once per step: the loss's cross_entropy kernel.
    mark = {e.iteration: e.start for e in trace if _kind(e.name, types) == "cross_entropy"}
    t0, t1 = mark[warmup - 1], mark[warmup + steps - 1]
    step_s = (t1 - t0) / steps
    measured = [e for e in trace if t0 <= e.start < t1]
    per_op: dict[str, float] = {}
    for e in measured:
        k = _kind(e.name, types)
        per_op[k] = per_op.get(k, 0.0) + (e.end - e.start) / steps
    return SbpflowRun(step_s, per_op, len(measured) / steps, list(result.losses))


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


def run_torch(s: Shape, steps: int, warmup: int) -> tuple[float, list[float]]:
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
        data = batches[i % len(batches)]
        loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        marks.append(time.perf_counter())
    return (marks[-1] - marks[warmup - 1]) / steps, losses


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
    pt: list[float] = []
    for _ in range(repeat):
        gc.collect()
        sb.append(run_sbpflow(s, steps, warmup, types))
        gc.collect()
        pt.append(run_torch(s, steps, warmup)[0])
        print(f"    sbpflow {sb[-1].step_s * 1e3:8.1f} ms/step   torch {pt[-1] * 1e3:8.1f} ms/step")
    sb_s, pt_s = statistics.median(r.step_s for r in sb), statistics.median(pt)
    ratio = sb_s / pt_s
    print(
        f"  median: sbpflow {sb_s * 1e3:.1f} ms/step, PyTorch eager {pt_s * 1e3:.1f} ms/step: "
        f"ratio {ratio:.2f} (target <= {TARGET}) {'MET' if ratio <= TARGET else 'NOT MET'}"
    )
    print(f"  first losses: sbpflow {sb[0].losses[0]:.3f} (ln V = {math.log(s.vocab):.3f})")
    per_op = {k: statistics.median(r.per_op.get(k, 0.0) for r in sb) for k in sb[0].per_op}
    busy = sum(per_op.values())
    print(
        f"  sbpflow per-op breakdown (time inside acts, ms/step; {sb[0].acts_per_step:.0f} acts/step, "
        f"{busy * 1e3:.1f} ms in acts, {(sb_s - busy) * 1e3:.1f} ms outside them):"
    )
    for k, t in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {t * 1e3:8.2f} ms  {100 * t / sb_s:5.1f} %  {k}")
    return ratio


SHAPES = {
    "main": Shape("main (examples/charlm.py)", layers=2, heads=4, width=64, seq_len=64, batch=16),
    "small": Shape("GPT-small block", layers=1, heads=12, width=768, seq_len=256, batch=8),
}


def blas_kernel() -> str:
    """numpy's OpenBLAS core (threadpoolctl, where installed): OPENBLAS_CORETYPE picks an older one."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed"
    import numpy

    numpy.ones((2, 2)) @ numpy.ones((2, 2))  # numpy's BLAS is loaded
    return ", ".join(
        f"{i.get('internal_api')} {i.get('architecture')} x{i.get('num_threads')}"
        for i in threadpool_info()
        if i.get("user_api") == "blas"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the main job only, 5 steps x 3 repetitions")
    ap.add_argument("--only", choices=sorted(SHAPES), action="append", help="default: both")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--small-layers", type=int, default=1)
    ap.add_argument("--top", type=int, default=14, help="op types shown in the breakdown")
    args = ap.parse_args()
    names = args.only or (["main"] if args.quick else ["main", "small"])
    print(
        f"1 thread (OMP/OPENBLAS/MKL_NUM_THREADS=1, torch.set_num_threads(1)); OPENBLAS_CORETYPE="
        f"{os.environ.get('OPENBLAS_CORETYPE', '(unset)')} ({blas_kernel()}); load {os.getloadavg()[0]:.1f}"
    )
    ratios = {}
    for name in names:
        s = SHAPES[name]
        if name == "small":
            s = Shape(s.name, args.small_layers, s.heads, s.width, s.seq_len, s.batch)
        quick = args.quick or name == "small"
        steps, warmup = (5, 3) if quick else (20, 5)
        ratios[name] = bench(s, steps, warmup, args.repeat or 3, args.top)
    print("\nratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()) + f" (target <= {TARGET})")


if __name__ == "__main__":
    main()
