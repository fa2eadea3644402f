"""Wide & Deep (Cheng et al., 2016) on click-log-shaped data, with model-parallel embedding tables.

    sbpflow run examples/wide_deep.py --ranks 2          # on Ray workers
    python examples/wide_deep.py --ranks 2 --train       # in-process, then AUC on held-out batches

OneFlow's case study: both embedding tables split by rows S(0) over the ranks (``columns=True``: the
deep table by columns S(1) instead), so each rank holds 1/p of the vocabulary and looks up only the
ids in its rows; the lookups are partial sums P that the compiler reduce-scatters onto the batch split.
The dense tower is data parallel (inputs S(0), weights replicated, gradients all-reduced), the wide
part linear (one weight per id, a [V, 1] table, plus a linear term in the dense features), and the loss
binary cross-entropy with logits. ``sf.run`` returns losses and parameters, not fetched tensors, so
:func:`evaluate` computes AUC and accuracy from the logits of a one-device forward
(``sbpflow.oracle.reference.forward``) of held-out batches with the trained parameters.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import sbpflow as sf
from sbpflow.client.cli.summary import summarize
from sbpflow.data import SyntheticSource
from sbpflow.oracle import reference
from sbpflow.random import Normal, Zeros


class WideDeep(sf.nn.Module):
    def __init__(self, n_dense: int, fields: int, vocab: int, dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        rows = fields * vocab  # one shared table, field f owning rows [f * vocab, (f + 1) * vocab)
        self.fields, self.dim = fields, dim
        self.wide = sf.nn.Embedding(rows, 1, init=Zeros())  # the linear model's weight per id
        self.wide_dense = sf.nn.Linear(n_dense, 1)
        self.deep = sf.nn.Embedding(rows, dim, init=Normal(0.0, 0.05))
        self.tower = sf.nn.MLP([fields * dim + n_dense, *hidden, 1], activation="relu")

    def logits(self, dense: sf.Tensor, ids: sf.Tensor) -> sf.Tensor:
        n = dense.shape[0]
        wide = self.wide(ids).reshape(n, self.fields)  # [N, F]  P (table S(0)) -> S(0)
        wide = wide.sum(1) + self.wide_dense(dense).reshape(n)  # [N]  S(0)
        emb = self.deep(ids).reshape(n, self.fields * self.dim)  # [N, F*D]  P -> S(0)
        x = sf.nn.functional.concat([emb, dense], axis=1)  # [N, F*D + dense]  S(0)
        deep = self.tower(x).reshape(n)  # [N]  S(0): the tower is data parallel
        return wide + deep

    def forward(self, dense: sf.Tensor, ids: sf.Tensor, label: sf.Tensor) -> tuple[sf.Tensor, sf.Tensor]:
        logits = self.logits(dense, ids)
        return sf.nn.functional.binary_cross_entropy_with_logits(logits, label), logits  # loss: []


class TrainWideDeep(sf.Graph):
    def __init__(self, model: WideDeep, lr: float, steps: int) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))
        self.config.steps = steps

    def build(self, dense: sf.Tensor, ids: sf.Tensor, label: sf.Tensor) -> tuple[sf.Tensor, sf.Tensor]:
        loss, logits = self.model(dense, ids, label)
        loss.backward()
        return loss, logits  # the logits are a fetch, for evaluate()


def make_job(
    ranks: int = 2,
    dense: int = 4,
    fields: int = 4,
    vocab: int = 128,
    dim: int = 8,
    hidden: tuple[int, ...] = (32, 16),
    batch_size: int = 32,
    steps: int = 20,
    lr: float = 0.01,
    seed: int = 0,
    columns: bool = False,
    device: str = "cpu",
) -> sf.Job:
    """The small configuration (tests); the paper's is ``vocab=2**20 // fields, dim=16, hidden=(1024,) * 3``."""
    where = sf.placement(device, ranks=list(range(ranks)))
    model = WideDeep(dense, fields, vocab, dim, hidden)
    sf.nn.parallel.data_parallel(model, where)  # the dense tower and the wide linear term: replicated
    model.wide.weight.to_global(where, sf.sbp.split(0))  # tables split by rows over the ranks
    model.deep.weight.to_global(where, sf.sbp.split(1) if columns else sf.sbp.split(0))
    data = SyntheticSource(
        batch_size=batch_size,
        kind="clicks",
        params={"dense": dense, "fields": fields, "vocab": vocab},
        seed=seed,
    )
    graph = TrainWideDeep(model, lr, steps)
    graph.config.seed = seed
    return graph.trace(data, placement=where, input_sbp=sf.sbp.split(0))


# ---- evaluation ----------------------------------------------------------------------------------


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: the chance that a random click scores above a random non-click (ties
    count half), by the rank-sum (Mann-Whitney U) statistic."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0.5
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)  # tied scores share the mean of their ranks
    ranks = ((ends - counts + 1 + ends) / 2.0)[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def evaluate(job: sf.Job, parameters: Mapping[str, Any], batches: int = 8, first: int = 1 << 12) -> dict:
    """AUC, accuracy (logit > 0) and mean loss on held-out batches ``first..first+batches`` (training
    reads batches from 0), from a one-device forward of ``job`` with ``parameters``."""
    logits_name = job.fetches[-1]
    scores, labels, losses = [], [], []
    for b in range(first, first + batches):
        out = reference.forward(job, step=b, fetches=[logits_name, job.loss], parameters=parameters)
        assert job.data is not None
        scores.append(out[logits_name])
        labels.append(job.data.read(b)["label"])
        losses.append(float(out[job.loss]))
    s, y = np.concatenate(scores), np.concatenate(labels)
    return {
        "auc": auc(s, y),
        "accuracy": float(np.mean((s > 0) == (y > 0.5))),
        "loss": float(np.mean(losses)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dense", type=int, default=4)
    ap.add_argument("--fields", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128, help="ids per field")
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", type=lambda s: tuple(map(int, s.split(","))), default=(32, 16))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--columns", action="store_true", help="split the deep table by columns S(1)")
    ap.add_argument("--train", action="store_true", help="train in-process, then evaluate AUC")
    args = vars(ap.parse_args())
    train = args.pop("train")
    job = make_job(**args)
    print(summarize(job))
    if train:
        result = sf.run(job, backend="inprocess", return_parameters=True)
        print(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over {len(result.losses)} steps")
        assert result.parameters is not None
        print("held-out:", evaluate(job, result.parameters))


if __name__ == "__main__":
    main()
