"""sbpflow/ops/kernels/jit_streams.py: its loads and stores read and write what indexing does, carry the
scoped no-alias metadata that lets LLVM drop its overlap test, and refuse the calls they cannot make."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from sbpflow.ops.kernels.jit_streams import STREAMS, load, store  # noqa: E402


@numba.njit
def _scaled(x: Any, out: Any, k: Any) -> None:  # pragma: no cover - compiled
    for i in range(x.size):
        store(out, i, load(x, i, 0) * k, 1)  # type: ignore[call-arg]


@numba.njit
def _bad_stream(x: Any) -> Any:  # pragma: no cover - compiled
    return load(x, 0, STREAMS)  # type: ignore[call-arg]


@numba.njit
def _store_into(x: Any) -> None:  # pragma: no cover - compiled
    store(x, 0, 1.0, 1)  # type: ignore[call-arg]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_load_and_store_are_indexing(dtype: Any) -> None:
    x = np.arange(37, dtype=dtype) - 5
    out = np.zeros_like(x)
    _scaled(x, out, 3)
    np.testing.assert_array_equal(out, x * 3)


def test_accesses_carry_their_streams() -> None:
    ir = _scaled.inspect_llvm(_scaled.signatures[0])
    assert "!alias.scope" in ir and "!noalias" in ir and "sbpflow.stream1" in ir


def test_refused_calls_do_not_compile() -> None:
    """A stream out of range, a 2-d or strided array, a store into a read-only array: typing errors."""
    with pytest.raises(numba.core.errors.TypingError):
        _bad_stream(np.zeros(3))
    with pytest.raises(numba.core.errors.TypingError):
        _scaled(np.zeros((2, 2)), np.zeros((2, 2)), 1.0)
    with pytest.raises(numba.core.errors.TypingError):
        _scaled(np.zeros(4)[::2], np.zeros(2), 1.0)
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(numba.core.errors.TypingError):
        _store_into(frozen)
