"""The readers' fast paths (one gather for token windows, one permutation per epoch) give the same rows."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

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


def test_a_token_file_is_mapped_once_and_again_once_the_path_names_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads share one mapping of the file (opened and checked once); a file moved over the path, or one
    grown in place, is another identity: opened, checked and mapped again, never the old ids."""
    path = tmp_path / "t.bin"
    np.arange(100, dtype=np.int32).tofile(path)
    opens: list[int] = []
    real = TokenFileSource._open_tokens
    monkeypatch.setattr(TokenFileSource, "_open_tokens", lambda self: opens.append(1) or real(self))
    src = TokenFileSource(path=str(path), seq_len=4, batch_size=2)
    assert [src.read(b)["tokens"][0, 0] for b in range(3)] == [0, 8, 16] and len(opens) == 1
    (np.arange(100, dtype=np.int32) + 1000).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", path)
    assert src.read(0)["tokens"][0, 0] == 1000 and len(opens) == 2
    with path.open("ab") as f:
        np.arange(100, 200, dtype=np.int32).tofile(f)
    assert src.num_samples == 49 and src.read(23)["tokens"][1, 0] == 188 and len(opens) == 3
    assert src.read(23)["tokens"][1, 0] == 188 and len(opens) == 3
