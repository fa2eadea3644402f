"""Plan quality: what GPT's compiled plans move and how fast they step, the hand figures beside them, and
how well the cost model's step times rank the measured ones.

    python bench/compiler/plan_quality.py               # the issue's GPT (heads 4, width 128, 2 layers,
                                                        # batch 4, seq 16)
    python bench/compiler/plan_quality.py --steps 12    # fewer measured steps
    python bench/compiler/plan_quality.py --only model  # the second table alone

**Bytes.** For each layout on 4 ranks: the bytes per step of the hand-derived plan (Megatron's, or DDP's
for data parallelism; derived in tests/control_plane/compiler/test_plan_bytes.py), of the plan SBP
inference's one-op walk picks alone (``sbp_ilp.ENABLED = False``, the peer), and of the plan the
whole-graph program picks (the default where it applies: some weight annotated split); the compile time
of each; the measured step time of both plans, trained side by side in-process; and the cost model's
step time of the program's plan (``cost_model.estimate`` on the ``cpu`` profile, this machine measured
at start-up, over the ``inprocess`` link), as modelled seconds over measured seconds: by the roofline
alone, and with the plan's kernels timed on this machine (``kernel_probe.measure_kernels``).

**Modelled against measured.** The MLP example and GPT tiny (the examples' defaults) under DP1, DP2 and
TP2 (and GPT as two pipeline stages), in-process: the measured step, the modelled one (roofline; kernels timed) and their ratios, and
what bounds the modelled step. The
Spearman rank correlation of modelled and measured step times is printed for this table, for the first
table's program plans, and for all rows together: the point of a cost model is to rank plans as they
run (issue 15's target for the search: >= 0.8).

**Measuring on a shared machine.** Every run is in-process with one BLAS thread a rank (the profile is
measured with the same), and its step time is the fastest window of ``WINDOW`` consecutive steps after
``WARM`` warm-up steps (the runtime runs a step ahead, so single step gaps come in pairs; a window's mean
is not fooled by that, and its fastest is the least disturbed). Plans compared run alternately
``--repeat`` times, each first in turn, and the fastest run of each is kept. Benchmark, not a test: the
step times on this shared 2-core machine are noisy, the bytes are exact.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._shared import load_example  # noqa: E402
from sbpflow.control_plane.compiler import pipeline  # noqa: E402
from sbpflow.control_plane.compiler.cost.cost_model import DeviceProfile, StepEstimate, estimate  # noqa: E402
from sbpflow.control_plane.compiler.passes import sbp_ilp
from sbpflow.control_plane.profiling.cpu_profile import WARM, WINDOW, measure_cpu_profile, step_time  # noqa: E402
from sbpflow.control_plane.profiling.kernel_probe import measure_kernels  # noqa: E402
from tests.control_plane.compiler.test_plan_bytes import (  # noqa: E402
    MEGATRON_TP4,
    MEGATRON_TP4_VOCAB,
    SHAPE,
    step_bytes,
)

# layout -> (example arguments, the hand figure and whose it is)
LAYOUTS: dict[str, tuple[dict[str, Any], int, str]] = {
    "TP4": ({"tp": True}, MEGATRON_TP4, "Megatron"),
    "TP4 vocab-parallel": ({"tp": True, "vocab_parallel": True}, MEGATRON_TP4_VOCAB, "Megatron"),
    "DP4": ({}, 9_965_592, "DDP"),
    "DP2 x TP2": ({"tp": True, "dp": 2}, 4_007_968, "Megatron"),
    "PP2 x DP2": ({"pp": 2, "micro_batches": 2}, 3_387_996, "Megatron"),
}
# the second table: example, make_job arguments
MODELLED: dict[str, tuple[str, dict[str, Any]]] = {
    "MLP DP1": ("mlp", {"ranks": 1}),
    "MLP DP2": ("mlp", {"ranks": 2}),
    "MLP TP2": ("mlp", {"ranks": 2, "tp": True}),
    "GPT DP1": ("gpt", {"ranks": 1}),
    "GPT DP2": ("gpt", {"ranks": 2}),
    "GPT TP2": ("gpt", {"ranks": 2, "tp": True}),
    "GPT PP2": ("gpt", {"ranks": 2, "pp": 2, "micro_batches": 2}),
}
THREADS = 1
LINK = "inprocess"


def compiled(kwargs: dict[str, Any], whole_graph: bool, steps: int) -> tuple[pipeline.Compiled, float]:
    sbp_ilp.ENABLED = whole_graph
    try:
        job = load_example("gpt").make_job(**SHAPE, **kwargs, steps=steps)
        t = time.perf_counter()
        return pipeline.compile(job), time.perf_counter() - t
    finally:
        sbp_ilp.ENABLED = True


def step_s(c: pipeline.Compiled, steps: int) -> float:
    """The fastest window's mean step (module docstring), in seconds."""
    assert c.state.job.config.steps == steps, "the plans are compiled for --steps"
    return step_time(c, THREADS)


def modelled(c: pipeline.Compiled, cpu: DeviceProfile) -> tuple[StepEstimate, StepEstimate]:
    """The plan's modelled step by the roofline alone, and with its kernels timed on this machine."""
    kernels = measure_kernels(c.state, THREADS, LINK == "inprocess")
    return estimate(c, cpu, LINK), estimate(c, cpu, LINK, kernels=kernels)


