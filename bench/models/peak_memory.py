"""Peak memory of a training step: sbpflow on one rank in process against PyTorch eager, per paper model.

    prlimit --as=12000000000 python bench/models/peak_memory.py           # the three models (~3 min)
    prlimit --as=12000000000 python bench/models/peak_memory.py --quick   # tiny shapes, a smoke run
    python bench/models/peak_memory.py --only gpt                         # one model

The models are the benchmarks' own, imported, never copied: ``gpt`` the main job (examples/charlm.py at
bench/models/gpt_step.py's ``main`` shape, AdamW, clipping, the schedule; PyTorch its nanoGPT twin),
``resnet18`` bench/models/resnet.py's (SGD with momentum; PyTorch its ``torch_model``), ``bert``
bench/models/bert.py's examples/bert.py job on a 1 x 1 mesh (AdamW; PyTorch transformers'
``BertForMaskedLM``, both from the same weights).

Each side runs in a fresh process (``--probe MODEL SIDE``), BLAS and torch on one thread: a warm-up run
of the same model first (a few steps: what a first run loads, torch's lazily loaded code and sbpflow's
numba JIT of each kernel, is then loaded), garbage collected and malloc's free memory handed back
(``malloc_trim``); its baseline is then its resident set (VmRSS) and private memory (RssAnon), and the
kernel's peak-RSS mark (VmHWM) is reset (``/proc/self/clear_refs`` ``5``); then the measured run (the
job or model built before the baseline). sbpflow's run compiles its plan first: its mark is reset once
more at its first step's report, so that the compile's transient peak is not in it (the steps are alike
after the first; what the compile leaves, the plan, stays in the figure). Per side:

* ``peak``: VmHWM at the end minus the baseline VmRSS — the highest resident set of the steps (the
  parameters, optimizer states, the values they hold), exact (the kernel keeps the mark), what a memory
  plan lowers;
* ``anon``: the highest RssAnon a sampler thread saw (every ``SAMPLE_S``) minus the baseline's.

``ratio <model> N`` is sbpflow's peak over PyTorch's (lower is better; the issue's target <= 1.0).
Run it under ``prlimit --as`` (an address-space cap: a runaway plan fails instead of swapping the shared
machine). A benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy (here or by sbpflow) and torch are imported

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# transformers imports torchvision where it is installed, and this venv's torchvision 0.28 does not load
# under torch 2.13 ("operator torchvision::nms does not exist"); nothing here needs it
sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]

from bench.models import bert, gpt_step, resnet  # noqa: E402

SAMPLE_S = 0.002  # the RssAnon sampler's period
MODELS = ("gpt", "resnet18", "bert")
SIDES = ("sbpflow", "torch")
# steps a run, per model, full and --quick; the warm-up run's (resnet.py's timing needs 2 gaps after WARMUP)
STEPS = {False: {"gpt": 8, "resnet18": 6, "bert": 5}, True: {"gpt": 4, "resnet18": 4, "bert": 4}}
WARM_STEPS = {"gpt": 2, "resnet18": resnet.WARMUP + 2, "bert": bert.WARMUP + 2}
RESNET = {
    False: {"depth": 18, "width": 16, "image_size": 32, "batch_size": 32, "classes": 10, "lr": 0.05},
    True: {"depth": 18, "width": 8, "image_size": 16, "batch_size": 16, "classes": 10, "lr": 0.05},
}


def status_kb() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon of this process in kB (gpt_step's /proc/self/status probe, unrounded)."""
    return {k: round(v * 1024) for k, v in gpt_step.status_mb().items()}


def reset_peak() -> None:
    """Resets the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Sampler:
    """The highest RssAnon seen, every SAMPLE_S on a daemon thread (RssAnon has no kernel-kept peak)."""

    def __init__(self) -> None:
        self.top, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.top = max(self.top, status_kb()["RssAnon"])

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def trim() -> None:
    """Collects garbage and hands malloc's free memory back to the system (glibc's ``malloc_trim``), so a
    baseline taken after a warm-up run holds what the run keeps, not what malloc kept of what it freed."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def after_first(then: Callable[[], object]) -> Callable[..., float]:
    """A step report (or resnet.py's clock, read at each report) that calls ``then`` at its first call."""
    calls = [0]

    def hook(*_: object) -> float:
        calls[0] += 1
        if calls[0] == 1:
            then()
        return time.perf_counter()

    return hook


