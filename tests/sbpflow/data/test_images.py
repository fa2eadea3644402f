"""ImageFileSource on real files: an image folder and the same images as tar shards give the same samples,
any layout of rows the same samples, labels from sorted class folders; each bad input one DataError that
names the file; the data roots, at Submit and as each file is opened."""

from __future__ import annotations

import dataclasses
import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sbpflow.data.access import DataAccessDenied
from sbpflow.data.images import ImageFileSource, image_source
from sbpflow.data.sources import DataError

CLASSES = ("cat", "dog", "eel")


def write_folder(root: Path, per_class: int = 4, classes: tuple[str, ...] = CLASSES, seed: int = 0) -> Path:
    """root/<class>/<i>.jpg: JPEGs of a few sizes (and one PNG of each mode a folder may hold)."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = 24 + 3 * i, 40 - 2 * c
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:02d}.jpg", quality=90)
    Image.fromarray(rng.integers(0, 256, (30, 20), dtype=np.uint8)).save(root / classes[0] / "gray.png")
    Image.new("P", (25, 25), 3).save(root / classes[1 % len(classes)] / "palette.png")
    Image.new("RGBA", (25, 30), (10, 200, 30, 9)).save(root / classes[-1] / "alpha.png")
    (root / classes[0] / "README.txt").write_text("not an image: skipped")
    return root


def folder_samples(root: Path) -> list[tuple[Path, int]]:
    """The folder's samples in the source's order: classes sorted, each class's files sorted."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    exts = (".jpg", ".jpeg", ".png")
    return [
        (p, c)
        for c, name in enumerate(classes)
        for p in sorted((root / name).iterdir(), key=str)
        if p.suffix.lower() in exts
    ]


