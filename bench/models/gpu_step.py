"""A GPT-small training step on one GPU, sbpflow (kernels on cupy) against PyTorch on the same GPU.

    python bench/models/gpu_step.py                  # GPT-small, bf16 and fp32, on the GPU (a few minutes)
    python bench/models/gpu_step.py --json out.json  # the figures as JSON too
    python bench/models/gpu_step.py --quick          # fewer steps
    python bench/models/gpu_step.py --cpu-smoke      # a tiny GPT on the CPU: the same code path, no GPU

GPT-small: 12 layers, 12 heads, width 768, seq 1024, batch 8, vocabulary 50304 (GPT-2's, padded),
trained with AdamW (betas 0.9/0.95, weight decay 0.1), global-norm clipping to 1.0 and the warmup-cosine
schedule, each precision in turn:

* sbpflow: ``examples/gpt.py``'s job with ``device="cuda"``, ``ranks=1`` and the precision set
  (``bf16``: bf16 compute with fp32 master weights), run by ``sf.run(job, backend="inprocess")``; its step
  time is the span of its loss reports over the measured steps (warm-up excluded);
* PyTorch eager: ``bench/models/gpt_step.py``'s model (nanoGPT's, attention spelled out as sbpflow runs it) on
  the same GPU, ``torch.autocast(bfloat16)`` for bf16, ``torch.optim.AdamW``, ``clip_grad_norm_``,
  ``loss.item()`` each step as sbpflow's loss report does;
* PyTorch ``torch.compile`` of that model, where it compiles (an error is reported, not fatal).

Achieved TFLOP/s counts 6 x (matmul parameters) + 12 x layers x seq x width per token; the bf16 GEMM peak
is measured in the same run (an 8192^3 bf16 matmul in PyTorch). Targets (issue 18): sbpflow's step at
most 1.2x PyTorch eager's, and at least 40 % of the measured bf16 GEMM peak in bf16. Without a GPU it
refuses, saying so, unless ``--cpu-smoke``. Benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sbpflow as sf  # noqa: E402
from bench._shared import load_example  # noqa: E402
from bench.models.gpt_step import Shape, torch_model  # noqa: E402
from sbpflow.device import DeviceUnavailable, array_module  # noqa: E402
from sbpflow.job import Precision  # noqa: E402

SMALL = Shape("gpt-small", layers=12, heads=12, width=768, seq_len=1024, batch=8, vocab=50304)
SMOKE = Shape("smoke", layers=2, heads=2, width=32, seq_len=16, batch=2, vocab=64)
TARGET_RATIO, TARGET_PEAK = 1.2, 0.40
PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class Side:
    """One contender at one precision: seconds per step, achieved TFLOP/s, first and last loss."""

    name: str
    precision: str
    step_s: float | None = None
    tflops: float | None = None
    losses: tuple[float, ...] = ()
    error: str = ""


def flops_per_step(s: Shape) -> float:
    """Forward and backward: 6 per matmul parameter per token, plus attention's 12 x L x T x d per token."""
    matmul_params = 12 * s.layers * s.width**2 + s.vocab * s.width
    return s.batch * s.seq_len * (6 * matmul_params + 12 * s.layers * s.seq_len * s.width)


def device_or_refuse(cpu_smoke: bool) -> str:
    """ "cpu" for the smoke run; else "cuda" where cupy and PyTorch both see a GPU, or exit saying why."""
    if cpu_smoke:
        return "cpu"
    try:
        array_module("cuda")
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailable("PyTorch sees no CUDA device (a CPU build of torch?)")
    except (DeviceUnavailable, ImportError) as e:
        raise SystemExit(
            f"bench/models/gpu_step.py needs a CUDA GPU that cupy and PyTorch both see: {e}. On a machine "
            "without one, run `python bench/models/gpu_step.py --cpu-smoke` (a tiny GPT on the CPU, the same "
            "code path)"
        ) from None
    return "cuda"


def measured(marks: list[float], warmup: int, steps: int) -> float:
    """Seconds per step over the steps after ``warmup``, from a time mark taken after each step."""
    return (marks[warmup + steps - 1] - marks[warmup - 1]) / steps


def run_sbpflow(s: Shape, precision: str, device: str, warmup: int, steps: int) -> Side:
    job = load_example("gpt").make_job(
        ranks=1, layers=s.layers, heads=s.heads, width=s.width, vocab=s.vocab, seq_len=s.seq_len,
        batch_size=s.batch, steps=warmup + steps, lr=3e-4, warmup=2, device=device,
    )  # fmt: skip
    job = replace(job, config=replace(job.config, precision=Precision(precision)))
    marks: list[float] = []
    result = sf.run(job, backend="inprocess", on_step=lambda m: marks.append(time.perf_counter()))
    step = measured(marks, warmup, steps)
    losses = (result.losses[0], result.losses[-1])
    return Side("sbpflow", precision, step, flops_per_step(s) / step / 1e12, losses)


