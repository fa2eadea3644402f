"""BERT masked-LM training samples/s on CPU: sbpflow on one rank against PyTorch (transformers), side by side.

    python bench/models/bert.py            # 4 layers, width 256, 4 heads, seq 128, batch 16, vocab 8192
    python bench/models/bert.py --quick    # 2 layers, width 64, seq 32, batch 8, vocab 512: a smoke run
    python bench/models/bert.py --trace    # and sbpflow's kernel time by op type, acts a step (one run more)

The model is examples/bert.py's: ``sf.nn.BertForMaskedLM`` (post-LN encoder, exact GELU, attention
without a mask, the MLM head tied to the word embedding, the loss at the masked positions only) traced by
its ``TrainBert`` (AdamW, betas 0.9/0.999, weight decay 0.01, the warmup-cosine schedule), float32, on
``SyntheticSource(kind="mlm")`` batches (15 % of a sequence's positions predicted). PyTorch runs
transformers' ``BertForMaskedLM`` (``attn_implementation="sdpa"``: with no mask, as sbpflow's, one fused
attention op on both sides) the same way: the encoder, the hidden states gathered at the masked
positions, the MLM head there, the cross entropy; ``torch.optim.AdamW`` with the same hyper-parameters
and ``LambdaLR`` on the same schedule. Both start from the same weights (sbpflow loads transformers'
random initialisation through the ``hf-bert`` layout) and read the same batches, drawn before the
timed steps; their first losses must agree to float32 (the run stops if not) and the largest relative
gap over the steps is printed. Dropout is 0 on both sides.

Both run on one thread: BLAS pinned before numpy and torch load, ``sf.run(backend="inprocess",
threads=1)``, ``torch.set_num_threads(1)``. A step's time is the span of the step reports after
``WARMUP`` steps over their number (sbpflow: ``on_step``; torch: a mark after each step), wall clock;
CPU time (the process's, both sides) is printed beside it, what another process's load leaves alone. The
sides alternate ``--repeat`` times; the medians of the repetitions are compared: ``ratio`` is sbpflow's
samples/s over PyTorch's for examples/bert.py's job (its 2-d mesh, here 1 x 1, and ``tensor_parallel``:
what ``sbpflow run examples/bert.py --ranks 1`` runs), ``ratio 1-d`` for the same model on a one-device
placement. A benchmark, not a test.
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
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sbpflow as sf  # noqa: E402
from bench._shared import load_example  # noqa: E402
from bench.models.gpt_step import _kind, op_types  # noqa: E402
from sbpflow.data import SyntheticSource  # noqa: E402
from sbpflow.data.sources import ArraySource  # noqa: E402
from sbpflow.job import WarmupCosine  # noqa: E402

WARMUP = 2
FIRST_LOSS_RTOL = 1e-4  # float32, the same weights and batch: the two first losses agree to this


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    heads: int = 4
    width: int = 256
    seq_len: int = 128
    batch: int = 16
    vocab: int = 8192
    lr: float = 1e-3
    warmup: int = 2  # the schedule's warm-up steps

    @property
    def predictions(self) -> int:
        return max(1, round(0.15 * self.seq_len))  # examples/bert.py's


QUICK = Shape(layers=2, heads=2, width=64, seq_len=32, batch=8, vocab=512)


@dataclass
class Side:
    step_s: float  # wall a step
    cpu_s: float  # process CPU time a step
    losses: list[float]


def per_step(marks: list[tuple[float, float]]) -> tuple[float, float]:
    """Wall and CPU seconds a step over the steps after WARMUP, from (perf_counter, process_time) marks
    taken at each step's report (a span, not gaps: sbpflow may deliver a few reports at once)."""
    (w0, c0), (w1, c1) = marks[WARMUP], marks[-1]
    n = len(marks) - 1 - WARMUP
    return (w1 - w0) / n, (c1 - c0) / n


def mark() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


# ---- the shared start: transformers' weights, the batches --------------------------------------------


def hf_model(s: Shape) -> Any:
    import torch
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=s.vocab,
        hidden_size=s.width,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        intermediate_size=4 * s.width,
        max_position_embeddings=s.seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        layer_norm_eps=1e-12,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg)


def sbpflow_model(s: Shape, state: dict[str, Any]) -> Any:
    cfg = sf.nn.BertConfig(
        vocab_size=s.vocab, seq_len=s.seq_len, n_layer=s.layers, n_head=s.heads, n_embd=s.width,
        dropout=0.0, pad_token_id=0,  # transformers' padding_idx: its row starts at 0
    )  # fmt: skip
    model = sf.nn.BertForMaskedLM(cfg)
    model.load_state_dict(state, layout="hf-bert")
    return model


def make_job(s: Shape, state: dict[str, Any], steps: int, mesh: bool = True) -> sf.Job:
    """examples/bert.py's job on one rank (``mesh``: its 2-d mesh, here 1 x 1, and ``tensor_parallel``;
    else the model on a one-device placement), from ``state`` (transformers' names), its batches served
    from memory (drawn here, before any timed step)."""
    ex = load_example("bert")
    model = sbpflow_model(s, state)
    where = ex.mesh(1, 1) if mesh else sf.placement("cpu", ranks=[0])
    graph = ex.TrainBert(
        ex.tensor_parallel(model, where, tp_axis=1) if mesh else model, s.lr, steps, s.warmup
    )
    graph.config.seed = 0
    params = {"seq_len": s.seq_len, "vocab": s.vocab, "predictions": s.predictions}
    source = SyntheticSource(batch_size=s.batch, kind="mlm", params=params, seed=0)
    sbp = {"input_sbp": (sf.sbp.split(0), sf.sbp.broadcast)} if mesh else {}
    job = graph.trace(source, placement=where, **sbp)
    reads = [source.read(b) for b in range(steps)]
    arrays = {k: np.concatenate([r[k] for r in reads]) for k in reads[0]}
    return dataclasses.replace(job, data=ArraySource(batch_size=s.batch, arrays=arrays))


