"""The transport contract (actor_workers/transport/base.py), one suite run on every kind of world in
``worlds.WORLDS``: every collective against numpy on the logical tensor for groups of 2, 3 and 4 (one out of
order), sub-groups at once, every dtype, uneven splits, small and large arrays, 0-d, empty and
non-contiguous inputs; point-to-point FIFO per tag; mismatches that name both sides and do not derail the
next call; abort; timeouts that name the peer and the tag; bad arguments. What only one transport has
(its internals, its failure modes) stays in that transport's own test file."""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.transport.base import Transport, TransportAborted, TransportError
from tests.actor_workers.transport.worlds import (
    DTYPES,
    GROUPS,
    HUGE,
    LARGE,
    WORLDS,
    assert_same_bits,
    assert_sum,
    cut,
    logical,
    spmd,
    values,
    world,
)

pytestmark = pytest.mark.usefixtures("no_leftover_threads")


@pytest.fixture(params=[w.param() for w in WORLDS.values()])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def fresh(shape: tuple[int, ...], dtype: Any, salt: int) -> np.ndarray:
    """``logical`` made anew, not from the cache: what an input must still equal after the call."""
    return logical.__wrapped__(shape, dtype, salt)


def total(arrays: list[np.ndarray]) -> np.ndarray:
    """The sum in list (group) order: what a transport that sums in group order gives bit for bit."""
    return functools.reduce(np.add, arrays)


# -- collectives ------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", GROUPS)
def test_all_reduce_sums_identically_on_every_member_and_results_are_private(
    kind: str, group: tuple[int, ...]
) -> None:
    """Small arrays of every dtype: exactly the sum in group order. A large one: the same bits everywhere."""
    small = {r: [logical((10, 3), d, salt=r) for d in DTYPES] for r in group}
    large = {r: logical(LARGE, np.float32, salt=r) for r in group}

    def body(t: Transport) -> Any:
        sums = [t.all_reduce(x, group, f"s{i}") for i, x in enumerate(small[t.rank])]
        return sums, t.all_reduce(large[t.rank], group, "large")

    with world(kind) as ts:
        out = values(spmd(ts, body, group))
    expected = [total([small[r][i] for r in group]) for i in range(len(DTYPES))]
    for i, dtype in enumerate(DTYPES):
        s = [out[r][0][i] for r in group]
        assert s[0].dtype == np.dtype(dtype)
        assert_same_bits(s + [expected[i]])
        s[0][...] = 0  # results are private: writing one changes neither the others nor the inputs
        assert_same_bits([s[1], expected[i]])
        assert_same_bits([small[group[0]][i], fresh((10, 3), dtype, group[0])])
    b = [out[r][1] for r in group]
    assert_same_bits(b)
    assert_sum(b[0], total([large[r] for r in group]))
    b[0][...] = 0
    assert_sum(b[1], total([large[r] for r in group]))
    assert_same_bits([large[group[0]], fresh(LARGE, np.float32, group[0])])


def test_all_reduce_every_dtype_small_and_large(kind: str) -> None:
    group = (0, 1, 2)
    inputs = {r: [logical(s, d, salt=r) for d in DTYPES for s in [(10, 3), LARGE]] for r in group}
    with world(kind, group) as ts:
        out = values(
            spmd(ts, lambda t: [t.all_reduce(x, group, f"t{i}") for i, x in enumerate(inputs[t.rank])])
        )
    for i, x in enumerate(inputs[0]):
        assert_same_bits([out[r][i] for r in group])
        assert_sum(out[0][i], total([inputs[r][i] for r in group]))
        assert out[0][i].dtype == x.dtype


def test_all_reduce_of_non_contiguous_scalar_and_empty_arrays(kind: str) -> None:
    group = (0, 1, 2)
    small = {r: logical((6, 8), np.float64, salt=r) for r in group}
    large = {r: logical((600, 800), np.float64, salt=r) for r in group}
    with world(kind, group) as ts:
        out = values(
            spmd(
                ts,
                lambda t: (
                    t.all_reduce(small[t.rank].T[::2], group, "t"),
                    t.all_reduce(large[t.rank].T[::2], group, "T"),
                    t.all_reduce(np.float64(t.rank), group, "s"),
                    t.all_reduce(np.zeros((0, 4), np.int32), group, "e"),
                    t.all_gather(np.zeros((0, 4)), group, 0, "ge"),
                ),
            )
        )
    assert_same_bits([out[1][0], total([small[r].T[::2] for r in group])])
    assert_sum(out[1][1], total([large[r].T[::2] for r in group]))
    assert out[2][2].shape == () and out[2][2] == 3.0 and isinstance(out[2][2], np.ndarray)
    assert out[0][3].shape == (0, 4) and out[0][3].dtype == np.int32
    assert out[0][4].shape == (0, 4)


