"""Data sources: what feeds a job's input tensors, as plain data, and the readers that serve a rank.

A source yields global batches of ``batch_size`` samples; batch ``b`` is samples ``[b*B, (b+1)*B)`` of
the (optionally shuffled, per epoch) sample order. ``read(batch, rows)`` returns only the rows a rank
holds (its ``S(0)`` share), and file-backed sources memory-map their files so that a rank reads just
those rows. Synthetic data is drawn by the counter-based generator, so it too is layout-independent.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from sbpflow.data.access import MAX_SHOWN, DataAccessDenied, opened
from sbpflow.data.clicks import click_shapes, read_clicks
from sbpflow.data.mlm import mlm_shapes, read_mlm
from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import SbpflowError
from sbpflow.limits import Limits, check_count, check_int, check_name
from sbpflow.random import RandomKey, normal, normal_at, row_offsets, tensor_rng_id, uniform_at


class DataError(SbpflowError, ValueError):
    """A data source that cannot serve: missing file, mismatched lengths, too few samples."""


@dataclass(frozen=True)
class DataField:
    name: str
    sample_shape: tuple[int, ...]
    dtype: DType


@dataclass(frozen=True, kw_only=True)
class _Common:
    batch_size: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = True

    def _check(self, n: int) -> None:
        if self.batch_size < 1:
            raise DataError(f"batch_size={self.batch_size}: a batch needs at least one sample")
        if n < self.batch_size:
            raise DataError(f"the source has {n} samples, fewer than one batch of {self.batch_size}")

    def _sample_ids(self, n: int, batch: int, rows: slice) -> np.ndarray:
        """The sample ids of ``rows`` of global batch ``batch``; shuffled per epoch when asked."""
        per_epoch = n // self.batch_size
        epoch, b = divmod(batch, per_epoch)
        ids = np.arange(b * self.batch_size, (b + 1) * self.batch_size)[rows]
        if self.shuffle:
            ids = _permutation(self.seed, epoch, n)[ids]
        return ids


@functools.lru_cache(maxsize=2)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The sample order of ``epoch``, drawn once per epoch, not once per batch (0.3 ms at 46k samples);
    read-only, since every reader of the epoch shares it."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.flags.writeable = False
    return order


@dataclass(frozen=True, eq=False, kw_only=True)
class ArraySource(_Common):
    """In-memory arrays, one per field, sharing their first (sample) dimension. For small data."""

    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(next(iter(self.arrays.values())))

    def fields(self) -> tuple[DataField, ...]:
        return tuple(DataField(k, tuple(v.shape[1:]), as_dtype(v.dtype)) for k, v in self.arrays.items())

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        ids = self._sample_ids(self.num_samples, batch, rows)
        return {k: np.ascontiguousarray(v[ids]) for k, v in self.arrays.items()}

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ArraySource)
            and _common(self) == _common(other)
            and self.arrays.keys() == other.arrays.keys()
            and all(
                a.dtype == other.arrays[k].dtype and np.array_equal(a, other.arrays[k])
                for k, a in self.arrays.items()
            )
        )


@dataclass(frozen=True, kw_only=True)
class FileSource(_Common):
    """A source that reads files: the base of every file format. ``allowed_roots``: set by the control
    plane from its data policy (``--data-root``), never carried by the wire; each file is then opened once
    and checked as opened (:mod:`sbpflow.data.access`). None: read what the process can (a user's own
    ``sf.run``).

    A format defines ``num_samples``, ``fields()``, ``read()`` (as every source), ``file_paths()`` (every file
    it would read, which the data policy checks at Submit) and ``check_limits()`` (its own values against
    :class:`sbpflow.limits.Limits`, before any file is opened), and registers its wire form in
    :data:`sbpflow.data.formats.FORMATS`. ``fields_need_files``: its fields are known only once its files
    are opened (the workers check the graph's inputs then, not Submit).
    """

    allowed_roots: tuple[str, ...] | None = field(default=None, compare=False)
    fields_need_files: ClassVar[bool] = False

    @property
    def num_samples(self) -> int:
        raise NotImplementedError(type(self).__name__)

    def fields(self) -> tuple[DataField, ...]:
        raise NotImplementedError(type(self).__name__)

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        raise NotImplementedError(type(self).__name__)

    def file_paths(self) -> list[tuple[str, str]]:
        """``(what, path)`` of every file this source would read, ``what`` naming it in a message."""
        raise NotImplementedError(type(self).__name__)

    def check_limits(self, limits: Limits) -> None:
        """Refuse (:class:`sbpflow.limits.LimitError`) a value of this source outside ``limits``."""
        raise NotImplementedError(type(self).__name__)

    @contextmanager
    def _file(self, what: str, path: str, fix: str) -> Iterator[str]:
        """``path`` opened and checked; a file that cannot be read is a DataError saying ``fix``. The
        reader's own message may quote the file's bytes, so it is never passed on."""
        try:
            with opened(path, self.allowed_roots, what) as name:
                yield name
        except (DataAccessDenied, DataError):  # already says which file and what to do
            raise
        except FileNotFoundError:
            raise DataError(f"{what} {path[:MAX_SHOWN]!r} does not exist") from None
        except (OSError, ValueError) as e:
            raise DataError(
                f"{what} {path[:MAX_SHOWN]!r} is not readable ({type(e).__name__}); {fix}"
            ) from None


@dataclass(frozen=True, kw_only=True)
class ArrayFileSource(FileSource):
    """One ``.npy`` file per field, memory-mapped: a rank reads only its rows."""

    paths: Mapping[str, str] = field(default_factory=dict)
    fields_need_files: ClassVar[bool] = True

    def _open(self) -> dict[str, np.ndarray]:
        out = {}
        for k, p in self.paths.items():
            with self._file(
                f"data field {k!r}", p, "give a .npy array file, written with numpy.save"
            ) as name:
                out[k] = np.load(name, mmap_mode="r")
        return out

    def file_paths(self) -> list[tuple[str, str]]:
        return [(f"data field {k!r}", p) for k, p in self.paths.items()]

    def check_limits(self, limits: Limits) -> None:
        check_count("job.data.array_files.paths", self.paths, limits)
        for key, path in self.paths.items():
            check_name("job.data.array_files.paths key", key, limits)
            check_name(f"job.data.array_files.paths[{key!r}]", path, limits, chars=limits.path_chars)

    @property
    def num_samples(self) -> int:
        return min(len(a) for a in self._open().values())

    def fields(self) -> tuple[DataField, ...]:
        return tuple(DataField(k, tuple(a.shape[1:]), as_dtype(a.dtype)) for k, a in self._open().items())

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        arrays = self._open()
        ids = self._sample_ids(min(len(a) for a in arrays.values()), batch, rows)
        return {
            k: np.ascontiguousarray(a[np.sort(ids)][np.argsort(np.argsort(ids))]) for k, a in arrays.items()
        }


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """A file's identity: its device and inode, and its size and modification time (a rewrite in place)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _Mapped:
    """The token files a process has mapped, by (path, dtype, allowed_roots, file identity): the last
    MAX of them, under a lock (a worker's loader threads read at once). A path that now names another
    file, or the same file rewritten, has another identity and is opened and checked again."""

    MAX = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()

    def get(self, key: tuple[Any, ...]) -> np.ndarray | None:
        with self._lock:
            return self._maps.get(key)

    def put(self, key: tuple[Any, ...], ids: np.ndarray) -> None:
        with self._lock:
            self._maps[key] = ids
            while len(self._maps) > self.MAX:
                self._maps.popitem(last=False)


_MAPPED = _Mapped()


@dataclass(frozen=True, kw_only=True)
class TokenFileSource(FileSource):
    """A file of token ids (GPT-style): sample i is the window at ``i*seq_len``.

    ``path``: a flat little-endian file of ``dtype`` ids (int32 or int64), or a ``.npy`` array of integer
    ids of one axis, whose own header gives their type (uint16 included: nanoGPT's uint16 ``.bin``, which
    the wire's DType cannot name, becomes one by ``np.save("train.npy", np.memmap("train.bin", np.uint16))``).
    Yields ``tokens`` and ``targets`` (the same window shifted by one token).
    """

    path: str = ""
    dtype: DType = DType.int32
    seq_len: int = 0

    def _tokens(self) -> np.ndarray:
        """The file's ids, mapped once per file (``_MAPPED``): mapped anew at every read, a batch's windows
        page-faulted into the new mapping each time (~80 of a 108 us read of the main job's batch)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return self._open_tokens()[0]  # raises the DataError that names the file
        key = (self.path, self.dtype, self.allowed_roots, _identity(st))
        if (hit := _MAPPED.get(key)) is not None:
            return hit
        ids, opened_as = self._open_tokens()
        if opened_as == key[3]:  # the file checked is the one the path names: kept for the next reads
            _MAPPED.put(key, ids)
        return ids

    def _open_tokens(self) -> tuple[np.ndarray, tuple[int, ...]]:
        """The ids, opened and checked against ``allowed_roots``, and the identity of the file opened."""
        if self.path.endswith(".npy"):
            fix = "give a .npy array of integer token ids, one axis, written with numpy.save"
            with self._file("token file", self.path, fix) as name:
                ids, ident = np.load(name, mmap_mode="r"), _identity(os.stat(name))
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise DataError(f"token file {self.path!r} holds {ids.dtype} of shape {ids.shape}; {fix}")
            return ids, ident
        with self._file("token file", self.path, f"give a flat file of {self.dtype.name} token ids") as name:
            return np.memmap(name, dtype=self.dtype.to_numpy(), mode="r"), _identity(os.stat(name))

    def file_paths(self) -> list[tuple[str, str]]:
        return [("token file", self.path)]

    def check_limits(self, limits: Limits) -> None:
        check_name("job.data.token_file.path", self.path, limits, chars=limits.path_chars)
        check_int("job.data.token_file.seq_len", self.seq_len, 1, limits.numel)

    @property
    def num_samples(self) -> int:
        return (len(self._tokens()) - 1) // self.seq_len

    def fields(self) -> tuple[DataField, ...]:
        return (
            DataField("tokens", (self.seq_len,), DType.int64),
            DataField("targets", (self.seq_len,), DType.int64),
        )

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        toks = self._tokens()
        ids = self._sample_ids((len(toks) - 1) // self.seq_len, batch, rows)
        return self.samples(toks, ids, self.seq_len)

    @staticmethod
    def samples(toks: np.ndarray, ids: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
        """``tokens`` and ``targets`` of samples ``ids`` of the flat ids ``toks`` (any source of them)."""
        windows = TokenFileSource.windows(toks, ids, seq_len, seq_len + 1)
        return {"tokens": windows[:, :-1].copy(), "targets": windows[:, 1:].copy()}

    @staticmethod
    def windows(toks: np.ndarray, ids: np.ndarray, stride: int, length: int) -> np.ndarray:
        """The ``length`` ids at ``i * stride`` for each ``i`` of ``ids``, int64 ``[len(ids), length]``."""
        # one gather of every window's positions, not a slice and a copy per sample
        at = ids[:, None] * stride + np.arange(length)
        return np.asarray(toks)[at].astype(np.int64, copy=False).reshape(len(ids), length)


@dataclass(frozen=True, kw_only=True)
class SyntheticSource(_Common):
    """Generated samples, each a pure function of (seed, field, sample id): no file, any size.

    ``kind``: ``"normal"`` (every float field N(0, 1); int fields uniform in ``[0, params['vocab'])``),
    ``"tokens"`` (``tokens``/``targets`` of ``params['seq_len']`` ids below ``params['vocab']``, targets
    the tokens shifted by one), ``"regression"`` (``x`` N(0, 1) of ``params['in']`` and
    ``y = x @ W`` with a fixed teacher ``W`` of ``params['out']`` columns), ``"clicks"`` (click logs for
    Wide & Deep: ``dense``, ``ids`` and ``label`` of :mod:`sbpflow.data.clicks`, from ``params['dense']``,
    ``params['fields']`` and ``params['vocab']``), ``"mlm"`` (masked-language-model pairs for BERT:
    ``tokens``, ``token_types``, ``positions`` and ``labels`` of :mod:`sbpflow.data.mlm`, from
    ``params['seq_len']``, ``params['vocab']`` and ``params['predictions']``).
    """

    kind: str = "normal"
    sample_fields: tuple[DataField, ...] = ()
    params: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    num_samples: int = 1 << 20

    def fields(self) -> tuple[DataField, ...]:
        if self.kind == "tokens":
            t = int(self.params["seq_len"])
            return (DataField("tokens", (t,), DType.int64), DataField("targets", (t,), DType.int64))
        if self.kind == "regression":
            return (
                DataField("x", (int(self.params["in"]),), DType.float32),
                DataField("y", (int(self.params["out"]),), DType.float32),
            )
        if self.kind == "normal":
            return self.sample_fields
        if self.kind == "clicks":
            return tuple(DataField(k, s, d) for k, (s, d) in click_shapes(self.params).items())
        if self.kind == "mlm":
            return tuple(DataField(k, s, d) for k, (s, d) in mlm_shapes(self.params).items())
        raise DataError(
            f"synthetic kind {self.kind!r} is unknown; use 'normal', 'tokens', 'regression', 'clicks' or 'mlm'"
        )

    def _draw(self, f: DataField, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of field ``f``'s logical draw of shape (num_samples, *sample_shape), all in one
        generator call (each element is a function of its offset alone: the same values as a draw of
        each row, bit for bit)."""
        key = RandomKey(self.seed, tensor_rng_id(f.name))
        offsets = row_offsets(ids, f.sample_shape)
        if f.dtype.is_floating:
            return normal_at(np, key, offsets, np.float64).astype(f.dtype.to_numpy())
        vocab = int(self.params.get("vocab", 2))
        return (uniform_at(np, key, offsets, np.float64) * vocab).astype(f.dtype.to_numpy())

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        ids = self._sample_ids(self.num_samples, batch, rows)
        if self.kind == "tokens":
            t = int(self.params["seq_len"])
            seq = self._draw(DataField("tokens", (t + 1,), DType.int64), ids)
            return {"tokens": seq[:, :-1].copy(), "targets": seq[:, 1:].copy()}
        if self.kind == "regression":
            x = self._draw(DataField("x", (int(self.params["in"]),), DType.float64), ids)
            w = normal(
                np,
                RandomKey(self.seed, tensor_rng_id("teacher")),
                (x.shape[1], int(self.params["out"])),
                None,
                np.float64,
            )
            return {"x": x.astype(np.float32), "y": (x @ w).astype(np.float32)}
        if self.kind == "clicks":
            return read_clicks(self.seed, self.params, self.num_samples, ids)
        if self.kind == "mlm":
            return read_mlm(self.seed, self.params, self.num_samples, ids)
        return {f.name: self._draw(f, ids) for f in self.fields()}


DataSource = ArraySource | SyntheticSource | FileSource  # FileSource: ArrayFileSource, TokenFileSource, ...


def with_roots(source: DataSource | None, roots: tuple[str, ...] | None) -> DataSource | None:
    """``source`` whose files are checked as opened against ``roots`` (a source without files as it is):
    how the control plane's data policy reaches a source decoded from the wire."""
    if isinstance(source, FileSource):
        return dataclasses.replace(source, allowed_roots=roots)
    return source


def _common(s: _Common) -> tuple[Any, ...]:
    return (s.batch_size, s.shuffle, s.seed, s.drop_last)
