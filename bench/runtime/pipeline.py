"""Pipeline benchmark: 4 stages x 16 micro-batches of a fixed-duration kernel, 1F1B by register counts.

    python bench/runtime/pipeline.py             # every configuration, 3 runs each, ~10 s
    python bench/runtime/pipeline.py --quick     # 2 ms kernels
    python bench/runtime/pipeline.py --trace /tmp/1f1b.json   # and the 1F1B run's trace, for ui.perfetto.dev

Each stage has a forward actor F and a backward actor B, each acting once per micro-batch (iteration =
micro-batch); B is preferred when both are ready (priority 0 vs 1), and F can run ahead of B by as
many micro-batches as the activation register F -> B has slots. With the 1F1B rule (activation count
stages - stage index, forward and backward edges between stages 1) that is exactly 1F1B's warm-up,
steady state and cool-down. The kernel is ``time.sleep``: fixed duration, GIL released, so the
2 cores of this machine do not limit it.

Measured: the step time against the ideal ``(m + p - 1) x (t_F + t_B)`` (the 1F1B bubble), with t the
kernel's nominal duration and, beside it, the duration ``time.sleep`` really takes here (calibrated);
and the peak number of live values per register, which bounds each stage's activation memory.
Configurations side by side: the 1F1B rule; every count 1 (no pipelining); OneFlow's 2 x stages
activation slots; and the 1F1B rule with the stages as 4 engines (ranks) of an EngineGroup, the
cross-stage edges carried by send/recv actors over an in-memory mailbox on separate streams.
Target: measured / ideal <= 1.15. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.actor_workers.runtime.group import EngineGroup
from sbpflow.actor_workers.runtime.trace import write_chrome_trace

TARGET = 1.15


def kernel(t: float) -> Callable[[int, list], list]:
    def act(it: int, xs: list) -> list:
        time.sleep(t)
        return [it]

    return act


def last(t: float) -> Callable[[int, list], None]:
    def act(it: int, xs: list) -> None:
        time.sleep(t)

    return act


def one_engine(
    p: int, m: int, t: float, act_count: Callable[[int], int], edge_count: int, trace: bool = False
) -> Engine:
    """All stages in one engine, stage s on stream "stage{s}". Registers: x_s F_s -> F_{s+1},
    a_s F_s -> B_s (the kept activation), g_s B_{s+1} -> B_s."""
    acts, regs = [], []
    x, a, g = (lambda s: 3 * s), (lambda s: 3 * s + 1), (lambda s: 3 * s + 2)
    for s in range(p):
        f_id, b_id = 2 * s, 2 * s + 1
        f_in = (x(s - 1),) if s else ()
        f_out = (a(s), x(s)) if s < p - 1 else (a(s),)
        b_in = (a(s), g(s + 1)) if s < p - 1 else (a(s),)
        b_out = (g(s),) if s else ()
        f_act = kernel(t) if len(f_out) == 1 else double(kernel(t))
        acts.append(ActorSpec(f_id, f"F{s}", f"stage{s}", f_in, f_out, f_act, m, priority=1))
        acts.append(
            ActorSpec(b_id, f"B{s}", f"stage{s}", b_in, b_out, kernel(t) if s else last(t), m, priority=0)
        )
        regs.append(RegisterSpec(a(s), f_id, (b_id,), act_count(s)))
        if s < p - 1:
            regs.append(RegisterSpec(x(s), f_id, (2 * (s + 1),), edge_count))
        if s:
            regs.append(RegisterSpec(g(s), b_id, (2 * (s - 1) + 1,), edge_count))
    return Engine(acts, regs, trace=trace)


class Mailbox:
    """Point-to-point messages between the ranks of the group: a queue per (src, dst, tag)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, str], queue.Queue] = {}
        self.aborted = False

    def q(self, src: int, dst: int, tag: str) -> queue.Queue:
        return self.queues.setdefault((src, dst, tag), queue.Queue())

    def send(self, src: int, dst: int, tag: str) -> Callable[[int, list], None]:
        box = self.q(src, dst, tag)
        return lambda it, xs: box.put(xs[0])

    def recv(self, src: int, dst: int, tag: str) -> Callable[[int, list], list]:
        box = self.q(src, dst, tag)

        def act(it: int, xs: list) -> list:
            while True:
                try:
                    return [box.get(timeout=0.1)]
                except queue.Empty:
                    if self.aborted:
                        raise ConnectionError(
                            f"mailbox aborted: rank {dst} waited for {tag} from {src}"
                        ) from None

        return act

    def abort(self, reason: str) -> None:
        self.aborted = True


