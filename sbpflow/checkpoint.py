"""Sharded checkpoints on disk: the format, atomic writing, listing, reading for any layout, export/import.

A checkpoint of a job after ``step`` completed steps is one directory ``<root>/step-00000020/`` with

    rank-00002.<token>.safetensors   one per rank of the writing layout: the shards that rank owns
    manifest.json                    written last; a checkpoint without one does not exist

Every rank file is a valid safetensors file (8-byte little-endian header length, a JSON header, raw
bytes) whose ``__metadata__["sbpflow"]`` says which slice of which logical tensor each entry holds, so
the files describe themselves. A tensor replicated (``B``) over a mesh axis is written by one replica
only (chosen by the tensor's name, so replicas share the writing); partial-sum (``P``) shards are all
written and marked ``partial``: the logical value is their sum. ZeRO-sharded state stays sharded — no
rank ever gathers a tensor to save it.

Atomicity: a rank writes ``*.tmp``, fsyncs, renames; whoever finds every rank's file present writes the
manifest the same way (two ranks racing write the same manifest; the rename is atomic). ``<token>``
names the attempt that wrote a file, so a file left by a dead attempt is never mixed into a new one.

RNG state and data position need no bytes: randomness is keyed by ``(seed, tensor, step)`` and batch
``b`` is a pure function of the source and ``b``, so the manifest's ``seed`` and ``step`` are both.

Reading (:class:`CheckpointReader`) gives any slice of any logical tensor from whichever files hold it,
through memory maps: a rank of a new layout reads exactly the bytes of its shard. :func:`export` writes
logical tensors to safetensors or ``.npz``; :func:`open_tensors` reads either back (or a checkpoint).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sbpflow.errors import SbpflowError
from sbpflow.placement import Placement
from sbpflow.sbp import Broadcast, NdSbp, PartialSum
from sbpflow.sharding import Index, shard_index

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")
RANK_FILE = re.compile(r"^rank-(\d{5})\.([A-Za-z0-9_-]+)\.safetensors$")
META_KEY = "sbpflow"

# numpy dtype name <-> safetensors dtype code
ST_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
}
NP_DTYPES = {v: k for k, v in ST_DTYPES.items()}


class CheckpointError(SbpflowError):
    """A checkpoint that is missing, incomplete, corrupt, or lacks a tensor the caller asked for."""


# ---- the manifest --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One stored slice ``[start, stop)`` of a logical tensor: entry ``key`` of file ``file``."""

    file: str
    key: str
    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def index(self) -> Index:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))


@dataclass(frozen=True)
class TensorEntry:
    """A logical tensor: its shape, dtype, kind and the pieces that hold it (summed when ``partial``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy name
    kind: str = "parameter"
    partial: bool = False
    pieces: tuple[Piece, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds. ``step`` steps were completed: training resumes at step ``step``
    (0-based), reading batch ``data_position`` and drawing with ``(seed, tensor, step)``."""

    job: str
    step: int
    seed: int
    tensors: tuple[TensorEntry, ...]
    files: Mapping[str, int] = field(default_factory=dict)  # file -> bytes, checked on open
    ranks: tuple[int, ...] = ()
    format_version: int = FORMAT_VERSION

    @property
    def data_position(self) -> int:
        return self.step

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise CheckpointError(
            f"checkpoint of job {self.job!r} at step {self.step} has no tensor {name!r}; "
            f"it has {sorted(t.name for t in self.tensors)}"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Manifest:
        d = json.loads(text)
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"manifest format_version {d.get('format_version')!r} is not {FORMAT_VERSION}; "
                "read it with the sbpflow version that wrote it"
            )
        tensors = tuple(
            TensorEntry(
                t["name"],
                tuple(t["shape"]),
                t["dtype"],
                t["kind"],
                t["partial"],
                tuple(Piece(p["file"], p["key"], tuple(p["start"]), tuple(p["stop"])) for p in t["pieces"]),
            )
            for t in d["tensors"]
        )
        return Manifest(d["job"], d["step"], d["seed"], tensors, d["files"], tuple(d["ranks"]))


