"""PyTorch's layout: nanoGPT names, Linear weights [out, in], qkv columns [q | k | v].

The rules are checked exactly without torch (the two directions are inverses, and the qkv order is
the one nanoGPT's ``split(n_embd, dim=2)`` reads); with torch (the bench extra), an sbpflow GPT's
export loads into a nanoGPT-shaped PyTorch module that gives the same logits, and a GPT initialised by
PyTorch, imported, gives PyTorch's first loss.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint.format import write_safetensors
from sbpflow.checkpoint.read import TensorFile
from sbpflow.client.torch_layout import from_torch, to_torch, torch_rules
from sbpflow.data.sources import ArraySource

CFG = sf.nn.GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, n_embd=16)


class Logits(sf.Graph):
    def __init__(self, model: sf.nn.GPT) -> None:
        super().__init__()
        self.model = model

    def build(self, tokens: sf.Tensor) -> sf.Tensor:
        return self.model(tokens)


class Train(sf.Graph):
    def __init__(self, model: sf.nn.GPT) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.AdamW(model.parameters(), lr=1e-2))

    def build(self, tokens: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        loss = self.model(tokens, targets)
        loss.backward()
        return loss


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(4, CFG.seq_len + 1))
    return ids[:, :-1], ids[:, 1:]


def test_the_rules_name_nanogpts_tensors_and_invert_exactly() -> None:
    model = sf.nn.GPT(CFG)
    rules = torch_rules({"model": model})
    names = {r.tensor: r.torch for r in rules}
    assert names["model.wte.weight"] == "transformer.wte.weight"
    assert names["model.blocks.1.attn.c_attn.bias"] == "transformer.h.1.attn.c_attn.bias"
    assert names["model.lm_head.weight"] == "lm_head.weight" and len(names) == len(list(model.parameters()))
    values = {f"model.{k}": v for k, v in model.state_dict().items()}
    there = to_torch(values, rules)
    assert there["transformer.h.0.mlp.c_fc.weight"].shape == (4 * 16, 16)  # [out, in]
    back = from_torch(there, rules)
    assert set(back) == set(values) and all(np.array_equal(back[k], values[k]) for k in values)


def test_the_qkv_columns_come_out_as_q_then_k_then_v() -> None:
    heads, dh = 2, 3
    # column (h, j, d) here holds 100*j + 10*h + d: j = 0, 1, 2 for q, k, v
    cols = np.array([100 * j + 10 * h + d for h in range(heads) for j in range(3) for d in range(dh)], float)
    model = sf.nn.GPT(sf.nn.GPTConfig(vocab_size=4, seq_len=2, n_layer=1, n_head=heads, n_embd=heads * dh))
    rules = torch_rules({"model": model})
    there = to_torch({"model.blocks.0.attn.c_attn.bias": cols}, rules)["transformer.h.0.attn.c_attn.bias"]
    q, k, v = np.split(there, 3)  # nanoGPT: q, k, v = c_attn(x).split(n_embd, dim=2)
    assert list(q) == [10 * h + d for h in range(heads) for d in range(dh)]
    assert np.all(k // 100 == 1) and np.all(v // 100 == 2)


def test_an_unknown_torch_name_passes_through_so_a_strict_import_names_it() -> None:
    rules = torch_rules({"model": sf.nn.GPT(CFG)})
    assert "transformer.h.0.attn.bias" in from_torch({"transformer.h.0.attn.bias": np.ones(1)}, rules)


# ---- against PyTorch ---------------------------------------------------------------------------------


def torch_gpt(cfg: sf.nn.GPTConfig, conv1d: bool = False) -> Any:
    """nanoGPT's GPT (untied head, GELU tanh as GPT-2), in plain PyTorch; ``conv1d``: Hugging Face
    GPT-2's blocks, whose projections are Conv1D (weight [in, out], y = x @ W + b)."""
    torch = pytest.importorskip("torch", reason="torch comes with the bench extra: pip install -e '.[bench]'")
    nn, fn = torch.nn, torch.nn.functional

    class Conv1D(nn.Module):
        def __init__(self, n_in: int, n_out: int) -> None:
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.empty(n_in, n_out)), nn.Parameter(torch.empty(n_out))

        def forward(self, x: Any) -> Any:
            return x @ self.weight + self.bias

    Lin = Conv1D if conv1d else nn.Linear

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = (
                Lin(cfg.n_embd, 3 * cfg.n_embd),
                Lin(cfg.n_embd, cfg.n_embd),
            )

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)
            q, k, v = (z.view(b, t, cfg.n_head, d // cfg.n_head).transpose(1, 2) for z in (q, k, v))
            y = fn.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_fc, self.c_proj = (
                Lin(cfg.n_embd, 4 * cfg.n_embd),
                Lin(4 * cfg.n_embd, cfg.n_embd),
            )

        def forward(self, x: Any) -> Any:
            return self.c_proj(fn.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), Attention()
            self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), Mlp()

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict(
                {
                    "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
                    "wpe": nn.Embedding(cfg.seq_len, cfg.n_embd),
                    "h": nn.ModuleList(Block() for _ in range(cfg.n_layer)),
                    "ln_f": nn.LayerNorm(cfg.n_embd),
                }
            )
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

        def forward(self, idx: Any) -> Any:
            tr = self.transformer
            x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
            for block in tr.h:
                x = block(x)
            return self.lm_head(tr.ln_f(x))

    torch.manual_seed(0)
    model = GPT().double()
    for name, p in model.named_parameters():  # nanoGPT's init, and biases away from 0 to be seen
        with torch.no_grad():
            p.normal_(0.0, 0.02 if "weight" in name and "ln" not in name else 0.1)
            if "ln" in name and "weight" in name:
                p.add_(1.0)
    return model


EXAMPLE = """
import sbpflow as sf


def make_job(tp: bool = False) -> sf.Job:
    from tests.client.test_torch_layout import CFG, Logits, batch, sf_gpt
    from sbpflow.data.sources import ArraySource

    where = sf.placement("cpu", [0, 1] if tp else [0])
    data = ArraySource(batch_size=4, arrays={"tokens": batch()[0]})
    return Logits(sf_gpt(where, tp)).trace(data, placement=where, input_sbp=sf.sbp.broadcast)
"""


def _example(where: Path) -> Path:
    """An example file whose make_job builds the same model (what export reads the layout off)."""
    path = where / "example.py"
    path.write_text(EXAMPLE)
    return path


def sf_gpt(where: sf.Placement, tp: bool) -> sf.nn.GPT:
    model = sf.nn.GPT(CFG).to(sf.float64)
    if tp:
        sf.nn.parallel.megatron(model, where, tp_axis=-1)
    return model


@pytest.mark.parametrize("tp", [False, True], ids=["one", "tp"])
def test_an_export_in_torch_layout_loads_into_pytorch_and_gives_the_same_logits(
    tp: bool, tmp_path: Path
) -> None:
    import subprocess
    import sys

    theirs = torch_gpt(CFG)
    torch = pytest.importorskip("torch")
    where = sf.placement("cpu", [0, 1] if tp else [0])
    tokens, targets = batch()
    graph = Train(sf_gpt(where, tp))
    graph.config.checkpoint_every = 2
    train = graph.trace(
        ArraySource(batch_size=4, arrays={"tokens": tokens, "targets": targets}),
        steps=2,
        placement=where,
        input_sbp=sf.sbp.broadcast,
    )
    root = tmp_path / "ck"
    sf.run(train, backend="inprocess", checkpoint_dir=str(root))
    model = sf_gpt(where, tp)
    logits_job = Logits(model).trace(
        ArraySource(batch_size=4, arrays={"tokens": tokens}), placement=where, input_sbp=sf.sbp.broadcast
    )
    ck = sorted(root.iterdir())[-1]
    out = sf.run(logits_job, backend="inprocess", init_from=str(ck)).outputs
    ours = next(iter(out.values()))[0]
    exported = tmp_path / "torch.safetensors"
    cli = [sys.executable, "-m", "sbpflow.client.cli.main", "export", str(ck), "--layout", "torch"]
    cli += ["--example", str(_example(tmp_path)), "--set", f"tp={tp}", "--out", str(exported)]
    subprocess.run(cli, check=True, capture_output=True, text=True)
    file = TensorFile(exported)  # the bytes are safetensors; the safetensors package is not a dependency
    state = {k: torch.from_numpy(file.read(k)) for k in file.names()}
    theirs.load_state_dict(state, strict=True)
    with torch.no_grad():
        want = theirs(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(ours, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["torch", "gpt2"], ids=["nanogpt", "hf-gpt2"])
def test_a_gpt_initialised_by_pytorch_imports_and_gives_pytorchs_first_loss(
    layout: str, tmp_path: Path
) -> None:
    theirs = torch_gpt(CFG, conv1d=layout == "gpt2")
    torch = pytest.importorskip("torch")
    tokens, targets = batch(1)
    with torch.no_grad():
        logits = theirs(torch.from_numpy(tokens))
        want = float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, CFG.vocab_size), torch.from_numpy(targets).reshape(-1)
            )
        )
    path = tmp_path / "theirs.safetensors"
    write_safetensors(path, {k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    where = sf.placement("cpu", [0, 1])
    for tp in (False, True):
        job = Train(sf_gpt(where, tp)).trace(
            ArraySource(batch_size=4, arrays={"tokens": tokens, "targets": targets}),
            placement=where,
            input_sbp=sf.sbp.broadcast if tp else sf.sbp.split(0),
        )
        got = sf.run(job, backend="inprocess", init_from=str(path), layout=layout).losses[0]
        assert math.isclose(got, want, rel_tol=1e-10), (tp, got, want)
    wrong = "torch" if layout == "gpt2" else "gpt2"  # the other orientation: a shape error, not a silent one
    with pytest.raises(sf.SbpflowError, match="shape mismatch"):
        sf.run(job, backend="inprocess", init_from=str(path), layout=wrong)


def test_a_tied_head_has_both_names_there_and_one_tensor_here() -> None:
    cfg = sf.nn.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, n_embd=16, tie_embeddings=True)
    model = sf.nn.GPT(cfg)
    rules = torch_rules({"model": model})
    values = {f"model.{k}": v for k, v in model.state_dict().items()}
    there = to_torch(values, rules)
    np.testing.assert_array_equal(
        there["lm_head.weight"], there["transformer.wte.weight"]
    )  # as nanoGPT saves it
    back = from_torch(there, rules)
    assert set(back) == set(values) and np.array_equal(back["model.wte.weight"], values["model.wte.weight"])
    there["lm_head.weight"] = there["lm_head.weight"] + 1
    with pytest.raises(sf.SbpflowError, match="tied to 'model.wte.weight'"):
        from_torch(there, rules)
