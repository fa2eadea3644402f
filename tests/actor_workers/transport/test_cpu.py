"""What only the CPU transport has: the direct and ring paths and where one ends (``DIRECT_BYTES``), messages
on both sides of a shared-memory slot (``SLOT_BYTES``), large messages both ways at once, shared memory only
within a host, a closed peer, connect errors, a message sent just before close, and real processes, one
SIGKILLed mid-collective. The contract itself, which this transport keeps over shared memory and over TCP,
is tests/.../test_conformance.py (worlds ``cpu-shm`` and ``cpu-tcp``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.transport.base import Transport, TransportAborted, TransportError
from sbpflow.actor_workers.transport.cpu import collectives as cpu_collectives
from sbpflow.actor_workers.transport.cpu.collectives import DIRECT_BYTES
from sbpflow.actor_workers.transport.cpu.connect import Endpoint
from sbpflow.actor_workers.transport.cpu.links import (
    DATA,
    READ_BYTES,
    SLOT_BYTES,
    SLOTS,
    InLink,
    as_bytes,
    encode,
)
from sbpflow.actor_workers.transport.cpu.transport import CpuTransport
from tests.actor_workers.transport.worlds import (
    HUGE,
    LARGE,
    assert_same_bits,
    assert_sum,
    cpu_mesh,
    logical,
    spmd,
    values,
)

pytestmark = pytest.mark.usefixtures("no_leftover_threads")

MODES = ["shm", "tcp"]
# the conformance suite's large arrays take the ring, and its huge ones span several shared-memory slots
assert np.prod(LARGE) * 4 > DIRECT_BYTES
assert np.prod(HUGE) * 4 > SLOT_BYTES


@contextmanager
def mesh(
    ranks: Sequence[int] = (0, 1, 2, 3), mode: str = "shm", timeout: float = 10.0, host_ids: bool = False
) -> Iterator[dict[int, CpuTransport]]:
    with cpu_mesh(ranks, timeout, shared_memory=mode == "shm", host_ids=host_ids) as ts:
        yield ts


# -- paths and boundaries ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_direct_path_ends_at_direct_bytes_and_the_ring_takes_over(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(p - 1) x |T| <= DIRECT_BYTES: summed in group order; one element more: the ring, same bits on all."""
    ringed: list[int] = []  # the size of every array that went round the ring
    ring = cpu_collectives._ring_reduce_scatter

    def counted(call: Any, x: np.ndarray, *args: Any) -> None:  # the real ring, counted
        ringed.append(x.size)
        ring(call, x, *args)

    monkeypatch.setattr(cpu_collectives, "_ring_reduce_scatter", counted)
    group = (0, 1, 2)
    at_limit = DIRECT_BYTES // (8 * (len(group) - 1))  # float64 elements
    sizes = [at_limit, at_limit + 1]
    inputs = {r: [logical((n,), np.float64, salt=r) for n in sizes] for r in group}

    def body(t: Transport) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(t.all_reduce(x, group, "ar"), t.reduce_scatter(x, group, 0, "rs")) for x in inputs[t.rank]]

    with mesh(group, mode=mode) as ts:
        out = values(spmd(ts, body))
    assert ringed == [at_limit + 1] * 2 * len(group)  # all_reduce and reduce_scatter, on every member
    for k in range(len(sizes)):
        whole = inputs[0][k] + inputs[1][k] + inputs[2][k]
        assert_same_bits([out[r][k][0] for r in group])
        assert_sum(out[0][k][0], whole)
        assert_sum(np.concatenate([out[r][k][1] for r in group]), whole)
    assert_same_bits([out[0][0][0], inputs[0][0] + inputs[1][0] + inputs[2][0]])  # direct: in group order


