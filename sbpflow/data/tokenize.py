"""Text into token ids, once per corpus: the tokenizers and the token cache of :mod:`sbpflow.data.text`.

A tokenizer is ``"bytes"`` (each byte of the file is a token, ids 0..255, no end-of-text token) or a
Hugging Face ``tokenizers`` JSON file (BPE, WordPiece, Unigram: whatever ``Tokenizer.from_str`` reads).
A corpus (its files, in order, each a document followed by the tokenizer's end-of-text token where it has
one) is tokenized once into a flat cache file of ids under ``$SBPFLOW_CACHE`` (or ``~/.cache/sbpflow``),
keyed by each file's path, size and mtime and the tokenizer file's hash; every later read memory-maps it,
so a rank reads only its rows. The cache is written to a temporary name and renamed (a reader sees all of
it or none), under a file lock so that a second process on the machine waits for the first, not
tokenizes again.

Large files are tokenized in pieces (bounded memory, and parallel in ``encode_batch``): a piece ends at a
line start (after a newline, before a non-space), a boundary no usual pre-tokenizer (byte-level,
whitespace) merges across, so the ids equal encoding each file whole. A file that is not UTF-8 is refused
under a tokenizer file (naming its first bad byte; ``"bytes"`` takes any bytes).
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sbpflow.data.corpus import cache_dir
from sbpflow.data.sources import DataError

BYTES = "bytes"
VERSION = 1  # of the cache's layout: part of its key
PIECE = 1 << 18  # characters of text a piece aims at
GROUP = 32  # pieces encoded together (parallel in tokenizers' encode_batch): ~8 MiB of text held at once
MAX_RUN = 1 << 22  # bytes without a line break or a space: not text; refused under a tokenizer file
MAX_TOKENIZER = 1 << 28  # bytes of a tokenizer file
EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")  # the end-of-text token, by the names in use
SPECIAL_NAMES = {"cls": ("[CLS]", "<s>"), "sep": ("[SEP]", "</s>"), "mask": ("[MASK]", "<mask>")}

Opener = Callable[[str, str, str], AbstractContextManager[str]]  # FileSource._file: (what, path, fix) -> name
FIX_TEXT = "give a readable text file"
FIX_TOKENIZER = "give a Hugging Face tokenizer.json (tokenizers' Tokenizer.save), or tokenizer='bytes'"


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A loaded tokenizer: ``hf`` the ``tokenizers.Tokenizer`` (None for bytes), ``digest`` its file's
    SHA-256 (the cache key's part)."""

    name: str
    hf: Any
    digest: str

    @property
    def vocab_size(self) -> int:
        return 256 if self.hf is None else int(self.hf.get_vocab_size(with_added_tokens=True))

    @property
    def eot(self) -> int | None:
        return None if self.hf is None else self.token_id(EOT_NAMES)

    def token_id(self, names: tuple[str, ...]) -> int | None:
        """The id of the first of ``names`` the vocabulary has (None: none of them)."""
        for n in names:
            i = self.hf.token_to_id(n) if self.hf is not None else None
            if i is not None:
                return int(i)
        return None

    @property
    def dtype(self) -> np.dtype[Any]:
        """The cache's element type: the smallest that holds every id."""
        v = self.vocab_size
        return np.dtype(np.uint8 if v <= 1 << 8 else np.uint16 if v <= 1 << 16 else np.uint32)

    def encode(self, pieces: list[str]) -> list[np.ndarray]:
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)  # fast: without offsets
        return [np.asarray(e.ids, dtype=self.dtype) for e in encode(pieces, add_special_tokens=False)]


_TOKENIZERS: dict[tuple[str, tuple[str, ...] | None], Tokenizer] = {}
_LOCK = threading.Lock()
_WRITING = threading.Lock()  # one thread of a process writes a cache at a time (flock: one process)


