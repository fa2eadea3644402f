"""Module.state_dict(layout=...) and load_state_dict(layout=...) without torch: round trips for every
model family, and the refusals (a transposed file, a tied file into an untied model, a layout with no
rule), each naming the fix. Files are written here as safetensors; a .pt file needs torch."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint.format import write_safetensors

GPT_CFG = dict(vocab_size=32, seq_len=8, n_layer=2, n_head=2, n_embd=16)
BERT_CFG = sf.nn.BertConfig(
    vocab_size=40, seq_len=8, n_layer=2, n_head=2, n_embd=8, intermediate_size=12, pad_token_id=0
)

MODELS = {
    "torch": lambda: sf.nn.GPT(sf.nn.GPTConfig(**GPT_CFG)),
    "gpt2": lambda: sf.nn.GPT(sf.nn.GPTConfig(**GPT_CFG, tie_embeddings=True)),
    "hf-bert": lambda: sf.nn.BertForMaskedLM(BERT_CFG),
    "torchvision": lambda: sf.nn.resnet18(classes=10, width=4),
}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", list(MODELS))
def test_a_state_dict_in_a_layout_loads_back_to_the_same_values(layout: str, tmp_path: Path) -> None:
    ours = MODELS[layout]()
    ours.load_state_dict({k: v + 0.5 for k, v in ours.state_dict().items()})  # not what a fresh one draws
    there = ours.state_dict(layout=layout)
    other = MODELS[layout]()
    assert not _same(ours.state_dict(), other.state_dict())
    other.load_state_dict(there, layout=layout)
    assert _same(ours.state_dict(), other.state_dict())
    write_safetensors(tmp_path / "m.safetensors", there)  # and from a file, by its path
    third = MODELS[layout]()
    third.load_state_dict(str(tmp_path / "m.safetensors"), layout=layout)
    assert _same(ours.state_dict(), third.state_dict())


def test_the_layouts_use_pytorchs_names_and_orientation() -> None:
    gpt2 = MODELS["gpt2"]().state_dict(layout="gpt2")
    assert gpt2["transformer.h.0.attn.c_attn.weight"].shape == (16, 48), "Conv1D: [in, out]"
    np.testing.assert_array_equal(gpt2["lm_head.weight"], gpt2["transformer.wte.weight"])
    bert = MODELS["hf-bert"]().state_dict(layout="hf-bert")
    assert bert["bert.encoder.layer.1.intermediate.dense.weight"].shape == (12, 8), "[out, in], F = 12"
    assert bert["bert.encoder.layer.0.attention.self.key.weight"].shape == (8, 8)
    np.testing.assert_array_equal(bert["cls.predictions.decoder.bias"], bert["cls.predictions.bias"])
    vision = MODELS["torchvision"]().state_dict(layout="torchvision")
    assert vision["layer2.0.downsample.0.weight"].shape == (8, 4, 1, 1)
    assert vision["layer4.1.bn2.num_batches_tracked"].dtype == np.int64
    assert vision["conv1.weight"].shape == (4, 3, 7, 7), "torchvision's stem by default"


def test_bert_q_k_v_are_the_heads_columns_in_order() -> None:
    model = sf.nn.BertForMaskedLM(BERT_CFG)
    heads, dh = 2, 4
    # column (h, j, d) of the fused weight here holds 100*j + 10*h + d: j = 0, 1, 2 for q, k, v
    cols = np.array([100 * j + 10 * h + d for h in range(heads) for j in range(3) for d in range(dh)], "f4")
    values = model.state_dict()
    values["layers.0.attn.qkv.bias"] = cols
    model.load_state_dict(values)
    there = model.state_dict(layout="hf-bert")
    key = there["bert.encoder.layer.0.attention.self.key.bias"]
    assert list(key) == [100 + 10 * h + d for h in range(heads) for d in range(dh)]


def test_a_gpt2_file_under_layout_torch_is_refused_naming_gpt2() -> None:
    there = MODELS["torch"]().state_dict(layout="gpt2")  # c_proj is square: it alone would pass silently
    with pytest.raises(sf.SbpflowError, match="shape mismatch.*layout='gpt2'"):
        MODELS["torch"]().load_state_dict(there, layout="torch")
    nano = MODELS["torch"]().state_dict(layout="torch")
    with pytest.raises(sf.SbpflowError, match="layout='torch'"):
        MODELS["torch"]().load_state_dict(nano, layout="gpt2")


@pytest.mark.parametrize("drop_head", [True, False], ids=["no-head", "head-equal-to-wte"])
def test_a_tied_file_into_an_untied_gpt_is_refused_with_the_fix(drop_head: bool) -> None:
    there = MODELS["gpt2"]().state_dict(layout="gpt2")  # tied: lm_head.weight equals wte
    if drop_head:
        del there["lm_head.weight"]  # as Hugging Face's files for GPT-2 are saved
    untied = MODELS["torch"]()
    with pytest.raises(sf.SbpflowError, match=r"tie_embeddings=True"):
        untied.load_state_dict(there, layout="gpt2")
    found = untied.load_state_dict(there, layout="gpt2", strict=False)
    assert found.missing == (("lm_head.weight",) if drop_head else ())
    tied = MODELS["gpt2"]()
    tied.load_state_dict(there, layout="gpt2")


def test_a_layout_without_a_rule_names_the_module() -> None:
    with pytest.raises(sf.SbpflowError, match="layout 'hf-bert' has no rule for GPT.*'torch', 'gpt2'"):
        MODELS["torch"]().state_dict(layout="hf-bert")
    with pytest.raises(sf.SbpflowError, match="no rule for ResNet"):
        MODELS["torchvision"]().load_state_dict({}, layout="gpt2")


def test_a_users_container_of_layers_needs_no_rule() -> None:
    mlp = sf.nn.MLP([3, 5, 2])
    there = mlp.state_dict(layout="torch")
    assert there["0.weight"].shape == (5, 3), "nn.Linear's [out, in]"
    sf.nn.MLP([3, 5, 2]).load_state_dict(there, layout="torch")


def test_a_dtype_mismatch_under_a_layout_does_not_tell_to_pass_a_layout() -> None:
    there = {k: v.astype(np.float64) for k, v in MODELS["torch"]().state_dict(layout="torch").items()}
    with pytest.raises(sf.SbpflowError, match="dtype mismatch") as e:
        MODELS["torch"]().load_state_dict(there, layout="torch")
    assert "pass layout" not in str(e.value)
    assert "model.to(dtype)" in str(e.value)
    with pytest.raises(sf.SbpflowError, match="layout= 'torch', 'gpt2'"):
        MODELS["torch"]().load_state_dict(there)  # without one: PyTorch's names are not this model's


def test_a_torch_save_file_without_torch_says_what_it_is_and_how_to_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"PK\x03\x04" + bytes(64))  # a torch.save file is a zip archive
    real = builtins.__import__

    def no_torch(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torch":
            raise ImportError("no torch")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(sf.SbpflowError, match="torch.save file; reading it needs torch"):
        MODELS["torch"]().load_state_dict(str(path), layout="torch")


def test_a_torch_save_file_loads_through_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch comes with the bench extra")
    ours = MODELS["torchvision"]()
    there = ours.state_dict(layout="torchvision")
    torch.save({"state_dict": {k: torch.from_numpy(v) for k, v in there.items()}}, tmp_path / "r.pt")
    other = MODELS["torchvision"]()
    other.load_state_dict(tmp_path / "r.pt", layout="torchvision")
    assert _same(ours.state_dict(), other.state_dict())
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(sf.SbpflowError, match="save a state dict"):
        other.load_state_dict(tmp_path / "list.pt")


def test_a_safetensors_file_is_never_taken_for_a_torch_file(tmp_path: Path) -> None:
    there = MODELS["torch"]().state_dict(layout="torch")
    for name in ("m.bin", "m.pt"):  # Hugging Face names safetensors .safetensors, but a user may not
        write_safetensors(tmp_path / name, there)
        MODELS["torch"]().load_state_dict(tmp_path / name, layout="torch")


@pytest.mark.parametrize(("example", "layout"), [("bert", "hf-bert"), ("gpt", "gpt2"), ("gpt", "torch")])
def test_a_traced_jobs_values_go_to_and_from_every_layout_of_its_model(example: str, layout: str) -> None:
    """init_from= and `sbpflow export --layout` convert through Job.bound: the modules' own rules."""
    from tests.examples.test_examples import load

    job = load(example).make_job(ranks=1, layers=1)
    assert job.bound is not None
    rng = np.random.default_rng(0)
    held = {p.tensor: rng.normal(size=job.graph.tensors[p.tensor].meta.shape) for p in job.parameters}
    theirs = job.bound.to_layout(layout, held)
    assert set(theirs) != set(held)  # PyTorch's names, not the graph's
    back = job.bound.from_layout(layout, theirs)
    assert set(back) == set(held) and all(np.array_equal(back[k], held[k]) for k in held)
    with pytest.raises(sf.SbpflowError, match="layout 'keras' is unknown"):
        job.bound.to_layout("keras", held)


def test_a_hub_gpt2_file_of_base_model_names_loads_into_the_model_with_a_head() -> None:
    """Hugging Face's gpt2 files hold GPT2Model's names (h.0..., wte.weight), not 'transformer.h.0...'."""
    cfg = sf.nn.GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, n_embd=8, tie_embeddings=True)
    source, target = sf.nn.GPT(cfg), sf.nn.GPT(cfg)
    theirs = source.state_dict(layout="gpt2")
    assert all(n.startswith("transformer.") for n in theirs if n != "lm_head.weight")
    hub = {n.removeprefix("transformer."): a for n, a in theirs.items() if n != "lm_head.weight"}
    assert target.load_state_dict(hub, layout="gpt2") == target.load_state_dict(theirs, layout="gpt2")
    mine, want = target.state_dict(), source.state_dict()
    assert set(mine) == set(want) and all(np.array_equal(mine[k], want[k]) for k in want)
    with pytest.raises(Exception, match="unexpected"):  # names of some other model still refused
        target.load_state_dict({f"encoder.{n}": a for n, a in hub.items()}, layout="gpt2")