def write_shards(samples: list[tuple[Path, int]], out: Path, shards: int = 2) -> list[str]:
    """The samples as WebDataset-style shards, in order: <key>.<ext> + <key>.cls, split into ``shards``."""
    out.mkdir(parents=True, exist_ok=True)
    per = -(-len(samples) // shards)
    paths = []
    for s in range(shards):
        path = out / f"train-{s:03d}.tar"
        with tarfile.open(path, "w") as tf:
            for k, (image, label) in enumerate(samples[s * per : (s + 1) * per]):
                key = f"sample{s * per + k:05d}"
                for name, data in ((key + image.suffix, image.read_bytes()), (f"{key}.cls", b"%d\n" % label)):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(tmp_path_factory.mktemp("images") / "train")


def source(path: Path | str, **kw: object) -> ImageFileSource:
    options: dict[str, object] = dict(batch_size=4, size=12, shuffle=True, seed=7)
    return image_source(str(path), **{**options, **kw})


def test_labels_follow_the_sorted_class_folders(folder: Path) -> None:
    s = source(folder, shuffle=False)
    expected = [label for _, label in folder_samples(folder)]
    assert s.num_samples == 15 and s.num_classes == 3
    labels = np.concatenate([s.read(b)["labels"] for b in range(s.num_samples // 4)])
    np.testing.assert_array_equal(labels, expected[:12])
    batch = s.read(0)
    assert batch["images"].shape == (4, 3, 12, 12) and batch["images"].dtype == np.float32
    assert batch["labels"].dtype == np.int64


def test_a_folder_and_its_tar_shards_give_the_same_samples(folder: Path, tmp_path: Path) -> None:
    shards = write_shards(folder_samples(folder), tmp_path / "shards", shards=3)
    from_folder = source(folder)
    from_tars = source(str(tmp_path / "shards" / "train-*.tar"))
    assert from_tars.layout == "tar" and from_tars.num_samples == from_folder.num_samples
    assert image_source(shards[0], batch_size=1).layout == "tar"
    for b in range(2 * (15 // 4)):  # two epochs, shuffled
        a, t = from_folder.read(b), from_tars.read(b)
        np.testing.assert_array_equal(a["labels"], t["labels"])
        np.testing.assert_array_equal(a["images"], t["images"])


def test_any_rows_and_threads_read_the_same_samples(folder: Path) -> None:
    s = source(folder, batch_size=6)
    for b in range(3):
        whole = s.read(b)
        halves = [s.read(b, slice(0, 3)), dataclasses.replace(s, threads=1).read(b, slice(3, 6))]
        for key in whole:
            np.testing.assert_array_equal(whole[key], np.concatenate([h[key] for h in halves]))
    # the crop and flip are drawn per epoch: the same sample in the next epoch is another crop
    ids = [s._sample_ids(15, b, slice(None)) for b in (0, 2)]
    same = np.intersect1d(ids[0], ids[1])
    if same.size:
        i = int(same[0])
        a = s.read(0)["images"][list(ids[0]).index(i)]
        c = s.read(2)["images"][list(ids[1]).index(i)]
        assert not np.array_equal(a, c)


def test_center_crop_and_normalize_match_numpy(tmp_path: Path) -> None:
    """Resize(20) of a 20-wide image changes nothing, so the sample is its centre 16x16, normalised; a
    grayscale image becomes three equal channels."""
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)
    gray = rng.integers(0, 256, (30, 20), dtype=np.uint8)
    for name, pixels in (("a", rgb), ("b", gray)):
        (tmp_path / name).mkdir()
        Image.fromarray(pixels).save(tmp_path / name / "0.png")  # lossless
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    s = source(tmp_path, batch_size=2, size=16, shuffle=False, crop="center", resize=20, flip=False)
    got = dataclasses.replace(s, mean=mean, std=std).read(0)["images"]
    for k, pixels in enumerate((rgb, np.repeat(gray[..., None], 3, axis=2))):
        crop = pixels[7:23, 2:18].transpose(2, 0, 1) / 255.0  # top round((30-16)/2), left (20-16)/2
        want = (crop - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
        np.testing.assert_allclose(got[k], want, atol=1e-5)
    plain = dataclasses.replace(s, mean=(), std=()).read(0)["images"]
    np.testing.assert_allclose(plain[0], rgb[7:23, 2:18].transpose(2, 0, 1) / 255.0, atol=1e-6)


def test_a_flip_mirrors_the_image(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    pixels = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    for i in range(16):
        Image.fromarray(pixels).save(tmp_path / "a" / f"{i:02d}.png")
    s = source(tmp_path, batch_size=16, size=8, crop="resize", mean=(), std=())
    images = s.read(0)["images"]
    want = pixels.transpose(2, 0, 1) / 255.0
    flipped = [bool(np.allclose(im, want[:, :, ::-1], atol=1e-6)) for im in images]
    kept = [bool(np.allclose(im, want, atol=1e-6)) for im in images]
    assert all(f != k for f, k in zip(flipped, kept, strict=True))  # each exactly one of the two
    assert 0 < sum(flipped) < 16
    np.testing.assert_allclose(dataclasses.replace(s, flip=False).read(0)["images"][0], want, atol=1e-6)


def test_a_reduced_jpeg_decode_is_close_to_the_full_one(tmp_path: Path) -> None:
    """draft() decodes at 1/8 for a 32x32 crop of a 512x384 photo-like image: the same picture."""
    (tmp_path / "a").mkdir()
    y, x = np.mgrid[0:384, 0:512]
    smooth = np.stack([x / 2, y / 1.5, (x + y) / 4], axis=2) % 256
    Image.fromarray(smooth.astype(np.uint8)).save(tmp_path / "a" / "0.jpg", quality=95)
    s = source(tmp_path, batch_size=1, size=32, crop="center", flip=False, mean=(), std=())
    reduced, full = s.read(0)["images"], dataclasses.replace(s, full_decode=True).read(0)["images"]
    assert not np.array_equal(reduced, full)  # the draft was taken
    assert np.abs(reduced - full).mean() < 0.02  # of a [0, 1] range


# ---- bad inputs: one DataError naming the file ----


def _error(s: ImageFileSource) -> str:
    with pytest.raises(DataError) as e:
        s.read(0)
    return str(e.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_bad_image_names_its_file(folder: Path, tmp_path: Path, damage: str) -> None:
    root = write_folder(tmp_path / "d", per_class=1, classes=("a",))
    bad = root / "a" / "00.jpg"
    data = bad.read_bytes()
    bad.write_bytes({"garbage": os.urandom(500), "truncated": data[: len(data) // 2], "empty": b""}[damage])
    msg = _error(source(root, batch_size=4, shuffle=False))
    assert str(bad) in msg and "JPEG or PNG" in msg


def test_a_truncated_tar_shard_names_the_shard(folder: Path, tmp_path: Path) -> None:
    (shard,) = write_shards(folder_samples(folder), tmp_path, shards=1)
    data = Path(shard).read_bytes()
    for cut in (100, 2000, 7000, len(data) - 10240 + 100):
        Path(shard).write_bytes(data[:cut])
        msg = _error(source(shard))
        assert shard in msg and ("tar" in msg) and ("truncated" in msg or "not a whole tar" in msg), msg


def _tar(path: Path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def _jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (9, 9), (1, 2, 3)).save(out, "JPEG")
    return out.getvalue()


@pytest.mark.parametrize(
    ("members", "says"),
    [
        ({"a.jpg": b"x", "a.cls": b"-1"}, "does not hold a class number"),
        ({"a.jpg": b"x"}, "has no a.cls"),
        ({"a.cls": b"1"}, "has no image"),
        ({"a.jpg": b"x", "a.cls": b"one"}, "does not hold a class number"),
        ({"a.jpg": b"x", "a.png": b"y", "a.cls": b"1"}, "two images"),
        ({"a.txt": b"x"}, "holds no image"),
    ],
)
def test_a_bad_sample_in_a_shard_names_the_shard(
    tmp_path: Path, members: dict[str, bytes], says: str
) -> None:
    shard = _tar(tmp_path / "s.tar", members)
    msg = _error(source(shard, batch_size=1))
    assert shard in msg and says in msg, msg


def test_a_label_beyond_classes_is_refused(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "s.tar", {"a.jpg": _jpeg(), "a.cls": b"5", "b.jpg": _jpeg(), "b.cls": b"0"})
    assert source(shard, batch_size=1).num_classes == 6
    msg = _error(source(shard, batch_size=1, classes=3))
    assert "'a.jpg'" in msg and "class 5, outside 0..2" in msg


def test_folders_without_images_or_classes(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "r", per_class=1, classes=("a", "b"))
    (root / "c").mkdir()
    (root / "c" / "notes.txt").write_text("x")
    assert str(root / "c") in _error(source(root, batch_size=1)) and "holds no .jpg" in _error(
        source(root, batch_size=1)
    )
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "0.jpg").write_bytes(_jpeg())
    assert "has no class subfolders" in _error(source(tmp_path / "flat", batch_size=1))
    missing = tmp_path / "missing"
    assert f"image folder {str(missing)!r} does not exist" in _error(source(missing, batch_size=1))
    assert "matches no file" in _error(source(str(tmp_path / "none-*.tar"), batch_size=1))
    assert "does not exist" in _error(source(str(tmp_path / "gone.tar"), batch_size=1))


def test_fewer_samples_than_a_batch_and_a_class_mismatch(folder: Path) -> None:
    assert "fewer than one batch of 16" in _error(source(folder, batch_size=16))
    msg = _error(source(folder, classes=4))
    assert "has 3 class subfolders, but classes=4" in msg and str(folder) in msg


# ---- the data roots ----


def test_the_data_policy_refuses_a_folder_outside_its_roots(folder: Path, tmp_path: Path) -> None:
    from control_plane.service.data_policy import DataPolicy

    roots = tmp_path / "roots"
    roots.mkdir()
    s = source(folder)
    assert not DataPolicy.under([roots]).allows(s.file_paths()[0][1])
    assert DataPolicy.under([folder.parent]).allows(s.file_paths()[0][1])
    # as opened: a class folder linked from inside the roots to outside them is refused image by image
    inside = roots / "train"
    inside.mkdir()
    os.symlink(folder / "cat", inside / "cat")
    linked = dataclasses.replace(source(inside, batch_size=1), allowed_roots=(str(roots),))
    with pytest.raises(DataAccessDenied, match="outside what the server may read"):
        linked.read(0)