@pytest.mark.parametrize("mode", MODES)
def test_two_members_sum_as_the_payload_arrives_with_the_bits_of_the_group_order_sum(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two members: the receive thread adds the peer's array into the result (no separate sum), up to
    DIRECT_BYTES; both get the bits of the sum in group order (a + b == b + a); one element more: the ring."""

    def no_separate_sum(*args: Any) -> None:
        raise AssertionError("a two-member direct sum went through _sum_in_order")

    monkeypatch.setattr(cpu_collectives, "_sum_in_order", no_separate_sum)
    at_limit = DIRECT_BYTES // 8  # float64 elements
    shapes = [(), (0,), (3, 5), (at_limit,), (at_limit + 1,)]
    inputs = {r: [logical(s, np.float64, salt=r) for s in shapes] for r in (0, 1)}

    def body(t: Transport) -> list[tuple[np.ndarray, np.ndarray | None]]:
        return [
            (t.all_reduce(x, (0, 1), "ar"), t.reduce_scatter(x, (0, 1), 0, "rs") if x.ndim else None)
            for x in inputs[t.rank]
        ]

    with mesh((0, 1), mode=mode) as ts:
        out = values(spmd(ts, body))
    for k, shape in enumerate(shapes):
        whole = inputs[0][k] + inputs[1][k]
        assert_same_bits([out[0][k][0], out[1][k][0], whole])
        if shape:
            assert_same_bits([np.concatenate([out[0][k][1], out[1][k][1]]), whole])


def test_frames_parse_the_same_however_the_reads_cut_them() -> None:
    """The reader's read-ahead buffer: many frames in one read, a header or a payload cut across reads,
    payloads that fill or pass the buffer and a meta larger than it, all come out as sent."""
    sizes = [0, 1, 13, 4096, READ_BYTES // 4 + 1, READ_BYTES + 3, 2]
    payloads = [np.arange(n, dtype=np.int64).astype(np.uint8) for n in sizes]
    metas = [{"k": f"m{i}", "n": n} for i, n in enumerate(sizes)]
    metas[-1]["k"] = "m" * (READ_BYTES + 5)
    stream = b"".join(encode(DATA, m, p.size) + p.tobytes() for m, p in zip(metas, payloads, strict=True))
    for piece in (len(stream), 7, 65_537):
        a, b = socket.socketpair()
        sender = threading.Thread(target=_send_in_pieces, args=(a, stream, piece))
        sender.start()
        link = InLink(0, b, None)
        try:
            for m, p in zip(metas, payloads, strict=True):
                frame = link.frame()
                assert (frame.kind, frame.meta, frame.nbytes, frame.chunked) == (DATA, m, p.size, False)
                got = np.empty(p.size, np.uint8)
                link.payload(frame, as_bytes(got), None)
                assert_same_bits([got, p])
        finally:
            sender.join()
            a.close()
            link.close()


def _send_in_pieces(sock: socket.socket, data: bytes, piece: int) -> None:
    for i in range(0, len(data), piece):
        sock.sendall(data[i : i + piece])


def test_shared_memory_messages_on_both_sides_of_a_slot() -> None:
    sizes = [
        SLOT_BYTES - 1,
        SLOT_BYTES,
        SLOT_BYTES + 1,
        SLOTS * SLOT_BYTES + 1,
    ]  # the last: every slot, twice
    payloads = [np.arange(n, dtype=np.int64).astype(np.uint8) for n in sizes]
    with mesh((0, 1)) as ts:
        assert ts[0]._out[1].ring is not None
        for p in payloads:
            ts[0].send(p, 1, "m")
        for p in payloads:
            assert_same_bits([ts[1].recv(0, "m"), p])


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


def test_links_use_shared_memory_only_within_a_host() -> None:
    with mesh((0, 1), mode="shm") as ts:
        assert ts[0]._out[1].ring is not None and ts[0].endpoint.uds.startswith("@")
    with mesh((0, 1), mode="shm", host_ids=True) as ts:  # two "hosts": TCP even though both could map memory
        assert ts[0]._out[1].ring is None
        out = values(spmd(ts, lambda t: t.all_reduce(np.full(LARGE, 1.0, np.float32), (0, 1), "x")))
        assert (out[0] == 2).all()
    with mesh((0, 1), mode="tcp") as ts:
        assert ts[0]._out[1].ring is None and ts[0].endpoint.uds == ""


# -- failures ---------------------------------------------------------------------------------------


def test_a_closed_peer_fails_calls_that_need_it_at_once() -> None:
    with mesh((0, 1, 2), timeout=30) as ts:
        ts[2].close()
        start = time.monotonic()
        with pytest.raises(TransportError, match="rank 2 closed its transport"):
            ts[0].all_reduce(np.zeros(2), (0, 2), "x")
        with pytest.raises(TransportError, match="rank 2"):
            ts[1].send(np.zeros(2), 2, "y")
        assert time.monotonic() - start < 15  # at once, not by the 30 s timeout
        out = values(spmd(ts, lambda t: t.all_reduce(np.ones(2), (0, 1), "still"), ranks=[0, 1]))
        np.testing.assert_array_equal(out[1], [2.0, 2.0])  # the others still work


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
