"""The examples' make_job traces and verifies, on DP, TP and a 2-d mesh."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from sbpflow.client.cli.summary import summarize

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kwargs", [{}, {"tp": True, "ranks": 4, "layers": 2}])
def test_mlp_example(kwargs) -> None:
    job = load("mlp").make_job(**kwargs)
    job.verify()
    assert job.loss and job.optimizer is not None
    assert "matmul" in summarize(job)


@pytest.mark.parametrize(
    "kwargs", [{}, {"tp": True}, {"tp": True, "dp": 2, "ranks": 4, "heads": 4, "width": 32}]
)
def test_gpt_example(kwargs) -> None:
    job = load("gpt").make_job(**kwargs)
    job.verify()
    assert job.optimizer is not None and job.optimizer.clip_grad_norm == 1.0
    assert job.graph.tensors["model.blocks.0.attn.c_attn.weight"].sbp is not None or not kwargs


@pytest.mark.parametrize(
    "name, kwargs", [("mlp", {"tp": True, "ranks": 4}), ("gpt", {"tp": True, "dp": 2, "ranks": 4})]
)
def test_traced_jobs_round_trip_through_the_wire(name: str, kwargs) -> None:
    from sbpflow.codec import wire
    from sbpflow.v1 import job_pb2

    job = load(name).make_job(**kwargs)
    blob = wire.job_to_proto(job).SerializeToString()
    back = wire.job_from_proto(job_pb2.Job.FromString(blob))
    assert back == job
    back.verify()


def test_gpt_size_is_configurable() -> None:
    job = load("gpt").make_job(layers=3, heads=4, width=48, vocab=100, seq_len=12)
    t = job.graph.tensors
    assert t["model.wte.weight"].meta.shape == (100, 48)
    assert t["model.wpe.weight"].meta.shape == (12, 48)
    assert "model.blocks.2.attn.c_attn.weight" in t and "model.blocks.3.attn.c_attn.weight" not in t


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("mlp", {"ranks": 4, "pp": 2, "layers": 3, "micro_batches": 4, "batch_size": 16}),
        ("mlp", {"pp": 2, "stage_ranks": (2, 4), "layers": 3, "grad_accum": 2, "schedule": "gpipe"}),
        ("gpt", {"ranks": 4, "pp": 4, "layers": 4, "micro_batches": 4}),
    ],
)
def test_pipeline_options_stage_the_layers(name: str, kwargs) -> None:
    job = load(name).make_job(**kwargs)
    job.verify()
    stages = len(kwargs.get("stage_ranks", ())) or kwargs["pp"]
    assert sorted({o.stage for o in job.graph.ops}) == list(range(stages))
    last = max(job.graph.ops, key=lambda o: o.stage)
    assert job.graph.producer(job.loss).stage == last.stage  # the loss is computed in the last stage
    ranks = {r for o in job.graph.ops if o.placement for r in o.placement.ranks}
    assert ranks == set(range(sum(kwargs.get("stage_ranks", ())) or kwargs["ranks"]))
    assert job.config.micro_batches == kwargs.get("micro_batches", 1)


def test_the_readme_job_is_a_char_gpt_on_python_sources_whose_loss_falls(tmp_path: Path, monkeypatch) -> None:
    """examples/charlm.py (the README's main job) on real text: a few steps on the in-process runtime
    already bring the loss down from ln(128) (the untrained model's ~uniform guess)."""
    import numpy as np

    import sbpflow as sf

    monkeypatch.setenv("SBPFLOW_CACHE", str(tmp_path))
    job = load("charlm").make_job(steps=12, width=32, seq_len=32, batch_size=8)
    assert job.graph.tensors["model.wte.weight"].meta.shape[0] == sf.corpus.VOCAB
    losses = sf.run(job, backend="inprocess").losses
    assert abs(losses[0] - np.log(sf.corpus.VOCAB)) < 0.5
    assert np.mean(losses[-3:]) < losses[0] - 0.5