# ---- safetensors ---------------------------------------------------------------------------------------


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    sync_dir: bool = True,
) -> int:
    """Write ``tensors`` to ``path`` atomically (temp name, fsync, rename, and with ``sync_dir`` an fsync
    of the directory so the rename survives a crash); returns the bytes written."""
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    arrays, offset = [], 0
    for name, value in tensors.items():
        a = np.ascontiguousarray(value)
        code = ST_DTYPES.get(a.dtype.name)
        if code is None:
            raise CheckpointError(f"tensor {name!r} has dtype {a.dtype}, which safetensors cannot hold here")
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer does
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for a in arrays:
            if a.nbytes:
                f.write(a.data)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        _fsync_dir(path.parent)
    return 8 + len(raw) + offset


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data begins."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise CheckpointError(f"{path}: header length {n} is implausible; the file is corrupt")
        try:
            return json.loads(f.read(n)), 8 + n
        except ValueError as exc:
            raise CheckpointError(
                f"{path}: the safetensors header is not JSON ({exc}); the file is corrupt"
            ) from None


class SafetensorsFile:
    """Memory-mapped entries of one safetensors file: ``file[key]`` is a read-only view, no copy."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.header, self._base = read_safetensors_header(self.path)
        self.metadata: dict[str, str] = self.header.pop("__metadata__", {}) or {}
        size = self.path.stat().st_size
        end = max((int(e["data_offsets"][1]) for e in self.header.values()), default=0)
        if self._base + end > size:
            raise CheckpointError(f"{self.path}: holds {size} bytes but its header needs {self._base + end}")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._base else None

    def keys(self) -> list[str]:
        return list(self.header)

    def __getitem__(self, key: str) -> np.ndarray:
        e = self.header.get(key)
        if e is None:
            raise CheckpointError(f"{self.path} has no entry {key!r}; it has {sorted(self.header)}")
        dtype = np.dtype(NP_DTYPES[e["dtype"]])
        a, b = (self._base + int(o) for o in e["data_offsets"])
        if a == b or self._map is None:
            return np.zeros(tuple(e["shape"]), dtype)
        return self._map[a:b].view(dtype).reshape(tuple(e["shape"]))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- writing a rank's shards ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """What a rank saves of one tensor: its local value and where it lies in the logical tensor."""

    name: str
    value: np.ndarray
    index: Index
    shape: tuple[int, ...]  # logical
    kind: str = "parameter"
    partial: bool = False


def writes(name: str, placement: Placement, nd_sbp: NdSbp, rank: int) -> bool:
    """True when ``rank`` is the replica that saves ``name``: along each ``B`` mesh axis one coordinate
    (picked from the name, so different tensors spread over the replicas) writes; ``P`` and ``S`` write all."""
    coord = placement.coord_of(rank)
    pick = zlib.crc32(name.encode())
    return all(
        c == pick % n
        for s, n, c in zip(nd_sbp, placement.shape, coord, strict=True)
        if isinstance(s, Broadcast)
    )


def shard_of(
    name: str, kind: str, value: Any, placement: Placement, nd_sbp: NdSbp, rank: int, shape: Sequence[int]
) -> Shard:
    index = shard_index(tuple(shape), placement.shape, nd_sbp, placement.coord_of(rank))
    partial = any(isinstance(s, PartialSum) for s in nd_sbp)
    return Shard(name, np.asarray(value), index, tuple(shape), kind, partial)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def write_rank(root: str | Path, step: int, rank: int, token: str, shards: Iterable[Shard]) -> Path:
    """Write one rank's shards for the checkpoint of ``step`` (atomically); returns the file."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {}
    for s in shards:
        tensors[s.name] = s.value
        meta[s.name] = {
            "start": [i.start for i in s.index],
            "stop": [i.stop for i in s.index],
            "shape": list(s.shape),
            "kind": s.kind,
            "partial": s.partial,
        }
    path = d / f"rank-{rank:05d}.{token}.safetensors"
    # no directory fsync here: the manifest's, in the same directory after every rank file is there,
    # makes their renames durable; a crash before it leaves a checkpoint that was never complete
    write_safetensors(path, tensors, {META_KEY: json.dumps(meta)}, sync_dir=False)
    return path


