"""The image pipeline's samples/s: sbpflow's ImageFileSource against torch's DataLoader, side by side.

    python bench/data/images.py                  # 512 JPEGs of 500x375, crops of 224, 2 workers, batch 32
    python bench/data/images.py --size 112       # smaller crops (where a reduced JPEG decode pays more)
    python bench/data/images.py --quick          # 96 images, one repeat: a smoke run
    python bench/data/images.py --trace T.json   # T.json from `sbpflow run examples/resnet.py --set data=DIR
                                                 # --trace T.json`: how long each step's first conv waited

Both sides read the same folder of generated JPEGs (10 class subfolders; photo-like: smooth colour fields
with grain, quality 90, ~500x375 as ImageNet's typical image) and do the same work per sample: decode,
RandomResizedCrop (scale 0.08..1, ratio 3/4..4/3, bilinear), a random horizontal flip, to float32 CHW in
[0, 1], Normalize (ImageNet's mean and std), batched.

- sbpflow: ``ImageFileSource.read`` of each batch in turn, decoding on ``--workers`` threads (Pillow
  releases the GIL in decode and resize), a JPEG decoded at 1/2, 1/4 or 1/8 scale where the crop still
  holds every pixel it needs (``draft``; ``--full-decode`` turns it off).
- peer: ``torch.utils.data.DataLoader`` with ``--workers`` worker processes over a Dataset doing exactly
  what torchvision's ``ImageFolder`` (PIL open + ``convert("RGB")``), ``RandomResizedCrop``,
  ``RandomHorizontalFlip``, ``ToTensor`` and ``Normalize`` do, written out with the same PIL and torch
  calls: torchvision itself cannot be imported beside this torch (its import fails with "operator
  torchvision::nms does not exist").

Each side's throughput is its batches after the first (the folder listing, the pool's and the workers'
start excluded) over their time; the sides alternate ``--repeat`` times on the same cores and the medians
are compared: ``ratio`` is sbpflow's samples/s over the peer's. A benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy/torch are imported: the workers are the parallelism

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, cast  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sbpflow.data.images import IMAGENET_MEAN, IMAGENET_STD, ImageFileSource  # noqa: E402

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def make_folder(root: Path, images: int, classes: int = 10, seed: int = 0) -> None:
    """``images`` photo-like JPEGs of 500x375 (some 375x500), ``classes`` subfolders."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(images):
        folder = root / f"class{i % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        w, h = (500, 375) if i % 4 else (375, 500)
        coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(
            (w, h), Image.Resampling.BICUBIC
        )
        grain = rng.normal(0, 12, (h, w, 3))
        pixels = np.clip(np.asarray(coarse, dtype=np.float64) + grain, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


def sbpflow_rate(root: Path, args: argparse.Namespace) -> float:
    source = ImageFileSource(
        paths=(str(root),),
        batch_size=args.batch_size,
        size=args.size,
        shuffle=True,
        seed=1,
        threads=args.workers,
        full_decode=args.full_decode,
    )
    batches = source.num_samples // args.batch_size
    source.read(0)  # the listing and the pool, as the peer's workers start before its first batch
    t0 = time.perf_counter()
    for b in range(1, batches):
        source.read(b)
    return (batches - 1) * args.batch_size / (time.perf_counter() - t0)


class TorchvisionLike:
    """torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize, with
    the PIL and torch calls those classes make (torchvision 0.2x, PIL images)."""

    def __init__(self, root: Path, size: int) -> None:
        import torch

        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        self.samples = [
            (str(p), c) for c, name in enumerate(classes) for p in sorted((root / name).glob("*.jpg"))
        ]
        self.size = size
        self.mean = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def _params(self, width: int, height: int) -> tuple[int, int, int, int]:
        import torch

        area = height * width
        log_ratio = torch.log(torch.tensor(RATIO))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(SCALE[0], SCALE[1]).item()
            aspect_ratio = math.exp(torch.empty(1).uniform_(log_ratio[0].item(), log_ratio[1].item()).item())
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = int(torch.randint(0, height - h + 1, size=(1,)).item())
                j = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return i, j, h, w
        in_ratio = width / height
        if in_ratio < min(RATIO):
            w, h = width, int(round(width / min(RATIO)))
        elif in_ratio > max(RATIO):
            h, w = height, int(round(height * max(RATIO)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __getitem__(self, k: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        path, label = self.samples[k]
        with open(path, "rb") as f:  # torchvision's pil_loader
            img = Image.open(f).convert("RGB")
        i, j, h, w = self._params(*img.size)
        img = img.crop((j, i, j + w, i + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        t = torch.from_numpy(np.array(img, np.uint8, copy=True)).view(self.size, self.size, 3)
        t = t.permute((2, 0, 1)).contiguous().to(dtype=torch.float32).div(255)  # ToTensor
        return t.sub_(self.mean).div_(self.std), label  # Normalize (on ToTensor's fresh tensor)


def torch_rate(root: Path, args: argparse.Namespace) -> float:
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    data = TorchvisionLike(root, args.size)
    loader: Any = DataLoader(
        cast(Any, data), batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True
    )
    it = iter(loader)
    next(it)  # the workers started
    t0 = time.perf_counter()
    n = sum(len(labels) for _, labels in it)
    return n / (time.perf_counter() - t0)


def stem_waits(path: str) -> list[tuple[int, float]]:
    """(iteration, ms) that rank 0's first convolution (``model.stem.conv2d``) waited for its batch: the
    part of the compute thread's idle gap before it that ends when the batch's last DATA_LOAD act ends."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    acts = [e for e in events if e.get("ph") == "X" and e["pid"] == 0]
    compute = sorted((e for e in acts if names[(0, e["tid"])] == "compute"), key=lambda e: e["ts"])
    ready: dict[int, float] = {}
    for e in acts:
        if names[(0, e["tid"])] == "data":
            it = e["args"]["iteration"]
            ready[it] = max(ready.get(it, 0.0), e["ts"] + e["dur"])
    out = []
    for before, e in zip(compute, compute[1:], strict=False):
        if e["name"].startswith("kernel model.stem.conv2d"):
            idle_from = before["ts"] + before["dur"]
            out.append(
                (
                    e["args"]["iteration"],
                    max(0.0, min(ready[e["args"]["iteration"]], e["ts"]) - idle_from) / 1e3,
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="threads (sbpflow) and processes (torch)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--full-decode", action="store_true", help="sbpflow: no reduced JPEG decode")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trace", default="", help="report a ResNet run's waits on data from its trace instead")
    args = ap.parse_args()
    if args.trace:
        for it, ms in stem_waits(args.trace):
            print(f"step {it}: the first convolution waited {ms:.2f} ms for its batch")
        return
    if args.quick:
        args.images, args.repeat = 96, 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "train"
        make_folder(root, args.images)
        kb = sum(p.stat().st_size for p in root.rglob("*.jpg")) / args.images / 1024
        print(
            f"{args.images} JPEGs (500x375, {kb:.0f} KB each), crops {args.size}, batch {args.batch_size}, "
            f"{args.workers} workers, {len(os.sched_getaffinity(0))} cores"
        )
        ours, peer = [], []
        for r in range(args.repeat):
            ours.append(sbpflow_rate(root, args))
            peer.append(torch_rate(root, args))
            print(
                f"repeat {r + 1}: sbpflow {ours[-1]:7.1f} samples/s   torch DataLoader {peer[-1]:7.1f} samples/s"
            )
    a, b = statistics.median(ours), statistics.median(peer)
    print(f"sbpflow ImageFileSource  {a:7.1f} samples/s (median)")
    print(f"torch DataLoader         {b:7.1f} samples/s (median)")
    print(f"ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