def fastest(plans: dict[str, pipeline.Compiled], steps: int, repeat: int) -> dict[str, float]:
    """Each plan's fastest run of ``repeat``, run alternately, each first in turn."""
    runs: dict[str, list[float]] = {k: [] for k in plans}
    names = list(plans)
    for r in range(repeat):
        for k in names if r % 2 == 0 else names[::-1]:
            runs[k].append(step_s(plans[k], steps))
    return {k: min(v) for k, v in runs.items()}


Row = tuple[float, float, float]  # modelled (roofline), modelled (kernels timed), measured seconds


def bytes_table(args: argparse.Namespace, cpu: DeviceProfile) -> list[Row]:
    """The first table; returns each program plan's :data:`Row`."""
    print(
        f"GPT {SHAPE}, float32, in-process, {THREADS} BLAS thread a rank; bytes per step, compile s, step ms "
        f"(fastest {WINDOW}-step window after {WARM}, fastest of {args.repeat} alternating runs); model: "
        f"cost_model on the measured cpu profile, link {LINK}"
    )
    head = f"{'layout':20s} {'hand':>11s} {'walk':>11s} {'program':>11s} {'prog/hand':>9s}"
    head += f" {'compile w/p s':>14s} {'step walk':>10s} {'step prog':>10s} {'prog/walk':>9s}"
    print(head + f" {'model prog':>10s} {'model/meas':>10s} {'+kernels':>9s}")
    pairs: list[tuple[float, float, float]] = []
    for name, (kwargs, hand, whose) in LAYOUTS.items():
        walk, tw = compiled(kwargs, False, args.steps)
        prog, tp = compiled(kwargs, True, args.steps)
        bw, bp = step_bytes(walk.state), step_bytes(prog.state)
        got = fastest({"walk": walk, "prog": prog}, args.steps, args.repeat)
        sw, sp = got["walk"], got["prog"]
        roof, kern = (e.step_s for e in modelled(prog, cpu))
        pairs.append((roof, kern, sp))
        print(
            f"{name:20s} {hand:>11,d} {bw:>11,d} {bp:>11,d} {bp / hand:>8.2f}x {tw:>6.1f}/{tp:<7.1f}"
            f" {sw * 1e3:>10.1f} {sp * 1e3:>10.1f} {sp / sw:>8.2f}x {roof * 1e3:>10.2f} {roof / sp:>9.2f}x"
            f" {kern / sp:>8.2f}x   ({whose})"
        )
    print("target: prog/hand <= 1.00 with annotations (TP layouts); the walk is the peer for step times")
    print("where walk and program bytes are equal the plans are the same: their step ratio is the noise")
    return pairs


def model_table(args: argparse.Namespace, cpu: DeviceProfile) -> list[Row]:
    """The second table; returns its :data:`Row` s."""
    print(f"\nmodelled against measured, in-process on this CPU ({cpu.source}):")
    plans = {
        k: pipeline.compile(load_example(ex).make_job(**kw, steps=args.steps))
        for k, (ex, kw) in MODELLED.items()
    }
    measured = fastest(plans, args.steps, args.repeat)
    print(
        f"{'plan':10s} {'measured ms':>12s} {'roofline ms':>12s} {'model/meas':>10s} {'+kernels ms':>12s}"
        f" {'model/meas':>10s}  modelled step (with kernels) bound by"
    )
    pairs = []
    for k, c in plans.items():
        roof, kern = modelled(c, cpu)
        m = measured[k]
        pairs.append((roof.step_s, kern.step_s, m))
        print(
            f"{k:10s} {m * 1e3:>12.2f} {roof.step_s * 1e3:>12.2f} {roof.step_s / m:>9.2f}x"
            f" {kern.step_s * 1e3:>12.2f} {kern.step_s / m:>9.2f}x  {kern.bound} (compute"
            f" {kern.compute_s * 1e3:.2f}, exposed comm {kern.exposed_comm_s * 1e3:.2f}, data {kern.data_s * 1e3:.2f} ms)"
        )
    return pairs


def spearman(rows: list[Row], which: int) -> float:
    if len(rows) < 3:
        return float("nan")
    return float(spearmanr([r[which] for r in rows], [r[2] for r in rows]).statistic)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("bytes", "model"), help="print one table only")
    args = ap.parse_args()
    if args.steps < WARM + WINDOW + 1:
        ap.error(
            f"--steps must be at least {WARM + WINDOW + 1} ({WARM} warm-up steps and a {WINDOW}-step window)"
        )
    cpu = measure_cpu_profile(threads=THREADS)
    first = bytes_table(args, cpu) if args.only != "model" else []
    second = model_table(args, cpu) if args.only != "bytes" else []
    print("\nSpearman rank correlation of modelled and measured steps (roofline / with kernels timed):")
    for name, rows in (("GPT layouts", first), ("MLP/GPT DP1/DP2/TP2", second), ("all", first + second)):
        print(f"  {name:20s} {spearman(rows, 0):5.2f} / {spearman(rows, 1):5.2f}  ({len(rows)} plans)")
    print("target: >= 0.8")


if __name__ == "__main__":
    main()