@pytest.mark.parametrize("group", GROUPS)
def test_reduce_scatter_gives_member_i_part_i_of_the_sum(kind: str, group: tuple[int, ...]) -> None:
    """Along either axis, small (summed in group order) and large, uneven over 3 and 4."""
    shapes = [(10, 7), (400, 1001)]
    inputs = {r: [logical(s, np.float64, salt=r) for s in shapes] for r in group}

    def body(t: Transport) -> Any:
        return [
            [t.reduce_scatter(x, group, axis, f"rs{axis}-{k}") for k, x in enumerate(inputs[t.rank])]
            for axis in (0, 1)
        ]

    with world(kind) as ts:
        out = values(spmd(ts, body, group))
    for axis in (0, 1):
        for k in range(len(shapes)):
            whole = total([inputs[r][k] for r in group])
            for i, r in enumerate(group):
                got = out[r][axis][k]
                assert got.flags.c_contiguous
                assert_sum(got, np.ascontiguousarray(cut(whole, axis, len(group), i)))
            small = np.concatenate([out[r][axis][0] for r in group], axis=axis)
            assert_same_bits([small, total([inputs[r][0] for r in group])])


def test_reduce_scatter_every_dtype_along_a_negative_axis(kind: str) -> None:
    group = (0, 1, 2, 3)
    inputs = {r: [logical((3, 10), d, salt=r) for d in DTYPES] for r in group}
    with world(kind) as ts:
        out = values(
            spmd(
                ts, lambda t: [t.reduce_scatter(x, group, -1, f"rs{i}") for i, x in enumerate(inputs[t.rank])]
            )
        )
    for i, dtype in enumerate(DTYPES):
        assert [out[r][i].shape for r in group] == [(3, 3), (3, 3), (3, 2), (3, 2)]
        assert out[0][i].dtype == np.dtype(dtype)
        whole = np.concatenate([out[r][i] for r in group], axis=1)
        np.testing.assert_array_equal(whole, total([inputs[r][i] for r in group]))


@pytest.mark.parametrize("group", GROUPS)
def test_all_gather_concatenates_uneven_shards_in_group_order(kind: str, group: tuple[int, ...]) -> None:
    n = len(group)
    xs = [logical((4, 10), d) for d in DTYPES]
    with world(kind) as ts:
        # a dim of 10 over n: uneven for 3 and 4
        out = values(
            spmd(
                ts,
                lambda t: [t.all_gather(cut(x, 1, n, group.index(t.rank)), group, 1, "ag") for x in xs],
                group,
            )
        )
    for i, x in enumerate(xs):
        assert_same_bits([out[r][i] for r in group] + [x])


@pytest.mark.parametrize("group", GROUPS)
def test_all_to_all_s0_to_s1_and_back_reassembles_the_logical_tensor(
    kind: str, group: tuple[int, ...]
) -> None:
    n = len(group)
    xs = [logical((10, 9, 2), d) for d in DTYPES]
    with world(kind) as ts:
        out = values(
            spmd(
                ts,
                lambda t: [t.all_to_all(cut(x, 0, n, group.index(t.rank)), group, 1, 0, "a2a") for x in xs],
                group,
            )
        )
        back = values(
            spmd(ts, lambda t: [t.all_to_all(y, group, 0, 1, "a2a-back") for y in out[t.rank]], group)
        )
    for k, x in enumerate(xs):
        for i, r in enumerate(group):
            assert_same_bits([out[r][k], np.ascontiguousarray(cut(x, 1, n, i))])  # now S(1)
            assert_same_bits([back[r][k], np.ascontiguousarray(cut(x, 0, n, i))])  # S(0) again


def test_all_to_all_along_one_axis_exchanges_blocks(kind: str) -> None:
    group = (0, 1, 2)
    inputs = {r: np.arange(7) + 100 * r for r in group}
    with world(kind, group) as ts:
        out = values(spmd(ts, lambda t: t.all_to_all(inputs[t.rank], group, 0, 0, "x")))
    for j in group:
        np.testing.assert_array_equal(out[j], np.concatenate([cut(inputs[r], 0, 3, j) for r in group]))


@pytest.mark.parametrize("group", GROUPS)
def test_broadcast_copies_the_roots_array(kind: str, group: tuple[int, ...]) -> None:
    root = group[-1]
    xs = [logical((5, 3), d) for d in DTYPES]
    with world(kind) as ts:
        out = values(
            spmd(
                ts,
                lambda t: [t.broadcast(x if t.rank == root else None, root, group, "b") for x in xs],
                group,
            )
        )
    for i, x in enumerate(xs):
        assert_same_bits([out[r][i] for r in group] + [x])
        assert all(not np.shares_memory(out[r][i], x) for r in group)