def runner(model: str, side: str, quick: bool, steps: int) -> Callable[[], object]:
    """A run of ``steps`` steps of ``model`` on ``side``, its inputs built here (before the baseline)."""
    import sbpflow as sf

    if model == "gpt":
        shape = gpt_step.SHAPES["main"]
        if side == "torch":
            return lambda: gpt_step.run_torch(shape, steps, 0)
        job = gpt_step.make_job(shape, steps)
        return lambda: sf.run(job, backend="inprocess", threads=1, on_step=after_first(reset_peak))
    if model == "resnet18":
        cfg = RESNET[quick]
        if side == "torch":
            return lambda: resnet.torch_step_s(cfg, steps)
        job = resnet.sbpflow_job(cfg, steps)  # its images drawn here, before the baseline, as BERT's are
        return lambda: sf.run(job, backend="inprocess", threads=1, on_step=after_first(reset_peak))
    s = bert.QUICK if quick else bert.Shape()
    state = {k: v.detach().numpy().copy() for k, v in bert.hf_model(s).state_dict().items()}
    job = bert.make_job(s, state, steps)
    if side == "torch":
        data = bert.batches(job, s, steps)
        return lambda: bert.run_torch(s, state, data)
    return lambda: sf.run(job, backend="inprocess", threads=1, on_step=after_first(reset_peak))


def no_memory_plan() -> None:
    """sbpflow's executor without its memory plan in this process (``--memory-plan off``: the A/B of the
    plan; each register's value then lives in its own array)."""
    from sbpflow.actor_workers.execution import memory_plan

    memory_plan.plan = lambda *args, **kwargs: memory_plan.MemoryPlan({}, 0, 0)


def no_plan_views() -> None:
    """The memory plan without the values that readers view (``--plan-views off``: the A/B of planning
    them; they then live in their own arrays, as before)."""
    from sbpflow.actor_workers.execution import memory_plan

    memory_plan.PLAN_VIEWS = False


def probe(model: str, side: str, quick: bool) -> dict[str, float]:
    """One side's figures in MB (this process: call it in a fresh one). A warm-up run of the same model
    first loads what a first run loads (torch's lazily loaded code, sbpflow's numba JIT of each kernel)."""
    import torch

    torch.set_num_threads(1)
    warm = runner(model, side, quick, WARM_STEPS[model])
    run = runner(model, side, quick, STEPS[quick][model])
    warm()
    del warm
    trim()
    base = status_kb()
    reset_peak()
    with Sampler() as sampler:
        run()
    end = status_kb()
    return {
        "peak_mb": (end["VmHWM"] - base["VmRSS"]) / 1024,
        "anon_mb": (max(sampler.top, end["RssAnon"]) - base["RssAnon"]) / 1024,
        "base_mb": base["VmRSS"] / 1024,
    }


def measure(model: str, side: str, quick: bool, plan: str, views: str = "on") -> dict[str, float] | str:
    """One side's figures from a fresh process, or what its failure printed last."""
    cmd = [sys.executable, __file__, "--probe", model, side, "--memory-plan", plan, "--plan-views", views]
    out = subprocess.run([*cmd, *(["--quick"] if quick else [])], capture_output=True, text=True)
    if out.returncode:
        return (out.stderr.strip() or out.stdout.strip() or f"exit status {out.returncode}").splitlines()[-1]
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few steps: a smoke run")
    ap.add_argument("--only", choices=MODELS, action="append", help="default: all three")
    ap.add_argument("--probe", nargs=2, metavar=("MODEL", "SIDE"), help=argparse.SUPPRESS)
    ap.add_argument("--memory-plan", choices=("on", "off"), default="on", help="sbpflow's (off: the A/B)")
    ap.add_argument("--plan-views", choices=("on", "off"), default="on", help="plan values readers view")
    args = ap.parse_args()
    if args.memory_plan == "off":
        no_memory_plan()
    if args.plan_views == "off":
        no_plan_views()
    if args.probe:
        print(json.dumps(probe(*args.probe, args.quick)))
        return
    print(
        f"peak memory of the steps above the baseline, MB (VmHWM; RssAnon sampled every {SAMPLE_S * 1e3:.0f}"
        f" ms); each side a fresh process, 1 thread{', --quick' if args.quick else ''}; memory plan "
        f"{args.memory_plan}, views {args.plan_views}; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':10} {'sbpflow peak':>12} {'anon':>8} {'torch peak':>11} {'anon':>8}")
    failed = []
    for model in args.only or MODELS:
        ours, theirs = (measure(model, side, args.quick, args.memory_plan, args.plan_views) for side in SIDES)
        if isinstance(ours, str) or isinstance(theirs, str):  # the other models still run
            failed.append(model)
            print(f"{model:10} FAILED: {ours if isinstance(ours, str) else theirs}")
            continue
        print(
            f"{model:10} {ours['peak_mb']:12.1f} {ours['anon_mb']:8.1f} {theirs['peak_mb']:11.1f} "
            f"{theirs['anon_mb']:8.1f}"
        )
        print(f"ratio {model} {ours['peak_mb'] / max(theirs['peak_mb'], 1e-9):.2f}")
    print(f"load {os.getloadavg()[0]:.1f} (sbpflow / PyTorch peak: lower is better, target <= 1.0)")
    if failed:
        raise SystemExit(f"the probes of {', '.join(failed)} failed (their line above says why)")


if __name__ == "__main__":
    main()
