"""The NCCL transport on real GPUs. One GPU: a one-rank world runs every collective through NCCL, a self
send/recv, the stream discipline (inputs read before the caller overwrites them), abort and close. More
than one GPU: ranks as threads, one device each, every collective (uneven splits included), a sub-group,
point-to-point messages out of tag order and a mismatch, each against the in-process transport on numpy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.transport.base import Transport, TransportAborted, TransportError
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.actor_workers.transport.nccl.headers import NCCL_TYPES, nccl_type
from sbpflow.actor_workers.transport.nccl.transport import NcclTransport, SharedUids
from tests.gpu.conftest import gpu_count

DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.bool_]


@pytest.fixture(scope="module")
def one(cp: ModuleType) -> Iterator[NcclTransport]:
    t = NcclTransport(0, [0], NcclTransport.unique_id(), device=0, timeout=60.0)
    yield t
    t.close()


def sample(cp: ModuleType, shape: tuple[int, ...], dtype: Any, seed: int = 0) -> Any:
    x = np.random.default_rng(seed).uniform(-3, 3, size=shape)
    return cp.asarray(x > 0 if dtype == np.bool_ else x.astype(dtype))


def fresh(cp: ModuleType, got: Any, x: Any) -> None:
    """``got`` is a cupy array equal to ``x`` that shares no memory with it."""
    assert isinstance(got, cp.ndarray) and got.dtype == x.dtype and got.shape == x.shape
    cp.testing.assert_array_equal(got, x)
    assert got.size == 0 or got.data.ptr != x.data.ptr, "the result aliases the input"


def test_the_transport_is_a_transport(one: NcclTransport) -> None:
    assert isinstance(one, Transport)


def test_the_dtype_table_is_cupys_nccl_constants(cp: ModuleType) -> None:
    from cupy.cuda import nccl

    names = {"ncclInt8": "NCCL_INT8", "ncclUint8": "NCCL_UINT8", "ncclInt32": "NCCL_INT32"}
    names |= {"ncclUint32": "NCCL_UINT32", "ncclInt64": "NCCL_INT64", "ncclUint64": "NCCL_UINT64"}
    names |= {"ncclFloat16": "NCCL_FLOAT16", "ncclFloat32": "NCCL_FLOAT32", "ncclFloat64": "NCCL_FLOAT64"}
    for dtype, t in NCCL_TYPES.items():
        if t.name == "ncclBfloat16":  # cupy.cuda.nccl has no constant for it: nccl.h's value, after float64
            assert t.code == nccl.NCCL_FLOAT64 + 1
            continue
        assert t.code == getattr(nccl, names[t.name]), dtype
    assert (nccl.NCCL_SUM, nccl.NCCL_MAX) == (0, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_collective_on_a_one_rank_world(cp: ModuleType, one: NcclTransport, dtype: Any) -> None:
    x = sample(cp, (3, 5, 2), dtype)
    fresh(cp, one.all_reduce(x, (0,), "ar"), x)
    fresh(cp, one.reduce_scatter(x, (0,), 1, "rs"), x)
    fresh(cp, one.all_gather(x, (0,), -1, "ag"), x)
    fresh(cp, one.all_to_all(x, (0,), 0, 2, "a2a"), x)
    fresh(cp, one.broadcast(x, 0, (0,), "bc"), x)


@pytest.mark.parametrize("shape", [(), (0, 4), (1,)])
def test_scalars_and_empty_arrays(cp: ModuleType, one: NcclTransport, shape: tuple[int, ...]) -> None:
    x = sample(cp, shape, np.float32)
    fresh(cp, one.all_reduce(x, (0,), "ar"), x)
    if shape:
        fresh(cp, one.all_gather(x, (0,), 0, "ag"), x)


def test_non_contiguous_and_host_inputs(cp: ModuleType, one: NcclTransport) -> None:
    x = sample(cp, (6, 4), np.float64).T  # a transposed view
    fresh(cp, one.all_reduce(x, (0,), "t"), cp.ascontiguousarray(x))
    host = np.arange(5.0)
    got = one.all_gather(host, (0,), 0, "host")
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(got.get(), host)


def test_the_comm_stream_reads_inputs_before_the_caller_overwrites_them(
    cp: ModuleType, one: NcclTransport
) -> None:
    with cp.cuda.Stream(non_blocking=True):  # the caller's work runs on a stream of its own
        x = cp.arange(1 << 24, dtype=cp.float32) * 2  # enqueued, maybe not yet run
        out = one.all_reduce(x, (0,), "race")
        x.fill(-1)  # enqueued after the call: must not reach what NCCL read
        sent = x[:8].copy()
        one.send(x, 0, "race")  # send copies too
        x.fill(7)
        got = one.recv(0, "race")
        assert float(out[-1]) == 2 * ((1 << 24) - 1) and bool((out >= 0).all())
        cp.testing.assert_array_equal(got[:8], sent)


def test_self_send_recv_is_fifo_per_tag(cp: ModuleType, one: NcclTransport) -> None:
    a, b, c = (cp.full((2,), v, cp.float32) for v in (1, 2, 3))
    one.send(a, 0, "x")
    one.send(b, 0, "y")
    one.send(c, 0, "x")
    a.fill(0)  # the message is a copy
    assert [float(one.recv(0, t)[0]) for t in ("y", "x", "x")] == [2.0, 1.0, 3.0]


def test_a_self_recv_nothing_was_sent_for_times_out_naming_the_tag(cp: ModuleType) -> None:
    with NcclTransport(0, [0], NcclTransport.unique_id(), timeout=0.3) as t:
        with pytest.raises(TransportError, match=r"recv from itself tag 'never'"):
            t.recv(0, "never")


def test_a_group_other_than_the_world_needs_uid_for(cp: ModuleType) -> None:
    x = cp.ones(3)
    with NcclTransport(0, [0, 1], NcclTransport.unique_id(), timeout=30) as t:
        with pytest.raises(TransportError, match=r"collective:0 is not the world \(\[0, 1\]\).*uid_for"):
            t.all_reduce(x, (0,), "sub")
    uids = SharedUids()
    with NcclTransport(0, [0, 1], NcclTransport.unique_id(), uid_for=uids, timeout=30) as t:
        fresh(cp, t.all_reduce(x, (0,), "sub"), x)


def test_an_unmovable_dtype_is_refused_before_any_communication(cp: ModuleType, one: NcclTransport) -> None:
    with pytest.raises(TransportError, match="cannot move dtype complex64"):
        one.all_reduce(cp.ones(2, cp.complex64), (0,), "c")
    fresh(cp, one.all_reduce(cp.ones(2), (0,), "after"), cp.ones(2))  # the communicator is still in step


def test_abort_fails_every_later_call_and_tells_the_hook_once(cp: ModuleType) -> None:
    told: list[str] = []
    t = NcclTransport(0, [0], NcclTransport.unique_id(), on_abort=told.append)
    t.all_reduce(cp.ones(4), (0,), "warm")  # a communicator to abort
    t.abort("rank 3 failed: boom")
    t.abort("a second reason")
    assert told == ["rank 3 failed: boom"]
    for call in (
        lambda: t.all_reduce(cp.ones(4), (0,), "x"),
        lambda: t.send(cp.ones(1), 0, "s"),
        lambda: t.recv(0, "s"),
    ):
        with pytest.raises(TransportAborted, match="^rank 3 failed: boom$"):
            call()
    t.close()


def test_a_closed_transport_refuses_calls(cp: ModuleType) -> None:
    t = NcclTransport(0, [0], NcclTransport.unique_id())
    t.all_reduce(cp.ones(4), (0,), "warm")
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.all_reduce(cp.ones(4), (0,), "x")


# -- more than one GPU: ranks as threads, against the in-process transport --------------------------

N = gpu_count()
multi = pytest.mark.skipif(N < 2, reason=f"needs more than one GPU (this machine has {N})")


def on_every_rank(
    cp: ModuleType, fn: Callable[[int, Any, ModuleType], Any]
) -> tuple[dict[int, Any], dict[int, Any]]:
    """``fn(rank, transport, xp)`` on NCCL (one thread and device per rank) and on the in-process world
    (numpy); the results by rank, host copies for NCCL; an exception is a result too."""
    ranks, uid, uids = list(range(N)), NcclTransport.unique_id(), SharedUids()
    got: dict[int, Any] = {}

    def worker(r: int) -> None:
        with cp.cuda.Device(r), NcclTransport(r, ranks, uid, device=r, uid_for=uids, timeout=60) as t:
            try:
                out = fn(r, t, cp)
                got[r] = [o.get() for o in out] if isinstance(out, list) else out.get()
            except Exception as e:
                got[r] = e

    threads = [threading.Thread(target=worker, args=(r,)) for r in ranks]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    want: dict[int, Any] = {}

    def reference(r: int, world: InProcessWorld) -> None:
        try:
            want[r] = fn(r, world.transport(r), np)
        except Exception as e:
            want[r] = e

    with InProcessWorld(ranks, timeout=60) as world:
        refs = [threading.Thread(target=reference, args=(r, world)) for r in ranks]
        for th in refs:
            th.start()
        for th in refs:
            th.join(120)
    return got, want


def rank_array(xp: ModuleType, r: int, shape: tuple[int, ...]) -> Any:
    return xp.asarray(np.random.default_rng(r).standard_normal(shape))


COLLECTIVES: dict[str, Callable[[int, Any, ModuleType], Any]] = {
    "all_reduce": lambda r, t, xp: t.all_reduce(rank_array(xp, r, (3, 4)), tuple(range(N)), "ar"),
    "reduce_scatter_uneven": lambda r, t, xp: t.reduce_scatter(
        rank_array(xp, r, (3, 2 * N + 1)), tuple(range(N)), 1, "rs"
    ),
    "all_gather_uneven": lambda r, t, xp: t.all_gather(
        rank_array(xp, r, (2, r + 1)), tuple(range(N)), 1, "ag"
    ),
    "all_to_all": lambda r, t, xp: t.all_to_all(
        rank_array(xp, r, (2 * N + 1, r + 2)), tuple(range(N)), 0, 1, "a2a"
    ),
    "broadcast": lambda r, t, xp: t.broadcast(
        rank_array(xp, r, (5,)) if r == 1 else None, 1, tuple(range(N)), "bc"
    ),
    "sub_group_reversed": lambda r, t, xp: (
        t.all_gather(rank_array(xp, r, (r + 1, 2)), (1, 0), 0, "sub") if r < 2 else xp.zeros(1)
    ),
}


@multi
@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collectives_across_gpus_match_the_in_process_transport(cp: ModuleType, name: str) -> None:
    got, want = on_every_rank(cp, COLLECTIVES[name])
    for r in range(N):
        assert not isinstance(got[r], Exception), f"rank {r}: {got[r]!r}"
        np.testing.assert_allclose(got[r], want[r], rtol=1e-12, err_msg=f"{name} rank {r}")


@multi
def test_messages_arrive_per_tag_whatever_order_they_are_received_in(cp: ModuleType) -> None:
    def ring(r: int, t: Any, xp: ModuleType) -> list[Any]:
        nxt, prev = (r + 1) % N, (r - 1) % N
        t.send(rank_array(xp, r, (4,)), nxt, "first")
        t.send(rank_array(xp, r + 10, (2, 3)), nxt, "second")
        return [t.recv(prev, "second"), t.recv(prev, "first")]

    got, want = on_every_rank(cp, ring)
    for r in range(N):
        for g, w in zip(got[r], want[r], strict=True):
            np.testing.assert_array_equal(g, w)


@multi
def test_members_that_disagree_get_an_error_naming_both(cp: ModuleType) -> None:
    got, _ = on_every_rank(cp, lambda r, t, xp: t.all_reduce(xp.ones(4 + r), tuple(range(N)), "mismatch"))
    for r in range(N):
        assert isinstance(got[r], TransportError), got[r]
        assert "rank 0 called all_reduce(tag='mismatch'" in str(got[r]) and "float64[5]" in str(got[r])


def test_nccl_type_accepts_every_dtype_the_tests_move() -> None:
    assert all(nccl_type(d) for d in DTYPES)