def try_complete(root: str | Path, step: int, token: str, ranks: Sequence[int], job: str, seed: int) -> bool:
    """Write the manifest of ``step`` if every rank of ``ranks`` has written its file under ``token``;
    True when the checkpoint is complete (by this call or an earlier one)."""
    d = step_dir(root, step)
    names = {r: f"rank-{r:05d}.{token}.safetensors" for r in ranks}
    if not all((d / n).exists() for n in names.values()):
        return False
    entries: dict[str, dict[str, Any]] = {}
    files = {}
    for name in names.values():
        f = SafetensorsFile(d / name)
        files[name] = f.path.stat().st_size
        for key, m in json.loads(f.metadata.get(META_KEY, "{}")).items():
            e = entries.setdefault(
                key,
                {"shape": tuple(m["shape"]), "kind": m["kind"], "partial": m["partial"], "pieces": []},
            )
            e["dtype"] = NP_DTYPES[f.header[key]["dtype"]]
            e["pieces"].append(Piece(name, key, tuple(m["start"]), tuple(m["stop"])))
    tensors = tuple(
        TensorEntry(k, e["shape"], e["dtype"], e["kind"], e["partial"], tuple(e["pieces"]))
        for k, e in sorted(entries.items())
    )
    manifest = Manifest(job, step, seed, tensors, files, tuple(ranks))
    tmp = d / f"{MANIFEST}.{token}.{os.getpid()}-{secrets.token_hex(4)}.tmp"  # racers: own names
    with open(tmp, "w") as out:
        out.write(manifest.to_json())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, d / MANIFEST)
    _fsync_dir(d)
    return True


# ---- listing and reading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    bytes: int


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Every complete checkpoint under ``root`` (a manifest that reads), oldest first."""
    root = Path(root)
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not STEP_DIR.match(d.name):
            continue
        try:
            m = Manifest.from_json((d / MANIFEST).read_text())
        except (OSError, ValueError, KeyError, CheckpointError):
            continue
        out.append(CheckpointInfo(m.step, d, sum(m.files.values())))
    return out


def latest(root: str | Path) -> CheckpointInfo | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from either itself or a root holding several (the latest)."""
    p = Path(path)
    if (p / MANIFEST).exists():
        return p
    last = latest(p)
    if last is None:
        raise CheckpointError(
            f"{p} holds no complete checkpoint (no step-NNNNNNNN/{MANIFEST}); pass a checkpoint directory "
            "or the checkpoint_dir of a job that has written one"
        )
    return last.path


def prune(root: str | Path, keep_tokens: Sequence[str] = ()) -> list[Path]:
    """Remove what no complete checkpoint refers to: step directories without a manifest, temp files,
    and rank files the manifest does not list. Call it only while no writer runs. Returns what went."""
    import shutil

    gone: list[Path] = []
    root = Path(root)
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not STEP_DIR.match(d.name):
            continue
        if not (d / MANIFEST).exists():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
            continue
        listed = set(Manifest.from_json((d / MANIFEST).read_text()).files)
        for f in d.iterdir():
            if f.name != MANIFEST and f.name not in listed:
                f.unlink(missing_ok=True)
                gone.append(f)
    return gone


