"""A real text corpus every machine has offline: the Python standard library's own source code.

``python_sources()`` concatenates the ``.py`` files of a fixed list of standard-library packages (sorted,
so the corpus is the same on every machine with the same Python), keeps it character-level over
:data:`VOCAB` symbols (ASCII; anything else becomes ``?``), and writes the token ids once to a cache file
(``$SBPFLOW_CACHE`` or ``~/.cache/sbpflow``) that a :class:`~sbpflow.data.sources.TokenFileSource` memory-maps,
so every worker reads only its rows. ``decode`` turns ids back into text.

    source = sf.corpus.char_source(seq_len=64, batch_size=16)   # tokens/targets [16, 64], vocab 128
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sbpflow.data.sources import DataError, TokenFileSource
from sbpflow.dtype import DType

VOCAB = 128  # ASCII
UNKNOWN = ord("?")
PACKAGES = (
    "json",
    "email",
    "http",
    "collections",
    "logging",
    "unittest",
    "asyncio",
    "xml",
    "urllib",
    "importlib",
)
MAX_CHARS = 4_000_000


def cache_dir() -> Path:
    return Path(os.environ.get("SBPFLOW_CACHE") or Path.home() / ".cache" / "sbpflow")


def python_sources(packages: Sequence[str] = PACKAGES, max_chars: int = MAX_CHARS) -> Path:
    """The token file of the corpus (int32 ids below :data:`VOCAB`), written on first use."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{sys.version}|{stdlib}|{','.join(packages)}|{max_chars}".encode()).hexdigest()[:16]
    path = cache_dir() / f"pysrc-{key}.int32"
    if path.exists():
        return path
    files = sorted(f for p in packages for f in (stdlib / p).rglob("*.py"))
    if not files:
        raise DataError(
            f"no .py files under {stdlib} for packages {list(packages)}; is the standard library installed?"
        )
    text = bytearray()
    for f in files:
        text += f.read_bytes()
        if len(text) >= max_chars:
            break
    ids = np.frombuffer(bytes(text[:max_chars]), dtype=np.uint8).astype(np.int32)
    ids[ids >= VOCAB] = UNKNOWN
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    ids.tofile(tmp)
    os.replace(tmp, path)  # whole or absent: concurrent first uses never see half a file
    return path


def char_source(seq_len: int, batch_size: int, seed: int = 0, shuffle: bool = True) -> TokenFileSource:
    """Windows of ``seq_len`` characters of the corpus (``tokens``) and the next character of each
    (``targets``), ``batch_size`` per batch, shuffled per epoch."""
    return TokenFileSource(
        path=str(python_sources()),
        dtype=DType.int32,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
    )


def decode(ids: Sequence[int] | np.ndarray) -> str:
    return bytes(int(i) for i in np.asarray(ids).reshape(-1)).decode("ascii", errors="replace")
