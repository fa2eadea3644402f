"""Where each image of an image source lies: an image folder's files or tar shards' members, listed once.

    folder_index(root)            root/<class>/**/*.jpg|.jpeg|.png, classes and files in sorted order
    tar_index(shards, opener)     WebDataset-style shards: each member's offset, read straight from there

An :class:`ImageIndex` holds arrays, not an object per sample (ImageNet's 1.28M samples in ~40 MB). Files
of other extensions are skipped, as torchvision's ``ImageFolder`` skips them (a ``README.txt``, a
``.DS_Store``); an empty class, a folder without classes, a shard that is not a whole tar or a sample
without its image or its ``.cls`` are each an error naming the file and the fix.
"""

from __future__ import annotations

import glob
import os
import tarfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from sbpflow.data.sources import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
TAR_FIX = "give uncompressed tar shards (WebDataset-style: <key>.jpg and <key>.cls members), written whole"
Opener = Callable[[str, str, str], AbstractContextManager[str]]  # FileSource._file


@dataclass(frozen=True, eq=False)
class ImageIndex:
    """Sample i is ``files[file_of[i]]`` (a tar shard: its bytes ``offset[i] .. offset[i] + size[i]``,
    member ``members[i]``; a folder: the whole file) of class ``labels[i]``."""

    files: tuple[str, ...]
    file_of: np.ndarray  # int32 [n]
    labels: np.ndarray  # int64 [n]
    classes: int  # the folder's class subfolders, or the largest label + 1
    offset: np.ndarray | None = None  # int64 [n], tar shards only
    size: np.ndarray | None = None
    members: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.labels)


def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def folder_index(root: str) -> ImageIndex:
    """The images under ``root``'s class subfolders (sorted by name, numbered from 0), each class's
    files found recursively and sorted by path."""
    try:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except FileNotFoundError:
        raise DataError(f"image folder {root!r} does not exist; give a folder of class subfolders") from None
    except OSError as e:
        raise DataError(
            f"image folder {root!r} cannot be listed ({type(e).__name__}); give a readable folder of class "
            "subfolders"
        ) from None
    if not classes:
        raise DataError(
            f"image folder {root!r} has no class subfolders; put each class's images in a subfolder of its "
            "own (root/cat/1.jpg, root/dog/2.jpg)"
        )
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        found = sorted(
            os.path.join(d, f)
            for d, _, names in os.walk(os.path.join(root, name))
            for f in names
            if is_image(f)
        )
        if not found:
            raise DataError(
                f"class folder {os.path.join(root, name)!r} holds no .jpg, .jpeg or .png image; add its "
                "images or remove the folder"
            )
        files += found
        labels += [label] * len(found)
    return ImageIndex(
        tuple(files), np.arange(len(files), dtype=np.int32), np.asarray(labels, np.int64), len(classes)
    )


def expand(patterns: Sequence[str]) -> list[str]:
    """Files and glob patterns -> the files, each pattern's matches sorted, each file once; a pattern that
    matches nothing is an error (a plain path stays, to be opened and named if it is missing)."""
    out: dict[str, None] = {}
    for p in patterns:
        if glob.has_magic(p):
            matched = sorted(glob.glob(p))
            if not matched:
                raise DataError(f"tar shard pattern {p!r} matches no file; check the path and the pattern")
            out.update(dict.fromkeys(matched))
        else:
            out[p] = None
    return list(out)


@dataclass
class _Shard:
    members: list[tuple[str, int, int]]  # (name, offset of its data, size), files only
    cls: dict[str, bytes]  # a .cls member's name -> its bytes
    problem: str = ""


def _read_shard(shard: str, opener: Opener) -> _Shard:
    """The members of ``shard`` and the bytes of its .cls members; ``problem`` says what makes it unusable.
    Nothing is raised inside the opener's block (it would word any error as an unreadable file)."""
    out = _Shard([], {})
    with opener("tar shard", shard, TAR_FIX) as name, open(name, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        try:
            with tarfile.open(fileobj=f, mode="r:") as tf:
                infos = tf.getmembers()
        except tarfile.TarError as e:
            out.problem = f"is not a whole tar file ({e})"
            return out
        stop = 0
        for m in infos:
            if m.isfile():
                out.members.append((m.name, m.offset_data, m.size))
            stop = max(stop, m.offset_data + -(-m.size // 512) * 512)
        f.seek(stop)
        if f.read(1024) != bytes(1024) or stop + 1024 > end:  # a tar ends with two zero blocks
            last = repr(infos[-1].name) if infos else "its start"
            out.problem = f"is truncated (it ends inside or right after member {last})"
            return out
        for n, off, size in out.members:
            if n.endswith(".cls") and size <= 64:
                f.seek(off)
                out.cls[n] = f.read(size)
    return out


def _split(name: str) -> tuple[str, str]:
    """WebDataset's key (the path up to the first dot of the file's name) and the last extension."""
    d, base = os.path.split(name)
    return os.path.join(d, base.split(".", 1)[0]), os.path.splitext(base)[1].lower()


def _samples(shard: str, s: _Shard) -> list[tuple[str, int, int, int]]:
    """(image member, offset, size, label) of each key of ``shard`` holding an image, in member order."""
    images: dict[str, tuple[str, int, int]] = {}
    labels: dict[str, int] = {}
    for name, off, size in s.members:
        key, ext = _split(name)
        if ext in IMAGE_SUFFIXES:
            if key in images:
                raise DataError(
                    f"tar shard {shard!r} has two images for key {key!r} ({images[key][0]!r}, {name!r}); "
                    "give each sample one image member"
                )
            images[key] = (name, off, size)
        elif ext == ".cls":
            text = s.cls.get(name, b"").strip()
            if not text.isdigit():
                raise DataError(
                    f"member {name!r} of tar shard {shard!r} does not hold a class number; write the "
                    "class as a decimal integer (0, 1, ...) in <key>.cls"
                )
            labels[key] = int(text)
    for key in images.keys() - labels.keys():
        raise DataError(
            f"member {images[key][0]!r} of tar shard {shard!r} has no {key}.cls beside it; give every "
            "image a .cls member holding its class"
        )
    for key in labels.keys() - images.keys():
        raise DataError(
            f"member {key}.cls of tar shard {shard!r} has no image beside it; give every sample a .jpg, "
            ".jpeg or .png member"
        )
    return [(*images[k], labels[k]) for k in images]


def tar_index(shards: Sequence[str], opener: Opener) -> ImageIndex:
    """Every sample of ``shards``, shard by shard in the order given, each shard's in member order."""
    rows: list[tuple[int, str, int, int, int]] = []
    for i, shard in enumerate(shards):
        s = _read_shard(shard, opener)
        if s.problem:
            raise DataError(f"tar shard {shard!r} {s.problem}; {TAR_FIX}")
        found = _samples(shard, s)
        if not found:
            raise DataError(f"tar shard {shard!r} holds no image; {TAR_FIX}")
        rows += [(i, *r) for r in found]
    file_of, members, offset, size, labels = zip(*rows, strict=True)
    labels_a = np.asarray(labels, np.int64)
    return ImageIndex(
        tuple(shards),
        np.asarray(file_of, np.int32),
        labels_a,
        int(labels_a.max()) + 1,
        np.asarray(offset, np.int64),
        np.asarray(size, np.int64),
        tuple(members),
    )
