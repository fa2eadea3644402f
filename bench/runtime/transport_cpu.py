"""CPU transport throughput between two processes on this host: sbpflow over shared memory, sbpflow over
TCP (loopback; the ranks get different host ids), and torch.distributed with gloo, side by side.

    python bench/runtime/transport_cpu.py          # 1 MB and 64 MB float32, 7 alternating repetitions
    python bench/runtime/transport_cpu.py --quick  # a smoke run in seconds

Two spawned processes each hold all three: an sbpflow ``CpuTransport`` with shared memory, one without,
and a gloo process group (torch==2.13.0, the ``bench`` extra). Every repetition runs each backend in
turn (the order rotates) over the same cases, a barrier before each case; the figure is the median over
repetitions. Per case, for an array of |T| bytes:
- ``all_reduce``: |T| / time of one all-reduce of both ranks' arrays (algorithm bandwidth); sbpflow hands
  back a fresh result, gloo sums in place;
- ``send/recv``: a ping-pong — rank 0 sends |T|, rank 1 receives it and sends it back — |T| / half the
  round trip.
and, per backend, the CPU time of a call on rank 0 (its process, every thread: the receive threads' and
gloo's own), which is what a worker whose core is busy computing pays. ``--job`` adds the main job's
cases (examples/charlm.py on 2 workers: its 8-byte token-count and loss all-reduces and its 964,608-byte
gradient bucket). The issue's targets: sbpflow >= gloo (ratio >= 1.0) and shared memory faster than
TCP. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MB = 1 << 20
BACKENDS = ["sbpflow-shm", "sbpflow-tcp", "gloo"]


class Gloo:
    """torch.distributed's gloo behind the calls this benchmark makes."""

    def __init__(self, rank: int, port: int) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch, self.dist, self.rank = torch, dist, rank
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=__import__("datetime").timedelta(seconds=120),
        )

    def all_reduce(self, x: np.ndarray) -> Any:
        t = self.torch.from_numpy(x)
        self.dist.all_reduce(t)
        return t

    def send(self, x: np.ndarray, dst: int) -> None:
        self.dist.send(self.torch.from_numpy(x), dst)

    def recv(self, x: np.ndarray, src: int) -> np.ndarray:
        self.dist.recv(self.torch.from_numpy(x), src)
        return x

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


class Sbpflow:
    def __init__(self, transport: Any) -> None:
        self.t = transport

    def all_reduce(self, x: np.ndarray) -> Any:
        return self.t.all_reduce(x, (0, 1), "ar")

    def send(self, x: np.ndarray, dst: int) -> None:
        self.t.send(x, dst, "pp")

    def recv(self, x: np.ndarray, src: int) -> np.ndarray:
        return self.t.recv(src, "pp")  # type: ignore[no-any-return]

    def barrier(self) -> None:
        self.t.all_reduce(np.zeros(1), (0, 1), "barrier")

    def close(self) -> None:
        self.t.close()


def _case(b: Any, rank: int, op: str, x: np.ndarray, iters: int) -> tuple[float, float]:
    """Seconds per operation (rank 0's clock) and this process's CPU seconds per operation, after a
    warm-up and a barrier."""

    def once() -> None:
        if op == "all_reduce":
            b.all_reduce(x)
        elif rank == 0:
            b.send(x, 1)
            b.recv(x, 1)
        else:
            b.send(b.recv(x, 0), 0)

    once()
    b.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        once()
    elapsed, used = time.perf_counter() - start, time.process_time() - cpu
    per = iters * (2 if op == "send/recv" else 1)
    return elapsed / per, used / per


def _worker(rank: int, conn: Any, port: int, cases: list[tuple[str, int, int]], reps: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import faulthandler

    faulthandler.enable()
    from sbpflow.actor_workers.transport.cpu.transport import CpuTransport

    shm = CpuTransport(rank, timeout=120, shared_memory=True)
    tcp = CpuTransport(rank, timeout=120, shared_memory=True, host_id=f"bench-host-{rank}")
    conn.send((shm.endpoint, tcp.endpoint))
    shm_eps, tcp_eps = conn.recv()
    shm.connect(shm_eps)
    tcp.connect(tcp_eps)
    backends = {"sbpflow-shm": Sbpflow(shm), "sbpflow-tcp": Sbpflow(tcp), "gloo": Gloo(rank, port)}
    arrays = {nbytes: np.zeros(max(1, nbytes // 4), np.float32) for _, nbytes, _ in cases}
    times: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for rep in range(reps):
        order = BACKENDS[rep % 3 :] + BACKENDS[: rep % 3]
        for name in order:
            for op, nbytes, iters in cases:
                times.setdefault((name, op, nbytes), []).append(
                    _case(backends[name], rank, op, arrays[nbytes], iters)
                )
    for b in backends.values():
        b.close()
    conn.send(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 MB and 8 MB, 2 repetitions")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--job", action="store_true", help="also the main job's sizes: 8 B and 964,608 B")
    args = p.parse_args()
    sizes = [(1 * MB, 40), (8 * MB, 4)] if args.quick else [(1 * MB, 100), (64 * MB, 5)]
    if args.job:
        sizes = [(8, 400), (964_608, 200), *sizes]
    reps = 2 if args.quick else args.repeat
    cases = [(op, nbytes, iters) for op in ("all_reduce", "send/recv") for nbytes, iters in sizes]
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, pipes[r][1], port, cases, reps)) for r in range(2)]
    for proc in procs:
        proc.start()
    eps = [pipes[r][0].recv() for r in range(2)]
    for r in range(2):
        pipes[r][0].send(([e[0] for e in eps], [e[1] for e in eps]))
    while not pipes[0][0].poll(0.5):
        if any(proc.exitcode is not None for proc in procs):
            time.sleep(2)
            for proc in procs:
                proc.kill()
                proc.join()
            raise SystemExit(f"a worker failed: exit codes {[proc.exitcode for proc in procs]}")
    times = pipes[0][0].recv()
    pipes[1][0].recv()
    for proc in procs:
        proc.join()
    print(
        f"2 processes on this host ({os.cpu_count()} cores), float32, median of {reps} repetitions; GB/s = 1e9 bytes/s"
    )
    print(
        f"{'case':<22}"
        + "".join(f"{b:>14}" for b in BACKENDS)
        + f"{'shm/gloo':>10}{'tcp/gloo':>10}{'shm/tcp':>9}"
        + "".join(f"{b + ' CPU us':>20}" for b in BACKENDS)
        + f"   load {os.getloadavg()[0]:.1f}"
    )
    for op, nbytes, _ in cases:
        gbps = {b: nbytes / statistics.median(t for t, _ in times[(b, op, nbytes)]) / 1e9 for b in BACKENDS}
        cpu = {b: statistics.median(c for _, c in times[(b, op, nbytes)]) * 1e6 for b in BACKENDS}
        size = f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes:,} B"
        row = f"{op + ' ' + size:<22}" + "".join(f"{gbps[b]:>14.2f}" for b in BACKENDS)
        row += f"{gbps['sbpflow-shm'] / gbps['gloo']:>10.2f}{gbps['sbpflow-tcp'] / gbps['gloo']:>10.2f}"
        row += f"{gbps['sbpflow-shm'] / gbps['sbpflow-tcp']:>9.2f}"
        row += "".join(f"{cpu[b]:>20.1f}" for b in BACKENDS)
        print(row)


if __name__ == "__main__":
    main()