def batches(job: sf.Job, s: Shape, steps: int) -> list[dict[str, np.ndarray]]:
    assert isinstance(job.data, ArraySource)
    return [{k: v[i * s.batch : (i + 1) * s.batch] for k, v in job.data.arrays.items()} for i in range(steps)]


# ---- the two sides --------------------------------------------------------------------------------------


def run_sbpflow(job: sf.Job) -> Side:
    marks: list[tuple[float, float]] = []
    result = sf.run(job, backend="inprocess", threads=1, on_step=lambda m: marks.append(mark()))
    return Side(*per_step(marks), [float(v) for v in result.losses])


def run_torch(s: Shape, state: dict[str, Any], data: list[dict[str, np.ndarray]]) -> Side:
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    model = hf_model(s)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(s.warmup, len(data), 0.0).factor)
    inputs = [{k: torch.from_numpy(v.astype(np.int64)) for k, v in b.items()} for b in data]
    losses, marks = [], []
    for b in inputs:
        h = model.bert(input_ids=b["tokens"], token_type_ids=b["token_types"])[0]  # [B, T, D]
        at = b["positions"].unsqueeze(-1).expand(-1, -1, h.shape[-1])  # [B, P, D]
        logits = model.cls(h.gather(1, at))  # [B, P, V]
        loss = F.cross_entropy(logits.reshape(-1, s.vocab), b["labels"].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.item()))
        marks.append(mark())
    return Side(*per_step(marks), losses)


def breakdown(job: sf.Job, steps: int) -> tuple[dict[str, float], float]:
    """sbpflow's kernel seconds a step by op type, and acts a step, from one traced run (the trace costs
    ~0.3 us an act: not the run the ratio is taken from)."""
    types = op_types(job)
    events = sf.run(job, backend="inprocess", threads=1, trace=True).trace or []
    # acts of one iteration spread over steps (sources run ahead): steps bounded by the loss's kernel
    at = {e.iteration: e.start for e in events if _kind(e.name, types) == "cross_entropy"}
    t0, t1 = at[WARMUP], at[steps - 1]
    n = steps - 1 - WARMUP
    per_op: dict[str, float] = {}
    measured = [e for e in events if t0 <= e.start < t1]
    for e in measured:
        k = _kind(e.name, types)
        per_op[k] = per_op.get(k, 0.0) + (e.end - e.start) / n
    return per_op, len(measured) / n


def report(s: Shape, args: argparse.Namespace, sides: dict[str, list[Side]]) -> None:
    """The table, the losses' agreement (stops where a first loss differs) and the ratios."""
    theirs = sides["pytorch"][0].losses
    for name, runs in sides.items():
        ours = runs[0].losses
        if abs(ours[0] - theirs[0]) > FIRST_LOSS_RTOL * abs(theirs[0]):
            raise SystemExit(
                f"the first losses differ: {name} {ours[0]!r}, PyTorch {theirs[0]!r} (same weights, batch)"
            )
    step = {k: statistics.median(x.step_s for x in v) for k, v in sides.items()}
    cpu = {k: statistics.median(x.cpu_s for x in v) for k, v in sides.items()}
    print(f"BERT MLM {s}, float32, 1 thread, median of {args.repeat} x {args.steps - 1} steps")
    print(f"{'':12} {'step':>10} {'cpu/step':>10} {'samples/s':>10}  losses: first, last, largest gap")
    for k, v in sides.items():
        ours = v[0].losses
        gap = max(abs(x - y) / abs(y) for x, y in zip(ours, theirs, strict=True))
        print(
            f"{k:12} {step[k] * 1e3:7.1f} ms {cpu[k] * 1e3:7.1f} ms {s.batch / step[k]:10.1f}  "
            f"{ours[0]:.5f}, {ours[-1]:.5f}, {gap:.1e}"
        )
    print(f"load {os.getloadavg()[0]:.1f}; samples/s over PyTorch's (cpu time in brackets):")
    t, c = step["pytorch"], cpu["pytorch"]
    print(
        f"ratio {t / step['sbpflow']:.2f}  ({c / cpu['sbpflow']:.2f})  examples/bert.py's job, a 1 x 1 mesh"
    )
    print(f"ratio 1-d {t / step['sbpflow 1-d']:.2f}  ({c / cpu['sbpflow 1-d']:.2f})  the model on one device")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="sbpflow's kernel time by op type (one run more)")
    args = ap.parse_args()
    s = QUICK if args.quick else Shape()
    if args.quick:
        args.steps, args.repeat = 5, 1
    steps = WARMUP + args.steps
    state = {k: v.detach().numpy().copy() for k, v in hf_model(s).state_dict().items()}
    jobs = {"sbpflow": make_job(s, state, steps), "sbpflow 1-d": make_job(s, state, steps, mesh=False)}
    data = batches(jobs["sbpflow"], s, steps)
    sides: dict[str, list[Side]] = {k: [] for k in (*jobs, "pytorch")}
    for _ in range(args.repeat):
        for name, job in jobs.items():
            sides[name].append(run_sbpflow(job))
        sides["pytorch"].append(run_torch(s, state, data))
    report(s, args, sides)
    for name, job in jobs.items() if args.trace else ():
        per_op, acts = breakdown(job, steps)
        print(f"{name}, traced: {acts:.0f} acts a step, {sum(per_op.values()) * 1e3:.1f} ms in them")
        for k, v in sorted(per_op.items(), key=lambda kv: -kv[1]):
            print(f"  {k:28} {v * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
