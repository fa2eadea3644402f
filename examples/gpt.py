"""A small GPT-2 language model on synthetic tokens or your own text, traced into a Job.

    python examples/gpt.py --ranks 4 --layers 2 --heads 4 --width 128 --vocab 512 --seq-len 64 --tp
    sbpflow run examples/gpt.py --data "corpus/*.txt" --steps 100     # your text, byte-level (vocab 256)
    sbpflow run examples/gpt.py --data book.txt --set tokenizer=tokenizer.json   # a tokenizers BPE file
    sbpflow run examples/gpt.py --data train.npy      # token ids (.npy of any int type, or int32 .bin)

``--data`` (``make_job(data=...)``): a text file or glob pattern, tokenized by ``tokenizer`` (``bytes``,
or a Hugging Face ``tokenizer.json``) and packed into ``seq_len`` windows, shuffled each epoch; or a
token file. The vocabulary is the tokenizer's (the largest id + 1 for a token file) unless ``--vocab``
is larger. Without it, ``--text`` picks random ids (``synthetic``) or Python's own sources (``pysrc``).

Data parallel by default (tokens S(0) over the ranks); ``--tp`` applies the Megatron layout
(``sf.nn.parallel.megatron``) on the same ranks, ``--vocab-parallel`` with it splits the vocabulary too, and ``--dp N`` with ``--tp`` makes a 2-d mesh of N
data-parallel groups of ``ranks / N`` tensor-parallel ranks. ``--pp S`` cuts the blocks into S pipeline
stages (embeddings in the first, the head and the loss in the last) on consecutive groups of ranks, data
parallel inside each; ``--micro-batches`` and ``--grad-accum`` cut each step's batch.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import sbpflow as sf
from sbpflow.client.cli.summary import summarize
from sbpflow.data import DataSource, SyntheticSource, TokenFileSource
from sbpflow.data.text import TextFileSource


class LossHead(sf.nn.Module):
    """The loss as a module, so that a pipeline can put it in the last stage with the logits."""

    def forward(self, logits: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        return sf.nn.functional.cross_entropy(logits, targets)  # loss: []


class TrainGPT(sf.Graph):
    def __init__(
        self, model: sf.nn.GPT, lr: float, steps: int, warmup: int, head: LossHead | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.head = head
        self.add_optimizer(
            sf.optim.AdamW(
                model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0
            ),
            lr_scheduler=sf.optim.lr_scheduler.WarmupCosine(warmup, steps, min_lr_ratio=0.1),
        )
        self.config.steps = steps

    def build(self, tokens: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        if self.head is not None:  # pipelined: logits in the last stage, then the loss there
            loss = self.head(self.model(tokens), targets)
        else:
            loss = self.model(tokens, targets)  # tokens, targets: [B, T]; loss: []
        loss.backward()
        return loss


def make_job(
    ranks: int = 2,
    layers: int = 2,
    heads: int = 4,  # divides 4 ranks: --tp on 4 ranks keeps whole heads (Megatron's layout)
    width: int = 64,  # weights larger than 64 tokens of activations: TP pays off (Megatron's layout)
    vocab: int = 64,
    seq_len: int = 16,
    batch_size: int = 4,
    dropout: float = 0.0,
    steps: int = 10,
    lr: float = 3e-4,
    warmup: int = 2,
    seed: int = 0,
    tp: bool = False,
    vocab_parallel: bool = False,
    sequence_parallel: bool = False,
    dp: int = 1,
    pp: int = 1,
    stage_ranks: tuple[int, ...] = (),
    micro_batches: int = 1,
    grad_accum: int = 1,
    schedule: str = "1f1b",
    text: str = "synthetic",
    device: str = "cpu",
    data: str = "",
    tokenizer: str = "bytes",
) -> sf.Job:
    if text not in TEXTS:
        raise SystemExit(f"--text {text!r}: use one of {sorted(TEXTS)}")
    source: DataSource
    if data:
        source, vocab = own_data(data, tokenizer, seq_len, batch_size, vocab, seed)
    elif text == "pysrc":
        vocab = max(vocab, sf.corpus.VOCAB)
    cfg = sf.nn.GPTConfig(
        vocab_size=vocab, seq_len=seq_len, n_layer=layers, n_head=heads, n_embd=width, dropout=dropout
    )
    model = sf.nn.GPT(cfg)
    if tp and dp > 1:
        if ranks % dp:
            raise SystemExit(f"--ranks {ranks} is not divisible by --dp {dp}")
        per = ranks // dp
        where = sf.placement(device, ranks=[list(range(i * per, (i + 1) * per)) for i in range(dp)])
        input_sbp: tuple = (sf.sbp.split(0), sf.sbp.broadcast)  # batch over dp, whole on each tp group
    else:
        where = sf.placement(device, ranks=list(range(ranks)))
        input_sbp = (sf.sbp.broadcast if tp else sf.sbp.split(0),)
    if tp:
        sf.nn.parallel.megatron(
            model, where, tp_axis=-1, vocab_parallel=vocab_parallel, sequence_parallel=sequence_parallel
        )
    head = None
    if pp > 1 or stage_ranks:
        if tp:
            raise SystemExit("--tp with --pp is not wired up in this example")
        head = LossHead()
        where = stage_blocks(model, head, stage_placements(ranks, pp, stage_ranks, device))
        input_sbp = (sf.sbp.split(0),)
    if not data:
        source = TEXTS[text](seq_len, batch_size, vocab, seed)
    graph = TrainGPT(model, lr, steps, warmup, head)
    graph.config.seed = seed
    graph.config.micro_batches, graph.config.gradient_accumulation_steps = micro_batches, grad_accum
    graph.config.pipeline_schedule = schedule
    return graph.trace(source, placement=where, input_sbp=input_sbp)


# Where the tokens come from: random ids (no file, any size), or a real character-level corpus (the
# Python standard library's sources, available offline on every machine; vocabulary 128).
TEXTS: dict[str, Any] = {
    "synthetic": lambda seq_len, batch_size, vocab, seed: SyntheticSource(
        batch_size=batch_size, kind="tokens", params={"seq_len": seq_len, "vocab": vocab}, seed=seed
    ),
    "pysrc": lambda seq_len, batch_size, vocab, seed: sf.corpus.char_source(seq_len, batch_size, seed),
}


def own_data(
    data: str, tokenizer: str, seq_len: int, batch_size: int, vocab: int, seed: int
) -> tuple[DataSource, int]:
    """The source of ``--data`` and the vocabulary it needs (at least ``vocab``): a token file (``.npy``,
    or ``.bin`` of int32 ids), else text files or a glob pattern under ``tokenizer``."""
    common: dict[str, Any] = {"seq_len": seq_len, "batch_size": batch_size, "seed": seed, "shuffle": True}
    if data.endswith((".npy", ".bin")):
        ids = np.load(data, mmap_mode="r") if data.endswith(".npy") else np.memmap(data, np.int32, mode="r")
        return TokenFileSource(path=data, dtype=sf.int32, **common), max(vocab, int(ids.max()) + 1)
    text = TextFileSource(paths=(data,), tokenizer=tokenizer, **common)
    return text, max(vocab, text.vocab_size)


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


def stage_blocks(model: sf.nn.GPT, head: LossHead, stages: list[sf.Placement]) -> sf.Placement:
    """Embeddings in stage 0, block i of n in stage ``i * S // n``, the final norm, the head and the loss
    in the last stage. Returns stage 0's placement (where the tokens are loaded)."""
    n, last = len(model.blocks), len(stages) - 1
    if n < len(stages):
        raise SystemExit(f"{n} blocks cannot fill {len(stages)} stages; add --layers")
    model.set_stage(0, stages[0])
    for i in range(n):
        k = i * len(stages) // n
        model.blocks[i].set_stage(k, stages[k])
    for m in (model.ln_f, model.lm_head, head):
        m.set_stage(last, stages[last])
    return stages[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--tp", action="store_true", help="Megatron tensor parallelism over the ranks")
    ap.add_argument(
        "--vocab-parallel",
        action="store_true",
        help="with --tp: split the embedding, the head and the loss by vocabulary",
    )
    ap.add_argument(
        "--sequence-parallel", action="store_true", help="with --tp: the residual stream split by sequence"
    )
    ap.add_argument("--dp", type=int, default=1, help="with --tp: data-parallel groups (a 2-d mesh)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--stage-ranks", type=lambda s: tuple(map(int, s.split(","))), default=())
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--text", choices=sorted(TEXTS), default="synthetic", help="pysrc: Python's own sources")
    ap.add_argument("--data", default="", help="a text file or glob, or a .npy/.bin token file")
    ap.add_argument("--tokenizer", default="bytes", help="with --data text: bytes, or a tokenizer.json")
    job = make_job(**vars(ap.parse_args()))
    print(summarize(job, show_parameters=False))


if __name__ == "__main__":
    main()
