"""ResNet (He et al. 2016) image classification, data parallel, traced into a Job.

    sbpflow run examples/resnet.py --ranks 2                         # ResNet-18, 16x16 images, width 8
    sbpflow plan examples/resnet.py --ranks 8 --set depth=50 --set width=64 --set image_size=224
    sbpflow run examples/resnet.py --set data=DIR --set image_size=64   # DIR/<class>/*.jpg: an image folder
    sbpflow run examples/resnet.py --set data='shards/train-*.tar'     # WebDataset-style tar shards
    python examples/resnet.py --data DIR                             # DIR/images.npy, DIR/labels.npy

Data parallel: the images are ``S(0)`` and the parameters are left to the compiler (``B``, their
gradients ``P`` all-reduced). Batch norm is synchronised across the ranks by SBP alone: its means over
the batch of an ``S(0)`` activation are partial sums ``P``, which the compiler all-reduces to ``B``.

Data: generated images by default (``SyntheticSource``: N(0, 1) pixels and uniform labels, each a pure
function of (seed, sample), so the same on every layout; a model can only memorise them). ``--data``:

- an image folder (one subfolder of .jpg/.jpeg/.png images per class) or tar shards (a ``.tar`` file or a
  glob of them, WebDataset-style ``<key>.jpg`` + ``<key>.cls``): decoded by the workers, each image a
  random-resized crop of ``image_size`` x ``image_size``, flipped at random and normalised with
  ImageNet's mean and std (``ImageFileSource``, sbpflow/data/images.py). The classes are the folder's
  (the shards' largest label + 1) unless ``classes`` says; a folder of another number is an error.
- a folder holding ``images.npy`` [N, C, H, W] float32 and ``labels.npy`` [N] int64, memory-mapped, each
  rank reading its own rows (``ArrayFileSource``); or shards ``images_*.npy`` / ``labels_*.npy``,
  concatenated in memory (``ArraySource``, which a job carries inline: for small sets only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import sbpflow as sf
from sbpflow.client.cli.summary import summarize
from sbpflow.client.nn.resnet import DEPTHS, ResNet
from sbpflow.data import ArrayFileSource, ArraySource, DataField, DataSource, SyntheticSource
from sbpflow.data.images import ImageFileSource, image_source
from sbpflow.dtype import DType

F = sf.nn.functional


class TrainResNet(sf.Graph):
    def __init__(self, model: ResNet, lr: float, steps: int) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
        self.config.steps = steps

    def build(self, images: sf.Tensor, labels: sf.Tensor) -> sf.Tensor:
        loss = F.cross_entropy(self.model(images), labels)
        loss.backward()
        return loss


def synthetic_images(
    batch_size: int, image_size: int, channels: int, classes: int, seed: int
) -> SyntheticSource:
    fields = (
        DataField("images", (channels, image_size, image_size), DType.float32),
        DataField("labels", (), DType.int64),
    )
    return SyntheticSource(batch_size=batch_size, sample_fields=fields, params={"vocab": classes}, seed=seed)


def npy_folder(path: str, batch_size: int, seed: int = 0) -> DataSource:
    """``images.npy`` + ``labels.npy`` (memory-mapped), or shards ``images_*.npy`` + ``labels_*.npy``."""
    root = Path(path)
    if (root / "images.npy").is_file() and (root / "labels.npy").is_file():
        paths = {"images": str(root / "images.npy"), "labels": str(root / "labels.npy")}
        return ArrayFileSource(batch_size=batch_size, paths=paths, shuffle=True, seed=seed)
    images, labels = sorted(root.glob("images_*.npy")), sorted(root.glob("labels_*.npy"))
    if not images or len(images) != len(labels):
        raise SystemExit(
            f"{path}: expected images.npy and labels.npy, or as many images_*.npy as labels_*.npy shards"
        )
    arrays: dict[str, np.ndarray] = {
        "images": np.concatenate([np.load(p) for p in images]).astype(np.float32, copy=False),
        "labels": np.concatenate([np.load(p) for p in labels]).astype(np.int64, copy=False),
    }
    return ArraySource(batch_size=batch_size, arrays=arrays, shuffle=True, seed=seed)


def is_npy_folder(path: str) -> bool:
    root = Path(path)
    return root.is_dir() and any(root.glob("images*.npy"))


def make_job(
    ranks: int = 2,
    depth: int = 18,
    width: int = 8,
    image_size: int = 16,
    channels: int = 3,
    classes: int = 0,
    batch_size: int = 8,
    steps: int = 10,
    lr: float = 0.05,
    seed: int = 0,
    data: str = "",
    device: str = "cpu",
) -> sf.Job:
    if depth not in DEPTHS:
        raise SystemExit(f"--depth {depth}: use one of {sorted(DEPTHS)}")
    """``classes``: 0 is the image folder's number of classes, else 10."""
    where = sf.placement(device, ranks=list(range(ranks)))
    source: DataSource | None = None
    if data and is_npy_folder(data):
        source = npy_folder(data, batch_size, seed)
        f = {d.name: d for d in source.fields()}["images"]
        channels, image_size = f.sample_shape[0], f.sample_shape[1]
    elif data:
        source = image_source(data, batch_size=batch_size, size=image_size, classes=classes, seed=seed)
        channels = 3
    if isinstance(source, ImageFileSource):
        classes = source.num_classes  # the folder's; a folder of another number than `classes` is refused
    classes = classes or 10
    model = ResNet(depth, classes, width, channels, small_stem=image_size <= 32)
    graph = TrainResNet(model, lr, steps)
    graph.config.seed = seed
    source = source or synthetic_images(batch_size, image_size, channels, classes, seed)
    return graph.trace(source, placement=where, input_sbp=sf.sbp.split(0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--depth", type=int, default=18, choices=sorted(DEPTHS))
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--classes", type=int, default=0, help="0: the image folder's, else 10")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--data", default="", help="an image folder, tar shards or a folder of .npy files (see above)"
    )
    job = make_job(**vars(ap.parse_args()))
    print(summarize(job))


if __name__ == "__main__":
    main()
