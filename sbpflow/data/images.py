"""Images a job trains on: an image folder or WebDataset-style tar shards, decoded and transformed by the
worker that reads them (``ImageFileSource``, wire ``image_files``: ``protos/sbpflow/v1/data_image.proto``).

    ImageFileSource(paths=("train/",), batch_size=256, size=224)                 # a folder, training
    ImageFileSource(paths=("val/",), batch_size=256, size=224, crop="center", flip=False)
    ImageFileSource(paths=("shards/train-*.tar",), layout="tar", batch_size=256, size=224)

A sample is ``images`` float32 [3, size, size] (RGB, normalised) and ``labels`` int64 []. Its random crop
and flip are drawn from (seed, epoch, sample id) (:func:`sbpflow.data.image_transforms.draws`), so a
sample is the same whichever rank reads it, in a batch or in halves. The files are listed (or the shards'
members indexed) once per process and kept (:func:`_index`); ``read`` then opens each image where it lies
(a shard at its member's offset) and decodes a batch on a thread pool (Pillow releases the GIL in decode
and resize), one thread per core the process may use unless ``threads`` says.
"""

from __future__ import annotations

import glob
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.data.access import MAX_SHOWN
from sbpflow.data.image_index import ImageIndex, expand, folder_index, tar_index
from sbpflow.data.image_transforms import center_box, decode, draws, normalizer, random_resized_box, to_chw
from sbpflow.data.sources import DataError, DataField, FileSource
from sbpflow.dtype import DType
from sbpflow.errors import SbpflowError
from sbpflow.limits import Limits, check_count, check_float, check_int, check_name, refuse

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYOUTS = ("folder", "tar")
CROPS = ("random_resized", "center", "resize")
MAX_IMAGE_BYTES = 1 << 28  # one image file (or tar member): read whole into memory
MAX_SIDE = 1 << 15  # pixels of a sample's side, and of `resize`
IMAGE_FIX = "give JPEG or PNG images that Pillow can open (re-save or remove this one)"
W = "job.data.image_files"


