"""Sampling text from a trained language model: ``sbpflow generate examples/charlm.py --checkpoint DIR
--prompt "def "`` (``--prompt`` again: a batch), under any layout its example builds (``--ranks 2 --tp``:
the Megatron split), the text printed as it comes.

The model runs as one live plan (:mod:`sbpflow.control_plane.generation.live_plan`): compiled once, its
actors up until the last token, one step of it a token; its parameters imported from the checkpoint
(strict: the example must build the model that was trained). A GPT whose prompts and new tokens fit its
``seq_len`` runs one position a step, each layer's keys and values kept in the plan as variables (a
``running_stat`` gives each its next value: the new token's written at its position), so a token costs
O(T) attention; any other model, or a longer text, a forward of each row's last ``seq_len`` tokens a
step (padding after them, which a causal model's earlier positions never see). The logits of a row's
last position, divided by the temperature and cut to the ``top_k`` likeliest, give its next token;
temperature 0 takes the likeliest (greedy). The example provides ``make_model(**kwargs)``, returning the
model (a module whose forward maps ids [B, T] to logits [B, T, V], ``config.seq_len`` long at most), its
placement and the tokens' SBP, and ``encode`` / ``decode`` between text and ids.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sbpflow.client.cli.exit_codes import UsageError
from sbpflow.client.functional import matmul, softmax, split
from sbpflow.client.nn.layers import ModuleList
from sbpflow.client.nn.module import Module
from sbpflow.client.nn.parameter import Parameter
from sbpflow.client.nn.transformer import GPT
from sbpflow.client.static_graph import Graph
from sbpflow.client.tensor import Tensor, emit
from sbpflow.data.sources import ArraySource
from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.placement import Placement
from sbpflow.random import Zeros
from sbpflow.sbp import B, S


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


@dataclass(frozen=True)
class Where:
    """Where and how a generation runs: its parameters' file (None: the model's values), the model's
    placement and its inputs' SBP, seconds a token at most, BLAS threads (None: as they are)."""

    checkpoint: str | None
    placement: Placement
    input_sbp: Any
    timeout: float = 600.0
    threads: int | None = None


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
    ``sampling.max_new_tokens`` lists of ``len(prompts)`` tokens, each row drawing as it would alone (its
    own generator, seeded ``sampling.seed``). The model runs as one live plan
    (:mod:`sbpflow.control_plane.generation.live_plan`): compiled once, its actors up until the last token.
    A GPT whose rows fit its ``seq_len`` runs a token a step with its keys and values kept in the plan
    (:func:`_cached`); any other model a forward of each row's last ``seq_len`` tokens a step
    (:func:`_windowed`). Parameters: ``checkpoint`` (strict: the example must build the model that was
    trained), or the model's own values (None)."""
    if not prompts or not all(prompts):
        raise SbpflowError("a prompt is empty: give at least one token (a character) to continue from")
    fits = all(len(p) + sampling.max_new_tokens <= model.config.seq_len for p in prompts)
    run = _cached if fits and cacheable(model) else _windowed
    how = Where(checkpoint, placement, input_sbp, timeout, threads)
    return run(model, [list(p) for p in prompts], sampling, how)


def _windowed(model: Module, ids: list[list[int]], sampling: Sampling, how: Where) -> Iterator[list[int]]:
    """A step a token: the model on each row's last ``seq_len`` tokens (padding after them, which a
    causal model's earlier positions never see), the next token from the last one's logits."""
    from sbpflow.control_plane.generation.live_plan import LivePlan

    window, rngs = int(model.config.seq_len), [np.random.default_rng(sampling.seed) for _ in ids]
    tokens = np.zeros((len(ids), window), np.int64)
    data = ArraySource(batch_size=len(ids), arrays={"tokens": tokens})
    job = _Forward(model.eval()).trace(data, placement=how.placement, input_sbp=how.input_sbp)
    with LivePlan(job, init_from=how.checkpoint, threads_=how.threads) as plan:
        for _ in range(sampling.max_new_tokens):
            tokens[:] = 0
            for r, row in enumerate(ids):
                context = row[-window:]
                tokens[r, : len(context)] = context
            logits = plan({"tokens": tokens}, how.timeout)  # [B, T, V]
            new = [
                next_token(logits[r, min(len(row), window) - 1], sampling, rngs[r])
                for r, row in enumerate(ids)
            ]
            for row, t in zip(ids, new, strict=True):
                row.append(t)
            yield new