def load_tokenizer(name: str, opener: Opener, roots: tuple[str, ...] | None) -> Tokenizer:
    """``"bytes"``, or the tokenizer file ``name`` opened through ``opener`` (once per process and roots)."""
    if name == BYTES:
        return Tokenizer(BYTES, None, BYTES)
    with _LOCK:
        if (name, roots) in _TOKENIZERS:
            return _TOKENIZERS[name, roots]
    with opener("tokenizer file", name, FIX_TOKENIZER) as path, open(path, "rb") as f:
        data = f.read(MAX_TOKENIZER + 1)
    if len(data) > MAX_TOKENIZER:
        raise DataError(f"tokenizer file {name!r} is over {MAX_TOKENIZER >> 20} MiB; {FIX_TOKENIZER}")
    from tokenizers import Tokenizer as HfTokenizer

    try:
        hf = HfTokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own Exception; its message may quote the file
        raise DataError(
            f"tokenizer file {name!r} is not a tokenizers JSON file ({type(e).__name__}); {FIX_TOKENIZER}"
        ) from None
    tok = Tokenizer(name, hf, hashlib.sha256(data).hexdigest())
    with _LOCK:
        return _TOKENIZERS.setdefault((name, roots), tok)


def token_cache(files: list[str], tok: Tokenizer, opener: Opener) -> np.ndarray:
    """The ids of ``files`` tokenized by ``tok`` (module docstring), memory-mapped from the cache."""
    key = hashlib.sha256(f"{VERSION}|{tok.digest}|{tok.dtype.str}".encode())
    for f in files:
        with opener("text file", f, FIX_TEXT) as name:
            st, real = os.stat(name), os.path.realpath(name)
        if st.st_size == 0:
            raise DataError(f"text file {f!r} is empty; remove it from the paths or give it text")
        key.update(f"|{real}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}".encode())
    path = cache_dir() / f"text-{key.hexdigest()[:24]}.{tok.dtype.name}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_name(path.name + ".lock")):
            if not path.exists():  # another process may have written it while this one waited
                _write(path, files, tok, opener)
    return np.memmap(path, dtype=tok.dtype, mode="r")


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """An exclusive lock on ``lock`` among this machine's processes (threads: ``_LOCK`` too)."""
    import fcntl

    with _WRITING, open(lock, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write(path: Path, files: list[str], tok: Tokenizer, opener: Opener) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for f in files:
                with _opened(opener, f) as src:
                    if tok.hf is None:
                        _copy_bytes(src, out)
                        continue
                    for group in _groups(_pieces(src, f)):
                        for ids in tok.encode(group):
                            ids.tofile(out)
                if tok.eot is not None:
                    np.asarray([tok.eot], tok.dtype).tofile(out)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _opened(opener: Opener, path: str) -> BinaryIO:
    """The text file ``path`` opened through ``opener``, read outside its block (whose error handling
    would reword this module's own errors)."""
    with opener("text file", path, FIX_TEXT) as name:
        return open(name, "rb")


def _copy_bytes(src: BinaryIO, out: BinaryIO) -> None:
    while chunk := src.read(1 << 24):
        out.write(chunk)


def _groups(pieces: Iterator[str]) -> Iterator[list[str]]:
    group: list[str] = []
    for p in pieces:
        group.append(p)
        if len(group) == GROUP:
            yield group
            group = []
    if group:
        yield group


def _pieces(src: BinaryIO, name: str, piece: int = PIECE) -> Iterator[str]:
    """The file's text in pieces of about ``piece`` characters, each ending at a line start (module
    docstring); non-UTF-8 bytes and a run of ``MAX_RUN`` bytes without a line break are refused."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    text, read = "", 0
    while True:
        chunk = src.read(piece)
        held = decoder.getstate()[0]  # the bytes of a character cut by the last chunk
        try:
            text += decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as e:
            bad = (held + chunk)[e.start : e.start + 1]
            raise DataError(
                f"text file {name!r} is not UTF-8 (byte {read - len(held) + e.start} is {bad!r}); convert "
                "it (iconv -f LATIN1 -t UTF-8, say), or read its raw bytes with tokenizer='bytes'"
            ) from None
        read += len(chunk)
        if not chunk:
            if text:
                yield text
            return
        cut = _line_start(text, piece // 2)
        if cut > 0:
            yield text[:cut]
            text = text[cut:]
        elif len(text) > MAX_RUN:
            raise DataError(
                f"text file {name!r} has {len(text)} characters without a line break before byte {read}: "
                "not text a tokenizer can cut; break its lines, or use tokenizer='bytes'"
            )


def _line_start(text: str, start: int) -> int:
    """The last index after ``start`` that follows a newline and is not whitespace (0: none)."""
    i = len(text) - 1
    while (i := text.rfind("\n", start, i)) >= 0:
        if not text[i + 1].isspace():
            return i + 1
    return 0
