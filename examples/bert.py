"""BERT masked-language-model pre-training, tensor x data parallel on a 2-d mesh, traced into a Job.

    sbpflow run examples/bert.py --ranks 2                          # 2 layers, width 32, TP over 2 ranks
    sbpflow run examples/bert.py --ranks 4 --dp 2                   # a 2x2 mesh: DP groups of 2 TP ranks
    sbpflow plan examples/bert.py --ranks 64 --dp 8 --set size=large --set batch_size=64   # BERT-Large, 8x8
    sbpflow run examples/bert.py --data "corpus/*.txt" --set seq_len=64 --steps 100    # MLM on your text

The mesh is ``dp`` data-parallel groups of ``ranks / dp`` tensor-parallel ranks: the batch is ``S(0)``
over mesh axis 0 and whole (``B``) over axis 1, where ``sf.nn.bert.tensor_parallel`` splits the
encoder Megatron's way and the word embedding (tied to the MLM decoder) by vocabulary rows. The loss is
the cross entropy at the masked positions only (BERT's 15 %: ``predictions`` per sequence).

Data: ``SyntheticSource(kind="mlm")`` (:mod:`sbpflow.data.mlm`): sentence pairs whose second sentence
repeats the first, masked 80 / 10 / 10 as BERT does, each sample a pure function of (seed, sample). Or
your text, ``--data FILE`` (a file or glob pattern; :class:`~sbpflow.data.text.TextFileSource` with
``mlm``): ``[CLS] window [SEP]`` samples tokenized by ``tokenizer`` (``bytes``, or a tokenizer.json with
[CLS]/[SEP]/[MASK] tokens), ``mask_prob`` of each window masked afresh each epoch; the vocabulary is the
tokenizer's, padded to a multiple of 128 so that tensor parallelism splits it evenly.
"""

from __future__ import annotations

import argparse

import sbpflow as sf
from sbpflow.client.cli.summary import summarize
from sbpflow.client.nn.bert import BertConfig, BertForMaskedLM, tensor_parallel
from sbpflow.data import DataSource, SyntheticSource
from sbpflow.data.text import TextFileSource, TextMlm
from sbpflow.limits import LIMITS

# named configurations: "small" for tests and laptops; "base" and "large" as in the paper, with BERT's
# 30,522 WordPiece ids padded to 30,720 (a multiple of 128 x 8, as Megatron pads) so that TP up to 8
# splits the vocabulary evenly
SIZES: dict[str, dict[str, int]] = {
    "small": {"layers": 2, "heads": 2, "width": 32, "vocab": 64, "seq_len": 16},
    "base": {"layers": 12, "heads": 12, "width": 768, "vocab": 30720, "seq_len": 512},
    "large": {"layers": 24, "heads": 16, "width": 1024, "vocab": 30720, "seq_len": 512},
}


class TrainBert(sf.Graph):
    def __init__(self, model: BertForMaskedLM, lr: float, steps: int, warmup: int) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(
            sf.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01),
            lr_scheduler=sf.optim.lr_scheduler.WarmupCosine(warmup, steps, min_lr_ratio=0.0),
        )
        self.config.steps = steps

    def build(
        self, tokens: sf.Tensor, token_types: sf.Tensor, positions: sf.Tensor, labels: sf.Tensor
    ) -> sf.Tensor:
        loss = self.model(tokens, token_types, positions, labels)  # tokens: [B, T]; positions: [B, P]
        loss.backward()
        return loss


def mesh(ranks: int, dp: int, device: str = "cpu") -> sf.Placement:
    """``dp`` rows of ``ranks / dp`` tensor-parallel ranks."""
    if dp < 1 or ranks % dp:
        raise SystemExit(f"--ranks {ranks} is not divisible by --dp {dp}: each DP group needs as many ranks")
    per = ranks // dp
    return sf.placement(device, ranks=[list(range(i * per, (i + 1) * per)) for i in range(dp)])


def make_job(
    ranks: int = 2,
    dp: int = 1,
    size: str = "small",
    layers: int = 0,
    heads: int = 0,
    width: int = 0,
    vocab: int = 0,
    seq_len: int = 0,
    batch_size: int = 4,
    dropout: float = 0.0,
    steps: int = 10,
    lr: float = 1e-3,
    warmup: int = 2,
    seed: int = 0,
    device: str = "cpu",
    data: str = "",
    tokenizer: str = "bytes",
    mask_prob: float = 0.15,
) -> sf.Job:
    """``size`` picks a configuration; a non-zero ``layers``/``heads``/``width``/``vocab``/``seq_len``
    overrides its entry. ``data``: MLM on this text file or glob pattern (module docstring)."""
    if size not in SIZES:
        raise SystemExit(f"--size {size!r}: use one of {sorted(SIZES)}")
    given = {"layers": layers, "heads": heads, "width": width, "vocab": vocab, "seq_len": seq_len}
    c = {k: v or SIZES[size][k] for k, v in given.items()}
    data_source: DataSource
    if data:
        mlm = TextMlm(mask_prob=mask_prob)
        data_source = TextFileSource(
            paths=(data,),
            tokenizer=tokenizer,
            seq_len=c["seq_len"],
            mlm=mlm,
            batch_size=batch_size,
            seed=seed,
        )
        data_source.check_limits(LIMITS)  # mask_prob and seq_len named before the model is built
        c["vocab"] = -(-max(c["vocab"], data_source.vocab_size) // 128) * 128
    else:
        predictions = max(1, round(0.15 * c["seq_len"]))
        params = {"seq_len": c["seq_len"], "vocab": c["vocab"], "predictions": predictions}
        data_source = SyntheticSource(batch_size=batch_size, kind="mlm", params=params, seed=seed)
    cfg = BertConfig(
        vocab_size=c["vocab"],
        seq_len=c["seq_len"],
        n_layer=c["layers"],
        n_head=c["heads"],
        n_embd=c["width"],
        dropout=dropout,
    )
    where = mesh(ranks, dp, device)
    model = tensor_parallel(BertForMaskedLM(cfg), where, tp_axis=1)
    graph = TrainBert(model, lr, steps, warmup)
    graph.config.seed = seed
    return graph.trace(data_source, placement=where, input_sbp=(sf.sbp.split(0), sf.sbp.broadcast))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel groups (mesh axis 0)")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    for name in ("layers", "heads", "width", "vocab", "seq-len"):
        ap.add_argument(f"--{name}", type=int, default=0, help="override the size's value")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", default="", help="MLM on this text file or glob pattern")
    ap.add_argument("--tokenizer", default="bytes", help="with --data: bytes, or a tokenizer.json")
    ap.add_argument("--mask-prob", type=float, default=0.15)
    job = make_job(**vars(ap.parse_args()))
    print(summarize(job, show_parameters=False))


if __name__ == "__main__":
    main()