# ---- a KV cache as plan state ----------------------------------------------------------------------------

CACHE = "cache"  # the step graph's attribute holding the caches: their names start with it, no file has them


def cacheable(model: Module) -> bool:
    """A GPT (``sf.nn.GPT``'s attributes) whose residual stream is not split by sequence."""
    return isinstance(model, GPT) and model.sequence_layout is None


class _LayerCache(Module):
    """One layer's keys and values for every row and position: [B, H, T, Dh], heads split as its qkv."""

    def __init__(self, shape: tuple[int, ...], like: Parameter) -> None:
        super().__init__()
        self.k = Parameter(shape, Zeros(), requires_grad=False)
        self.v = Parameter(shape, Zeros(), requires_grad=False)
        if like.placement is not None and like.sbp is not None:  # Megatron: qkv S(1) -> heads S(1)
            sbp = [S(1) if x == S(1) else B for x in like.sbp]
            self.k.to_global(like.placement, sbp)
            self.v.to_global(like.placement, sbp)


class _CachedStep(Graph):
    """One token per row through a GPT, each layer's keys and values kept in the plan between steps: the
    new token's written at its position (``write`` one-hot there, ``keep`` its complement), the earlier
    ones read back; ``bias`` masks the positions after it. O(T) attention a token, not a whole forward."""

    def __init__(self, model: GPT, rows: int) -> None:
        super().__init__()
        self.model = model  # the attribute the training graph used: the checkpoint's names
        cfg = model.config
        shape = (rows, cfg.n_head, cfg.seq_len, cfg.n_embd // cfg.n_head)
        like = model.blocks[0].attn.c_attn.weight
        setattr(self, CACHE, ModuleList(_LayerCache(shape, like) for _ in range(cfg.n_layer)))

    def build(self, tokens: Tensor, positions: Tensor, write: Tensor, keep: Tensor, bias: Tensor) -> Tensor:
        m = self.model
        x = m.wte(tokens) + m.wpe(positions)  # x: [B, 1, D]
        for block, cache in zip(m.blocks, getattr(self, CACHE), strict=True):
            x = x + _attend(block.attn, block.ln_1(x), cache, (write, keep, bias))
            x = x + block.mlp(block.ln_2(x))
        x = m.ln_f(x)
        if m.config.tie_embeddings:
            return matmul(x, m.wte.weight, transpose_b=True)  # logits: [B, 1, V]
        return m.lm_head(x)


def _attend(attn: Any, h: Tensor, cache: _LayerCache, masks: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    write, keep, bias = masks  # [B, 1, T, 1], [B, 1, T, 1], [B, 1, 1, T]
    b, _, d = h.shape
    heads = attn.n_head
    qkv = attn.c_attn(h).reshape(b, 1, heads, 3, d // heads)  # as CausalSelfAttention: whole heads a rank
    q, k, v = (z.reshape(b, 1, heads, d // heads).permute(0, 2, 1, 3) for z in split(qkv, 1, axis=3))
    keys = cache.k * keep + k * write  # [B, H, T, Dh]: the new key at its position
    values = cache.v * keep + v * write
    emit("running_stat", cache.k, keys, momentum=1.0)  # the plan's next value of the cache
    emit("running_stat", cache.v, values, momentum=1.0)
    (att,) = emit("batch_matmul", q, keys, transpose_b=True)  # [B, H, 1, T]
    (att,) = emit("mul_scalar", att, value=1.0 / math.sqrt(d // heads))
    att = softmax(att + bias, axis=-1)
    (y,) = emit("batch_matmul", att, values)  # [B, H, 1, Dh]
    return attn.c_proj(y.permute(0, 2, 1, 3).reshape(b, 1, d))


def _cached(model: Module, ids: list[list[int]], sampling: Sampling, how: Where) -> Iterator[list[int]]:
    """A step a position: each row's token there in, its keys and values into the cache, the next
    token's logits out. A row whose prompt ends earlier draws earlier; its k-th tokens go out together."""
    from sbpflow.control_plane.generation.live_plan import LivePlan

    assert isinstance(model, GPT)
    rows, window = len(ids), model.config.seq_len
    lengths, rngs = [len(r) for r in ids], [np.random.default_rng(sampling.seed) for _ in ids]
    feed = {
        "tokens": np.zeros((rows, 1), np.int64),
        "positions": np.zeros((rows, 1), np.int64),
        "write": np.zeros((rows, 1, window, 1), np.float32),
        "keep": np.ones((rows, 1, window, 1), np.float32),
        "bias": np.zeros((rows, 1, 1, window), np.float32),
    }
    job = _CachedStep(model.eval(), rows).trace(
        ArraySource(batch_size=rows, arrays=feed), placement=how.placement, input_sbp=how.input_sbp
    )
    if how.checkpoint is not None:
        _check_without_cache(job, how.checkpoint)
    sent = 0
    with LivePlan(job, init_from=how.checkpoint, threads_=how.threads, strict=False) as plan:
        for step in range(max(lengths) + sampling.max_new_tokens - 1):
            for r, row in enumerate(ids):
                at = min(step, len(row) - 1)  # a row done keeps rewriting its last position
                feed["tokens"][r, 0], feed["positions"][r, 0] = row[at], at
                feed["write"][r, 0, :, 0] = np.arange(window) == at
                feed["keep"][r] = 1 - feed["write"][r]
                feed["bias"][r, 0, 0] = np.where(np.arange(window) <= at, 0.0, -1e30)
            logits = plan(feed, how.timeout)  # [B, 1, V]
            for r, row in enumerate(ids):
                if step == len(row) - 1 and len(row) < lengths[r] + sampling.max_new_tokens:
                    row.append(next_token(logits[r, 0], sampling, rngs[r]))
            while all(len(row) > lengths[r] + sent for r, row in enumerate(ids)):
                yield [row[lengths[r] + sent] for r, row in enumerate(ids)]
                sent += 1


def _check_without_cache(job: Job, checkpoint: str) -> None:
    """``checkpoint`` holds every parameter of the model in its shape and dtype, the caches aside."""
    from sbpflow.checkpoint.imports import check, metas_of
    from sbpflow.checkpoint.read import open_tensors
    from sbpflow.control_plane.launch.start_values import FIX, wanted

    model = {n: meta for n, meta in wanted(job).items() if not n.startswith(CACHE + ".")}
    check(model, metas_of(open_tensors(checkpoint)), True, f"the checkpoint {checkpoint}", FIX)


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
    from sbpflow.client.cli.examples import load_example, make_kwargs

    example = load_example(args.example)
    make_model: Callable[..., Any] | None = getattr(example, "make_model", None)
    if make_model is None or not hasattr(example, "encode") or not hasattr(example, "decode"):
        raise UsageError(
            f"{args.example} has no make_model(), encode() and decode(); generate needs them (see "
            "examples/charlm.py)"
        )
    model, where, sbp = make_model(**make_kwargs(args, make_model))
    if args.job is not None:  # no disk shared with the server: its checkpoint streamed here first
        with tempfile.TemporaryDirectory(prefix="sbpflow-generate-") as tmp:
            args.checkpoint = _downloaded(args, Path(tmp))
            return _write(args, example, model, where, sbp)
    return _write(args, example, model, where, sbp)


def _downloaded(args: argparse.Namespace, into: Path) -> str:
    from sbpflow.client.client import Client

    token = args.token or os.environ.get("SBPFLOW_TOKEN") or None
    with Client(args.address, token=token, tls_ca=args.tls_ca) as client:
        return str(client.download_checkpoint(args.job, into))


def _write(args: argparse.Namespace, example: Any, model: Any, where: Any, sbp: Any) -> int:
    """Print the prompt(s) and what the model writes after them, from ``args.checkpoint``."""
    from sbpflow.checkpoint.read import resolve

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
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint, a folder of them (the latest), or a .safetensors")
    source.add_argument(
        "--job", metavar="ID", help="the latest checkpoint of job ID, read through the server at --address"
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
