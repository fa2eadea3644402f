"""InsightFace-style face recognition: a data-parallel ResNet and a model-parallel classifier.

    sbpflow run examples/insightface.py --ranks 2                      # ResNet-18, 8x8 images, 24 identities
    sbpflow run examples/insightface.py --set data=DIR --set image_size=112   # DIR/<identity>/*.jpg
    sbpflow plan examples/insightface.py --ranks 8 --set depth=50 --set width=64 --set image_size=112 \
        --set embedding=512 --set classes=1000000 --set batch_size=512

The OneFlow paper's case for model parallelism: a classifier over a million identities has a weight
[D, K] that one device cannot hold (or hold four times, with its gradient and momentum), so it is split
by classes ``S(1)`` over the ranks while the backbone stays data parallel (images and activations
``S(0)``, parameters ``B``). The compiler all-gathers the [N, D] embeddings to ``B`` for the classifier,
whose logits [N, K] come out ``S(1)``: each rank scores every face against its own identities.

The loss is a softmax cross entropy in two stages that never gathers the logits (``F.cross_entropy``
with ``vocab_chunks``, sbpflow/ops/layers/vocab.py): the row maximum from each rank's maxima of its own classes
(an all-gather of N x ranks numbers), then the sum of exponentials and the label's logit as partial
sums ``P``, reduced over the ranks (2 N numbers). The logits are cosines with CosFace's additive margin
(``scale * (cos - margin)`` at the label), as InsightFace trains.

Data: generated faces (``SyntheticSource``: N(0, 1) pixels and uniform identities, each a pure
function of (seed, sample)); a model can only memorise them. ``--data DIR``: a folder of aligned face
images, one subfolder per identity (or WebDataset-style tar shards, ``<key>.jpg`` + ``<key>.cls``), read
by the workers (``ImageFileSource``): each face resized whole to ``image_size`` (aligned faces are not
cropped), flipped at random, its pixels scaled to [-1, 1] as InsightFace does. The identities are the
folder's unless ``classes`` says (a folder of another number is an error).
"""

from __future__ import annotations

import argparse

import sbpflow as sf
from sbpflow.client.cli.summary import summarize
from sbpflow.client.nn.resnet import DEPTHS, ResNet
from sbpflow.data import DataField, SyntheticSource
from sbpflow.data.images import ImageFileSource, image_source
from sbpflow.dtype import DType
from sbpflow.random import Normal

F = sf.nn.functional


class MarginClassifier(sf.nn.Module):
    """Cosine similarity of the normalised embedding to each identity's normalised weight column, with
    CosFace's margin at the label: ``scale * (cos - margin * onehot)``; weight [D, K]."""

    def __init__(self, dim: int, classes: int, scale: float = 64.0, margin: float = 0.35) -> None:
        super().__init__()
        self.classes, self.scale, self.margin = classes, scale, margin
        self.weight = sf.nn.Parameter((dim, classes), Normal(0.0, 0.01))

    def forward(self, features: sf.Tensor, labels: sf.Tensor) -> sf.Tensor:
        f = features / (features * features).sum(axis=1, keepdims=True).sqrt()  # [N, D]  rows of norm 1
        w = self.weight
        w = w / (w * w).sum(axis=0, keepdims=True).sqrt()  # [D, K]  S(1): each column on its rank
        cos = F.matmul(f, w)  # cos: [N, K]  S(1), f gathered to B
        onehot = F.one_hot(labels, self.classes, dtype=cos.dtype)  # [N, K]  S(1): each rank its columns
        return (cos - onehot * self.margin) * self.scale  # logits: [N, K]  S(1)


