"""examples/wide_deep.py: the job traces and verifies, its tables run vocabulary parallel, it learns,
and its AUC helper agrees with the pairwise definition."""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.codec import wire
from sbpflow.control_plane.compiler.pipeline import compile
from sbpflow.sbp import B, P, S
from sbpflow.v1 import job_pb2
from tests.examples.test_examples import load


@pytest.mark.parametrize("kwargs", [{}, {"ranks": 4, "columns": True}])
def test_job_traces_verifies_and_round_trips(kwargs) -> None:
    job = load("wide_deep").make_job(**kwargs)
    job.verify()
    tensors = job.graph.tensors
    assert tensors["model.wide.weight"].sbp == (S(0),)
    assert tensors["model.deep.weight"].sbp == ((S(1),) if kwargs.get("columns") else (S(0),))
    assert job.fetches and tensors[job.fetches[-1]].meta.shape == (32,)  # the logits
    back = wire.job_from_proto(job_pb2.Job.FromString(wire.job_to_proto(job).SerializeToString()))
    assert back == job


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_tables_are_looked_up_vocabulary_parallel(ranks: int) -> None:
    """Each rank looks up the ids in its rows (table S(0), ids B -> P) and keeps its rows' gradient."""
    state = compile(load("wide_deep").make_job(ranks=ranks), lower="none").state
    for table in ("wide", "deep"):
        (op,) = [o for o in state.graph.ops if o.name == f"model.{table}.embedding_0"]
        assert state.choices[op.name].signature.ins == ((S(0),), (B,)), state.choices[op.name]
        assert state.choices[op.name].signature.outs == ((P,),)


def test_auc_is_the_chance_a_click_outscores_a_non_click() -> None:
    auc = load("wide_deep").auc
    rng = np.random.default_rng(0)
    scores = np.round(rng.standard_normal(200), 1)  # many ties
    labels = (rng.random(200) < 0.3).astype(np.float32)
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert auc(scores, labels) == pytest.approx(pairs, abs=1e-12)
    assert auc(np.arange(4.0), np.array([0, 0, 1, 1])) == 1.0
    assert np.isnan(auc(np.arange(3.0), np.ones(3)))


def test_it_learns_in_process_on_two_ranks() -> None:
    example = load("wide_deep")
    job = example.make_job(ranks=2, steps=40, batch_size=64)
    result = sf.run(job, backend="inprocess", return_parameters=True, timeout=120)
    assert np.mean(result.losses[-5:]) < result.losses[0] - 0.1
    held_out = example.evaluate(job, result.parameters, batches=4)
    assert held_out["auc"] > 0.65 and held_out["accuracy"] > 0.6, held_out
