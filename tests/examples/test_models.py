"""The paper's four case-study examples from the CLI: each trains on 2 in-process ranks and on 2 Ray
workers; the BERT and InsightFace paper-scale configurations trace for ``sbpflow plan``."""

from __future__ import annotations

import math

import pytest

from sbpflow.client.cli.main import main
from tests.examples.test_examples import EXAMPLES, load

# short runs: a few steps of each example's small configuration, with its parallel layout
RUNS = {
    "resnet": ["--set", "width=4", "--set", "image_size=8"],
    "wide_deep": [],
    "insightface": [],
    "bert": [],
}


def losses_printed(out: str) -> list[float]:
    return [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]


@pytest.mark.parametrize("name", ["wide_deep", "insightface", "bert"])  # resnet: test_example_resnet.py
def test_trains_from_the_cli_on_two_in_process_ranks(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", str(EXAMPLES / f"{name}.py"), "--ranks", "2", "--steps", "2", "--backend", "inprocess"]
    assert main([*args, *RUNS[name]]) == 0
    losses = losses_printed(capsys.readouterr().out)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses


@pytest.mark.parametrize("name", sorted(RUNS))
def test_trains_on_two_ray_workers(name: str, ray_local: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", str(EXAMPLES / f"{name}.py"), "--ranks", "2", "--steps", "2", "--backend", "ray"]
    assert main([*args, "--ray-address", ray_local, *RUNS[name]]) == 0
    out = capsys.readouterr().out
    losses = losses_printed(out)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out
    assert "SUCCEEDED" in out


def test_bert_runs_on_a_dp_x_tp_mesh_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", str(EXAMPLES / "bert.py"), "--ranks", "4", "--steps", "2", "--backend", "inprocess"]
    assert main([*args, "--dp", "2"]) == 0
    assert len(losses_printed(capsys.readouterr().out)) == 2


def test_bert_large_traces_at_paper_scale() -> None:
    job = load("bert").make_job(ranks=64, dp=8, size="large", batch_size=64)
    job.verify()
    t = job.graph.tensors
    assert t["model.word.weight"].meta.shape == (30720, 1024)
    assert [str(s) for s in t["model.word.weight"].sbp] == ["B", "S(0)"], "vocabulary parallel on TP"
    assert [str(s) for s in t["model.layers.23.attn.qkv.weight"].sbp] == ["B", "S(1)"]
    assert [str(s) for s in t["model.layers.23.fc_out.weight"].sbp] == ["B", "S(0)"]
    assert t["positions"].meta.shape == (64, 77), "15 % of 512 positions masked"


def test_bert_refuses_a_mesh_that_does_not_divide() -> None:
    with pytest.raises(SystemExit, match="not divisible by --dp 3"):
        load("bert").make_job(ranks=4, dp=3)


def test_insightface_paper_scale_traces_with_a_million_identities() -> None:
    job = load("insightface").make_job(
        ranks=8, depth=50, width=64, image_size=112, embedding=512, classes=1_000_000, batch_size=512
    )
    job.verify()
    w = job.graph.tensors["head.weight"]
    assert w.meta.shape == (512, 1_000_000) and str(w.sbp) == "(S(1),)"


def test_bert_keeps_megatrons_weight_splits_where_the_activations_outweigh_them() -> None:
    """With the residual stream pinned (whole on TP, batch on DP), qkv and the first feed-forward layer
    run column-split and the second row-split on their own weight shards: no weight is gathered for
    them. (The attention projection may go sequence-parallel instead: fewer bytes, the compiler's call.)"""
    from sbpflow.control_plane.compiler.pipeline import compile as compile_job

    job = load("bert").make_job(
        ranks=4, dp=2, layers=2, heads=4, width=256, vocab=512, seq_len=128, batch_size=32
    )
    graph = compile_job(job, lower=False).state.graph
    want = {"attn.qkv": "(B, S(1))", "fc": "(B, S(1))", "fc_out": "(B, S(0))"}
    for o in graph.ops:
        layer = o.name.split(".matmul_0")[0].split("layers.")[-1].split(".", 1)[-1]
        if o.op_type == "matmul" and not o.name.startswith("grad/") and layer in want:
            assert str(graph.tensors[o.inputs[1]].sbp) == want[layer], (
                o.name,
                graph.tensors[o.inputs[1]].sbp,
            )
