"""An image's transforms, as torchvision does them, drawn from (seed, epoch, sample) alone.

    draws(seed, epoch, ids)            [n, DRAWS] uniforms: a sample's random choices, whatever reads it
    random_resized_box(w, h, u, ...)   torchvision's RandomResizedCrop box (10 tries, then the centre)
    center_box(w, h, size, resize)     Resize(resize) + CenterCrop(size), as a box of the original image
    decode(file, box, size, ...)       Pillow: open, a reduced JPEG decode where it loses nothing, the box
                                       resized to size x size (bilinear), RGB, flipped: uint8 [size, size, 3]
    to_chw(pixels, scale, shift, out)  (pixels / 255 - mean) / std as float32 [3, size, size], into ``out``

A box is ``(left, top, right, bottom)`` in the image's pixels, as Pillow's. Pillow releases the GIL while
it decodes and resizes, so a thread pool decodes a batch in parallel (:mod:`sbpflow.data.images`).
"""

from __future__ import annotations

import math
from typing import IO, Any

import numpy as np

from sbpflow.random import RandomKey, tensor_rng_id, uniform_at

TRIES = 10  # torchvision's RandomResizedCrop tries 10 boxes before it falls back to the centre
DRAWS = 4 * TRIES + 1  # per try: area, log ratio, top, left; then the flip
Box = tuple[float, float, float, float]


def draws(seed: int, epoch: int, ids: np.ndarray) -> np.ndarray:
    """[len(ids), DRAWS] uniforms in [0, 1): the random choices of samples ``ids`` in ``epoch``, each a
    function of (seed, epoch, sample id) only, so any rank reading any rows draws the same."""
    key = RandomKey(seed % 2**64, tensor_rng_id("images.transform"), epoch % 2**32)
    offsets = np.asarray(ids, dtype=np.uint64)[:, None] * np.uint64(DRAWS) + np.arange(DRAWS, dtype=np.uint64)
    return uniform_at(np, key, offsets, np.float64)


def random_resized_box(
    width: int, height: int, u: np.ndarray, scale: tuple[float, float], ratio: tuple[float, float]
) -> Box:
    """torchvision's ``RandomResizedCrop.get_params`` on the uniforms ``u`` (one sample's draws): a box of
    ``scale`` of the area and an aspect ratio in ``ratio`` (log-uniform), placed uniformly; after
    ``TRIES`` boxes that do not fit, the centre box of the ratio nearest the image's."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for t in range(TRIES):
        a, r, i, j = u[4 * t : 4 * t + 4]
        target = area * (scale[0] + (scale[1] - scale[0]) * a)
        aspect = math.exp(log_lo + (log_hi - log_lo) * r)
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(i * (height - h + 1))  # torch.randint(0, height - h + 1)
            left = int(j * (width - w + 1))
            return (left, top, left + w, top + h)
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return (left, top, left + w, top + h)


def center_box(width: int, height: int, size: int, resize: int) -> Box:
    """torchvision's ``Resize(resize)`` (the shorter side to ``resize``) then ``CenterCrop(size)``, as the
    box of the original image that becomes the size x size crop."""
    if width <= height:
        new_w, new_h = resize, int(resize * height / width)
    else:
        new_w, new_h = int(resize * width / height), resize
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    sx, sy = width / new_w, height / new_h
    return (left * sx, top * sy, (left + size) * sx, (top + size) * sy)


def decode(
    file: str | IO[bytes], box_of: Any, size: int, flip: bool, reduce: bool
) -> tuple[np.ndarray, tuple[int, int], Box]:
    """The image in ``file``: ``box_of(width, height)`` of it resized to size x size (bilinear, as
    torchvision), RGB, flipped left to right if ``flip``; with ``reduce``, a JPEG is decoded at 1/2, 1/4 or
    1/8 scale where the box still holds at least size x size pixels (libjpeg scales in the DCT, several
    times faster). Returns the pixels uint8 [size, size, 3], the image's size and the box."""
    from PIL import Image

    with Image.open(file) as img:
        width, height = img.size
        box = box_of(width, height)
        if reduce and img.format == "JPEG":
            bw, bh = box[2] - box[0], box[3] - box[1]
            img.draft("RGB", (math.ceil(width * size / bw), math.ceil(height * size / bh)))
        sx, sy = img.size[0] / width, img.size[1] / height  # 1 unless draft reduced it
        scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        # L, RGB and RGBA convert channel by channel, so after the resize (fewer pixels); the others before
        # (a palette must not be resampled as indices)
        early = img.mode not in ("L", "RGB", "RGBA")
        src = img.convert("RGB") if early else img
        out = src.resize((size, size), Image.Resampling.BILINEAR, box=scaled)
        if out.mode != "RGB":
            out = out.convert("RGB")
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(out), (width, height), box


def normalizer(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, shift)`` [3, 1, 1] float32 with ``pixel * scale - shift == (pixel / 255 - mean) / std``;
    no mean and std: ``pixel / 255``."""
    m = np.asarray(mean or (0.0, 0.0, 0.0), dtype=np.float64)
    s = np.asarray(std or (1.0, 1.0, 1.0), dtype=np.float64)
    return (1 / (255 * s)).astype(np.float32)[:, None, None], (m / s).astype(np.float32)[:, None, None]


def to_chw(pixels: np.ndarray, scale: np.ndarray, shift: np.ndarray, out: np.ndarray) -> None:
    """uint8 [H, W, 3] -> ``out`` float32 [3, H, W], normalised (two passes, no temporary)."""
    np.multiply(pixels.transpose(2, 0, 1), scale, out=out)
    np.subtract(out, shift, out=out)
