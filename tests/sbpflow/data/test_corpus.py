"""sf.corpus: the standard library's sources as a character-level token file, written once, read by rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sbpflow.data import corpus
from sbpflow.data.sources import DataError


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SBPFLOW_CACHE", str(tmp_path))
    return tmp_path


def test_the_corpus_is_python_source_as_ascii_ids_written_once(cache: Path) -> None:
    path = corpus.python_sources(packages=("json",))
    assert path.parent == cache
    ids = np.fromfile(path, dtype=np.int32)
    assert ids.min() >= 0 and ids.max() < corpus.VOCAB
    text = corpus.decode(ids[:20_000])
    assert "def " in text and "import " in text
    stamp = path.stat().st_mtime_ns
    assert corpus.python_sources(packages=("json",)) == path and path.stat().st_mtime_ns == stamp
    assert not list(cache.glob("*.tmp*"))


def test_char_source_serves_windows_and_next_characters() -> None:
    source = corpus.char_source(seq_len=16, batch_size=4)
    batch = source.read(0)
    assert batch["tokens"].shape == batch["targets"].shape == (4, 16)
    np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])
    np.testing.assert_array_equal(source.read(3, slice(1, 3))["tokens"], source.read(3)["tokens"][1:3])


def test_an_unknown_package_is_refused_with_where_it_looked() -> None:
    with pytest.raises(DataError, match="no .py files under .* for packages \\['no_such_pkg'\\]"):
        corpus.python_sources(packages=("no_such_pkg",))
