"""A readable one-screen summary of a traced Job: op counts, parameters, inputs, config."""

from __future__ import annotations

from collections import Counter

from sbpflow.graph import TensorKind
from sbpflow.job import Job


def summarize(job: Job, show_parameters: bool = True) -> str:
    g = job.graph
    ops = Counter(o.op_type for o in g.ops)
    params = g.of_kind(TensorKind.parameter)
    c = job.config
    lines = [
        f"job {job.name}: {len(g.ops)} ops, {len(params)} parameters "
        f"({sum(p.meta.numel for p in params):,} values), loss {job.loss or None!r}",
        f"config: steps={c.steps} grad_accum={c.gradient_accumulation_steps} micro_batches={c.micro_batches} "
        f"zero={c.zero_stage} precision={c.precision.value} seed={c.seed}",
        "optimizer: " + (f"{job.optimizer.algorithm} on {len(job.optimizer.parameters)} parameters"
                         if job.optimizer else "none"),
        "ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())),
        "inputs:",
        *(f"  {t!r}" for t in g.of_kind(TensorKind.input)),
    ]  # fmt: skip
    if show_parameters:
        lines += ["parameters:", *(f"  {p!r}" for p in params)]
    return "\n".join(lines)
