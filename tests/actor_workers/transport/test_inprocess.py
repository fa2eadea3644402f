"""The in-process transport: every collective against numpy on the logical tensor, for groups of 2, 3 and
4 rank-threads, sub-groups running at once, uneven splits and several dtypes; point-to-point order;
mismatches, aborts and missing peers fail fast with messages that name both sides; no thread outlives
its test."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.transport import (
    InProcessWorld,
    Transport,
    TransportAborted,
    TransportError,
)
from sbpflow.errors import SbpflowError
from sbpflow.sharding import split_range

JOIN_TIMEOUT = 10.0
GROUPS = [(0, 1), (0, 1, 2), (0, 1, 2, 3), (2, 0, 3, 1)]
DTYPES = [np.float32, np.float64, np.int64, np.bool_]


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before]
    assert not left, f"threads left behind: {left}"


def spmd(
    world: InProcessWorld, fn: Callable[[Transport], Any], ranks: Sequence[int] | None = None
) -> dict[int, Any]:
    """Run ``fn(transport)`` on one thread per rank; a rank's result is its return value or its exception."""
    ranks = world.ranks if ranks is None else ranks
    out: dict[int, Any] = {}

    def body(r: int) -> None:
        try:
            out[r] = fn(world.transport(r))
        except BaseException as e:  # noqa: B036 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}") for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        world.abort("test: a rank hung")
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


# -- collectives ------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_sums_in_group_order_and_is_bit_identical(group: tuple[int, ...], dtype: Any) -> None:
    world = InProcessWorld(range(4), timeout=5)
    inputs = {r: logical((10, 3), dtype, salt=r) for r in group}
    out = values(spmd(world, lambda t: t.all_reduce(inputs[t.rank], group, "grad"), group))
    expected = functools.reduce(np.add, [inputs[r] for r in group])
    assert_same_bits([out[r] for r in group])
    assert out[group[0]].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out[group[0]], expected)
    # results are private: writing one changes neither the others nor the inputs
    out[group[0]][...] = 0
    np.testing.assert_array_equal(out[group[1]], expected)
    np.testing.assert_array_equal(inputs[group[0]], logical((10, 3), dtype, salt=group[0]))


def test_all_reduce_of_non_contiguous_and_scalar_arrays() -> None:
    world = InProcessWorld(range(3), timeout=5)
    base = {r: logical((6, 8), np.float64, salt=r) for r in range(3)}
    out = values(
        spmd(
            world,
            lambda t: (
                t.all_reduce(base[t.rank].T[::2], (0, 1, 2), "t"),
                t.all_reduce(np.float64(t.rank), (0, 1, 2), "s"),
            ),
        )
    )
    np.testing.assert_array_equal(out[1][0], sum(b.T[::2] for b in base.values()))
    assert out[2][1].shape == () and out[2][1] == 3.0


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_scatter_gives_member_i_part_i_of_the_sum(group: tuple[int, ...], axis: int) -> None:
    world = InProcessWorld(range(4), timeout=5)
    inputs = {r: logical((10, 7), np.float64, salt=r) for r in group}
    out = values(spmd(world, lambda t: t.reduce_scatter(inputs[t.rank], group, axis, "rs"), group))
    total = functools.reduce(np.add, [inputs[r] for r in group])
    for i, r in enumerate(group):
        np.testing.assert_array_equal(out[r], cut(total, axis, len(group), i))
    np.testing.assert_array_equal(np.concatenate([out[r] for r in group], axis=axis), total)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_dtypes_and_negative_axis(dtype: Any) -> None:
    world = InProcessWorld(range(4), timeout=5)
    inputs = {r: logical((3, 10), dtype, salt=r) for r in range(4)}
    out = values(spmd(world, lambda t: t.reduce_scatter(inputs[t.rank], (0, 1, 2, 3), -1, "rs")))
    total = functools.reduce(np.add, inputs.values())
    assert [out[r].shape for r in range(4)] == [(3, 3), (3, 3), (3, 2), (3, 2)]
    assert out[0].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.concatenate([out[r] for r in range(4)], axis=1), total)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_concatenates_uneven_shards_in_group_order(group: tuple[int, ...], dtype: Any) -> None:
    world = InProcessWorld(range(4), timeout=5)
    x = logical((4, 10), dtype)
    n = len(group)
    shards = {r: cut(x, 1, n, i) for i, r in enumerate(group)}  # a dim of 10 over n: uneven for 3 and 4
    out = values(spmd(world, lambda t: t.all_gather(shards[t.rank], group, 1, "ag"), group))
    assert_same_bits([out[r] for r in group])
    np.testing.assert_array_equal(out[group[0]], x)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_s0_to_s1_reassembles_the_logical_tensor(group: tuple[int, ...], dtype: Any) -> None:
    world = InProcessWorld(range(4), timeout=5)
    x = logical((10, 9, 2), dtype)
    n = len(group)
    s0 = {r: cut(x, 0, n, i) for i, r in enumerate(group)}
    out = values(spmd(world, lambda t: t.all_to_all(s0[t.rank], group, 1, 0, "a2a"), group))
    for i, r in enumerate(group):
        np.testing.assert_array_equal(out[r], cut(x, 1, n, i))  # now S(1)
    back = values(spmd(world, lambda t: t.all_to_all(out[t.rank], group, 0, 1, "a2a-back"), group))
    for r in group:
        np.testing.assert_array_equal(back[r], s0[r])