def group(p: int, m: int, t: float, act_count: Callable[[int], int], edge_count: int) -> EngineGroup:
    """Stage s is rank s: F and B on "compute", each recv on its own stream, the sends on "send".
    Registers of a rank: 0 F -> B (activation), 1 recv x -> F, 2 F -> send x, 3 B -> send g, 4 recv g -> B."""
    box = Mailbox()
    engines = []
    for s in range(p):
        first, final = s == 0, s == p - 1
        f_in, f_out = () if first else (1,), (0,) if final else (0, 2)
        b_in, b_out = (0,) if final else (0, 4), () if first else (3,)
        f_act = kernel(t) if final else double(kernel(t))
        acts = [
            ActorSpec(0, "F", "compute", f_in, f_out, f_act, m, priority=1),
            ActorSpec(1, "B", "compute", b_in, b_out, last(t) if first else kernel(t), m, priority=0),
        ]
        regs = [RegisterSpec(0, 0, (1,), act_count(s))]
        if not first:
            acts.append(ActorSpec(2, "recv x", "recv_fwd", (), (1,), box.recv(s - 1, s, "x"), m))
            acts.append(ActorSpec(3, "send g", "send", (3,), (), box.send(s, s - 1, "g"), m))
            regs += [RegisterSpec(1, 2, (0,), edge_count), RegisterSpec(3, 1, (3,), edge_count)]
        if not final:
            acts.append(ActorSpec(4, "send x", "send", (2,), (), box.send(s, s + 1, "x"), m))
            acts.append(ActorSpec(5, "recv g", "recv_bwd", (), (4,), box.recv(s + 1, s, "g"), m))
            regs += [RegisterSpec(2, 0, (4,), edge_count), RegisterSpec(4, 5, (1,), edge_count)]
        engines.append(Engine(acts, regs, rank=s))
    return EngineGroup(engines, abort_hooks=[box.abort])


def double(fn: Callable[[int, list], list]) -> Callable[[int, list], list]:
    return lambda it, xs: fn(it, xs) * 2


def calibrate(t: float, n: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(n):
        time.sleep(t)
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--kernel-ms", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--trace", type=Path, help="write the Chrome trace of the 1F1B run here (open in Perfetto)"
    )
    args = parser.parse_args()
    p, m = args.stages, args.micro_batches
    t = (2.0 if args.quick else args.kernel_ms) / 1000
    t_real = calibrate(t)
    ideal, ideal_real = (m + p - 1) * 2 * t, (m + p - 1) * 2 * t_real
    rule = lambda s: p - s  # noqa: E731  (1F1B: stage s holds at most p - s activations)
    configs = [
        ("1F1B rule, one engine", lambda: one_engine(p, m, t, rule, 1, args.trace is not None), rule),
        ("all counts 1, one engine", lambda: one_engine(p, m, t, lambda s: 1, 1), lambda s: 1),
        ("2 x stages slots, one engine", lambda: one_engine(p, m, t, lambda s: 2 * p, 1), lambda s: 2 * p),
        ("1F1B rule, 4 ranks + mailbox", lambda: group(p, m, t, rule, 1), rule),
    ]
    print(
        f"{p} stages x {m} micro-batches, kernel {t * 1e3:.1f} ms (sleep really takes {t_real * 1e3:.3f} ms)"
    )
    print(
        f"ideal step (m + p - 1) x (t_F + t_B) = {ideal * 1e3:.1f} ms ({ideal_real * 1e3:.1f} ms calibrated)"
    )
    print(
        f"{'configuration':<32} {'step ms':>8} {'/ideal':>7} {'/calib':>7}  peak live activations per stage"
    )
    for name, build, counts in configs:
        steps = []
        for _ in range(args.repeat):  # the median of a few runs: this machine is shared
            runner = build()
            start = time.perf_counter()
            out = runner.run(timeout=120)
            steps.append(time.perf_counter() - start)
        step = sorted(steps)[len(steps) // 2]
        if isinstance(out, dict):  # a group: register 0 of each rank is its activation
            peaks = [out[s].peak_live[0] for s in range(p)]
        else:
            peaks = [out.peak_live[3 * s + 1] for s in range(p)]
        slots = [counts(s) for s in range(p)]
        if args.trace is not None and not isinstance(out, dict) and out.trace:
            write_chrome_trace(out.trace, args.trace)
        flag = "ok" if step / ideal_real <= TARGET else "over target"
        print(
            f"{name:<32} {step * 1e3:>8.1f} {step / ideal:>7.3f} {step / ideal_real:>7.3f}  "
            f"{peaks} of {slots} slots  {flag}"
        )


if __name__ == "__main__":
    main()
