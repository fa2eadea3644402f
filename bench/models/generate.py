"""Greedy generation, tokens/s: sbpflow's live plan against Hugging Face ``generate`` and a plain torch loop.

    python bench/models/generate.py             # GPT-2-shaped, 2 layers, seq 64: 16 prompt tokens, 32 new
    python bench/models/generate.py --quick     # 8 new tokens, the job-per-token path on 2
    python bench/models/generate.py --layers 12 --seq-len 256

One model, GPT-2's shape (width 768, 12 heads, vocabulary 50257, tied embeddings, tanh GELU; ``--layers``
blocks, ``--seq-len`` positions), float32, its weights drawn once by sbpflow and copied into the peers
(Hugging Face's Conv1D is sbpflow's ``[in, out]``; c_attn's columns reordered from sbpflow's
``[H, 3, Dh]`` to GPT-2's ``[3, H, Dh]``). Every side draws greedily and on one thread (BLAS, torch's
intra-op pool), in this process, one after the other on the same cores:

* ``sbpflow``: ``sbpflow generate``'s loop (``client/cli/generate.stream``): one live plan, compiled once,
  a step of it per token over the last ``seq_len`` tokens (padded: the plan's shape is fixed);
* ``job per token``: what ``sbpflow generate`` did before, a whole ``sf.run`` of the compiled job a token
  (its per-token time only, on ``--before`` tokens);
* ``hf``: ``GPT2LMHeadModel.generate(do_sample=False)`` with its KV cache (skipped with a message where
  transformers is absent);
* ``torch``: the same forward written in torch, on the whole sequence so far each token (no cache).

Each prints tokens/s after the first token (compile and warm-up out), and whether its tokens are
sbpflow's. The last line is ``ratio N``: sbpflow's tokens/s over Hugging Face's (over the torch loop's
without transformers). Benchmark, not a test.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy (here or by sbpflow) and torch are imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import sbpflow as sf  # noqa: E402
from sbpflow.client.cli.generate import Sampling, _Forward, stream  # noqa: E402

GREEDY = Sampling(temperature=0)


def sbpflow_side(model: sf.nn.GPT, prompt: list[int], new: int) -> tuple[list[int], float]:
    """sbpflow's tokens and the seconds of all but the first (compile and start-up)."""
    where = sf.placement("cpu", ranks=[0])
    tokens, t0 = [], 0.0
    sampling = dataclasses.replace(GREEDY, max_new_tokens=new)
    for (t,) in stream(model, [prompt], sampling, None, where, sf.sbp.broadcast, threads=1):
        tokens.append(t)
        t0 = t0 or time.perf_counter()
    return tokens, time.perf_counter() - t0


def job_per_token(model: sf.nn.GPT, prompt: list[int], new: int) -> float:
    """Seconds a token as ``sbpflow generate`` ran before the live plan: a whole run of the job a token."""
    from sbpflow.control_plane.compiler import pipeline
    from sbpflow.control_plane.launch.launcher import launch

    window, ids = model.config.seq_len, list(prompt)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "tokens.npy"
        np.save(path, np.zeros((1, window), np.int64))
        data = sf.data.ArrayFileSource(batch_size=1, paths={"tokens": str(path)})
        job = _Forward(model.eval()).trace(data, placement=sf.placement("cpu", ranks=[0]))
        compiled = pipeline.compile(job)
        t0 = time.perf_counter()
        for _ in range(new):
            context = ids[-window:]
            np.save(path, np.asarray([context + [0] * (window - len(context))], np.int64))
            (logits,) = launch(compiled, backend="inprocess", threads=1).outputs.values()
            ids.append(int(np.argmax(logits[0][0, len(context) - 1])))
    return (time.perf_counter() - t0) / new


def torch_forward(values: dict[str, np.ndarray], cfg: sf.nn.GPTConfig) -> Callable[[Any], Any]:
    """The model in torch, nanoGPT's way (attention spelled out), on sbpflow's weights."""
    import torch

    w = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in values.items()}
    h, d = cfg.n_head, cfg.n_embd
    ln = torch.nn.functional.layer_norm

    def forward(idx: Any) -> Any:
        t = idx.shape[1]
        x = w["wte.weight"][idx] + w["wpe.weight"][:t]
        mask = torch.full((t, t), float("-inf")).triu(1)
        for i in range(cfg.n_layer):
            p = f"blocks.{i}."
            y = ln(x, (d,), w[p + "ln_1.weight"], w[p + "ln_1.bias"])
            qkv = (y @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]).view(1, t, h, 3, d // h)
            q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))  # [1, H, T, Dh]
            a = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5 + mask, -1) @ v
            x = (
                x
                + a.transpose(1, 2).reshape(1, t, d) @ w[p + "attn.c_proj.weight"]
                + w[p + "attn.c_proj.bias"]
            )
            y = ln(x, (d,), w[p + "ln_2.weight"], w[p + "ln_2.bias"])
            y = torch.nn.functional.gelu(
                y @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"], approximate="tanh"
            )
            x = x + y @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
        return ln(x, (d,), w["ln_f.weight"], w["ln_f.bias"]) @ w["wte.weight"].T

    return forward


