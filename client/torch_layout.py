"""PyTorch's layout of a model's parameters: nanoGPT's (and GPT-2's) names, Linear weights as
[out, in], and the fused qkv columns as [q | k | v]; and Hugging Face GPT-2's (``"gpt2"``), the same
names and qkv order but the block's projections as ``Conv1D``, whose weights are [in, out] as here.

sbpflow stores a ``Linear`` weight as [in, out] (its forward is one matmul, and the Megatron splits read
off it), and ``sf.nn.GPT`` orders the fused qkv columns per head, [H, 3, Dh], so that a tensor-parallel
column split keeps whole heads; PyTorch's ``nn.Linear`` is [out, in] and nanoGPT splits c_attn's output
as [3, H, Dh]. :func:`torch_rules` reads the rules off the modules a graph holds (a table by module
type), and :func:`to_torch` / :func:`from_torch` apply them, each the other's exact inverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sbpflow.checkpoint.format import CheckpointError
from sbpflow.client.nn.layers import Linear
from sbpflow.client.nn.module import Module
from sbpflow.client.nn.transformer import GPT, CausalSelfAttention, FeedForward


@dataclass(frozen=True)
class TorchRule:
    """One parameter: its tensor name in the job, its name in PyTorch, and how its array differs."""

    tensor: str
    torch: str
    transpose: bool = False  # a Linear weight: [in, out] here, [out, in] there
    qkv_heads: int = 0  # fused qkv columns: [H, 3, Dh] here, [3, H, Dh] there (0: not fused qkv)
    conv1d: bool = False  # a Conv1D in Hugging Face's GPT-2 ([in, out] there: not transposed)
    tied: bool = False  # a second name there for a tensor that has its own rule (a tied head)


# module type -> {child name here: its name in PyTorch}: nanoGPT keeps GPT's modules in `transformer`
TORCH_NAMES: dict[type[Module], dict[str, str]] = {
    GPT: {
        "wte": "transformer.wte",
        "wpe": "transformer.wpe",
        "blocks": "transformer.h",
        "ln_f": "transformer.ln_f",
    },
}
# module type -> {child name: what makes its parameters' columns fused qkv}
QKV_CHILDREN: dict[type[Module], str] = {CausalSelfAttention: "c_attn"}
# modules whose Linear children Hugging Face's GPT-2 makes Conv1D
CONV1D_PARENTS: tuple[type[Module], ...] = (CausalSelfAttention, FeedForward)


def torch_rules(modules: Mapping[str, Module]) -> tuple[TorchRule, ...]:
    """The rule of every parameter of a graph's ``modules`` (graph attribute -> module), in the order
    ``sf.Graph.trace`` names them (a tied parameter once, at its first path). PyTorch's names are the
    module's own (no graph attribute) when one attribute holds every parameter."""
    owners = [a for a, m in modules.items() if any(True for _ in m.parameters())]
    rules, seen = [], set[int]()
    for attr, root in modules.items():
        torch_of = {attr: "" if len(owners) <= 1 else attr}
        heads_of: dict[str, int] = {}
        conv1d: set[str] = set()
        for path, mod in root.named_modules(attr):
            for name, _ in mod.named_children():
                sub = f"{path}.{name}"
                torch_of[sub] = _join(torch_of[path], TORCH_NAMES.get(type(mod), {}).get(name, name))
                if QKV_CHILDREN.get(type(mod)) == name and isinstance(mod, CausalSelfAttention):
                    heads_of[sub] = mod.n_head
                if isinstance(mod, CONV1D_PARENTS):
                    conv1d.add(sub)
            for pname, p in mod.__dict__["_parameters"].items():
                if id(p) in seen or p is None:
                    continue
                seen.add(id(p))
                transpose = isinstance(mod, Linear) and pname == "weight"
                name = _join(torch_of[path], pname)
                rules.append(
                    TorchRule(f"{path}.{pname}", name, transpose, heads_of.get(path, 0), path in conv1d)
                )
            if isinstance(mod, GPT) and mod.config.tie_embeddings:  # nanoGPT and GPT-2 name it twice
                head = _join(torch_of[path], "lm_head.weight")
                rules.append(TorchRule(f"{path}.wte.weight", head, tied=True))
    return tuple(rules)


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def _qkv(a: np.ndarray, heads: int, to_torch: bool) -> np.ndarray:
    """The last axis of ``a`` (3D columns) from [H, 3, Dh] to [3, H, Dh] (or back)."""
    *lead, n = a.shape
    here, there = (heads, 3, n // (3 * heads)), (3, heads, n // (3 * heads))
    src = here if to_torch else there
    return np.ascontiguousarray(np.swapaxes(a.reshape(*lead, *src), -3, -2).reshape(*lead, n))


def to_torch(
    tensors: Mapping[str, np.ndarray], rules: tuple[TorchRule, ...], conv1d: bool = False
) -> dict[str, np.ndarray]:
    """The job's tensors (by tensor name) under PyTorch's names and layout (``conv1d``: Hugging Face
    GPT-2's, its blocks' weights not transposed); a tensor with no rule (optimizer state) is left out."""
    out = {}
    for r in rules:
        if r.tensor in tensors:
            a = np.asarray(tensors[r.tensor])
            a = _qkv(a, r.qkv_heads, to_torch=True) if r.qkv_heads else a
            out[r.torch] = np.ascontiguousarray(a.T) if _transposed(r, conv1d) else a
    return out


def from_torch(
    tensors: Mapping[str, np.ndarray], rules: tuple[TorchRule, ...], conv1d: bool = False
) -> dict[str, np.ndarray]:
    """A PyTorch state dict's arrays (by PyTorch name) under the job's tensor names and layout. Names
    no rule knows pass through unchanged, so a strict import names them as unexpected."""
    by_torch = {r.torch: r for r in rules}
    out, tied = {}, {}
    for name, value in tensors.items():
        a, r = np.asarray(value), by_torch.get(name)
        if r is None:
            out[name] = a
            continue
        if r.tied:
            tied[r.tensor] = (name, a)
            continue
        if _transposed(r, conv1d) and a.ndim != 2:
            raise CheckpointError(
                f"{name!r} is a Linear weight, 2-d [out, in] in PyTorch, but has shape {list(a.shape)}"
            )
        a = np.ascontiguousarray(a.T) if _transposed(r, conv1d) else a
        # columns that cannot be 3 x heads wide are left as they are: the import names their shape
        fused = r.qkv_heads and a.ndim and a.shape[-1] % (3 * r.qkv_heads) == 0
        out[r.tensor] = _qkv(a, r.qkv_heads, to_torch=False) if fused else a
    for tensor, (name, a) in tied.items():
        if tensor in out and not np.array_equal(out[tensor], a):
            raise CheckpointError(
                f"{name!r} is tied to {tensor!r} here (tie_embeddings), but the file holds other values for "
                "it; load it into a model with tie_embeddings=False"
            )
    return out


def _transposed(r: TorchRule, conv1d: bool) -> bool:
    """Whether the array is transposed there: a Linear weight, unless it is a Conv1D's there."""
    return r.transpose and not (conv1d and r.conv1d)
