"""TensorBoard scalars (issue 17): what writing them costs a run, against the same run without them
(target <= 1.02), and what one scalar costs the board against tensorboardX's SummaryWriter called
directly (the writer the board wraps).

    python bench/control_plane/tensorboard.py          # GPT example, 40 steps x 7 repetitions
    python bench/control_plane/tensorboard.py --quick  # 10 steps x 3

Runs: ``sf.run(job, backend="inprocess")`` of the GPT example with and without ``tensorboard_dir``,
alternately (who goes first alternates too); the engine's wall time (``RunResult.seconds``) of each,
medians compared. Per scalar: the caller's time per ``ScalarBoard.on_step`` (four scalars, queued for
the board's own thread) against four ``SummaryWriter.add_scalar`` calls on the caller's thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sbpflow as sf  # noqa: E402
from bench._shared import load_example  # noqa: E402
from sbpflow.control_plane.launch.tensorboard_scalars import ScalarBoard  # noqa: E402
from sbpflow.v1 import service_pb2 as sp  # noqa: E402


def runs(steps: int, repeat: int) -> tuple[float, float]:
    job = load_example("gpt").make_job(steps=steps)
    plain, board = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            order = (False, True) if i % 2 == 0 else (True, False)
            for with_board in order:
                where = str(Path(tmp) / str(i)) if with_board else None
                r = sf.run(job, backend="inprocess", timeout=600, tensorboard_dir=where)
                (board if with_board else plain).append(r.seconds / steps)
    return statistics.median(plain), statistics.median(board)


def per_scalar(n: int) -> tuple[float, float]:
    from tensorboardX import SummaryWriter

    job = load_example("gpt").make_job(steps=1)
    m = sp.StepMetrics(step=1, loss=2.5, samples_per_second=100.0, step_seconds=0.01)
    with tempfile.TemporaryDirectory() as tmp:
        with ScalarBoard(Path(tmp) / "board", job) as board:
            t = time.perf_counter()
            for i in range(n):
                m.step = i + 1
                board.on_step(m)
            ours = (time.perf_counter() - t) / n
        w = SummaryWriter(str(Path(tmp) / "direct"))
        t = time.perf_counter()
        for i in range(n):
            for tag in ("loss/train", "throughput/samples_per_second", "time/step_seconds", "lr"):
                w.add_scalar(tag, 1.0, i)
        direct = (time.perf_counter() - t) / n
        w.close()
    return ours, direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    steps, repeat = (10, 3) if a.quick else (a.steps, a.repeat)
    plain, board = runs(steps, repeat)
    print(f"step, without scalars: {plain * 1e3:.2f} ms; with: {board * 1e3:.2f} ms")
    print(f"ratio with/without: {board / plain:.3f} (target <= 1.02)")
    ours, direct = per_scalar(2000)
    print(
        f"a step's scalars on the caller's thread: board {ours * 1e6:.1f} us, SummaryWriter {direct * 1e6:.1f} us"
    )


if __name__ == "__main__":
    main()