@dataclass(frozen=True, kw_only=True)
class ImageFileSource(FileSource):
    """An image folder (``layout="folder"``: one path) or tar shards (``"tar"``: files or glob patterns).
    The fields are those of ``ImageFiles`` in data_image.proto, which documents each."""

    paths: tuple[str, ...] = ()
    size: int = 224
    layout: str = "folder"
    classes: int = 0  # 0: from the data
    crop: str = "random_resized"
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    resize: int = 0  # crop="center": 0 is round(size * 8 / 7)
    flip: bool = True
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    full_decode: bool = False
    threads: int = 0  # 0: one per core

    # ---- what the control plane asks before any file is opened ----

    def fields(self) -> tuple[DataField, ...]:
        return (
            DataField("images", (3, self.size, self.size), DType.float32),
            DataField("labels", (), DType.int64),
        )

    def file_paths(self) -> list[tuple[str, str]]:
        what = "image folder" if self.layout == "folder" else "tar shard"
        return [(what, p) for p in self.paths]

    def check_limits(self, limits: Limits) -> None:
        check_name(f"{W}.layout", self.layout, limits)
        if self.layout not in LAYOUTS:
            raise refuse(f"{W}.layout", self.layout, "is not a layout", f"give one of {LAYOUTS}")
        check_count(f"{W}.paths", self.paths, limits)
        if not self.paths or (self.layout == "folder" and len(self.paths) != 1):
            raise refuse(
                f"{W}.paths", list(self.paths), "is not one folder" if self.paths else "is empty",
                "give one image folder, or tar shards (files or glob patterns) with layout 'tar'",
            )  # fmt: skip
        for i, p in enumerate(self.paths):
            check_name(f"{W}.paths[{i}]", p, limits, chars=limits.path_chars)
        check_int(f"{W}.size", self.size, 1, MAX_SIDE)
        check_int(f"{W}.classes", self.classes, 0, limits.numel, "give 0 (from the data) or the classes")
        if self.crop not in CROPS:
            raise refuse(f"{W}.crop", self.crop, "is not a crop", f"give one of {CROPS}")
        _check_range(f"{W}.scale", self.scale, 1.0)
        _check_range(f"{W}.ratio", self.ratio, 1e6)
        if self.resize:
            check_int(
                f"{W}.resize", self.resize, self.size, MAX_SIDE, f"give 0 or a side >= size ({self.size})"
            )
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (0, 3) or len(self.mean) != len(self.std):
                raise refuse(
                    f"{W}.{name}", list(values), "is not one value per channel",
                    "give three means and three standard deviations (R, G, B), or neither",
                )  # fmt: skip
            for c, v in enumerate(values):
                lo = 1e-6 if name == "std" else -1e6
                check_float(f"{W}.{name}[{c}]", v, lo, 1e6)
        check_int(f"{W}.threads", self.threads, 0, 1024, "give 0 (one per core) or at most 1024 threads")

    # ---- what a worker reads ----

    def _index(self) -> ImageIndex:
        """The listing of the files (or the shards' members), checked against ``classes`` and at least a
        batch long; once per process for the same paths (each with the same modification time) and roots."""
        key = (self.layout, self.paths, _stamp(self.paths), self.allowed_roots)
        with _LISTING:  # two ranks of a process asking at once list once
            index = _INDEXES.get(key)
            if index is None:
                if self.layout == "folder":
                    index = folder_index(self.paths[0])
                else:
                    index = tar_index(expand(self.paths), self._file)
                while len(_INDEXES) >= 8:
                    _INDEXES.pop(next(iter(_INDEXES)))
                _INDEXES[key] = index
        _check_classes(index, self.classes, self.paths[0])
        self._check(len(index))
        return index

    @property
    def num_samples(self) -> int:
        return len(self._index())

    @property
    def num_classes(self) -> int:
        """``classes``, or the folder's class subfolders (the shards' largest label + 1)."""
        return self.classes or self._index().classes

    def read(self, batch: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        index = self._index()
        ids = self._sample_ids(len(index), batch, rows)
        epoch = batch // (len(index) // self.batch_size)
        u = draws(self.seed, epoch, ids)
        out = np.empty((len(ids), 3, self.size, self.size), np.float32)
        scale, shift = normalizer(self.mean, self.std)

        def one(k: int) -> None:
            pixels = self._decode(index, int(ids[k]), u[k])
            to_chw(pixels, scale, shift, out[k])

        list(_pool(self.threads).map(one, range(len(ids))))  # list(): raise the first failure here
        return {"images": out, "labels": index.labels[ids]}

    def _decode(self, index: ImageIndex, i: int, u: np.ndarray) -> np.ndarray:
        """Sample ``i``'s pixels, uint8 [size, size, 3]; a file that is not an image is a DataError."""
        path = index.files[index.file_of[i]]
        what = "image" if index.offset is None else f"image {index.members[i][:MAX_SHOWN]!r} in tar shard"
        flip = self.flip and u[-1] < 0.5
        try:
            with self._file(what, path, IMAGE_FIX) as name, open(name, "rb") as f:
                # the file's bytes read whole, then decoded: Pillow reading a file object in its small
                # chunks takes 1.6x as long to decode (3.1 ms against 1.9 ms for a 500x375 JPEG)
                if index.offset is None:
                    data = f.read(MAX_IMAGE_BYTES + 1)
                else:
                    assert index.size is not None
                    f.seek(int(index.offset[i]))
                    data = f.read(min(int(index.size[i]), MAX_IMAGE_BYTES + 1))
                    if len(data) < min(index.size[i], MAX_IMAGE_BYTES):
                        raise OSError("the shard is shorter than when it was indexed")
            if len(data) > MAX_IMAGE_BYTES:
                raise DataError(
                    f"{what} {path[:MAX_SHOWN]!r} is over {MAX_IMAGE_BYTES >> 20} MiB; {IMAGE_FIX}"
                )
            return decode(io.BytesIO(data), self._box_for(u), self.size, flip, not self.full_decode)[0]
        except SbpflowError:  # DataError, DataAccessDenied: worded already
            raise
        except Exception as e:  # Pillow's other failures: SyntaxError, DecompressionBombError, struct.error
            raise DataError(
                f"{what} {path[:MAX_SHOWN]!r} cannot be decoded ({type(e).__name__}); {IMAGE_FIX}"
            ) from None

    def _box_for(self, u: np.ndarray) -> Any:
        """The crop of one sample (its draws ``u``) as a function of the image's size."""
        if self.crop == "random_resized":
            return lambda w, h: random_resized_box(w, h, u, self.scale, self.ratio)
        if self.crop == "center":
            resize = self.resize or round(self.size * 8 / 7)
            return lambda w, h: center_box(w, h, self.size, resize)
        return lambda w, h: (0, 0, w, h)


def _check_range(where: str, r: tuple[float, float], hi: float) -> None:
    if len(r) != 2:
        raise refuse(where, list(r), "is not a (min, max) pair", "give two numbers")
    check_float(f"{where}_min", r[0], 1e-9, hi, f"give a number in (0, {hi:g}]")
    check_float(f"{where}_max", r[1], r[0], hi, f"give a number in [{where}_min, {hi:g}] ({r[0]:g}..{hi:g})")


def _stamp(paths: tuple[str, ...]) -> tuple[int, ...]:
    """The modification times of the paths that exist (a folder's changes when a class is added): a listing
    taken before is taken again."""
    out = []
    for p in paths:
        try:
            out.append(os.stat(p).st_mtime_ns)
        except (OSError, ValueError):
            out.append(0)
    return tuple(out)


def _check_classes(index: ImageIndex, classes: int, shown: str) -> None:
    """A folder of another number of classes than ``classes`` (when given), or a label beyond it."""
    if not classes:
        return
    if index.offset is None and index.classes != classes:
        raise DataError(
            f"image folder {shown[:MAX_SHOWN]!r} has {index.classes} class subfolders, but classes={classes}; "
            "give the folder's number of classes (or 0 to take it from the folder)"
        )
    if index.classes > classes:
        k = int(np.argmax(index.labels >= classes))
        raise DataError(
            f"member {index.members[k]!r} of tar shard {index.files[index.file_of[k]]!r} has class "
            f"{int(index.labels[k])}, outside 0..{classes - 1}; give classes above every label (or 0)"
        )


_LISTING = threading.Lock()
_INDEXES: dict[tuple[Any, ...], ImageIndex] = {}  # a few listings, the oldest dropped first
_POOLING = threading.Lock()
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's decoding threads (one pool per size, shared by every source and rank)."""
    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with _POOLING:
        if threads not in _POOLS:
            _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="sbpflow-images")
        return _POOLS[threads]


def image_source(path: str, **options: Any) -> ImageFileSource:
    """Tar shards if ``path`` is a ``.tar`` file, a glob pattern or a file, else an image folder; shuffled;
    ``options`` are :class:`ImageFileSource`'s. Where the layout is found from the path (on the client)."""
    tar = path.endswith(".tar") or glob.has_magic(path) or os.path.isfile(path)
    return ImageFileSource(paths=(path,), layout="tar" if tar else "folder", **{"shuffle": True, **options})
