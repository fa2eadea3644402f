"""Memory per device of the InsightFace classifier: model parallel (weight S(1)) against data parallel.

    python bench/models/insightface.py          # 4 ranks, D=64, N=32, K = 2^12 .. 2^18 measured
    python bench/models/insightface.py --quick  # a smoke run

The classifier of examples/insightface.py alone (CosFace margin head [D, K] and its two-stage softmax
cross entropy, SGD with momentum, float32), fed [N, D] embeddings, on ``--ranks`` in-process ranks: the
weight split by identities ``S(1)`` (model parallel) against the weight replicated ``B`` with the batch
split (data parallel, DDP's layout), run side by side for each number of identities K. Two figures
per device and layout:

- the plan's estimate (``Compiled.memory``: parameters, gradients, optimizer state, peak activations);
- a measured peak: the run's peak of traced allocations (``tracemalloc``, which numpy reports its
  arrays to) over ``--steps`` steps, divided by the ranks (in-process ranks share one process; the
  layouts are symmetric, so every rank holds the same).

Then the estimate alone for K up to ``--plan-max`` (not run): where data parallelism stops fitting a
device of ``--device-gib`` while model parallelism still does, the paper's point. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sbpflow as sf  # noqa: E402
from bench._shared import load_example  # noqa: E402
from sbpflow.control_plane.compiler.pipeline import compile as compile_job  # noqa: E402
from sbpflow.data.sources import DataField, SyntheticSource  # noqa: E402
from sbpflow.dtype import DType  # noqa: E402

MiB = 1 << 20


class Identity(sf.nn.Module):
    """No backbone: the job is fed the embeddings themselves."""

    def forward(self, x: sf.Tensor) -> sf.Tensor:
        return x


@dataclass(frozen=True)
class Row:
    classes: int
    layout: str
    estimate: int  # bytes per device, the plan's total
    weights: int  # bytes per device: parameters + gradients + optimizer state
    measured: int | None  # bytes per device, the run's traced peak / ranks


def head_job(ranks: int, dim: int, batch: int, classes: int, model_parallel: bool) -> sf.Job:
    face = load_example("insightface")
    where = sf.placement("cpu", ranks=list(range(ranks)))
    head = face.MarginClassifier(dim, classes, 16.0, 0.2)
    head.weight.to_global(where, sf.sbp.split(1) if model_parallel else sf.sbp.broadcast)
    graph = face.TrainFace(Identity(), head, where if model_parallel else None, 0.1, 3)
    fields = (DataField("images", (dim,), DType.float32), DataField("labels", (), DType.int64))
    data = SyntheticSource(batch_size=batch, sample_fields=fields, params={"vocab": classes})
    return graph.trace(data, placement=where, input_sbp=sf.sbp.split(0))


def measure(job: sf.Job, ranks: int, steps: int, run: bool) -> Row:
    compiled = compile_job(job, lower="auto" if run else "lazy")
    if not compiled.memory:
        compiled.device_plan(0)  # the estimate of rank 0 (every rank is alike)
    m = compiled.memory[min(compiled.memory)]
    k = job.graph.tensors["head.weight"].meta.shape[1]
    layout = "MP S(1)" if str(job.graph.tensors["head.weight"].sbp) == "(S(1),)" else "DP B"
    measured = None
    if run:
        gc.collect()
        tracemalloc.start()  # after the compile: the run's own arrays (parameters included), not the IR's
        sf.run(compiled, steps=steps, backend="inprocess", timeout=600)
        measured = tracemalloc.get_traced_memory()[1] // ranks
        tracemalloc.stop()
    return Row(k, layout, m.total, m.parameters + m.gradients + m.optimizer_state, measured)


def table(rows: list[Row]) -> None:
    print(
        "| K | layout | plan estimate / device | of which weight, grad, momentum | measured peak / device |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        got = "—" if r.measured is None else f"{r.measured / MiB:,.1f} MiB"
        print(
            f"| {r.classes:,} | {r.layout} | {r.estimate / MiB:,.1f} MiB | {r.weights / MiB:,.1f} MiB | {got} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--run-max", type=int, default=1 << 18, help="the largest K that is run and measured")
    ap.add_argument("--plan-max", type=int, default=1 << 24, help="the largest K that is only planned")
    ap.add_argument("--paper-dim", type=int, default=512, help="D for the planned-only rows")
    ap.add_argument("--device-gib", type=float, default=16.0)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.run_max, a.plan_max, a.steps = 1 << 12, 1 << 16, 2
    rows = []
    k = 1 << 12
    while k <= a.run_max:
        for mp in (True, False):
            rows.append(measure(head_job(a.ranks, a.dim, a.batch, k, mp), a.ranks, a.steps, run=True))
        k *= 4
    print(f"measured: {a.ranks} in-process ranks, D={a.dim}, N={a.batch}, float32, {a.steps} steps\n")
    table(rows)
    planned = []
    k = 1 << 16
    while k <= a.plan_max:
        for mp in (True, False):
            planned.append(measure(head_job(a.ranks, a.paper_dim, 8 * a.batch, k, mp), a.ranks, 0, run=False))
        k *= 4
    print(f"\nplanned only: D={a.paper_dim}, N={8 * a.batch}\n")
    table(planned)
    budget = a.device_gib * (1 << 30)
    for layout in ("MP S(1)", "DP B"):
        fits = [r.classes for r in planned if r.layout == layout and r.estimate <= budget]
        print(
            f"{layout}: the largest planned K that fits {a.device_gib:g} GiB a device: {max(fits, default=0):,}"
        )


if __name__ == "__main__":
    main()
