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
import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sbpflow.client.cli.exit_codes import UsageError
from sbpflow.client.nn.module import Module
from sbpflow.client.static_graph import Graph
from sbpflow.client.tensor import Tensor
from sbpflow.data.sources import ArrayFileSource
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


def generate(
    model: Module,
    prompt: Sequence[int],
    sampling: Sampling,
    checkpoint: str,
    placement: Placement,
    input_sbp: Any,
    **run: Any,
) -> list[int]:
    """``prompt`` followed by ``sampling.max_new_tokens`` tokens the model draws, each from a run of
    the model (keywords ``run``: ``sf.run``'s, default the in-process backend) under ``placement``."""
    from sbpflow.control_plane.compiler import pipeline
    from sbpflow.control_plane.launch.launcher import launch

    if not prompt:
        raise SbpflowError("the prompt is empty: give at least one character to continue from")
    window = int(model.config.seq_len)
    ids, rng = list(prompt), np.random.default_rng(sampling.seed)
    with tempfile.TemporaryDirectory(prefix="sbpflow-generate-") as scratch:
        tokens = Path(scratch) / "tokens.npy"
        np.save(tokens, np.zeros((1, window), np.int64))
        data = ArrayFileSource(batch_size=1, paths={"tokens": str(tokens)})
        job = _Forward(model.eval()).trace(data, placement=placement, input_sbp=input_sbp)
        compiled = pipeline.compile(dataclasses.replace(job, bound=None))  # the module keeps its values
        for _ in range(sampling.max_new_tokens):
            context = ids[-window:]
            np.save(tokens, np.asarray([context + [0] * (window - len(context))], np.int64))
            result = launch(compiled, init_from=checkpoint, **{"backend": "inprocess", **run})
            (logits,) = result.outputs.values()
            ids.append(next_token(logits[0][0, len(context) - 1], sampling, rng))
    return ids


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
    ids = generate(model, example.encode(args.prompt), sampling, checkpoint, where, sbp, timeout=args.timeout)
    print(example.decode(ids), flush=True)
    return 0


def generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("example", help="a Python file defining make_model(), encode() and decode()")
    p.add_argument(
        "--checkpoint", required=True, help="a checkpoint, a folder of them (the latest), or a .safetensors"
    )
    p.add_argument("--prompt", default="def ", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="how many tokens to write")
    p.add_argument("--temperature", type=float, default=0.8, help="0 takes the likeliest token")
    p.add_argument("--top-k", type=int, default=0, help="draw from the k likeliest only (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each forward run")
    p.add_argument("--ranks", type=int, help="number of ranks (make_model's ranks=)")
    p.add_argument("--tp", action="store_true", help="tensor parallel (make_model's tp=True)")
    p.add_argument("--layers", type=int, help="make_model's layers= (as trained)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other make_model argument")
    p.set_defaults(dp=None)  # no data parallelism in a batch of one