class TrainFace(sf.Graph):
    """``split``: the placement whose ranks split the classifier by classes, or None (data parallel)."""

    def __init__(
        self, backbone: ResNet, head: MarginClassifier, split: sf.Placement | None, lr: float, steps: int
    ) -> None:
        super().__init__()
        self.backbone, self.head, self.split = backbone, head, split
        params = [*backbone.parameters(), *head.parameters()]
        self.add_optimizer(sf.optim.SGD(params, lr=lr, momentum=0.9))
        self.config.steps = steps

    def build(self, images: sf.Tensor, labels: sf.Tensor) -> sf.Tensor:
        features = self.backbone(images)  # [N, D]  S(0)
        if self.split is None:
            loss = F.cross_entropy(self.head(features, labels), labels)
        else:  # every rank scores every face against its classes: labels whole, logits split by class
            labels = labels.to_global(self.split, sf.sbp.broadcast)  # [N]  B (an all-gather of N ids)
            logits = self.head(features, labels).to_global(self.split, sf.sbp.split(1))  # [N, K]  S(1)
            # two stages, the logits never gathered: the maxima of each rank's classes ([N, ranks],
            # gathered), then the sums of exponentials and the label's logit, partial sums P
            loss = F.cross_entropy(logits, labels, vocab_chunks=self.split.size)
        loss.backward()
        return loss


def faces(batch_size: int, image_size: int, classes: int, seed: int) -> SyntheticSource:
    fields = (
        DataField("images", (3, image_size, image_size), DType.float32),
        DataField("labels", (), DType.int64),
    )
    return SyntheticSource(batch_size=batch_size, sample_fields=fields, params={"vocab": classes}, seed=seed)


def face_folder(path: str, batch_size: int, image_size: int, classes: int, seed: int) -> ImageFileSource:
    """Aligned faces: resized whole, flipped at random, (pixel / 255 - 0.5) / 0.5."""
    half = (0.5, 0.5, 0.5)
    return image_source(
        path,
        batch_size=batch_size,
        size=image_size,
        classes=classes,
        seed=seed,
        crop="resize",
        mean=half,
        std=half,
    )


def make_job(
    ranks: int = 2,
    depth: int = 18,
    width: int = 4,
    image_size: int = 8,
    embedding: int = 16,
    classes: int = 0,
    batch_size: int = 8,
    steps: int = 10,
    lr: float = 0.1,
    scale: float = 16.0,
    margin: float = 0.2,
    model_parallel: bool = True,
    seed: int = 0,
    data: str = "",
    device: str = "cpu",
) -> sf.Job:
    """``model_parallel=False`` replicates the classifier too (plain data parallelism), for comparison.
    ``classes``: 0 is the folder's number of identities, else 24."""
    if depth not in DEPTHS:
        raise SystemExit(f"--depth {depth}: use one of {sorted(DEPTHS)}")
    source = face_folder(data, batch_size, image_size, classes, seed) if data else None
    classes = source.num_classes if source is not None else classes or 24
    if model_parallel and classes % ranks:
        of = f"the {data!r} folder's {classes} identities" if data else f"--classes {classes}"
        raise SystemExit(
            f"{of} do not split into {ranks} equal parts; pick a multiple of --ranks, or --data-parallel"
        )
    where = sf.placement(device, ranks=list(range(ranks)))
    backbone = ResNet(depth, embedding, width, small_stem=image_size <= 32)
    head = MarginClassifier(embedding, classes, scale, margin)
    sf.nn.parallel.data_parallel(backbone, where)
    head.weight.to_global(where, sf.sbp.split(1) if model_parallel else sf.sbp.broadcast)
    graph = TrainFace(backbone, head, where if model_parallel else None, lr, steps)
    graph.config.seed = seed
    data_source = source or faces(batch_size, image_size, classes, seed)
    return graph.trace(data_source, placement=where, input_sbp=sf.sbp.split(0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--depth", type=int, default=18, choices=sorted(DEPTHS))
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--embedding", type=int, default=16)
    ap.add_argument("--classes", type=int, default=0, help="0: the folder's identities, else 24")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--data", default="", help="a folder of aligned faces, a subfolder per identity")
    ap.add_argument(
        "--data-parallel", dest="model_parallel", action="store_false", help="replicate the classifier"
    )
    job = make_job(**vars(ap.parse_args()))
    print(summarize(job, show_parameters=False))


if __name__ == "__main__":
    main()
