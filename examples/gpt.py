"""A small GPT-2 language model on synthetic tokens, traced into a Job.

    python examples/gpt.py --ranks 4 --layers 2 --heads 4 --width 128 --vocab 512 --seq-len 64 --tp

Data parallel by default (tokens S(0) over the ranks); ``--tp`` applies the Megatron layout
(``sf.nn.parallel.megatron``) on the same ranks, and ``--dp N`` with ``--tp`` makes a 2-d mesh of N
data-parallel groups of ``ranks / N`` tensor-parallel ranks.
"""

from __future__ import annotations

import argparse

import sbpflow as sf
from sbpflow.client.summary import summarize
from sbpflow.data import SyntheticSource


class TrainGPT(sf.Graph):
    def __init__(self, model: sf.nn.GPT, lr: float, steps: int, warmup: int) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(
            sf.optim.AdamW(
                model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0
            ),
            lr_scheduler=sf.optim.lr_scheduler.WarmupCosine(warmup, steps, min_lr_ratio=0.1),
        )
        self.config.steps = steps

    def build(self, tokens: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        loss = self.model(tokens, targets)  # tokens, targets: [B, T]; loss: []
        loss.backward()
        return loss


def make_job(
    ranks: int = 2,
    layers: int = 2,
    heads: int = 2,
    width: int = 32,
    vocab: int = 64,
    seq_len: int = 16,
    batch_size: int = 4,
    dropout: float = 0.0,
    steps: int = 10,
    lr: float = 3e-4,
    warmup: int = 2,
    seed: int = 0,
    tp: bool = False,
    dp: int = 1,
) -> sf.Job:
    cfg = sf.nn.GPTConfig(
        vocab_size=vocab, seq_len=seq_len, n_layer=layers, n_head=heads, n_embd=width, dropout=dropout
    )
    model = sf.nn.GPT(cfg)
    if tp and dp > 1:
        if ranks % dp:
            raise SystemExit(f"--ranks {ranks} is not divisible by --dp {dp}")
        per = ranks // dp
        where = sf.placement("cpu", ranks=[list(range(i * per, (i + 1) * per)) for i in range(dp)])
        input_sbp: tuple = (sf.sbp.split(0), sf.sbp.broadcast)  # batch over dp, whole on each tp group
    else:
        where = sf.placement("cpu", ranks=list(range(ranks)))
        input_sbp = (sf.sbp.broadcast if tp else sf.sbp.split(0),)
    if tp:
        sf.nn.parallel.megatron(model, where, tp_axis=-1)
    data = SyntheticSource(
        batch_size=batch_size, kind="tokens", params={"seq_len": seq_len, "vocab": vocab}, seed=seed
    )
    graph = TrainGPT(model, lr, steps, warmup)
    graph.config.seed = seed
    return graph.trace(data, placement=where, input_sbp=input_sbp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--tp", action="store_true", help="Megatron tensor parallelism over the ranks")
    ap.add_argument("--dp", type=int, default=1, help="with --tp: data-parallel groups (a 2-d mesh)")
    job = make_job(**vars(ap.parse_args()))
    print(summarize(job, show_parameters=False))


if __name__ == "__main__":
    main()
