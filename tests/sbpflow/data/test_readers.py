"""The readers' fast paths (one gather for token windows, one permutation per epoch) give the same rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sbpflow.data.sources import TokenFileSource
from sbpflow.dtype import DType


def test_token_windows_are_the_shuffled_samples_shifted_by_one(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.int32) % 97
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    seq, batch = 8, 4
    src = TokenFileSource(
        path=str(path), dtype=DType.int32, seq_len=seq, batch_size=batch, shuffle=True, seed=3
    )
    n = (len(tokens) - 1) // seq
    per_epoch = n // batch
    for b in (0, 5, per_epoch + 1):  # the first epoch, and one batch into the second
        epoch, k = divmod(b, per_epoch)
        ids = np.random.default_rng([3, epoch]).permutation(n)[k * batch : (k + 1) * batch][1:3]
        want = np.stack([tokens[i * seq : i * seq + seq + 1] for i in ids]).astype(np.int64)
        got = src.read(b, slice(1, 3))
        assert got["tokens"].dtype == np.int64
        np.testing.assert_array_equal(got["tokens"], want[:, :-1])
        np.testing.assert_array_equal(got["targets"], want[:, 1:])
