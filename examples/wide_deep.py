"""Wide & Deep (Cheng et al., 2016) on click-log-shaped data, with model-parallel embedding tables.

    sbpflow run examples/wide_deep.py --ranks 2          # on Ray workers
    python examples/wide_deep.py --ranks 2 --train       # in-process, then AUC on held-out batches
    sbpflow run examples/wide_deep.py --data clicks.parquet --steps 100   # your own click log

``data``: a Parquet, Arrow, CSV or JSON-lines table (or a glob of them) instead of synthetic clicks. By
default every numeric column but the label is a dense feature, every string column a categorical one,
and the label is the column ``label``; ``dense_columns``/``categorical_columns``/``label`` choose others.
Each categorical column gets its own ``vocab`` ids of the one shared table: by ``encoding="vocabulary"``
its ``vocab - 1`` most frequent values and id 0 for the rest, by ``"hash"`` its values hashed into
``vocab`` buckets. ``dense``, ``fields`` and ``vocab`` come from the table unless given (``vocab``: the
most distinct values of a column, plus one, at most 65,536); a given size that the table contradicts is an
error. Empty cells become ``dense_fill`` and ``category_fill`` (None: an empty cell is an error).

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
from typing import Any, NamedTuple

import numpy as np

import sbpflow as sf
from sbpflow.client.cli.summary import summarize
from sbpflow.data import DataSource, SyntheticSource
from sbpflow.data.columns import HASHED, VOCABULARY, TableField, describe, distinct
from sbpflow.data.tables import TableFileSource
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
    dense: int = 0,
    fields: int = 0,
    vocab: int = 0,
    dim: int = 8,
    hidden: tuple[int, ...] = (32, 16),
    batch_size: int = 32,
    steps: int = 20,
    lr: float = 0.01,
    seed: int = 0,
    columns: bool = False,
    device: str = "cpu",
    data: str = "",
    label: str = "label",
    dense_columns: tuple[str, ...] = (),
    categorical_columns: tuple[str, ...] = (),
    encoding: str = "vocabulary",
    dense_fill: float | None = 0.0,
    category_fill: str | None = "",
) -> sf.Job:
    """The small configuration (tests; synthetic: ``dense=4, fields=4, vocab=128``); the paper's is
    ``vocab=2**20 // fields, dim=16, hidden=(1024,) * 3``. ``data``: a table instead (module docstring)."""
    where = sf.placement(device, ranks=list(range(ranks)))
    source: DataSource
    if data:
        cols = TableColumns(label, dense_columns, categorical_columns, encoding, dense_fill, category_fill)
        source, (dense, fields, vocab) = click_table(data, cols, (dense, fields, vocab), batch_size, seed)
    else:
        dense, fields, vocab = dense or 4, fields or 4, vocab or 128
        source = SyntheticSource(
            batch_size=batch_size,
            kind="clicks",
            params={"dense": dense, "fields": fields, "vocab": vocab},
            seed=seed,
        )
    model = WideDeep(dense, fields, vocab, dim, hidden)
    sf.nn.parallel.data_parallel(model, where)  # the dense tower and the wide linear term: replicated
    model.wide.weight.to_global(where, sf.sbp.split(0))  # tables split by rows over the ranks
    model.deep.weight.to_global(where, sf.sbp.split(1) if columns else sf.sbp.split(0))
    graph = TrainWideDeep(model, lr, steps)
    graph.config.seed = seed
    return graph.trace(source, placement=where, input_sbp=sf.sbp.split(0))


# ---- a table of clicks -----------------------------------------------------------------------------------


class TableColumns(NamedTuple):
    label: str
    dense: tuple[str, ...]
    categorical: tuple[str, ...]
    encoding: str
    dense_fill: float | None
    category_fill: str | None


def click_table(
    path: str, cols: TableColumns, sizes: tuple[int, int, int], batch_size: int, seed: int
) -> tuple[TableFileSource, tuple[int, int, int]]:
    """The source of ``dense``, ``ids`` and ``label`` from the table at ``path`` and the sizes it gives
    (dense, fields, vocab): what the caller gave, else what the table holds. The table is looked at here
    only for what was not given (under ``sbpflow submit`` the file may be the server's alone)."""
    if cols.encoding not in ("vocabulary", "hash"):
        raise SystemExit(f"encoding={cols.encoding!r}: use 'vocabulary' or 'hash'")
    dense, fields, vocab = sizes
    kinds = {} if cols.dense and cols.categorical and vocab else describe([path])
    if kinds and cols.label not in kinds:
        raise SystemExit(
            f"{path}: no label column {cols.label!r} (columns: {', '.join(kinds)}); give label=..."
        )
    numeric = tuple(c for c, k in kinds.items() if k == "number" and c != cols.label)
    dense_cols = cols.dense or numeric
    cat_cols = cols.categorical or tuple(c for c, k in kinds.items() if k == "category" and c != cols.label)
    for what, found, given in (("dense", dense_cols, dense), ("categorical", cat_cols, fields)):
        if not found:
            raise SystemExit(f"{path}: no {what} columns; name them with {what}_columns=(...)")
        if given and given != len(found):
            raise SystemExit(
                f"{path}: {what} columns {list(found)} are {len(found)}, but {what if what == 'dense' else 'fields'}"
                f"={given} was given; give the same number, or leave it unset to take the table's"
            )
    if not vocab:
        vocab = min(max(distinct([path], cat_cols).values()) + 1, 1 << 16)
    source = TableFileSource(
        paths=(path,),
        batch_size=batch_size,
        shuffle=True,
        seed=seed,
        table_fields=(
            TableField("dense", dense_cols, fill=cols.dense_fill),
            TableField(
                "ids",
                cat_cols,
                encoding=VOCABULARY if cols.encoding == "vocabulary" else HASHED,
                buckets=vocab,
                offset_columns=True,
                fill_category=cols.category_fill,
            ),
            TableField("label", (cols.label,), scalar=True),
        ),
    )
    return source, (len(dense_cols), len(cat_cols), vocab)


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
    ap.add_argument("--dense", type=int, default=0, help="dense features (default: 4, or the table's)")
    ap.add_argument("--fields", type=int, default=0, help="categorical fields (default: 4, or the table's)")
    ap.add_argument("--vocab", type=int, default=0, help="ids per field (default: 128, or the table's)")
    ap.add_argument("--data", default="", help="a Parquet, Arrow, CSV or JSON-lines table of clicks")
    ap.add_argument("--label", default="label", help="the table's label column")
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
