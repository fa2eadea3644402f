"""The NCCL transport's CPU side: it imports without cupy, refuses bad arguments before touching CUDA, says
how to install cupy, and its dtype table and call headers are right (the GPU side is tests/gpu/test_nccl.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from sbpflow.actor_workers.transport.base import TransportError
from sbpflow.actor_workers.transport.nccl.comms import CommKey
from sbpflow.actor_workers.transport.nccl.headers import (
    MAX,
    NCCL_TYPES,
    NOT_MOVABLE,
    SUM,
    Header,
    NcclType,
    check_round,
    decode,
    encode,
    nccl_type,
    same_call,
    tag_hash,
)
from sbpflow.actor_workers.transport.nccl.transport import NcclTransport, SharedUids
from sbpflow.dtype import DType

UID = bytes(range(128))


@pytest.fixture
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)


def test_importing_the_module_does_not_import_cupy() -> None:
    code = "import sys, sbpflow.actor_workers.transport.nccl.transport; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_without_cupy_the_transport_and_unique_id_name_the_install(no_cupy: None) -> None:
    with pytest.raises(TransportError, match=r"pip install 'sbpflow\[gpu\]'"):
        NcclTransport(0, [0], UID)
    with pytest.raises(TransportError, match=r"pip install 'sbpflow\[gpu\]'"):
        NcclTransport.unique_id()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, [], UID), r"distinct ranks, got \[\]"),
        ((0, [0, 1, 1], UID), r"distinct ranks, got \[0, 1, 1\]"),
        ((2, [0, 1], UID), r"rank 2 is not in ranks \[0, 1\]"),
        ((0, [0, 1], b"short"), r"128 bytes of NcclTransport.unique_id\(\) made on rank 0.*got 5 bytes"),
        ((0, [0, 1], "text"), r"got str"),
    ],
)
def test_bad_arguments_are_refused_before_cuda_is_touched(args: tuple, message: str) -> None:
    with pytest.raises(TransportError, match=message):
        NcclTransport(*args)


def test_a_non_positive_timeout_is_refused() -> None:
    with pytest.raises(TransportError, match="timeout must be positive, got 0"):
        NcclTransport(0, [0], UID, timeout=0)


def test_the_dtype_table_covers_every_sbpflow_dtype_but_those_it_names() -> None:
    for d in DType:
        if d in NOT_MOVABLE:
            assert NOT_MOVABLE[d].strip()
            continue
        assert d.to_numpy() in NCCL_TYPES, f"{d} has no NCCL type"
    # nccl.h's ncclDataType_t: the codes are its values, one per width and kind
    assert (
        nccl_type(np.float32).code == 7
        and nccl_type(np.float64).code == 8
        and nccl_type(np.float16).code == 6
    )
    assert nccl_type(np.int64).code == 4 and nccl_type(np.int32).code == 2
    assert nccl_type(np.bool_) == NcclType(1, MAX, "ncclUint8")  # an all-reduce of bools is an or
    assert nccl_type(DType.bfloat16.to_numpy()) == NcclType(9, SUM, "ncclBfloat16")  # ml_dtypes' bfloat16
    assert all(t.reduce == SUM for d, t in NCCL_TYPES.items() if d != np.bool_)


def test_a_dtype_nccl_cannot_move_is_refused_with_the_ones_it_can() -> None:
    with pytest.raises(
        TransportError, match=r"cannot move dtype complex64; it moves \[.*'float32'.*\]: cast"
    ):
        nccl_type(np.complex64)


def test_comm_keys_print_the_name_a_control_plane_files_ids_under() -> None:
    assert str(CommKey("collective", (0, 2, 1))) == "collective:0,2,1"
    assert str(CommKey("p2p", (3, 1))) == "p2p:3->1"
    assert CommKey("p2p", (0, 1)) != CommKey("p2p", (1, 0))


def test_shared_uids_give_every_member_of_a_key_the_same_id_and_other_keys_another() -> None:
    made = iter([b"a" * 128, b"b" * 128])
    uids = SharedUids(lambda: next(made))
    k, other = CommKey("collective", (0, 1)), CommKey("p2p", (0, 1))
    assert uids(k) == uids(k) == b"a" * 128
    assert uids(other) == b"b" * 128


@pytest.mark.parametrize(
    ("op", "tag", "meta", "dtype", "shape"),
    [
        ("all_reduce", "t", (), np.float32, ()),
        ("all_to_all", "boxing/x:S(0)->S(1)", (0, 2), np.float64, (4, 5, 6)),
        ("broadcast", "b", (1,), None, None),
        ("send", "ü" * 40, (), np.bool_, tuple(range(1, 17))),  # a tag longer than the header keeps
    ],
)
def test_headers_round_trip(op: str, tag: str, meta: tuple, dtype: object, shape: tuple | None) -> None:
    h = decode(encode(op, tag, meta, dtype, shape, 7))
    assert (h.op, h.meta, h.shape, h.call) == (op, meta, shape, 7)
    assert h.dtype == (None if dtype is None else np.dtype(dtype))
    assert h.tag_hash == tag_hash(tag) and tag.encode().startswith(h.tag.encode()[:40])


def test_an_array_of_too_many_dims_is_refused() -> None:
    with pytest.raises(TransportError, match="at most 16 dims"):
        encode("send", "t", (), np.float32, (1,) * 17, 1)


def header(op: str, tag: str, meta: tuple, shape: tuple | None, call: int = 1) -> Header:
    return decode(encode(op, tag, meta, None if shape is None else np.float32, shape, call))


def test_members_that_agree_pass_and_uneven_gathers_are_agreement() -> None:
    check_round([header("all_gather", "g", (0,), (3, 2)), header("all_gather", "g", (0,), (2, 2))], (0, 1))
    check_round([header("broadcast", "b", (0,), (3,)), header("broadcast", "b", (0,), None)], (4, 5))


@pytest.mark.parametrize(
    ("theirs", "shown"),
    [
        (header("all_reduce", "other", (), (4,)), "tag='other'"),
        (header("all_gather", "t", (0,), (4,)), "all_gather"),
        (header("all_reduce", "t", (), (5,)), r"float32\[5\]"),
        (header("all_reduce", "t", (), (4,), call=2), "call #2"),
    ],
)
def test_members_that_disagree_are_named_both(theirs: Header, shown: str) -> None:
    mine = header("all_reduce", "t", (), (4,))
    with pytest.raises(
        TransportError, match=rf"rank 3 called all_reduce\(tag='t'.* but rank 8 called .*{shown}"
    ):
        check_round([mine, theirs], (3, 8))


def test_a_static_shape_call_is_the_same_as_its_first_but_for_its_number() -> None:
    first = encode("all_gather", "boxing/x", (0,), np.float32, (3, 4), 1)
    assert same_call(first, encode("all_gather", "boxing/x", (0,), np.float32, (3, 4), 9))
    assert not same_call(first, encode("all_gather", "boxing/x", (0,), np.float32, (2, 4), 9))
    assert not same_call(first, encode("all_gather", "boxing/x", (1,), np.float32, (3, 4), 9))
    assert not same_call(first, encode("all_gather", "boxing/x", (0,), np.float16, (3, 4), 9))
