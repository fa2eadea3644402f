"""The CPU transport: the in-process transport's semantics (every collective against numpy, uneven splits,
every dtype, 0-d, empty and non-contiguous arrays, point-to-point order, mismatches, aborts, timeouts) for
ranks that each own their transport and sockets — on threads of this process for speed, over shared
memory and over TCP — and between real processes, one of which is SIGKILLed mid-collective."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.transport import (
    CpuTransport,
    Endpoint,
    Transport,
    TransportAborted,
    TransportError,
)
from sbpflow.actor_workers.transport.cpu_collectives import DIRECT_BYTES
from sbpflow.actor_workers.transport.cpu_links import SLOT_BYTES
from sbpflow.sharding import split_range

JOIN_TIMEOUT = 20.0
GROUPS = [(0, 1), (0, 1, 2), (0, 1, 2, 3), (2, 0, 3, 1)]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_]
MODES = ["shm", "tcp"]
BIG = (512, 1100)  # float32: 2.2 MB, above the direct limit for every group (the ring path)
assert BIG[0] * BIG[1] * 4 > DIRECT_BYTES
assert 6_000_000 * 4 > SLOT_BYTES  # the 6 MB arrays below span several shared-memory slots


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before]
    assert not left, f"threads left behind: {left}"


def connect_all(transports: Sequence[CpuTransport], timeout: float = 10.0) -> None:
    endpoints = [t.endpoint for t in transports]
    errors: list[BaseException] = []

    def body(t: CpuTransport) -> None:
        try:
            t.connect(endpoints, timeout=timeout)
        except BaseException as e:  # noqa: B036 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(t,)) for t in transports]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


@contextmanager
def mesh(
    ranks: Sequence[int] = (0, 1, 2, 3), mode: str = "shm", timeout: float = 10.0, host_ids: bool = False
) -> Iterator[dict[int, CpuTransport]]:
    """One connected CpuTransport per rank in this process; ``host_ids`` gives every rank its own host."""
    ts = {
        r: CpuTransport(
            r, timeout=timeout, shared_memory=mode == "shm", host_id=f"host-{r}" if host_ids else None
        )
        for r in ranks
    }
    try:
        connect_all(list(ts.values()))
        yield ts
    finally:
        for t in ts.values():
            t.close()


def spmd(
    ts: dict[int, CpuTransport], fn: Callable[[CpuTransport], Any], ranks: Sequence[int] | None = None
) -> dict[int, Any]:
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
    errors = {r: v for r, v in out.items() if isinstance(v, BaseException)}
    if errors:
        raise next(iter(errors.values()))
    return out


def logical(shape: tuple[int, ...], dtype: Any, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(salt)
    if dtype == np.bool_:
        return rng.random(shape) < 0.3
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def cut(x: np.ndarray, axis: int, parts: int, i: int) -> np.ndarray:
    lo, hi = split_range(x.shape[axis], parts, i)
    return x[(slice(None),) * axis + (slice(lo, hi),)]


def assert_same_bits(results: Sequence[np.ndarray]) -> None:
    first = results[0]
    for r in results[1:]:
        assert r.dtype == first.dtype and r.shape == first.shape
        assert r.tobytes() == first.tobytes()


def assert_sum(got: np.ndarray, expected: np.ndarray) -> None:
    """Exact for integers and bool; floats summed in another order agree to rounding."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if np.issubdtype(got.dtype, np.floating):
        tol = 1e-2 if got.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, expected)


