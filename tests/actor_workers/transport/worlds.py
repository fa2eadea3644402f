"""Transport worlds for tests: one connected :class:`Transport` per rank, of any kind, behind one call.

``world(kind, ranks, timeout)`` is a context manager yielding ``{rank: Transport}``; on exit every transport
is closed. ``WORLDS`` is the registry of kinds (it refuses duplicates); the conformance suite runs each of
its tests on every kind there, so a new transport joins the suite by registering one :class:`World`.

Rules a kind keeps:

- Its transports take and return numpy arrays. A transport that works on other arrays (NCCL on cupy) is
  registered behind an adapter that converts at the boundary, so the numpy oracles here judge it.
- ``abort`` on any one of its transports reaches every rank (the contract's rule), so ``spmd`` can unblock
  a hung test through any of them.
- ``marks`` go on every test of the kind: a GPU kind carries ``pytest.mark.skipif(<no GPU>)`` and runs
  where there is one.

An NCCL kind, for instance, would be ``World("nccl", nccl_threads, marks=(skipif(gpu_count() < 4),))``
where ``nccl_threads`` gives each rank an ``NcclTransport`` on its own device (``SharedUids`` for the ids,
``on_abort`` reaching the other ranks) wrapped in a numpy <-> cupy adapter.

The helpers (``spmd``, ``values``, ``logical``, ``cut``, ``assert_same_bits``, ``assert_sum``) are shared by
the conformance suite and the per-transport test files.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pytest

from sbpflow.actor_workers.transport.base import Transport
from sbpflow.actor_workers.transport.cpu.transport import CpuTransport
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.sharding import split_range

JOIN_TIMEOUT = 20.0  # a rank-thread still running after this is hung: spmd aborts the world and fails
GROUPS = [(0, 1), (0, 1, 2), (0, 1, 2, 3), (2, 0, 3, 1)]  # the last is out of order: results follow it
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_]
LARGE = (512, 1100)  # float32: 2.2 MB, a transport's bulk path (the CPU ring), not its small-message one
HUGE = (1000, 1500)  # float32: 6 MB, more than one chunk of a transport's staging buffers

Opener = Callable[[Sequence[int], float], AbstractContextManager[Mapping[int, Transport]]]
T = TypeVar("T", bound=Transport)


@dataclass(frozen=True)
class World:
    """A kind of world: its name (the test id) and how to open one over ``ranks`` with ``timeout``."""

    name: str
    open: Opener
    marks: tuple[pytest.MarkDecorator, ...] = ()

    def param(self) -> Any:
        return pytest.param(self.name, marks=self.marks, id=self.name)


WORLDS: dict[str, World] = {}


def register(kind: World) -> None:
    if kind.name in WORLDS:
        raise ValueError(
            f"a world kind named {kind.name!r} is already registered: give the new one another name"
        )
    WORLDS[kind.name] = kind


@contextmanager
def world(
    kind: str, ranks: Sequence[int] = (0, 1, 2, 3), timeout: float = 10.0
) -> Iterator[Mapping[int, Transport]]:
    """One connected transport of ``kind`` per rank; all of them closed on exit."""
    if kind not in WORLDS:
        raise ValueError(
            f"no world kind {kind!r}: the kinds are {sorted(WORLDS)} (register new ones in worlds.py)"
        )
    with WORLDS[kind].open(ranks, timeout) as ts:
        yield ts


@contextmanager
def inprocess(ranks: Sequence[int], timeout: float) -> Iterator[Mapping[int, Transport]]:
    with InProcessWorld(ranks, timeout=timeout) as w:
        yield {r: w.transport(r) for r in ranks}


@contextmanager
def cpu_mesh(
    ranks: Sequence[int] = (0, 1, 2, 3),
    timeout: float = 10.0,
    shared_memory: bool = True,
    host_ids: bool = False,
) -> Iterator[dict[int, CpuTransport]]:
    """One connected CpuTransport per rank in this process; ``host_ids`` gives every rank its own host (TCP)."""
    ts = {
        r: CpuTransport(
            r, timeout=timeout, shared_memory=shared_memory, host_id=f"host-{r}" if host_ids else None
        )
        for r in ranks
    }
    try:
        endpoints = [t.endpoint for t in ts.values()]
        out = spmd(ts, lambda t: t.connect(endpoints, timeout=10.0))
        values(out)
        yield ts
    finally:
        for t in ts.values():
            t.close()


register(World("inprocess", inprocess))
register(World("cpu-shm", functools.partial(cpu_mesh, shared_memory=True)))
register(World("cpu-tcp", functools.partial(cpu_mesh, shared_memory=False)))


# -- running ranks ----------------------------------------------------------------------------------


def spmd(ts: Mapping[int, T], fn: Callable[[T], Any], ranks: Sequence[int] | None = None) -> dict[int, Any]:
    """Run ``fn(transport)`` on one thread per rank; a rank's result is its return value or its exception."""
    ranks = list(ts) if ranks is None else ranks
    out: dict[int, Any] = {}

    def body(r: int) -> None:
        try:
            out[r] = fn(ts[r])
        except BaseException as e:  # noqa: B036 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}") for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        next(iter(ts.values())).abort("test: a rank hung")
        for t in threads:
            t.join(JOIN_TIMEOUT)
        pytest.fail("a rank-thread did not finish in time")
    return out


def values(out: dict[int, Any]) -> dict[int, Any]:
    """``out`` itself when no rank raised; else the first rank's exception, raised."""
    errors = {r: v for r, v in out.items() if isinstance(v, BaseException)}
    if errors:
        raise next(iter(errors.values()))
    return out


# -- data and oracles -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def logical(shape: tuple[int, ...], dtype: Any, salt: int = 0) -> np.ndarray:
    """A random tensor (cached, so read-only: a transport that writes into its input fails loudly)."""
    rng = np.random.default_rng(salt)
    if dtype == np.bool_:
        x = rng.random(shape) < 0.3
    elif np.issubdtype(dtype, np.integer):
        x = rng.integers(-1000, 1000, size=shape).astype(dtype)
    else:
        x = rng.standard_normal(shape).astype(dtype)
    x.setflags(write=False)
    return x


def cut(x: np.ndarray, axis: int, parts: int, i: int) -> np.ndarray:
    lo, hi = split_range(x.shape[axis], parts, i)
    return x[(slice(None),) * axis + (slice(lo, hi),)]


def assert_same_bits(results: Sequence[np.ndarray]) -> None:
    first = results[0]
    for r in results[1:]:
        assert r.dtype == first.dtype and r.shape == first.shape, (r.dtype, r.shape, first.dtype, first.shape)
        assert r.tobytes() == first.tobytes()


def assert_sum(got: np.ndarray, expected: np.ndarray) -> None:
    """Exact for integers and bool; floats summed in another order agree to rounding."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.dtype)
    if np.issubdtype(got.dtype, np.floating):
        tol = 1e-2 if got.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, expected)
