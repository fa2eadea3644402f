"""The automatic plan search against the hand layouts, modelled and measured (issue 15, deliverable 3).

    python bench/compiler/auto_plan.py             # GPT, the MLP and Wide & Deep on 4 ranks
    python bench/compiler/auto_plan.py --models gpt --steps 8 --repeat 3
    python bench/compiler/auto_plan.py --profile h200 --no-measure
                                                   # modelled only, on published H200 figures
    python bench/compiler/auto_plan.py --scale     # the GPT-175B-shaped search over 1,024 devices

Per model (each traced data parallel, then re-laid out by the search): the search's table on the
``--profile`` (``cpu``: this machine, measured at start-up), its winner's modelled step time against the
best of the hand layouts {DP, TP, DP x TP, PP x DP, ZeRO-1/2/3} (and the example's own, Wide & Deep's
tables split by rows), the target being at most 1.0x; then the measured step time of the winner, the
hand layouts and the next fastest candidates, trained in process (``sf.run(backend="inprocess")``, with
the profile's BLAS threads a rank, after a warm-up run of each; the median step's wall time after 2
warm-up steps and the process's CPU time a step over ``--steps`` (32), the layouts run in turn
``--repeat`` times, each first in turn), and Spearman's rank
correlation of modelled against measured (target >= 0.8): of the medians, and of each repetition (its
spread). The model prices the ``--link`` the runs use (``inprocess``: ranks as threads sharing one
interpreter). Benchmark, not a test: this shared 2-core machine's step times are noisy.

``--scale`` times the search itself on a GPT-175B-shaped job (96 layers, width 12,288, 96 heads, sequence
2,048, batch 128) over 1,024 devices: see :mod:`bench.compiler._auto_scale`.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scipy.stats import spearmanr  # noqa: E402

import sbpflow as sf  # noqa: E402
from bench._shared import load_example  # noqa: E402
from sbpflow.control_plane.compiler import pipeline  # noqa: E402
from sbpflow.control_plane.compiler.cost.cost_model import DeviceProfile  # noqa: E402
from sbpflow.control_plane.compiler.search import auto_plan  # noqa: E402
from sbpflow.control_plane.compiler.search.auto_layouts import Layout, relayout  # noqa: E402
from sbpflow.control_plane.profiling import pricing  # noqa: E402

RANKS = 4
# model -> (example, make_job arguments, its own hand layout where the example has one beside the flags')
MODELS: dict[str, tuple[str, dict[str, Any], Layout | None]] = {
    "gpt": ("gpt", {"heads": 4, "width": 128, "layers": 2, "batch_size": 4, "seq_len": 16}, None),
    "mlp": ("mlp", {"n_in": 64, "hidden": 256, "n_out": 16, "layers": 2, "batch_size": 256}, None),
    "wide_deep": ("wide_deep", {"vocab": 4096, "dim": 32, "batch_size": 64}, Layout(dp=4, tables=True)),
}
HAND: dict[str, list[Layout]] = {
    "DP": [Layout(dp=4)],
    "TP": [Layout(tp=4)],
    "DPxTP": [Layout(tp=2, dp=2)],
    "PPxDP": [Layout(pp=2, dp=2, micro_batches=m) for m in (2, 4)],
    **{f"ZeRO-{k}": [Layout(dp=4, zero=k)] for k in (1, 2, 3)},
}


def hand_rows(found: auto_plan.Search, own: Layout | None) -> dict[str, auto_plan.Candidate]:
    """The best priced candidate of each hand layout (a PP x DP layout at its better micro-batch count)."""
    by = {c.layout: c for c in found.candidates if c.estimate is not None}
    groups = {**HAND, **({"example's own": [own]} if own else {})}
    out = {}
    for name, lays in groups.items():
        have = [by[lay] for lay in lays if lay in by]
        if have:
            out[name] = min(have, key=auto_plan.Candidate.key)
    return out


@dataclass(frozen=True)
class Measured:
    """One layout's runs, one figure per repetition: the median step's wall time after 2 warm-up steps
    (``StepMetrics.step_seconds``), and the process's CPU time a step (a run of ``steps`` less a run of
    2, over ``steps - 2``: the in-process ranks are threads of this process, so this is every rank's
    work, which the machine's other load disturbs far less than wall time)."""

    wall_ms: tuple[float, ...]
    cpu_ms: tuple[float, ...]


def run_once(plan: pipeline.Compiled, steps: int, threads: int) -> tuple[list[float], float]:
    secs: list[float] = []
    cpu = time.process_time()
    sf.run(
        plan,
        steps=steps,
        backend="inprocess",
        timeout=600,
        threads=threads,
        on_step=lambda m: secs.append(m.step_seconds),
    )
    return secs, time.process_time() - cpu