class CheckpointReader:
    """Slices of the logical tensors of one complete checkpoint (or of a safetensors/.npz file of logical
    tensors, see :func:`open_tensors`). Only the pieces that overlap the asked slice are touched."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve(path)
        self.manifest = Manifest.from_json((self.path / MANIFEST).read_text())
        self._files: dict[str, SafetensorsFile] = {}
        for name, size in self.manifest.files.items():
            have = (self.path / name).stat().st_size if (self.path / name).exists() else -1
            if have != size:
                raise CheckpointError(
                    f"checkpoint {self.path}: file {name} has {have} bytes, the manifest says {size}; "
                    "the checkpoint is damaged, resume from an earlier one"
                )

    @property
    def step(self) -> int:
        return self.manifest.step

    def __contains__(self, name: str) -> bool:
        return any(t.name == name for t in self.manifest.tensors)

    def names(self, kinds: Sequence[str] | None = None) -> list[str]:
        return [t.name for t in self.manifest.tensors if kinds is None or t.kind in kinds]

    def _file(self, name: str) -> SafetensorsFile:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = SafetensorsFile(self.path / name)
        return f

    def piece(self, p: Piece) -> np.ndarray:
        return self._file(p.file)[p.key]

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        """The logical tensor ``name``, or its slice ``index``, as a new array."""
        t = self.manifest.tensor(name)
        index = index if index is not None else tuple(slice(0, n) for n in t.shape)
        lo = [s.start for s in index]
        out = np.zeros(tuple(s.stop - s.start for s in index), np.dtype(t.dtype))
        for p in t.pieces:
            a = [max(x, s) for x, s in zip(lo, p.start, strict=True)]
            b = [min(s.stop, e) for s, e in zip(index, p.stop, strict=True)]
            if any(x >= y for x, y in zip(a, b, strict=True)):
                continue
            src = tuple(slice(x - s, y - s) for x, y, s in zip(a, b, p.start, strict=True))
            dst = tuple(slice(x - s, y - s) for x, y, s in zip(a, b, lo, strict=True))
            if t.partial:
                out[dst] += self.piece(p)[src]
            else:
                out[dst] = self.piece(p)[src]
        return out


def read_logical(path: str | Path, kinds: Sequence[str] | None = ("parameter",)) -> dict[str, np.ndarray]:
    """Every logical tensor of a checkpoint (of ``kinds``), gathered: for export and tests, never resume."""
    r = CheckpointReader(path)
    return {n: r.read(n) for n in r.names(kinds)}


# ---- export and import ---------------------------------------------------------------------------------

EXPORTERS = {
    "safetensors": lambda path, tensors: write_safetensors(path, tensors, {"format": "pt"}),
    "npz": lambda path, tensors: np.savez(path, **tensors),
}


def export(
    checkpoint: str | Path, out: str | Path, fmt: str = "safetensors", kinds: Sequence[str] = ("parameter",)
) -> Path:
    """Write the logical tensors of ``kinds`` of a checkpoint to ``out`` as ``fmt`` (safetensors or npz)."""
    writer = EXPORTERS.get(fmt)
    if writer is None:
        raise CheckpointError(f"export format {fmt!r} is unknown; use one of {sorted(EXPORTERS)}")
    writer(Path(out), read_logical(checkpoint, kinds))
    return Path(out)


class TensorFile:
    """Logical tensors from a safetensors or .npz file, with :class:`CheckpointReader`'s ``read``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.step = 0
        if self.path.suffix == ".npz":
            with np.load(self.path) as z:
                self._arrays: Mapping[str, np.ndarray] = {k: z[k] for k in z.files}
        else:
            f = SafetensorsFile(self.path)
            self._arrays = {k: f[k] for k in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._arrays

    def names(self, kinds: Sequence[str] | None = None) -> list[str]:
        return list(self._arrays)

    def read(self, name: str, index: Index | None = None) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}; it has {sorted(self._arrays)}")
        return np.array(a if index is None else a[index])


def open_tensors(path: str | Path) -> CheckpointReader | TensorFile:
    """A reader of a checkpoint directory (or root), a ``.safetensors`` or a ``.npz`` file."""
    p = Path(path)
    return TensorFile(p) if p.is_file() else CheckpointReader(p)