def run_torch(s: Shape, precision: str, device: str, warmup: int, steps: int, compiled: bool) -> Side:
    import torch

    torch.manual_seed(0)
    model = torch_model(s).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    forward = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, s.vocab, (s.batch, s.seq_len + 1), generator=gen).to(device) for _ in range(2)
    ]
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16")
    losses, marks = [], []
    for i in range(warmup + steps):
        data = batches[i % len(batches)]
        with autocast:
            loss = forward(data[:, :-1], data[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())  # a sync, as sbpflow's loss report is
        marks.append(time.perf_counter())
    step = measured(marks, warmup, steps)
    name = "torch.compile" if compiled else "torch eager"
    return Side(name, precision, step, flops_per_step(s) / step / 1e12, (losses[0], losses[-1]))


def gemm_peak(device: str, n: int, iters: int = 20) -> float:
    """TFLOP/s of an n^3 matmul in PyTorch: bf16 on the GPU, float32 on the CPU (the smoke run)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def attempt(name: str, precision: str, run: Callable[[], Side]) -> Side:
    """``run()``, or the side with the error that stopped it (one contender failing stops no other)."""
    try:
        side = run()
    except Exception as e:
        side = Side(name, precision, error=f"{type(e).__name__}: {e}"[:400])
    print(f"  {describe(side)}", flush=True)
    return side


def describe(side: Side) -> str:
    if side.error:
        return f"{side.name:<14} {side.precision}: failed: {side.error}"
    assert side.step_s is not None and side.tflops is not None
    loss = " -> ".join(f"{v:.3f}" for v in side.losses)
    return f"{side.name:<14} {side.precision}: {side.step_s * 1e3:9.1f} ms/step {side.tflops:7.1f} TFLOP/s  loss {loss}"


def verdicts(sides: list[Side], peak: float) -> dict[str, Any]:
    """sbpflow against eager per precision, and bf16 sbpflow against the peak, with the targets."""
    by = {(x.name, x.precision): x for x in sides if not x.error}
    out: dict[str, Any] = {}
    for p in PRECISIONS:
        ours, eager = by.get(("sbpflow", p)), by.get(("torch eager", p))
        if ours and eager and ours.step_s and eager.step_s:
            ratio = ours.step_s / eager.step_s
            out[f"{p} sbpflow / eager"] = {
                "ratio": ratio,
                "target": TARGET_RATIO,
                "met": ratio <= TARGET_RATIO,
            }
    ours = by.get(("sbpflow", "bf16"))
    if ours and ours.tflops:
        share = ours.tflops / peak
        out["bf16 sbpflow / GEMM peak"] = {"ratio": share, "target": TARGET_PEAK, "met": share >= TARGET_PEAK}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny GPT on the CPU (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="fewer steps: 2 warm-up, 3 measured")
    ap.add_argument("--warmup", type=int, help="steps before the measured ones, cupy compiling (default 3)")
    ap.add_argument("--steps", type=int, help="measured steps (default 5)")
    ap.add_argument("--batch", type=int, help="batch size (default: 8; 2 with --cpu-smoke)")
    ap.add_argument("--layers", type=int, help="layers (default: 12; 2 with --cpu-smoke)")
    ap.add_argument("--precision", choices=PRECISIONS, action="append", help="default: both")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (always skipped on CPU)")
    ap.add_argument("--json", metavar="FILE", help="write the figures and verdicts as JSON")
    args = ap.parse_args(argv)
    device = device_or_refuse(args.cpu_smoke)
    shape = SMOKE if args.cpu_smoke else SMALL
    shape = replace(shape, batch=args.batch or shape.batch, layers=args.layers or shape.layers)
    print(f"{shape} on {device}: {flops_per_step(shape) / 1e12:.2f} TFLOP a step", flush=True)
    peak = gemm_peak(device, 8192 if device == "cuda" else 256)
    print(f"  GEMM peak ({'bf16' if device == 'cuda' else 'fp32'}, measured): {peak:.1f} TFLOP/s", flush=True)
    sides: list[Side] = []
    w, n = args.warmup or (2 if args.quick else 3), args.steps or (3 if args.quick else 5)

    def save() -> dict[str, Any]:  # after every side: a run cut short by its time limit keeps what it had
        result = {"shape": asdict(shape), "device": device, "peak_tflops": peak}
        result |= {"sides": [asdict(x) for x in sides], "verdicts": verdicts(sides, peak)}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return result

    for p in args.precision or PRECISIONS:
        contenders = [("sbpflow", lambda p=p: run_sbpflow(shape, p, device, w, n))]
        contenders.append(("torch eager", lambda p=p: run_torch(shape, p, device, w, n, False)))
        if device == "cuda" and not args.no_compile:
            contenders.append(("torch.compile", lambda p=p: run_torch(shape, p, device, w, n, True)))
        for name, run in contenders:
            sides.append(attempt(name, p, run))
            save()
    for what, v in save()["verdicts"].items():
        print(f"  {what}: {v['ratio']:.2f} (target {v['target']}: {'met' if v['met'] else 'NOT met'})")
    return 1 if any(x.error for x in sides) else 0


if __name__ == "__main__":
    sys.exit(main())