def test_all_to_all_along_one_axis_exchanges_blocks() -> None:
    world = InProcessWorld(range(3), timeout=5)
    inputs = {r: np.arange(7) + 100 * r for r in range(3)}
    out = values(spmd(world, lambda t: t.all_to_all(inputs[t.rank], (0, 1, 2), 0, 0, "x")))
    for j in range(3):
        np.testing.assert_array_equal(out[j], np.concatenate([cut(inputs[r], 0, 3, j) for r in range(3)]))


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_copies_the_roots_array(group: tuple[int, ...], dtype: Any) -> None:
    world = InProcessWorld(range(4), timeout=5)
    root = group[-1]
    x = logical((5, 3), dtype)
    out = values(spmd(world, lambda t: t.broadcast(x if t.rank == root else None, root, group, "b"), group))
    assert_same_bits([out[r] for r in group] + [x])
    assert all(not np.shares_memory(out[r], x) for r in group)


def test_sub_groups_of_a_2x2_mesh_run_concurrently() -> None:
    """Columns (0, 2), (1, 3) then rows (0, 1), (2, 3), many rounds, with jitter between calls."""
    world = InProcessWorld(range(4), timeout=5)
    col = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    row = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}

    def body(t: Transport) -> list[np.ndarray]:
        rng = np.random.default_rng(t.rank)
        got = []
        for step in range(30):
            if rng.random() < 0.3:
                time.sleep(0.001)
            x = np.full((4, 5), float(t.rank + 10 * step))
            y = t.all_reduce(x, col[t.rank], f"col-{step}")
            got.append(t.all_gather(y, row[t.rank], 0, f"row-{step}"))
        return got

    out = values(spmd(world, body))
    for step in range(30):
        col_sum = {c: 2 * 10.0 * step + sum(c) for c in [(0, 2), (1, 3)]}
        expected = np.concatenate([np.full((4, 5), col_sum[(0, 2)]), np.full((4, 5), col_sum[(1, 3)])])
        assert_same_bits([out[r][step] for r in range(4)] + [expected])


def test_a_caller_may_overwrite_its_input_as_soon_as_the_call_returns() -> None:
    """Members read each other's inputs; none returns before every member has finished reading."""
    world = InProcessWorld(range(4), timeout=5)
    group = (0, 1, 2, 3)

    def body(t: Transport) -> list[bool]:
        buf = np.empty(1 << 16)
        ok = []
        for step in range(40):
            buf[:] = t.rank + step
            s = t.all_reduce(buf, group, f"ar{step}")
            g = t.all_gather(buf, group, 0, f"ag{step}")
            buf[:] = -1e9  # garbage that a slow reader would see
            ok.append(
                bool((s == 6 + 4 * step).all() and (g.reshape(4, -1) == np.arange(4)[:, None] + step).all())
            )
        return ok

    out = values(spmd(world, body))
    assert all(all(v) for v in out.values())


# -- point to point ---------------------------------------------------------------------------------


def test_send_recv_keeps_fifo_order_per_tag_and_copies() -> None:
    world = InProcessWorld([0, 1], timeout=5)

    def body(t: Transport) -> Any:
        if t.rank == 0:
            buf = np.zeros(3, dtype=np.int64)
            for i in range(100):
                buf[:] = i
                t.send(buf, 1, "a")  # reused buffer: only a copy keeps each message
                t.send(buf * -1, 1, "b")
            return None
        a = [int(t.recv(0, "a")[0]) for _ in range(50)]
        b = [int(t.recv(0, "b")[0]) for _ in range(100)]  # tag b drains independently of tag a
        a += [int(t.recv(0, "a")[0]) for _ in range(50)]
        return a, b

    out = values(spmd(world, body))
    assert out[1] == (list(range(100)), [-i for i in range(100)])


def test_recv_waits_for_a_later_send_and_self_send_works() -> None:
    world = InProcessWorld([0, 1], timeout=5)

    def body(t: Transport) -> Any:
        if t.rank == 0:
            time.sleep(0.1)
            t.send(np.arange(4.0), 1, "late")
            t.send(np.ones(2), 0, "self")
            return t.recv(0, "self")
        return t.recv(0, "late")

    out = values(spmd(world, body))
    np.testing.assert_array_equal(out[1], np.arange(4.0))
    np.testing.assert_array_equal(out[0], np.ones(2))


