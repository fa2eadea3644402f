"""A multi-layer perceptron regressing a fixed linear teacher, traced into a Job.

    python examples/mlp.py --ranks 4 --hidden 64 --layers 2
    sbpflow run examples/mlp.py --data houses.csv --set targets="('price',)"   # regression on a table

Data parallel by default (inputs S(0), parameters left to the compiler); ``--tp`` splits the hidden
layer Megatron-style instead (first weight S(1), second S(0)). ``--pp S`` cuts the layers into S pipeline
stages on consecutive groups of ranks (``--stage-ranks 2,4``: stages of different sizes), data parallel
inside each; ``--micro-batches`` and ``--grad-accum`` cut each step's batch.

``data``: a Parquet, Arrow, CSV or JSON-lines table instead of the synthetic teacher: ``targets`` (default:
the table's last numeric column) are ``y``, ``features`` (default: every other numeric column) are ``x``;
``n_in``/``n_out`` come from the table unless given (a contradiction is an error). Empty cells are an
error unless ``fill`` is given.
"""

from __future__ import annotations

import argparse

import sbpflow as sf
from sbpflow.client.cli.summary import summarize
from sbpflow.data import DataSource, SyntheticSource
from sbpflow.data.columns import TableField, describe
from sbpflow.data.tables import TableFileSource


class MLPRegression(sf.nn.Module):
    def __init__(self, n_in: int, hidden: int, n_out: int, layers: int) -> None:
        super().__init__()
        self.net = sf.nn.MLP([n_in, *([hidden] * layers), n_out], activation="relu")

    def forward(self, x: sf.Tensor, y: sf.Tensor) -> sf.Tensor:
        pred = self.net(x)  # pred: [N, out]  S(0)
        return sf.nn.functional.mse_loss(pred, y)  # loss: []


class TrainMLP(sf.Graph):
    def __init__(self, model: MLPRegression, lr: float, steps: int) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
        self.config.steps = steps

    def build(self, x: sf.Tensor, y: sf.Tensor) -> sf.Tensor:
        loss = self.model(x, y)
        loss.backward()
        return loss


def make_job(
    ranks: int = 2,
    n_in: int = 0,
    hidden: int = 32,
    n_out: int = 0,
    layers: int = 1,
    batch_size: int = 32,
    steps: int = 10,
    lr: float = 0.05,
    seed: int = 0,
    tp: bool = False,
    pp: int = 1,
    stage_ranks: tuple[int, ...] = (),
    micro_batches: int = 1,
    grad_accum: int = 1,
    schedule: str = "1f1b",
    device: str = "cpu",
    data: str = "",
    features: tuple[str, ...] = (),
    targets: tuple[str, ...] = (),
    fill: float | None = None,
) -> sf.Job:
    """Synthetic: ``n_in=16, n_out=4`` unless given; ``data``: a table (module docstring)."""
    where = sf.placement(device, ranks=list(range(ranks)))
    source: DataSource
    if data:
        source = regression_table(data, features, targets, fill, batch_size, seed)
        n_in, n_out = sized(n_in, "n_in", source, "x"), sized(n_out, "n_out", source, "y")
    else:
        n_in, n_out = n_in or 16, n_out or 4
        source = SyntheticSource(
            batch_size=batch_size, kind="regression", params={"in": n_in, "out": n_out}, seed=seed
        )
    model = MLPRegression(n_in, hidden, n_out, layers)
    if pp > 1 or stage_ranks:
        if tp:
            raise SystemExit("--tp with --pp is not wired up in this example")
        where = stage_layers(model, stage_placements(ranks, pp, stage_ranks, device))
    if tp:
        first, last = model.net[0], model.net[len(model.net) - 1]
        first.weight.to_global(where, sf.sbp.split(1))
        first.bias.to_global(where, sf.sbp.split(0))
        last.weight.to_global(where, sf.sbp.split(0))
    graph = TrainMLP(model, lr, steps)
    graph.config.seed = seed
    graph.config.micro_batches, graph.config.gradient_accumulation_steps = micro_batches, grad_accum
    graph.config.pipeline_schedule = schedule
    return graph.trace(source, placement=where, input_sbp=None if tp else sf.sbp.split(0))


def regression_table(
    path: str,
    features: tuple[str, ...],
    targets: tuple[str, ...],
    fill: float | None,
    batch_size: int,
    seed: int,
) -> TableFileSource:
    """``x`` (the feature columns) and ``y`` (the targets) of the table at ``path``; the table is looked at
    only for the columns not given."""
    numeric = [] if features and targets else [c for c, k in describe([path]).items() if k == "number"]
    targets = targets or tuple(numeric[-1:])
    features = features or tuple(c for c in numeric if c not in targets)
    if not targets or not features:
        raise SystemExit(f"{path}: needs a numeric target column and at least one numeric feature column")
    return TableFileSource(
        paths=(path,),
        batch_size=batch_size,
        shuffle=True,
        seed=seed,
        table_fields=(TableField("x", features, fill=fill), TableField("y", targets, fill=fill)),
    )


def sized(given: int, name: str, source: TableFileSource, field: str) -> int:
    """The width of ``field`` in ``source``; ``given`` (when not 0) must agree."""
    (width,) = next(f.sample_shape for f in source.fields() if f.name == field)
    if given and given != width:
        raise SystemExit(f"{name}={given}, but the table gives {field} {width} columns; leave {name} unset")
    return width


def stage_placements(
    ranks: int, pp: int, sizes: tuple[int, ...] = (), device: str = "cpu"
) -> list[sf.Placement]:
    """Consecutive groups of ranks, one per stage: ``sizes`` ranks each, else ``ranks / pp`` each."""
    if not sizes:
        if ranks % pp:
            raise SystemExit(f"--ranks {ranks} is not divisible by --pp {pp}")
        sizes = (ranks // pp,) * pp
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [sf.placement(device, ranks=list(range(a, a + n))) for a, n in zip(starts, sizes, strict=True)]


def stage_layers(model: MLPRegression, stages: list[sf.Placement]) -> sf.Placement:
    """Layer i of n runs in stage ``i * S // n``; the loss in the last stage. Returns stage 0's placement
    (where the inputs are loaded)."""
    n, last = len(model.net), len(stages) - 1
    if n < len(stages):
        raise SystemExit(f"{n} layers cannot fill {len(stages)} stages; add --layers")
    model.set_stage(last, stages[last])  # the loss, computed in MLPRegression.forward
    for i in range(n):
        k = i * len(stages) // n
        model.net[i].set_stage(k, stages[k])
    return stages[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--in", dest="n_in", type=int, default=0, help="inputs (default: 16, or the table's)")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--out", dest="n_out", type=int, default=0, help="outputs (default: 4, or the table's)")
    ap.add_argument("--data", default="", help="a Parquet, Arrow, CSV or JSON-lines table to regress on")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--tp", action="store_true", help="split the hidden layer over the ranks")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--stage-ranks", type=lambda s: tuple(map(int, s.split(","))), default=())
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    job = make_job(**vars(ap.parse_args()))
    print(summarize(job))


if __name__ == "__main__":
    main()
