"""Finding and reading sbpflow checkpoints, and exporting or importing their logical tensors.

:func:`list_checkpoints` and :func:`latest` find the complete checkpoints under a root (those whose
manifest reads); :func:`prune` removes what none of them refers to (and the ``*.tmp`` files of writers
that died). :func:`verify` reads every byte of a checkpoint against the manifest's sizes and CRCs, and
:func:`latest_intact` is the newest checkpoint that passes, telling ``on_corrupt`` of each newer one that
did not: resume and restart choose with it, so a corrupt or truncated latest checkpoint falls back to
the previous one. The reader verifies each piece's CRC before it first reads it, and refuses a file of
the wrong size when it opens the checkpoint. :class:`CheckpointReader` gives any
slice of any logical tensor of a checkpoint from whichever files hold it, through memory maps, so a rank
of a new layout reads exactly the bytes of its shard. :func:`export` writes logical tensors to
safetensors or ``.npz``; :func:`open_tensors` reads either back (or a checkpoint, or a ``torch.save`` file
through torch) with the same ``read``.
The format is in :mod:`sbpflow.checkpoint.format`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sbpflow.checkpoint.format import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    Manifest,
    Piece,
    SafetensorsFile,
    crc_of,
    crc_text,
    file_crc,
    write_safetensors,
)
from sbpflow.sharding import Index

# ---- listing -------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class CorruptCheckpoint:
    """A complete checkpoint that failed :func:`verify`, and why."""

    info: CheckpointInfo
    error: CheckpointError


OnCorrupt = Callable[[CorruptCheckpoint], None]


def verify(path: str | Path) -> Manifest:
    """Read every file of the checkpoint at ``path`` once and check its size and CRC-32 against the
    manifest (a version 1 manifest: sizes only); its manifest, or a ``CheckpointError`` naming the file
    and both values."""
    path = Path(path)
    try:
        m = Manifest.from_json((path / MANIFEST).read_text())
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path}: its manifest does not read ({exc})") from None
    for name, size in m.files.items():
        want = m.checksums.get(name, "")
        try:
            crc, have = file_crc(path / name) if want else (0, (path / name).stat().st_size)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: file {name} does not read ({exc})") from None
        if have != size:
            raise CheckpointError(f"file {name} has {have} bytes, the manifest says {size} (truncated?)")
        if want and crc_text(crc) != want:
            raise CheckpointError(f"file {name} has checksum {crc_text(crc)}, the manifest says {want}")
    return m


def latest_intact(
    root: str | Path, on_corrupt: OnCorrupt = lambda c: None, at_most: int | None = None
) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root`` that passes :func:`verify` (every byte read), of a
    step no later than ``at_most`` when given (later ones are neither read nor reported); ``on_corrupt``
    hears of each newer one that did not pass. None when none passes."""
    for info in reversed(list_checkpoints(root)):
        if at_most is not None and info.step > at_most:
            continue
        try:
            verify(info.path)
        except CheckpointError as exc:
            on_corrupt(CorruptCheckpoint(info, exc))
            continue
        return info
    return None


def corrupt_note(c: CorruptCheckpoint, resumes_at: int) -> str:
    """What a log line says of a corrupt checkpoint passed over for the one at ``resumes_at``."""
    then = f"resuming from step-{resumes_at:08d}" if resumes_at else "starting again from step 0"
    return f"checkpoint {c.info.path.name} is corrupt ({c.error}); {then}"


def resolve(path: str | Path, on_corrupt: OnCorrupt | None = None) -> Path:
    """A checkpoint directory from either itself or a root holding several: the latest, or with
    ``on_corrupt`` the latest intact one (:func:`latest_intact`: every byte read, the corrupt ones
    passed over and reported)."""
    p = Path(path)
    if (p / MANIFEST).exists():
        return p
    last = latest(p) if on_corrupt is None else latest_intact(p, on_corrupt)
    if last is None:
        raise CheckpointError(
            f"{p} holds no complete checkpoint (no step-NNNNNNNN/{MANIFEST}); pass a checkpoint directory "
            "or the checkpoint_dir of a job that has written one"
        )
    return last.path


def prune(root: str | Path, keep_tokens: Sequence[str] = ()) -> list[Path]:
    """Remove what no complete checkpoint refers to: step directories without a manifest, temp files,
    and rank files the manifest does not list. A directory whose manifest does not read (damaged, or of
    a newer format) loses only its temp files. Call it only while no writer runs. Returns what went."""
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
        try:
            listed = set(Manifest.from_json((d / MANIFEST).read_text()).files)
        except (OSError, ValueError, KeyError, CheckpointError):
            listed = {f.name for f in d.iterdir() if not f.name.endswith(".tmp")}
        for f in d.iterdir():
            if f.name != MANIFEST and f.name not in listed:
                f.unlink(missing_ok=True)
                gone.append(f)
    return gone