# -- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "second, words",
    [
        (lambda t: t.all_gather(np.zeros((2, 2)), (0, 1), 0, "t"), ["all_reduce", "all_gather"]),
        (lambda t: t.all_reduce(np.zeros((2, 2)), (0, 1), "other"), ["'t'", "'other'"]),
        (lambda t: t.all_reduce(np.zeros((2, 3)), (0, 1), "t"), ["[2, 2]", "[2, 3]"]),
        (lambda t: t.all_reduce(np.zeros((2, 2), np.float32), (0, 1), "t"), ["float64", "float32"]),
        (lambda t: t.all_reduce(np.zeros((2, 2)), (1, 0), "t"), ["(0, 1)", "(1, 0)"]),
    ],
    ids=["kind", "tag", "shape", "dtype", "group-order"],
)
def test_mismatched_collectives_raise_on_every_member_naming_both(
    second: Callable[[Transport], Any], words: list[str]
) -> None:
    world = InProcessWorld([0, 1], timeout=5)
    start = time.monotonic()
    out = spmd(world, lambda t: t.all_reduce(np.zeros((2, 2)), (0, 1), "t") if t.rank == 0 else second(t))
    assert time.monotonic() - start < 2
    for r in (0, 1):
        assert isinstance(out[r], TransportError), out[r]
        msg = str(out[r])
        assert "rank 0" in msg and "rank 1" in msg and "does not match" in msg
        for w in words:
            assert w in msg


def test_a_mismatch_does_not_derail_the_next_collective() -> None:
    world = InProcessWorld([0, 1], timeout=5)

    def body(t: Transport) -> Any:
        with pytest.raises(TransportError):
            t.all_reduce(np.zeros(2), (0, 1), f"tag-{t.rank}")
        return t.all_reduce(np.ones(2), (0, 1), "next")

    out = values(spmd(world, body))
    np.testing.assert_array_equal(out[0], [2.0, 2.0])


def test_abort_wakes_every_blocked_rank_within_a_second() -> None:
    world = InProcessWorld(range(4), timeout=30)
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

    start = time.monotonic()
    out = spmd(world, body)
    assert time.monotonic() - start < 1.5
    for r in (0, 1, 2):
        assert isinstance(out[r], TransportAborted) and str(out[r]) == "rank 3: kernel matmul failed"
    # and every later call, on any rank, fails the same way
    t1 = world.transport(1)
    for call in (lambda: t1.send(np.zeros(1), 0, "x"), lambda: t1.all_gather(np.zeros(1), (1,), 0, "y")):
        with pytest.raises(TransportAborted, match="kernel matmul failed"):
            call()


def test_a_missing_peer_times_out_with_a_clear_message() -> None:
    world = InProcessWorld(range(3), timeout=0.3)
    out = spmd(world, lambda t: t.all_reduce(np.zeros(2), (0, 1, 2), "task-17"), ranks=[0, 1])
    messages = [str(out[r]) for r in (0, 1)]
    assert all(isinstance(out[r], TransportError) for r in (0, 1))
    assert any("rank(s) [2] did not reach" in m and "'task-17'" in m for m in messages), messages
    # the late peer learns at once that the round failed
    start = time.monotonic()
    with pytest.raises(TransportError, match="gave up"):
        world.transport(2).all_reduce(np.zeros(2), (0, 1, 2), "task-17")
    assert time.monotonic() - start < 0.2


def test_recv_times_out_naming_the_peer_the_tag_and_what_is_pending() -> None:
    world = InProcessWorld([0, 1], timeout=0.2)
    world.transport(0).send(np.zeros(1), 1, "act-3")
    with pytest.raises(TransportError) as e:
        world.transport(1).recv(0, "act-4")
    msg = str(e.value)
    assert "rank 1" in msg and "from rank 0" in msg and "'act-4'" in msg and "'act-3'" in msg


def test_a_failing_kernel_of_one_member_fails_the_round_for_all() -> None:
    world = InProcessWorld([0, 1], timeout=5)
    arrays = {0: np.zeros((4, 2)), 1: np.zeros((3, 2))}  # the gather axis differs, the other axis agrees
    out = values(spmd(world, lambda t: t.all_gather(arrays[t.rank], (0, 1), 0, "ok")))
    assert out[0].shape == (7, 2)
    out = spmd(world, lambda t: t.all_gather(arrays[t.rank], (0, 1), 1, "bad"))
    assert all(isinstance(out[r], TransportError) and "does not match" in str(out[r]) for r in (0, 1))


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
    ],
)
def test_bad_arguments_fail_at_once(call: Callable[[Transport], Any], words: str) -> None:
    world = InProcessWorld(range(3), timeout=5)
    with pytest.raises(TransportError, match=words):
        call(world.transport(0))


def test_world_and_transport_lifecycle() -> None:
    with pytest.raises(TransportError, match="distinct"):
        InProcessWorld([0, 0])
    with pytest.raises(TransportError, match="not in this world"):
        InProcessWorld([0, 1]).transport(2)
    with InProcessWorld([0, 1]) as world:
        t = world.transport(0)
        assert isinstance(t, Transport) and t.rank == 0 and world.transport(0) is t
        single = t.all_reduce(np.arange(3), (0,), "alone")  # a group of one is a copy
        np.testing.assert_array_equal(single, np.arange(3))
    with pytest.raises(TransportError, match="closed"):
        t.send(np.zeros(1), 1, "x")
    assert issubclass(TransportError, SbpflowError)
