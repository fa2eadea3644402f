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

Integrity: each entry's CRC-32 is in its file's metadata and, with each file's, in the manifest
(:mod:`sbpflow.checkpoint.format`); the reader verifies a piece before it first reads it.

Atomicity: a rank writes ``*.tmp``, fsyncs, renames; whoever finds every rank's file present writes the
manifest the same way (two ranks racing write the same manifest; the rename is atomic). ``<token>``
names the attempt that wrote a file, so a file left by a dead attempt is never mixed into a new one.

A write that fails removes its temp file (a full disk is not filled further) and raises a
:class:`CheckpointStorageError` naming the folder, the errno's text and what to do: by
:data:`STORAGE_ERRORS`, :class:`CheckpointStorageFull` (``ENOSPC``, ``EDQUOT``) or
:class:`CheckpointStorageReadOnly` (``EROFS``, ``EACCES``, ``EPERM``); each says its job's ``reason``.

RNG state and data position need no bytes: randomness is keyed by ``(seed, tensor, step)`` and batch
``b`` is a pure function of the source and ``b``, so the manifest's ``seed`` and ``step`` are both.

Reading (:class:`CheckpointReader`) gives any slice of any logical tensor from whichever files hold it,
through memory maps: a rank of a new layout reads exactly the bytes of its shard. :func:`export` writes
logical tensors to safetensors or ``.npz``; :func:`open_tensors` reads either back (or a checkpoint).

This module writes checkpoints; the format (manifest, safetensors files) is in
:mod:`sbpflow.checkpoint.format`, listing, reading and export in :mod:`sbpflow.checkpoint.read`. Every
name of those is importable from here too.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sbpflow.checkpoint.format import (
    MANIFEST,
    META_KEY,
    NP_DTYPES,
    CheckpointError,
    Manifest,
    Piece,
    SafetensorsFile,
    TensorEntry,
    crc_of,
    crc_text,
    discard,
    fsync_dir,
    safetensors_crc,
    step_dir,
    write_safetensors,
)
from sbpflow.placement import Placement
from sbpflow.sbp import Broadcast, NdSbp, PartialSum
from sbpflow.sharding import Index, shard_index


class CheckpointStorageError(CheckpointError):
    """A checkpoint that could not be written for its storage (an I/O error): the job fails with ``reason``."""

    reason = "CHECKPOINT_STORAGE_ERROR"
    todo = "check the disk under it"


class CheckpointStorageFull(CheckpointStorageError):
    reason = "CHECKPOINT_STORAGE_FULL"
    todo = "free space there (or raise the quota)"


class CheckpointStorageReadOnly(CheckpointStorageError):
    reason = "CHECKPOINT_STORAGE_READ_ONLY"
    todo = "make it writable for the control plane's user"


# errno -> the error a failed write raises (any other OSError: CheckpointStorageError)
STORAGE_ERRORS: dict[int, type[CheckpointStorageError]] = {
    errno.ENOSPC: CheckpointStorageFull,
    errno.EDQUOT: CheckpointStorageFull,
    errno.EROFS: CheckpointStorageReadOnly,
    errno.EACCES: CheckpointStorageReadOnly,
    errno.EPERM: CheckpointStorageReadOnly,
}


def storage_error(error: OSError, directory: str | Path) -> CheckpointStorageError:
    """``error`` (a failed write under ``directory``) as the checkpoint error that says what to do."""
    cls = STORAGE_ERRORS.get(error.errno or 0, CheckpointStorageError)
    code = errno.errorcode.get(error.errno or 0, "no errno")
    what = error.strerror or str(error)
    return cls(
        f"cannot write a checkpoint in {directory}: {what} ({code}); {cls.todo}, or point the control "
        "plane's --checkpoint-root elsewhere, then resume the job"
    )


def make_dir(directory: str | Path) -> Path:
    """``directory`` and its parents, created if missing; ``CheckpointStorageError`` when they cannot be."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, directory) from e
    return Path(directory)


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


def write_rank(root: str | Path, step: int, rank: int, token: str, shards: Iterable[Shard]) -> Path:
    """Write one rank's shards for the checkpoint of ``step`` (atomically); returns the file."""
    d = make_dir(step_dir(root, step))
    tensors, meta = {}, {}
    for s in shards:
        tensors[s.name] = value = np.ascontiguousarray(s.value)  # the bytes written, and their CRC
        meta[s.name] = {
            "start": [i.start for i in s.index],
            "stop": [i.stop for i in s.index],
            "shape": list(s.shape),
            "kind": s.kind,
            "partial": s.partial,
            "checksum": crc_text(crc_of(value)),
        }
    path = d / f"rank-{rank:05d}.{token}.safetensors"
    # no directory fsync here: the manifest's, in the same directory after every rank file is there,
    # makes their renames durable; a crash before it leaves a checkpoint that was never complete
    try:
        write_safetensors(path, tensors, {META_KEY: json.dumps(meta)}, sync_dir=False)
    except OSError as e:
        raise storage_error(e, d) from e
    return path


def try_complete(root: str | Path, step: int, token: str, ranks: Sequence[int], job: str, seed: int) -> bool:
    """Write the manifest of ``step`` if every rank of ``ranks`` has written its file under ``token``;
    True when the checkpoint is complete (by this call or an earlier one)."""
    d = step_dir(root, step)
    names = {r: f"rank-{r:05d}.{token}.safetensors" for r in ranks}
    if not all((d / n).exists() for n in names.values()):
        return False
    entries: dict[str, dict[str, Any]] = {}
    files, checksums = {}, {}
    for name in names.values():
        f = SafetensorsFile(d / name)
        files[name] = f.path.stat().st_size
        metas = json.loads(f.metadata.get(META_KEY, "{}"))
        crcs = {key: int(m["checksum"].split(":")[1], 16) for key, m in metas.items()}
        checksums[name] = crc_text(safetensors_crc(f.header_crc, f.header, crcs))  # no data read
        for key, m in metas.items():
            e = entries.setdefault(
                key,
                {"shape": tuple(m["shape"]), "kind": m["kind"], "partial": m["partial"], "pieces": []},
            )
            e["dtype"] = NP_DTYPES[f.header[key]["dtype"]]
            e["pieces"].append(Piece(name, key, tuple(m["start"]), tuple(m["stop"]), m["checksum"]))
    tensors = tuple(
        TensorEntry(k, e["shape"], e["dtype"], e["kind"], e["partial"], tuple(e["pieces"]))
        for k, e in sorted(entries.items())
    )
    manifest = Manifest(job, step, seed, tensors, files, tuple(ranks), checksums)
    tmp = d / f"{MANIFEST}.{token}.{os.getpid()}-{secrets.token_hex(4)}.tmp"  # racers: own names
    try:
        with open(tmp, "w") as out:
            out.write(manifest.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, d / MANIFEST)
        fsync_dir(d)
    except OSError as e:
        discard(tmp)
        raise storage_error(e, d) from e
    return True
