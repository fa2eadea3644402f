"""How many BLAS / intra-op threads a rank's kernels run on (issue 14, thread discipline).

A kernel's GEMM runs on numpy's BLAS, whose thread pool is process-wide. Several workers on one host,
each with OpenBLAS's default of a thread per core, oversubscribe the host; so a Ray worker runs its
BLAS on as many threads as its device slots give it (its CPU bundle: 1 per CPU rank, 1 for a GPU
rank, whose kernels run on the device). The in-process backend leaves the process's setting unless
the run asks (``RunOptions.threads``).

The thread count is set two ways: the environment variables (for libraries loaded later and child
processes) and, since numpy's BLAS is loaded by then, threadpoolctl's limits on the loaded pools (a
dependency: the variables alone do not reach a pool already loaded, so an in-process run's rank threads
each ran OpenBLAS on every core, twice the CPU a step on this 2-core machine's small GEMMs).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from threadpoolctl import threadpool_info, threadpool_limits

ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def slot_threads(cpus: float | None) -> int:
    """The BLAS threads for a worker holding ``cpus`` CPUs (at least 1)."""
    return max(1, int(cpus or 0))


def _limits(n: int) -> threadpool_limits:
    return threadpool_limits(limits=n)  # applies now, on every loaded pool (BLAS and OpenMP)


def pin(n: int) -> None:
    """This process's kernels on ``n`` threads from now on (a worker process, at its start)."""
    for var in ENV_VARS:
        os.environ[var] = str(n)
    _limits(n)


@contextlib.contextmanager
def limited(n: int | None) -> Iterator[None]:
    """Within the block, the loaded thread pools on ``n`` threads (0 or None: as they are)."""
    limits = _limits(n) if n else None
    try:
        yield
    finally:
        if limits is not None:
            limits.restore_original_limits()


def blas_threads() -> int | None:
    """numpy's BLAS threads now (None where no BLAS pool is loaded)."""
    counts = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
    return max(counts) if counts else None
