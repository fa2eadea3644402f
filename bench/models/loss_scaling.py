"""What dynamic loss scaling costs a step: an fp16 GPT step with GradScaler's dynamic scale against the
same step with a static scale (issue 18 item 2), both in-process on one device, measured alternately.

    python bench/models/loss_scaling.py          # the example's GPT (width 64, 2 layers): 20 steps x 5
                                                 # repeats
    python bench/models/loss_scaling.py --quick  # 4 steps, once: a smoke run

The dynamic plan adds, per step, one read of the scale (the loss gradient's seed and 1 / scale), a
non-finite count per gradient and their sum, the scale's update, and a gated update per parameter in
place of the plain one (a host read of the count before each); the static plan seeds with a constant and
unscales by one. The scale starts at 1024 with growth every 2000 steps, so no step of either is skipped
and both do the same arithmetic otherwise (their losses are checked equal). Printed: each plan's step
time (``RunResult.seconds`` over the steps, compile excluded) and the CPU seconds of each run (compile
included; steadier than wall time when other processes share the cores), each repeat's ratios dynamic /
static and their medians. The model is small because numpy has no float16 BLAS: a width-256 GPT takes ~50 s a step
in fp16 here (either plan), so fp16 timings on CPU say little beyond the plan's own overhead.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sbpflow as sf  # noqa: E402
from bench._shared import load_example, repeat_args  # noqa: E402
from sbpflow.control_plane.launch.run_context import RunResult  # noqa: E402
from sbpflow.job import Job, LossScaling  # noqa: E402


def jobs(steps: int) -> tuple[Job, Job]:
    base = load_example("gpt").make_job(ranks=1, steps=steps)
    dynamic = replace(
        base, config=replace(base.config, precision="fp16", loss_scaling=LossScaling(init=1024.0))
    )
    static = replace(dynamic, config=replace(dynamic.config, loss_scale=1024.0))
    return dynamic, static


def main() -> None:
    args = repeat_args(__doc__ or "", steps=20, repeat=5)
    if args.quick:
        args.steps, args.repeat = 4, 1
    dynamic, static = jobs(args.steps)
    ratios, cpu_ratios = [], []
    for r in range(args.repeat):
        (d, d_cpu), (s, s_cpu) = (timed(job) for job in (dynamic, static))
        assert d.losses == s.losses and d.skipped_steps == 0, "the two plans should compute the same steps"
        ds, ss = d.seconds / args.steps, s.seconds / args.steps
        ratios.append(ds / ss)
        cpu_ratios.append(d_cpu / s_cpu)
        print(
            f"repeat {r}: dynamic {ds * 1e3:.1f} ms/step, static {ss * 1e3:.1f} ms/step: {ratios[-1]:.3f}; "
            f"CPU {d_cpu:.2f} s / {s_cpu:.2f} s: {cpu_ratios[-1]:.3f}"
        )
    print(
        f"median dynamic / static: wall {statistics.median(ratios):.3f}, CPU {statistics.median(cpu_ratios):.3f}"
    )


def timed(job: Job) -> tuple[RunResult, float]:
    """The run, and the CPU seconds this process spent in it (compile included, every thread)."""
    t = time.process_time()
    result = sf.run(job, backend="inprocess", threads=1)
    return result, time.process_time() - t


if __name__ == "__main__":
    main()
