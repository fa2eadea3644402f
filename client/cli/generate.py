"""Sampling text from a trained language model: ``sbpflow generate examples/charlm.py --checkpoint DIR
--prompt "def "``, under any layout its example builds (``--ranks 2 --tp``: the Megatron split).

Each new token is one forward-only run of the model on the last ``seq_len`` tokens, its parameters
imported from the checkpoint (strict: the example must build the model that was trained); the logits of
the context's last position, divided by the temperature and cut to the ``top_k`` likeliest, give the
next token. The job is compiled once: its input is always ``seq_len`` tokens long (the context, then
padding that a causal model's earlier positions never see), read from a file rewritten before each run.
Temperature 0 takes the likeliest (greedy). The example provides ``make_model(**kwargs)``, returning the
model (a module whose forward maps ids [B, T] to logits [B, T, V], ``config.seq_len`` long at most), its
placement and the tokens' SBP, and ``encode`` / ``decode`` between text and ids.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.client.cli.exit_codes import UsageError
from sbpflow.client.nn.module import Module
from sbpflow.client.static_graph import Graph
from sbpflow.client.tensor import Tensor
from sbpflow.data.sources import ArraySource
from sbpflow.errors import SbpflowError
from sbpflow.placement import Placement


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0: greedy
    top_k: int = 0  # 0: every token
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens}: generate at least one token"),
            (self.temperature >= 0, f"temperature={self.temperature}: use 0 (greedy) or a positive value"),
            (self.top_k >= 0, f"top_k={self.top_k}: use 0 (every token) or a positive count"),
        ]
        for ok, message in checks:
            if not ok:
                raise SbpflowError(message)


def next_token(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """A token drawn from ``logits`` [V] under ``s``."""
    z = np.asarray(logits, np.float64)
    if s.temperature == 0:
        return int(np.argmax(z))
    z = z / s.temperature
    if 0 < s.top_k < z.size:
        z = np.where(z >= np.partition(z, -s.top_k)[-s.top_k], z, -np.inf)
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


class _Forward(Graph):
    def __init__(self, model: Module) -> None:
        super().__init__()
        self.model = model  # the attribute the training graph used: the checkpoint's names

    def build(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)  # logits: [1, T, V]


def stream(
    model: Module,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    checkpoint: str | None,
    placement: Placement,
    input_sbp: Any,
    timeout: float = 600.0,
    threads: int | None = None,
) -> Iterator[list[int]]:
    """Per new position, the token each prompt of ``prompts`` (a batch) draws next, as they come:
    ``sampling.max_new_tokens`` lists of ``len(prompts)`` tokens. The model's forward runs as one live
    plan (:mod:`sbpflow.control_plane.generation.live_plan`): compiled once, its actors up until the last
    token, a step of it a token, on the last ``seq_len`` tokens of each row (padding after them, which a
    causal model's earlier positions never see). Parameters: ``checkpoint`` (strict: the example must
    build the model that was trained), or the model's own values (None)."""
    from sbpflow.control_plane.generation.live_plan import LivePlan

    if not prompts or not all(prompts):
        raise SbpflowError("a prompt is empty: give at least one token (a character) to continue from")
    window, rows = int(model.config.seq_len), len(prompts)
    ids, rng = [list(p) for p in prompts], np.random.default_rng(sampling.seed)
    tokens = np.zeros((rows, window), np.int64)
    data = ArraySource(batch_size=rows, arrays={"tokens": tokens})
    job = _Forward(model.eval()).trace(data, placement=placement, input_sbp=input_sbp)
    with LivePlan(job, init_from=checkpoint, threads_=threads) as plan:
        for _ in range(sampling.max_new_tokens):
            tokens[:] = 0
            for r, row in enumerate(ids):
                context = row[-window:]
                tokens[r, : len(context)] = context
            logits = plan({"tokens": tokens}, timeout)  # [B, T, V]
            new = [
                next_token(logits[r, min(len(row), window) - 1], sampling, rng) for r, row in enumerate(ids)
            ]
            for row, t in zip(ids, new, strict=True):
                row.append(t)
            yield new


def generate(
    model: Module,
    prompt: Sequence[int],
    sampling: Sampling,
    checkpoint: str | None,
    placement: Placement,
    input_sbp: Any,
    **run: Any,
) -> list[int]:
    """``prompt`` followed by ``sampling.max_new_tokens`` tokens the model draws (:func:`stream`, its
    keywords ``run``: ``timeout``, ``threads``) under ``placement``."""
    drawn = [t for (t,) in stream(model, [prompt], sampling, checkpoint, placement, input_sbp, **run)]
    return [*prompt, *drawn]


# ---- the command ---------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    """Print the prompt and the text the example's model writes after it."""
    from sbpflow.checkpoint.read import resolve
    from sbpflow.client.cli.examples import load_example, make_kwargs

    example = load_example(args.example)
    make_model: Callable[..., Any] | None = getattr(example, "make_model", None)
    if make_model is None or not hasattr(example, "encode") or not hasattr(example, "decode"):
        raise UsageError(
            f"{args.example} has no make_model(), encode() and decode(); generate needs them (see "
            "examples/charlm.py)"
        )
    model, where, sbp = make_model(**make_kwargs(args, make_model))
    checkpoint = (
        str(resolve(args.checkpoint))
        if not args.checkpoint.endswith((".safetensors", ".npz"))
        else args.checkpoint
    )
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.seed)
    prompts = [example.encode(text) for text in args.prompt or ["def "]]
    ids = [list(p) for p in prompts]
    shown = example.decode(ids[0]) if len(ids) == 1 else ""
    print(shown, end="", flush=True)
    for new in stream(model, prompts, sampling, checkpoint, where, sbp, args.timeout, args.threads):
        for row, t in zip(ids, new, strict=True):
            row.append(t)
        if len(ids) == 1:  # one prompt: its text as it comes (a token may complete a character later)
            text = example.decode(ids[0])
            print(text[len(shown) :], end="", flush=True)
            shown = text
    print("" if len(ids) == 1 else "\n".join(example.decode(row) for row in ids), flush=True)
    return 0


def generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("example", help="a Python file defining make_model(), encode() and decode()")
    p.add_argument(
        "--checkpoint", required=True, help="a checkpoint, a folder of them (the latest), or a .safetensors"
    )
    p.add_argument(
        "--prompt",
        action="append",
        help='the text to continue (default "def "); again for a batch of prompts',
    )
    p.add_argument("--max-new-tokens", type=int, default=200, help="how many tokens to write")
    p.add_argument("--temperature", type=float, default=0.8, help="0 takes the likeliest token")
    p.add_argument("--top-k", type=int, default=0, help="draw from the k likeliest only (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each token")
    p.add_argument("--threads", type=int, help="BLAS threads (default: as they are)")
    p.add_argument("--ranks", type=int, help="number of ranks (make_model's ranks=)")
    p.add_argument("--tp", action="store_true", help="tensor parallel (make_model's tp=True)")
    p.add_argument("--layers", type=int, help="make_model's layers= (as trained)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other make_model argument")
    p.set_defaults(dp=None)  # no data parallelism in a batch of one