# ---- reading -------------------------------------------------------------------------------------------


class CheckpointReader:
    """Slices of the logical tensors of one complete checkpoint (or of a safetensors/.npz file of logical
    tensors, see :func:`open_tensors`). Only the pieces that overlap the asked slice are touched."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve(path)
        self.manifest = Manifest.from_json((self.path / MANIFEST).read_text())
        self._files: dict[str, SafetensorsFile] = {}
        self._verified: set[tuple[str, str]] = set()  # pieces whose CRC was checked
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
        """The whole stored piece ``p``; its CRC is checked the first time (every byte of it read, even
        when only a slice is wanted: resharding along another axis reads more than it keeps)."""
        a = self._file(p.file)[p.key]
        if p.checksum and (p.file, p.key) not in self._verified:
            have = crc_text(crc_of(a))
            if have != p.checksum:
                raise CheckpointError(
                    f"checkpoint {self.path}: tensor {p.key!r} in file {p.file} has checksum {have}, the "
                    f"manifest says {p.checksum}; the file is corrupt: resume from an earlier checkpoint"
                )
            self._verified.add((p.file, p.key))
        return a

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


Convert = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def export(
    checkpoint: str | Path,
    out: str | Path,
    fmt: str = "safetensors",
    kinds: Sequence[str] = ("parameter",),
    convert: Convert | None = None,
) -> Path:
    """Write the logical tensors of ``kinds`` of a checkpoint to ``out`` as ``fmt`` (safetensors or npz),
    through ``convert`` when given (another layout's names and orientation: the job's ``to_layout``)."""
    writer = EXPORTERS.get(fmt)
    if writer is None:
        raise CheckpointError(f"export format {fmt!r} is unknown; use one of {sorted(EXPORTERS)}")
    tensors = read_logical(checkpoint, kinds)
    writer(Path(out), dict(convert(tensors)) if convert is not None else tensors)
    return Path(out)


# what a torch.save file starts with: a zip archive (PyTorch >= 1.6), or a pickle (the legacy format)
TORCH_MAGIC = (b"PK\x03\x04", b"\x80")
# the keys under which training scripts commonly save a model's state dict inside a larger one
STATE_KEYS = ("state_dict", "model", "model_state_dict", "module")


def is_torch_file(path: Path) -> bool:
    """A ``torch.save`` file, not safetensors (whose JSON header opens at byte 8, after its length, which
    may start with either magic)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head[8:9] == b"{":
        return False
    return head.startswith(TORCH_MAGIC) or path.suffix in (".pt", ".pth", ".bin", ".ckpt")


def read_torch(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a ``torch.save`` file (a state dict, or one under a key of ``STATE_KEYS``), read by
    ``torch.load(weights_only=True)``: no code in the file runs."""
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{path} is a PyTorch torch.save file; reading it needs torch (pip install torch), or convert it "
            "to safetensors where torch is installed (safetensors.torch.save_file(torch.load(path), out))"
        ) from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises pickle, zip and its own errors alike
        raise CheckpointError(f"{path}: torch.load(weights_only=True) could not read it: {exc}") from None
    for key in STATE_KEYS:
        if isinstance(loaded, Mapping) and isinstance(loaded.get(key), Mapping):
            loaded = loaded[key]
            break
    tensors = dict(loaded) if isinstance(loaded, Mapping) else {}
    bad = [str(k) for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if not tensors or bad:
        what = (
            f"holds {', '.join(bad[:5])}, which are not tensors"
            if bad
            else f"holds a {type(loaded).__name__}"
        )
        raise CheckpointError(f"{path} {what}; save a state dict: torch.save(model.state_dict(), path)")
    return {str(k): (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in tensors.items()}


class TensorFile:
    """Logical tensors from a safetensors, .npz or ``torch.save`` file, with :class:`CheckpointReader`'s
    ``read``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.step = 0
        if self.path.suffix == ".npz":
            with np.load(self.path) as z:
                self._arrays: Mapping[str, np.ndarray] = {k: z[k] for k in z.files}
        elif is_torch_file(self.path):
            self._arrays = read_torch(self.path)
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


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a file (safetensors, .npz, ``torch.save``) or a checkpoint's parameters, by name."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"{p} does not exist; give a safetensors, .npz, .pt or .bin file or a checkpoint"
        )
    reader = open_tensors(p)
    return {n: reader.read(n) for n in reader.names(("parameter",))}