# -- collectives ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", GROUPS)
def test_all_reduce_small_sums_in_group_order_and_large_rings_bit_identically(
    mode: str, group: tuple[int, ...]
) -> None:
    small = {r: logical((10, 3), np.float64, salt=r) for r in group}
    big = {r: logical(BIG, np.float32, salt=r) for r in group}
    with mesh(mode=mode) as ts:
        out = values(
            spmd(
                ts,
                lambda t: (t.all_reduce(small[t.rank], group, "s"), t.all_reduce(big[t.rank], group, "b")),
                group,
            )
        )
    s = [out[r][0] for r in group]
    b = [out[r][1] for r in group]
    assert_same_bits(s + [functools.reduce(np.add, [small[r] for r in group])])  # direct: group order
    assert_same_bits(b)
    assert_sum(b[0], functools.reduce(np.add, [big[r] for r in group]))
    # results are private: writing one changes neither the others nor the inputs
    b[0][...] = 0
    assert_sum(b[1], functools.reduce(np.add, [big[r] for r in group]))
    np.testing.assert_array_equal(big[group[0]], logical(BIG, np.float32, salt=group[0]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_every_dtype_small_and_large(mode: str, dtype: Any) -> None:
    group = (0, 1, 2)
    shapes = [(10, 3), (700, 400)]
    inputs = {r: [logical(s, dtype, salt=r) for s in shapes] for r in group}
    with mesh(group, mode=mode) as ts:
        out = values(
            spmd(ts, lambda t: [t.all_reduce(x, group, f"t{i}") for i, x in enumerate(inputs[t.rank])])
        )
    for i in range(len(shapes)):
        expected = functools.reduce(np.add, [inputs[r][i] for r in group])
        assert_same_bits([out[r][i] for r in group])
        assert_sum(out[0][i], expected)


@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_of_non_contiguous_scalar_and_empty_arrays(mode: str) -> None:
    base = {r: logical((600, 800), np.float64, salt=r) for r in range(3)}
    with mesh((0, 1, 2), mode=mode) as ts:
        out = values(
            spmd(
                ts,
                lambda t: (
                    t.all_reduce(base[t.rank].T[::2], (0, 1, 2), "t"),
                    t.all_reduce(np.float64(t.rank), (0, 1, 2), "s"),
                    t.all_reduce(np.zeros((0, 4), np.int32), (0, 1, 2), "e"),
                    t.all_gather(np.zeros((0, 4)), (0, 1, 2), 0, "ge"),
                ),
            )
        )
    assert_sum(out[1][0], sum(b.T[::2] for b in base.values()))
    assert out[2][1].shape == () and out[2][1] == 3.0 and isinstance(out[2][1], np.ndarray)
    assert out[0][2].shape == (0, 4) and out[0][2].dtype == np.int32
    assert out[0][3].shape == (0, 4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_scatter_gives_member_i_part_i_of_the_sum(
    mode: str, group: tuple[int, ...], axis: int
) -> None:
    shapes = [(10, 7), (400, 1001)]  # small (direct) and large (ring), uneven over 3 and 4
    inputs = {r: [logical(s, np.float64, salt=r) for s in shapes] for r in group}
    with mesh(mode=mode) as ts:
        out = values(
            spmd(
                ts,
                lambda t: [t.reduce_scatter(x, group, axis, f"rs{i}") for i, x in enumerate(inputs[t.rank])],
                group,
            )
        )
    for k in range(len(shapes)):
        total = functools.reduce(np.add, [inputs[r][k] for r in group])
        for i, r in enumerate(group):
            assert out[r][k].flags.c_contiguous
            assert_sum(out[r][k], np.ascontiguousarray(cut(total, axis, len(group), i)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_dtypes_and_negative_axis(dtype: Any) -> None:
    inputs = {r: logical((3, 10), dtype, salt=r) for r in range(4)}
    with mesh() as ts:
        out = values(spmd(ts, lambda t: t.reduce_scatter(inputs[t.rank], (0, 1, 2, 3), -1, "rs")))
    total = functools.reduce(np.add, inputs.values())
    assert [out[r].shape for r in range(4)] == [(3, 3), (3, 3), (3, 2), (3, 2)]
    assert out[0].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.concatenate([out[r] for r in range(4)], axis=1), total)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_concatenates_uneven_shards_in_group_order(
    mode: str, group: tuple[int, ...], dtype: Any
) -> None:
    x = logical((4, 10), dtype)
    n = len(group)
    shards = {r: cut(x, 1, n, i) for i, r in enumerate(group)}  # a dim of 10 over n: uneven for 3 and 4
    with mesh(mode=mode) as ts:
        out = values(spmd(ts, lambda t: t.all_gather(shards[t.rank], group, 1, "ag"), group))
    assert_same_bits([out[r] for r in group] + [x])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", GROUPS)
def test_all_to_all_s0_to_s1_reassembles_the_logical_tensor(mode: str, group: tuple[int, ...]) -> None:
    x = logical((10, 9, 2), np.int64)
    n = len(group)
    s0 = {r: cut(x, 0, n, i) for i, r in enumerate(group)}
    with mesh(mode=mode) as ts:
        out = values(spmd(ts, lambda t: t.all_to_all(s0[t.rank], group, 1, 0, "a2a"), group))
        for i, r in enumerate(group):
            np.testing.assert_array_equal(out[r], cut(x, 1, n, i))  # now S(1)
        back = values(spmd(ts, lambda t: t.all_to_all(out[t.rank], group, 0, 1, "a2a-back"), group))
    for r in group:
        np.testing.assert_array_equal(back[r], s0[r])


@pytest.mark.parametrize("mode", MODES)
def test_large_all_gather_all_to_all_and_broadcast(mode: str) -> None:
    x = logical((1000, 1500), np.float32)  # 6 MB
    group = (0, 1, 2)
    with mesh(group, mode=mode) as ts:
        out = values(
            spmd(
                ts,
                lambda t: (
                    t.all_gather(cut(x, 0, 3, t.rank), group, 0, "g"),
                    t.all_to_all(cut(x, 0, 3, t.rank), group, 1, 0, "a"),
                    t.broadcast(x if t.rank == 1 else None, 1, group, "b"),
                ),
            )
        )
    for r in group:
        assert_same_bits([out[r][0], x])
        np.testing.assert_array_equal(out[r][1], cut(x, 1, 3, r))
        assert_same_bits([out[r][2], x])
        assert not np.shares_memory(out[r][2], x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_copies_the_roots_array(mode: str, dtype: Any) -> None:
    group = (2, 0, 3, 1)
    root = group[-1]
    x = logical((5, 3), dtype)
    with mesh(mode=mode) as ts:
        out = values(spmd(ts, lambda t: t.broadcast(x if t.rank == root else None, root, group, "b"), group))
    assert_same_bits([out[r] for r in group] + [x])
    assert all(not np.shares_memory(out[r], x) for r in group)


def test_sub_groups_of_a_2x2_mesh_run_concurrently_on_non_contiguous_ranks() -> None:
    """Columns (10, 12), (11, 13) then rows (10, 11), (12, 13), many rounds, small and large."""
    col = {10: (10, 12), 12: (10, 12), 11: (11, 13), 13: (11, 13)}
    row = {10: (10, 11), 11: (10, 11), 12: (12, 13), 13: (12, 13)}

    def body(t: Transport) -> list[np.ndarray]:
        got = []
        for step in range(12):
            shape = (300, 300) if step % 4 == 0 else (4, 5)
            x = np.full(shape, float(t.rank + 10 * step))
            y = t.all_reduce(x, col[t.rank], f"col-{step}")
            got.append(t.all_gather(y[:4, :5], row[t.rank], 0, f"row-{step}"))
        return got

    with mesh((10, 11, 12, 13)) as ts:
        out = values(spmd(ts, body))
    for step in range(12):
        col_sum = {c: 2 * 10.0 * step + sum(c) for c in [(10, 12), (11, 13)]}
        expected = np.concatenate([np.full((4, 5), col_sum[(10, 12)]), np.full((4, 5), col_sum[(11, 13)])])
        assert_same_bits([out[r][step] for r in (10, 11, 12, 13)] + [expected])


def test_a_caller_may_overwrite_its_input_as_soon_as_the_call_returns() -> None:
    group = (0, 1, 2)

    def body(t: Transport) -> list[bool]:
        buf = np.empty(1 << 17)  # 1 MB: the ring path
        ok = []
        for step in range(6):
            buf[:] = t.rank + step
            s = t.all_reduce(buf, group, f"ar{step}")
            t.send(buf, (t.rank + 1) % 3, "p")
            buf[:] = -1e9  # garbage that a late reader would see
            got = t.recv((t.rank - 1) % 3, "p")
            ok.append(bool((s == 3 + 3 * step).all() and (got == (t.rank - 1) % 3 + step).all()))
        return ok

    with mesh(group) as ts:
        out = values(spmd(ts, body))
    assert all(all(v) for v in out.values())


# -- point to point ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_send_recv_keeps_fifo_order_per_tag_and_copies(mode: str) -> None:
    def body(t: Transport) -> Any:
        if t.rank == 0:
            buf = np.zeros(3, dtype=np.int64)
            big = np.zeros(300_000, dtype=np.float32)
            for i in range(100):
                buf[:] = i
                t.send(buf, 1, "a")  # reused buffer: only a copy keeps each message
                t.send(buf * -1, 1, "b")
                if i % 25 == 0:
                    big[:] = i
                    t.send(big, 1, "big")
            return None
        a = [int(t.recv(0, "a")[0]) for _ in range(50)]
        b = [int(t.recv(0, "b")[0]) for _ in range(100)]  # tag b drains independently of tag a
        a += [int(t.recv(0, "a")[0]) for _ in range(50)]
        big = [t.recv(0, "big") for _ in range(4)]
        return a, b, [(float(x.min()), float(x.max()), x.shape) for x in big]

    with mesh((0, 1), mode=mode) as ts:
        out = values(spmd(ts, body))
    assert out[1][:2] == (list(range(100)), [-i for i in range(100)])
    assert out[1][2] == [(float(i), float(i), (300_000,)) for i in (0, 25, 50, 75)]


def test_both_directions_at_once_with_large_messages_never_deadlock() -> None:
    """Every rank sends many MB to every other before receiving anything: the receive threads drain."""
    x = {r: logical((2_000_000,), np.float32, salt=r) for r in range(3)}

    def body(t: Transport) -> list[bool]:
        for k in range(2):
            for peer in range(3):
                if peer != t.rank:
                    t.send(x[t.rank] + k, peer, "many")
        return [
            bool(np.array_equal(t.recv(p, "many"), x[p] + k))
            for p in range(3)
            if p != t.rank
            for k in range(2)
        ]

    with mesh((0, 1, 2)) as ts:
        out = values(spmd(ts, body))
    assert all(all(v) for v in out.values())


@pytest.mark.parametrize("mode", MODES)
def test_a_message_sent_just_before_close_still_arrives(mode: str) -> None:
    x = logical((3_000_000,), np.float32)  # 12 MB: more chunks than the ring has slots
    with mesh((0, 1), mode=mode) as ts:
        ts[0].send(x, 1, "last")
        ts[0].close()  # at once: the reader's last credits find the socket closed
        assert_same_bits([ts[1].recv(0, "last"), x])
        with pytest.raises(TransportError, match="rank 0 closed its transport"):
            ts[1].recv(0, "last")


def test_recv_waits_for_a_later_send_self_send_works_and_dtypes_shapes_survive() -> None:
    def body(t: Transport) -> Any:
        if t.rank == 0:
            time.sleep(0.1)
            for i, d in enumerate(DTYPES):
                t.send(logical((2, 3), d, salt=i), 1, "typed")
            t.send(np.float32(7.5), 1, "scalar")
            t.send(np.ones(2), 0, "self")
            return t.recv(0, "self")
        return [t.recv(0, "typed") for _ in DTYPES] + [t.recv(0, "scalar")]

    with mesh((0, 1), mode="tcp") as ts:
        out = values(spmd(ts, body))
    np.testing.assert_array_equal(out[0], np.ones(2))
    for i, d in enumerate(DTYPES):
        assert_same_bits([out[1][i], logical((2, 3), d, salt=i)])
    assert out[1][-1].shape == () and out[1][-1].dtype == np.float32 and out[1][-1] == 7.5


def test_links_use_shared_memory_only_within_a_host() -> None:
    with mesh((0, 1), mode="shm") as ts:
        assert ts[0]._out[1].ring is not None and ts[0].endpoint.uds.startswith("@")
    with mesh((0, 1), mode="shm", host_ids=True) as ts:  # two "hosts": TCP even though both could map memory
        assert ts[0]._out[1].ring is None
        out = values(spmd(ts, lambda t: t.all_reduce(np.full(BIG, 1.0, np.float32), (0, 1), "x")))
        assert (out[0] == 2).all()
    with mesh((0, 1), mode="tcp") as ts:
        assert ts[0]._out[1].ring is None and ts[0].endpoint.uds == ""


# -- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "second, words",
    [
        (lambda t: t.all_gather(np.zeros((2, 2)), (0, 1), 0, "t"), ["all_reduce", "all_gather"]),
        (lambda t: t.all_reduce(np.zeros((2, 2)), (0, 1), "other"), ["'t'", "'other'"]),
        (lambda t: t.all_reduce(np.zeros((2, 3)), (0, 1), "t"), ["[2, 2]", "[2, 3]"]),
        (lambda t: t.all_reduce(np.zeros((2, 2), np.float32), (0, 1), "t"), ["float64", "float32"]),
        (lambda t: t.all_reduce(np.zeros((2, 2)), (1, 0), "t"), ["(0, 1)", "(1, 0)"]),
        (
            lambda t: t.all_reduce(np.zeros((400, 400)), (0, 1), "t"),
            ["[2, 2]", "[400, 400]"],
        ),  # ring vs direct
    ],
    ids=["kind", "tag", "shape", "dtype", "group-order", "large"],
)
def test_mismatched_collectives_raise_on_every_member_naming_both(
    second: Callable[[Transport], Any], words: list[str]
) -> None:
    with mesh((0, 1)) as ts:
        start = time.monotonic()
        out = spmd(ts, lambda t: t.all_reduce(np.zeros((2, 2)), (0, 1), "t") if t.rank == 0 else second(t))
        assert time.monotonic() - start < 3
        for r in (0, 1):
            assert isinstance(out[r], TransportError), out[r]
            msg = str(out[r])
            assert "rank 0" in msg and "rank 1" in msg and "does not match" in msg
            for w in words:
                assert w in msg
        # the next collective is not derailed
        again = values(spmd(ts, lambda t: t.all_reduce(np.ones(2), (0, 1), "next")))
        np.testing.assert_array_equal(again[0], [2.0, 2.0])


@pytest.mark.parametrize("mode", MODES)
def test_abort_reaches_every_blocked_rank_within_a_second(mode: str) -> None:
    blocked = threading.Barrier(4)

    def body(t: Transport) -> Any:
        if t.rank == 3:
            blocked.wait()
            time.sleep(0.2)  # let the others block
            t.abort("rank 3: kernel matmul failed")
            return time.monotonic()
        blocked.wait()
        if t.rank == 0:
            return t.recv(1, "never")
        return t.all_reduce(np.zeros(3), (1, 2, 3), "waits-for-3")  # rank 3 never joins

    with mesh(mode=mode, timeout=30) as ts:
        start = time.monotonic()
        out = spmd(ts, body)
        assert time.monotonic() - start < 1.5
        for r in (0, 1, 2):
            assert isinstance(out[r], TransportAborted) and str(out[r]) == "rank 3: kernel matmul failed"
        t1 = ts[1]  # every later call, on any rank, fails the same way
        for call in (lambda: t1.send(np.zeros(1), 0, "x"), lambda: t1.all_gather(np.zeros(1), (1,), 0, "y")):
            with pytest.raises(TransportAborted, match="kernel matmul failed"):
                call()


def test_a_missing_peer_times_out_naming_it_and_the_tag() -> None:
    with mesh((0, 1, 2), timeout=0.5) as ts:
        out = spmd(ts, lambda t: t.all_reduce(np.zeros(2), (0, 1, 2), "task-17"), ranks=[0, 1])
        for r in (0, 1):
            assert isinstance(out[r], TransportError)
            assert "rank 2" in str(out[r]) and "'task-17'" in str(out[r]), out[r]


def test_recv_times_out_naming_the_peer_the_tag_and_what_is_pending() -> None:
    with mesh((0, 1), timeout=0.3) as ts:
        ts[0].send(np.zeros(1), 1, "act-3")
        time.sleep(0.1)
        with pytest.raises(TransportError) as e:
            ts[1].recv(0, "act-4")
    msg = str(e.value)
    assert "rank 1" in msg and "rank 0" in msg and "'act-4'" in msg and "act-3" in msg


def test_a_closed_peer_fails_calls_that_need_it_at_once() -> None:
    with mesh((0, 1, 2), timeout=30) as ts:
        ts[2].close()
        start = time.monotonic()
        with pytest.raises(TransportError, match="rank 2 closed its transport"):
            ts[0].all_reduce(np.zeros(2), (0, 2), "x")
        with pytest.raises(TransportError, match="rank 2"):
            ts[1].send(np.zeros(2), 2, "y")
        assert time.monotonic() - start < 2
        out = values(spmd(ts, lambda t: t.all_reduce(np.ones(2), (0, 1), "still"), ranks=[0, 1]))
        np.testing.assert_array_equal(out[1], [2.0, 2.0])  # the others still work


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda t: t.all_reduce(np.zeros(2), (1, 2), "t"), "does not contain the calling rank 0"),
        (lambda t: t.all_reduce(np.zeros(2), (0, 7), "t"), "outside the world"),
        (lambda t: t.all_reduce(np.zeros(2), (0, 0), "t"), "repeated"),
        (lambda t: t.all_gather(np.zeros(2), (0,), 1, "t"), "axis 1 is out of range"),
        (lambda t: t.broadcast(np.zeros(2), 5, (0, 1), "t"), "not in group"),
        (lambda t: t.broadcast(None, 0, (0, 1), "t"), "root must pass an array"),
        (lambda t: t.send(np.zeros(2), 9, "t"), "not in this world"),
        (lambda t: t.recv(9, "t"), "not in this world"),
        (lambda t: t.send(np.array([object()]), 1, "t"), "plain numeric arrays"),
    ],
)
def test_bad_arguments_fail_at_once(call: Callable[[Transport], Any], words: str) -> None:
    with mesh((0, 1, 2)) as ts:
        with pytest.raises(TransportError, match=words):
            call(ts[0])


def test_lifecycle_connect_errors_and_close_is_idempotent() -> None:
    t = CpuTransport(0, timeout=5)
    assert isinstance(t, Transport) and t.endpoint.rank == 0 and t.endpoint.port > 0
    with pytest.raises(TransportError, match="call connect"):
        t.send(np.zeros(1), 1, "x")
    with pytest.raises(TransportError, match="including this one"):
        t.connect([Endpoint(1, "127.0.0.1", 1, "h")])
    dead = Endpoint(5, "127.0.0.1", 1, "elsewhere")  # nothing listens on port 1
    with pytest.raises(TransportError, match=r"could not reach rank\(s\) \[5\]"):
        t.connect([t.endpoint, dead], timeout=1)
    t.close()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.send(np.zeros(1), 1, "x")
    with CpuTransport(1, timeout=5) as lonely:
        with pytest.raises(TransportError, match=r"rank\(s\) \[2\] did not connect back"):
            other = CpuTransport(2, timeout=5)
            try:
                lonely.connect([lonely.endpoint, other.endpoint], timeout=0.5)  # rank 2 never calls connect
            finally:
                other.close()
        with pytest.raises(TransportError, match="closed"):
            lonely.close() or lonely.recv(1, "x")


# -- real processes ---------------------------------------------------------------------------------


def _peer_process(rank: int, mode: str, conn: Any, job: str) -> None:
    """A rank in its own process: publish the endpoint, connect, run ``job``, report the results."""
    t = CpuTransport(rank, timeout=20, shared_memory=mode == "shm")
    conn.send(t.endpoint)
    endpoints = conn.recv()
    t.connect(endpoints)
    try:
        group = tuple(e.rank for e in endpoints)
        if job == "hang":
            time.sleep(60)  # connected, never joins: the test kills it
        x = np.arange(3_000_000, dtype=np.float32) * (rank + 1)
        s = t.all_reduce(x, group, "big")
        t.send(s[:5] + rank, 0, "p2p")
        g = t.all_gather(np.full((2, rank + 1), rank), group, 1, "g")
        conn.send((float(s[-1]), g))
    finally:
        t.close()


@contextmanager
def processes(mode: str, jobs: Sequence[str]) -> Iterator[tuple[CpuTransport, list[Any], list[Any]]]:
    """This process is rank 0; every job in ``jobs`` runs as rank 1, 2, ... in a spawned process."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in jobs]
    procs = [
        ctx.Process(target=_peer_process, args=(i + 1, mode, child, job), daemon=True)
        for i, ((_, child), job) in enumerate(zip(pipes, jobs, strict=True))
    ]
    for p in procs:
        p.start()
    t = CpuTransport(0, timeout=20, shared_memory=mode == "shm")
    try:
        endpoints = [t.endpoint] + [parent.recv() for parent, _ in pipes]
        for parent, _ in pipes:
            parent.send(endpoints)
        t.connect(endpoints)
        yield t, procs, [parent for parent, _ in pipes]
    finally:
        t.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("mode", MODES)
def test_three_processes_exchange_data(mode: str) -> None:
    before = _shm_entries()
    with processes(mode, ["work", "work"]) as (t, procs, pipes):
        x = np.arange(3_000_000, dtype=np.float32)
        s = t.all_reduce(x, (0, 1, 2), "big")
        np.testing.assert_allclose(s, x * 6)
        got = {src: t.recv(src, "p2p") for src in (1, 2)}
        g = t.all_gather(np.full((2, 1), 0), (0, 1, 2), 1, "g")
        results = [pipe.recv() for pipe in pipes]
    for src in (1, 2):
        np.testing.assert_allclose(got[src], x[:5] * 6 + src)
    for last, their_g in results:
        assert last == pytest.approx(float(x[-1]) * 6)
        assert_same_bits([their_g, g])
    assert all(p.exitcode == 0 for p in procs)
    assert _shm_entries() <= before


def test_a_sigkilled_peer_fails_the_survivors_collective_within_seconds() -> None:
    before = _shm_entries()
    with processes("shm", ["work", "hang"]) as (t, procs, _):

        def kill_soon() -> None:
            time.sleep(0.5)
            os.kill(procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]

        killer = threading.Thread(target=kill_soon)
        killer.start()
        start = time.monotonic()
        with pytest.raises(TransportError, match="rank 2") as e:
            t.all_reduce(np.ones(3_000_000, np.float32), (0, 1, 2), "big")  # rank 1 joins, rank 2 never does
        killer.join()
        assert time.monotonic() - start < 5, e.value
        assert not isinstance(e.value, TransportAborted)
        with pytest.raises(TransportError, match="rank 2"):
            t.send(np.zeros(1), 2, "later")
    assert procs[1].exitcode == -signal.SIGKILL
    assert _shm_entries() <= before