def test_large_all_gather_all_to_all_and_broadcast(kind: str) -> None:
    x = logical(HUGE, np.float32)
    group = (0, 1, 2)
    with world(kind, group) as ts:
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


def test_sub_groups_of_a_2x2_mesh_run_concurrently_on_non_contiguous_ranks(kind: str) -> None:
    """Columns (10, 12), (11, 13) then rows (10, 11), (12, 13), many rounds with jitter, small and large."""
    col = {10: (10, 12), 12: (10, 12), 11: (11, 13), 13: (11, 13)}
    row = {10: (10, 11), 11: (10, 11), 12: (12, 13), 13: (12, 13)}
    steps = 30

    def body(t: Transport) -> list[np.ndarray]:
        rng = np.random.default_rng(t.rank)
        got = []
        for step in range(steps):
            if rng.random() < 0.3:
                time.sleep(0.001)
            shape = (300, 300) if step % 4 == 0 else (4, 5)
            y = t.all_reduce(np.full(shape, float(t.rank + 10 * step)), col[t.rank], f"col-{step}")
            got.append(t.all_gather(y[:4, :5], row[t.rank], 0, f"row-{step}"))
        return got

    with world(kind, (10, 11, 12, 13)) as ts:
        out = values(spmd(ts, body))
    for step in range(steps):
        col_sum = {c: 2 * 10.0 * step + sum(c) for c in [(10, 12), (11, 13)]}
        expected = np.concatenate([np.full((4, 5), col_sum[(10, 12)]), np.full((4, 5), col_sum[(11, 13)])])
        assert_same_bits([out[r][step] for r in (10, 11, 12, 13)] + [expected])


def test_a_caller_may_overwrite_its_input_as_soon_as_the_call_returns(kind: str) -> None:
    """Members read each other's inputs and messages; none returns while a peer may still read its buffer."""
    group = (0, 1, 2, 3)
    sizes = [1 << 12, 1 << 16, 1 << 17]  # float64: 32 KB (the CPU's direct path), 512 KB and 1 MB (its ring)

    def body(t: Transport) -> list[bool]:
        ok = []
        for step in range(24):
            buf = np.empty(sizes[step % 3])
            buf[:] = t.rank + step
            s = t.all_reduce(buf, group, f"ar{step}")
            g = t.all_gather(buf, group, 0, f"ag{step}")
            t.send(buf, (t.rank + 1) % 4, "p")
            buf[:] = -1e9  # garbage that a late reader would see
            got = t.recv((t.rank - 1) % 4, "p")
            ok.append(
                bool(
                    (s == 6 + 4 * step).all()
                    and (g.reshape(4, -1) == np.arange(4)[:, None] + step).all()
                    and (got == (t.rank - 1) % 4 + step).all()
                )
            )
        return ok

    with world(kind, group) as ts:
        out = values(spmd(ts, body))
    assert all(all(v) for v in out.values()), out


# -- point to point ---------------------------------------------------------------------------------


def test_send_recv_keeps_fifo_order_per_tag_and_copies(kind: str) -> None:
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
        bigs = [t.recv(0, "big") for _ in range(4)]
        return a, b, [(float(x.min()), float(x.max()), x.shape) for x in bigs]

    with world(kind, (0, 1)) as ts:
        out = values(spmd(ts, body))
    assert out[1][:2] == (list(range(100)), [-i for i in range(100)])
    assert out[1][2] == [(float(i), float(i), (300_000,)) for i in (0, 25, 50, 75)]


def test_recv_waits_for_a_later_send_self_send_works_and_dtypes_shapes_survive(kind: str) -> None:
    def body(t: Transport) -> Any:
        if t.rank == 0:
            time.sleep(0.1)  # rank 1 is waiting in recv by now
            for i, d in enumerate(DTYPES):
                t.send(logical((2, 3), d, salt=i), 1, "typed")
            t.send(np.float32(7.5), 1, "scalar")
            t.send(np.ones(2), 0, "self")
            return t.recv(0, "self")
        return [t.recv(0, "typed") for _ in DTYPES] + [t.recv(0, "scalar")]

    with world(kind, (0, 1)) as ts:
        out = values(spmd(ts, body))
    np.testing.assert_array_equal(out[0], np.ones(2))
    for i, d in enumerate(DTYPES):
        assert_same_bits([out[1][i], logical((2, 3), d, salt=i)])
    assert out[1][-1].shape == () and out[1][-1].dtype == np.float32 and out[1][-1] == 7.5