def torch_side(
    values: dict[str, np.ndarray], cfg: sf.nn.GPTConfig, prompt: list[int], new: int
) -> tuple[list[int], float]:
    import torch

    forward, ids, t0 = torch_forward(values, cfg), list(prompt), 0.0
    with torch.inference_mode():
        for _ in range(new):
            logits = forward(torch.tensor([ids[-cfg.seq_len :]]))
            ids.append(int(logits[0, -1].argmax()))
            t0 = t0 or time.perf_counter()
    return ids[len(prompt) :], time.perf_counter() - t0


def hf_state(values: dict[str, np.ndarray], cfg: sf.nn.GPTConfig) -> dict[str, Any]:
    """sbpflow's parameters under GPT2LMHeadModel's names and layout."""
    import torch

    h, d = cfg.n_head, cfg.n_embd
    order = np.arange(3 * d).reshape(h, 3, d // h).transpose(1, 0, 2).reshape(-1)  # [3,H,Dh] <- [H,3,Dh]
    out = {"transformer.wte.weight": values["wte.weight"], "transformer.wpe.weight": values["wpe.weight"]}
    out |= {"transformer.ln_f.weight": values["ln_f.weight"], "transformer.ln_f.bias": values["ln_f.bias"]}
    for k, v in values.items():
        if k.startswith("blocks."):
            name = "transformer.h." + k.removeprefix("blocks.")
            out[name] = v[..., order] if ".c_attn." in k else v
    out["lm_head.weight"] = values["wte.weight"]
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def hf_side(
    values: dict[str, np.ndarray], cfg: sf.nn.GPTConfig, prompt: list[int], new: int
) -> tuple[list[int], float] | None:
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("hf: transformers is not installed (pip install transformers); its peer is skipped")
        return None
    hc = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
    )
    model = GPT2LMHeadModel(hc).eval()
    model.load_state_dict(hf_state(values, cfg), strict=False)  # the attention's causal-mask buffers stay
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)  # warm-up: the first token
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - t0
        first = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        seconds -= time.perf_counter() - first  # its first token out, as on the other sides
    return out[0, len(prompt) :].tolist(), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new", type=int, default=32, help="new tokens")
    p.add_argument("--before", type=int, default=3, help="tokens for the job-per-token path (0: skip)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    new, before = (8, 2) if a.quick else (a.new, a.before)
    cfg = sf.nn.GPTConfig(
        vocab_size=50257, seq_len=a.seq_len, n_layer=a.layers, n_head=12, n_embd=768, tie_embeddings=True
    )
    model = sf.nn.GPT(cfg)
    values = {k: np.asarray(v) for k, v in model.state_dict().items()}
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, a.prompt_len)]
    print(
        f"GPT-2-shaped: {cfg.n_layer} layers, width 768, seq {cfg.seq_len}; {len(prompt)} prompt tokens, {new} new; 1 thread"
    )
    ours, seconds = sbpflow_side(model, prompt, new)
    rate = (new - 1) / seconds
    print(f"sbpflow live plan: {rate:8.1f} tokens/s  ({1000 / rate:.1f} ms/token)")
    if before:
        print(
            f"job per token:     {1 / job_per_token(model, prompt, before):8.1f} tokens/s  (before the live plan)"
        )
    peers = {}
    for name, side in (("hf", hf_side), ("torch", torch_side)):
        got = side(values, cfg, prompt, new)
        if got is None:
            continue
        tokens, secs = got
        peers[name] = (new - 1) / secs
        print(f"{name + ':':18} {peers[name]:8.1f} tokens/s  same tokens as sbpflow: {tokens == ours}")
    peer = peers.get("hf", peers.get("torch"))
    print(f"ratio {rate / peer:.2f}" if peer else "ratio n/a")


if __name__ == "__main__":
    main()
