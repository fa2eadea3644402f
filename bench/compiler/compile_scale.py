"""Compile-scale benchmark: a GPT-3-175B-shaped job compiled for 1024 devices (TP 8 x PP 16 x DP 8).

    python bench/compiler/compile_scale.py                     # 24, 48 and 96 layers, each in a fresh process
    python bench/compiler/compile_scale.py --layers 96 --profile
    python bench/compiler/compile_scale.py --layers 2 --quick  # a smoke run in seconds (TP 2 x PP 2 x DP 2)

The job is built symbolically: ``sf.nn.GPT`` only declares parameter shapes and their initialisers, and
tracing records ops and shapes, so nothing of the model's ~700 GB of fp32 parameters is ever allocated
(the trace's own peak allocation is reported beside it). Each pipeline stage is a DP x TP mesh of
``dp * tp`` consecutive ranks with the Megatron layout on the TP axis; the embeddings are in the first
stage, the final norm, the head and the loss in the last. Reported per layer count: the wall time of every
pass (``pipeline.compile``'s timings), the compiler's peak resident memory (``ru_maxrss``, and with
``--tracemalloc`` the peak of Python allocations), and the memory estimate of a device in the first,
a middle and the last stage beside the analytic figure (fp32: parameters ``N / (tp * pp) * 4`` bytes,
gradients the same, AdamW's two moments twice that; activations after Korthikanti et al. 2022).
Without the micro-batching pass the job falls back to TP x DP on ``tp * dp`` devices, and says so.
This is a benchmark, not a test: targets on a 2-core machine are a whole compile under 60 s and 8 GB.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import subprocess
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sbpflow as sf  # noqa: E402
from sbpflow.control_plane.compiler import pipeline  # noqa: E402
from sbpflow.data.sources import SyntheticSource  # noqa: E402
from sbpflow.sbp import B, S  # noqa: E402

FP32 = 4


@dataclass(frozen=True)
class Shape:
    layers: int = 96
    width: int = 12288
    heads: int = 96
    seq: int = 2048
    vocab: int = 50257
    tp: int = 8
    pp: int = 16
    dp: int = 8
    micro_batches: int = 16  # 1F1B needs at least one per stage
    # sequences per data-parallel rank per micro-batch (Megatron's usual 1); the step's batch is
    # dp * micro_batch * micro_batches = 128 sequences of 2048 tokens
    micro_batch: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


class LossHead(sf.nn.Module):
    def forward(self, logits: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        return sf.nn.functional.cross_entropy(logits, targets)


class TrainGPT(sf.Graph):
    def __init__(self, model: sf.nn.GPT, head: LossHead) -> None:
        super().__init__()
        self.model, self.head = model, head
        self.add_optimizer(sf.optim.AdamW(model.parameters(), lr=6e-5, weight_decay=0.1, clip_grad_norm=1.0))

    def build(self, tokens: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        loss = self.head(self.model(tokens), targets)  # tokens, targets: [B, T]; loss: []
        loss.backward()
        return loss


def make_job(s: Shape) -> sf.Job:
    cfg = sf.nn.GPTConfig(vocab_size=s.vocab, seq_len=s.seq, n_layer=s.layers, n_head=s.heads, n_embd=s.width)
    model, head = sf.nn.GPT(cfg), LossHead()
    per = s.tp * s.dp  # stage k: ranks k*per .. k*per+per-1 as a dp x tp mesh
    stages = [
        sf.placement("cpu", ranks=[[k * per + d * s.tp + t for t in range(s.tp)] for d in range(s.dp)])
        for k in range(s.pp)
    ]
    model.set_stage(0, stages[0])
    for i, block in enumerate(model.blocks):
        k = i * s.pp // s.layers
        block.set_stage(k, stages[k])
        sf.nn.parallel.megatron(block, stages[k], tp_axis=-1)
    for m in (model.ln_f, model.lm_head, head):
        m.set_stage(s.pp - 1, stages[-1])
    graph = TrainGPT(model, head)
    graph.config.micro_batches = s.micro_batches
    batch = s.dp * s.micro_batch * s.micro_batches
    data = SyntheticSource(batch_size=batch, kind="tokens", params={"seq_len": s.seq, "vocab": s.vocab})
    return graph.trace(data, placement=stages[0], input_sbp=(S(0), B))


# ---- the analytic figures ----------------------------------------------------------------------------


def parameters(s: Shape) -> dict[str, int]:
    """Exact parameter counts: a block (12 h^2 + 13 h), the embeddings, the final norm and the head."""
    h = s.width
    return {"block": 12 * h * h + 13 * h, "embeddings": (s.vocab + s.seq) * h, "head": 2 * h + h * s.vocab}


def analytic(s: Shape) -> dict[str, float]:
    """Per device, fp32: the issue's rule of thumb N / (tp * pp) for parameters and gradients, AdamW's two
    moments, and stored activations for 1F1B's first stage, which holds ``pp`` micro-batches in flight:
    ``s b h (34 + 5 a s / h)`` bytes per layer in fp16 (Korthikanti et al. 2022), doubled for fp32, divided
    by tp (as with sequence parallelism)."""
    n = parameters(s)
    total = s.layers * n["block"] + n["embeddings"] + n["head"]
    p = total / (s.tp * s.pp) * FP32
    per_layer = 2 * s.seq * s.micro_batch * s.width * (34 + 5 * s.heads * s.seq / s.width) / s.tp
    layers_per_stage = s.layers / s.pp
    return {
        "parameters_total": total,
        "parameters": p,
        "gradients": p,
        "optimizer_state": 2 * p,
        "activations_first_stage": per_layer * layers_per_stage * min(s.pp, s.micro_batches),
    }


# ---- one measured compile ----------------------------------------------------------------------------


def measure(s: Shape, trace_malloc: bool, profile: bool, lower: pipeline.Lower = "auto") -> dict[str, Any]:
    notes: list[str] = []
    tracemalloc.start()
    t = time.perf_counter()
    job = make_job(s)
    trace_s = time.perf_counter() - t
    trace_peak = tracemalloc.get_traced_memory()[1]
    if not trace_malloc:
        tracemalloc.stop()
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    c = pipeline.compile(job, lower=lower)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    built = sum(len(d.tasks) for d in (c.plan.devices if c.plan else c._devices.values()))
    per_rank = {}
    if c.lazy is not None:  # what a control plane does per worker: lower one more rank, not yet built
        for rank in (2, (s.pp // 2) * s.tp * s.dp + 2):  # not representatives: lowered now
            t = time.perf_counter()
            d = c.device_plan(rank)
            per_rank[rank] = {"s": time.perf_counter() - t, "tasks": len(d.tasks), "bytes": d.ByteSize()}
    out: dict[str, Any] = {
        "shape": asdict(s),
        "lowered": lower,
        "notes": notes + c.notes,
        "ops": len(job.graph.ops),
        "compiled_ops": len(c.state.graph.ops),
        "tasks": c.lazy.tasks if c.lazy else sum(len(d.tasks) for d in c.plan.devices) if c.plan else 0,
        "built_tasks": built,  # by the compile itself, before the ranks lowered on demand
        "per_rank": per_rank,
        "trace_s": trace_s,
        "trace_peak_bytes": trace_peak,
        "compile_s": wall,
        "timings": c.timings,
        "peak_rss_bytes": rss,
        "analytic": analytic(s),
        "memory": {},
    }
    if trace_malloc:
        out["tracemalloc_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    per = s.tp * s.dp
    for label, rank in (
        ("first stage", 0),
        ("middle stage", (s.pp // 2) * per),
        ("last stage", (s.pp - 1) * per),
    ):
        m = c.memory.get(rank)
        if m is not None:
            out["memory"][f"{label} (rank {rank})"] = asdict(m) | {"total": m.total}
    if prof:
        stats = pstats.Stats(prof, stream=sys.stderr)
        stats.sort_stats("cumulative").print_stats(30)
    return out


# ---- the report ---------------------------------------------------------------------------------------


def gb(n: float) -> str:
    return f"{n / 1e9:8.2f} GB"


def report(r: dict[str, Any]) -> str:
    s = Shape(**r["shape"])
    lines = [
        f"== {s.layers} layers, width {s.width}, {s.heads} heads, seq {s.seq}, vocab {s.vocab}: TP {s.tp} x PP "
        f"{s.pp} x DP {s.dp} = {s.devices} devices, {s.micro_batches} micro-batches of {s.dp * s.micro_batch}",
        *(f"   note: {n}" for n in r["notes"]),
        f"   trace {r['trace_s']:.2f} s, {r['ops']} ops, peak allocation {r['trace_peak_bytes'] / 1e6:.1f} MB "
        f"(the parameters would take {r['analytic']['parameters_total'] * FP32 / 1e9:.0f} GB: nothing materialised)",
        f"   compile {r['compile_s']:.2f} s{'' if r['lowered'] != 'none' else ' (graph passes only, --no-lower)'}: "
        f"{r['compiled_ops']} ops after the passes, {r['tasks']} tasks ({r['built_tasks']} built); "
        f"peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB"
        + (
            f", tracemalloc peak {r['tracemalloc_peak_bytes'] / 1e9:.2f} GB"
            if "tracemalloc_peak_bytes" in r
            else ""
        ),
        "   per pass: " + ", ".join(f"{k} {v:.2f}" for k, v in r["timings"].items() if k != "total") + " (s)",
        *(
            f"   one more rank on demand: rank {rank}, {p['tasks']} tasks, {p['bytes'] / 1e6:.1f} MB of "
            f"DevicePlan in {p['s']:.2f} s"
            for rank, p in r["per_rank"].items()
        ),
    ]
    a = r["analytic"]
    lines.append("   memory per device     parameters    gradients  optimizer   activations        total")
    lines.append(
        f"   analytic            {gb(a['parameters'])} {gb(a['gradients'])} {gb(a['optimizer_state'])} "
        f"{gb(a['activations_first_stage'])} (first stage)"
    )
    for label, m in r["memory"].items():
        lines.append(
            f"   {label:19s} {gb(m['parameters'])} {gb(m['gradients'])} {gb(m['optimizer_state'])} "
            f"{gb(m['peak_activations'])} {gb(m['total'])}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=lambda v: [int(x) for x in v.split(",")], default=[24, 48, 96])
    ap.add_argument("--quick", action="store_true", help="TP 2 x PP 2 x DP 2, 2 micro-batches: seconds")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--pp", type=int)
    ap.add_argument("--dp", type=int)
    ap.add_argument("--micro-batches", type=int)
    ap.add_argument("--tracemalloc", action="store_true", help="also the peak of Python allocations (slower)")
    ap.add_argument("--profile", action="store_true", help="cProfile of the compile, to stderr")
    ap.add_argument("--no-lower", action="store_true", help="stop after the graph passes (no Plan)")
    ap.add_argument(
        "--lower",
        choices=["auto", "eager", "lazy"],
        default="auto",
        help="materialise the Plan or lower on demand",
    )
    ap.add_argument(
        "--json", action="store_true", help="print one JSON result (used for the fresh processes)"
    )
    args = ap.parse_args()
    base = Shape(tp=2, pp=2, dp=2, micro_batches=2, micro_batch=2) if args.quick else Shape()
    over = {k: getattr(args, k) for k in ("tp", "pp", "dp", "micro_batches") if getattr(args, k) is not None}
    shapes = [Shape(**{**asdict(base), **over, "layers": n}) for n in args.layers]
    if args.json or len(shapes) == 1:
        r = measure(shapes[0], args.tracemalloc, args.profile, "none" if args.no_lower else args.lower)
        print(json.dumps(r) if args.json else report(r), flush=True)
        return
    results = []
    for s in shapes:  # a fresh process each, so that every peak memory is its own
        cmd = [sys.executable, __file__, "--json", "--layers", str(s.layers)]
        cmd += [
            f"--{k.replace('_', '-')}={v}"
            for k, v in asdict(s).items()
            if k in ("tp", "pp", "dp", "micro_batches")
        ]
        cmd += ["--tracemalloc"] if args.tracemalloc else []
        cmd += ["--no-lower"] if args.no_lower else [f"--lower={args.lower}"]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        results.append(r)
        print(report(r), flush=True)
    if len(results) > 1:
        print("\n   layers   compile s   s/layer   peak RSS GB   tasks (all ranks)   one more rank s")
        for r in results:
            n = r["shape"]["layers"]
            one = max((p["s"] for p in r["per_rank"].values()), default=0.0)
            print(
                f"   {n:6d} {r['compile_s']:11.2f} {r['compile_s'] / n:9.3f} {r['peak_rss_bytes'] / 1e9:13.2f}"
                f" {r['tasks']:19d} {one:17.2f}"
            )


if __name__ == "__main__":
    main()