# -- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "second, words",
    [
        (lambda t: t.all_gather(np.zeros((2, 2)), (0, 1), 0, "t"), ["all_reduce", "all_gather"]),
        (lambda t: t.all_reduce(np.zeros((2, 2)), (0, 1), "other"), ["'t'", "'other'"]),
        (lambda t: t.all_reduce(np.zeros((2, 3)), (0, 1), "t"), ["[2, 2]", "[2, 3]"]),
        (lambda t: t.all_reduce(np.zeros((2, 2), np.float32), (0, 1), "t"), ["float64", "float32"]),
        (lambda t: t.all_reduce(np.zeros((2, 2)), (1, 0), "t"), ["(0, 1)", "(1, 0)"]),
        (lambda t: t.all_reduce(np.zeros((400, 400)), (0, 1), "t"), ["[2, 2]", "[400, 400]"]),
    ],
    ids=["kind", "tag", "shape", "dtype", "group-order", "small-vs-large"],
)
def test_mismatched_collectives_raise_on_every_member_naming_both_and_do_not_derail_the_next(
    kind: str, second: Callable[[Transport], Any], words: list[str]
) -> None:
    with world(kind, (0, 1)) as ts:
        start = time.monotonic()
        out = spmd(ts, lambda t: t.all_reduce(np.zeros((2, 2)), (0, 1), "t") if t.rank == 0 else second(t))
        assert time.monotonic() - start < 3  # found at once, not by the 10 s timeout
        for r in (0, 1):
            assert isinstance(out[r], TransportError), out[r]
            msg = str(out[r])
            assert "rank 0" in msg and "rank 1" in msg and "does not match" in msg
            for w in words:
                assert w in msg
        again = values(spmd(ts, lambda t: t.all_reduce(np.ones(2), (0, 1), "next")))
    np.testing.assert_array_equal(again[0], [2.0, 2.0])


def test_abort_reaches_every_blocked_rank_within_a_second(kind: str) -> None:
    blocked = threading.Barrier(4)

    def body(t: Transport) -> Any:
        blocked.wait()
        if t.rank == 3:
            time.sleep(0.2)  # let the others block
            t.abort("rank 3: kernel matmul failed")
            return None
        if t.rank == 0:
            return t.recv(1, "never")
        return t.all_reduce(np.zeros(3), (1, 2, 3), "waits-for-3")  # rank 3 never joins

    with world(kind, timeout=30) as ts:
        start = time.monotonic()
        out = spmd(ts, body)
        assert time.monotonic() - start < 15  # at once, not by the 30 s timeout
        for r in (0, 1, 2):
            assert isinstance(out[r], TransportAborted) and str(out[r]) == "rank 3: kernel matmul failed"
        t1 = ts[1]  # every later call, on any rank, fails the same way
        for call in (lambda: t1.send(np.zeros(1), 0, "x"), lambda: t1.all_gather(np.zeros(1), (1,), 0, "y")):
            with pytest.raises(TransportAborted, match="kernel matmul failed"):
                call()


def test_a_missing_peer_times_out_naming_it_and_the_tag(kind: str) -> None:
    with world(kind, (0, 1, 2), timeout=0.2) as ts:
        out = spmd(ts, lambda t: t.all_reduce(np.zeros(2), (0, 1, 2), "task-17"), ranks=[0, 1])
    for r in (0, 1):
        assert isinstance(out[r], TransportError), out[r]
        assert re.search(r"rank(\(s\) \[| )2\b", str(out[r])) and "'task-17'" in str(out[r]), out[r]


def test_recv_times_out_naming_the_peer_the_tag_and_what_is_pending(kind: str) -> None:
    with world(kind, (0, 1), timeout=0.2) as ts:
        ts[0].send(np.zeros(1), 1, "act-3")
        ts[0].send(np.zeros(1), 1, "sync")
        ts[1].recv(0, "sync")  # one sender's messages arrive in order, so act-3 is there, set aside
        with pytest.raises(TransportError) as e:
            ts[1].recv(0, "act-4")
    msg = str(e.value)
    assert "rank 1" in msg and "from rank 0" in msg and "'act-4'" in msg and "act-3'" in msg


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
        (lambda t: t.all_reduce(np.array(["a", "b"]), (0, 1), "t"), "plain numeric arrays"),
    ],
)
def test_bad_arguments_fail_at_once(kind: str, call: Callable[[Transport], Any], words: str) -> None:
    with world(kind, (0, 1, 2)) as ts:
        with pytest.raises(TransportError, match=words):
            call(ts[0])