def measure(job: Any, lays: list[Layout], steps: int, repeat: int, threads: int) -> dict[Layout, Measured]:
    """Each layout trained in process ``repeat`` times, the layouts in turn and each first in turn, with
    ``threads`` BLAS threads a rank (the profile's: its rates were measured so; the process's default
    gives each of the 4 rank threads every core, and their GEMMs then fight over them), after a warm-up
    run of each."""
    plans = {lay: pipeline.compile(relayout(job, lay)) for lay in lays}
    for lay in lays:  # what a plan's first run pays once (numba's loops for a new signature) is no step's
        run_once(plans[lay], 2, threads)
    walls: dict[Layout, list[float]] = {lay: [] for lay in lays}
    cpus: dict[Layout, list[float]] = {lay: [] for lay in lays}
    for r in range(repeat):
        for lay in lays[r % len(lays) :] + lays[: r % len(lays)]:
            secs, cpu = run_once(plans[lay], steps, threads)
            _, cpu2 = run_once(plans[lay], 2, threads)
            walls[lay].append(1e3 * statistics.median(secs[2:]))
            cpus[lay].append(1e3 * (cpu - cpu2) / (steps - 2))
    return {lay: Measured(tuple(walls[lay]), tuple(cpus[lay])) for lay in lays}


def spread(xs: tuple[float, ...]) -> str:
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def ranking(modelled: dict[Layout, float], got: dict[Layout, Measured], what: str) -> str:
    """Spearman of the modelled step against the measured one: of each repetition, and of the medians."""
    lays = list(got)
    runs = [getattr(got[x], what) for x in lays]
    per = [
        spearmanr([modelled[x] for x in lays], [r[i] for r in runs]).statistic for i in range(len(runs[0]))
    ]
    med = spearmanr([modelled[x] for x in lays], [statistics.median(r) for r in runs]).statistic
    return (
        f"target: Spearman(modelled, measured {what}) over {len(lays)} layouts = {med:.2f} of the medians "
        f"(>= 0.8); by repetition {' '.join(f'{x:.2f}' for x in per)}"
    )


def one_model(name: str, args: argparse.Namespace, profile: DeviceProfile) -> None:
    example, kwargs, own = MODELS[name]
    job = load_example(example).make_job(ranks=RANKS, steps=args.steps, **kwargs)
    t = time.perf_counter()
    found = pricing.search(job, args.memory, profile=profile, link=args.link)
    took = time.perf_counter() - t
    print(
        f"\n== {name} ({kwargs}) on {RANKS} ranks, {profile.name} profile over {args.link}: "
        f"{len(found.candidates)} layouts weighed in {took:.1f} s"
    )
    print(found.table())
    print(found.why())
    hand = hand_rows(found, own)
    best_name, best = min(hand.items(), key=lambda kv: kv[1].key())
    w = found.winner
    assert w.estimate is not None and best.estimate is not None
    print(
        f"target: winner {w.layout} {w.estimate.step_s * 1e3:.3g} ms modelled / best hand layout "
        f"({best_name}: {best.layout}) {best.estimate.step_s * 1e3:.3g} ms = "
        f"{w.estimate.step_s / best.estimate.step_s:.2f}x (<= 1.00)"
    )
    if args.no_measure:
        return
    fitting = sorted((c for c in found.candidates if c.fits(found.budget)), key=auto_plan.Candidate.key)
    chosen = list(
        dict.fromkeys([w.layout, *(c.layout for c in hand.values()), *(c.layout for c in fitting[:3])])
    )
    modelled = {c.layout: c.estimate.step_s * 1e3 for c in fitting if c.estimate is not None}
    got = measure(job, chosen, args.steps, args.repeat, profile.threads)
    print(
        f"{'layout':30s} {'modelled ms':>12s} {'wall ms: median [range]':>26s} {'CPU ms: median [range]':>26s}"
    )
    for lay in sorted(chosen, key=lambda x: modelled[x]):
        print(
            f"{str(lay):30s} {modelled[lay]:>12.3g} {spread(got[lay].wall_ms):>26s} {spread(got[lay].cpu_ms):>26s}"
        )
    for what in ("wall_ms", "cpu_ms"):
        print(ranking(modelled, got, what))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"some of {','.join(MODELS)}")
    ap.add_argument("--profile", default="cpu", help="the cost model's device profile: cpu, h200 or a file")
    ap.add_argument(
        "--link",
        default="inprocess",
        help="the link the model prices (default inprocess: what the measured runs use; shm, tcp, nccl)",
    )
    ap.add_argument("--memory", type=int, default=80 * 10**9, help="the budget per device, bytes")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-measure", action="store_true", help="modelled figures only")
    ap.add_argument("--scale", action="store_true", help="time the 1,024-device GPT-175B search instead")
    args = ap.parse_args()
    if args.scale:
        from bench.compiler._auto_scale import main as scale

        scale(args.profile if args.profile != "cpu" else "h200")
        return
    profile = pricing.device_profile(args.profile)
    for name in args.models.split(","):
        one_model(name, args, profile)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\npeak RSS {rss:.2f} GB")


if __name__ == "__main__":
    main()
