"""One NCCL unique id per communicator key: the store names one maker per key, and a member makes an id
only when it is that maker and none is filed (a discarded id leaves NCCL's bootstrap listener behind)."""

from __future__ import annotations

import threading

import pytest

from sbpflow.actor_workers.transport.base import TransportError
from sbpflow.actor_workers.transport.nccl.uids import UidBook, fetch_uid


def test_the_first_to_ask_makes_the_id_and_the_others_wait_for_it() -> None:
    book = UidBook()
    assert book.ask("collective:0,1", 1) == (b"", True)
    assert book.ask("collective:0,1", 0) == (b"", False)  # not filed yet: come back
    assert book.ask("collective:0,1", 1) == (b"", True)  # the maker asking again is still the maker
    assert book.file("collective:0,1", b"u" * 128) == b"u" * 128
    assert book.ask("collective:0,1", 0) == (b"u" * 128, False)
    assert book.file("collective:0,1", b"v" * 128) == b"u" * 128  # the first filed stays


def test_members_racing_for_keys_make_exactly_one_id_per_key() -> None:
    book, made, lock = UidBook(), [], threading.Lock()
    keys = [f"collective:{k}" for k in range(6)]
    got: dict[tuple[int, str], bytes] = {}

    def make() -> bytes:
        with lock:
            made.append(1)
            return len(made).to_bytes(128, "little")

    def member(m: int) -> None:
        for key in keys:
            got[(m, key)] = fetch_uid(book.ask, book.file, key, m, make, timeout=10.0)

    threads = [threading.Thread(target=member, args=(m,)) for m in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == len(keys) == book.made()  # no id made and thrown away
    for key in keys:
        assert len({got[(m, key)] for m in range(8)}) == 1


def test_a_filed_id_is_returned_without_making_one() -> None:
    book = UidBook()
    book.ask("p2p:0->1", 0)
    book.file("p2p:0->1", b"a" * 128)

    def never() -> bytes:
        raise AssertionError("made an id for a key that has one")

    assert fetch_uid(book.ask, book.file, "p2p:0->1", 1, never, timeout=1.0) == b"a" * 128


def test_a_maker_that_never_files_times_the_others_out_with_the_reason() -> None:
    book = UidBook()
    book.ask("collective:0,1", 0)  # member 0 is the maker and then hangs
    with pytest.raises(
        TransportError, match="member 1 waited 0.05 s for the NCCL unique id of collective:0,1"
    ):
        fetch_uid(book.ask, book.file, "collective:0,1", 1, lambda: b"x" * 128, timeout=0.05)
