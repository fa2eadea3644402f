"""Impossible constraints are refused by ``pipeline.compile`` with the op, the tensors and the fix.

The issue's four: ``S(1)`` on an axis of size 1 over 4 ranks, pipeline stages out of order, a cycle
between stages, a placement larger than the cluster; and a pipeline given fewer micro-batches than stages.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import sbpflow as sf
from sbpflow.control_plane.compiler import pipeline
from sbpflow.data.sources import SyntheticSource
from sbpflow.errors import GraphError, PlacementError, SbpflowError
from sbpflow.job import Job
from sbpflow.sbp import S
from tests.examples.test_examples import load


def refused(job: Job, **kwargs: object) -> str:
    with pytest.raises(SbpflowError) as e:
        pipeline.compile(job, **kwargs)  # type: ignore[arg-type]
    return str(e.value)


def test_a_split_of_an_axis_of_size_one_over_four_ranks() -> None:
    job = load("mlp").make_job(ranks=4, n_out=1)
    w = job.graph.tensors["model.net.2.weight"]  # [32, 1]
    job.graph.set_tensor(replace(w, sbp=(S(1),)))
    with pytest.raises(GraphError) as e:
        pipeline.compile(job)
    msg = str(e.value)
    for part in ("model.net.2.weight", "[32, 1]", "S(1)", "axis 1 of size 1", "4 ranks", "sf.sbp.broadcast"):
        assert part in msg, (part, msg)


def _staged_mlp(stage_of: dict[str, int]) -> Job:
    """The one-hidden-layer MLP with its modules put in the given stages ("net.0", "net.2", "loss")."""
    mlp = load("mlp")
    places = [sf.placement("cpu", ranks=[0, 1]), sf.placement("cpu", ranks=[2, 3])]
    model = mlp.MLPRegression(8, 16, 2, 1)
    model.set_stage(stage_of["loss"], places[stage_of["loss"]])
    for name in ("net.0", "net.1", "net.2"):
        k = stage_of[name]
        model.net[int(name[-1])].set_stage(k, places[k])
    graph = mlp.TrainMLP(model, 0.05, 1)
    graph.config.micro_batches = 2
    data = SyntheticSource(batch_size=8, kind="regression", params={"in": 8, "out": 2}, seed=0)
    return graph.trace(data, placement=places[stage_of["net.0"]], input_sbp=S(0))


def test_stages_out_of_order() -> None:
    # the layers in stage 1 and the loss they feed in stage 0: data flows backwards, once
    msg = refused(_staged_mlp({"net.0": 1, "net.1": 1, "net.2": 1, "loss": 0}))
    assert "stages out of order" in msg and "cycle" not in msg
    assert "stage 0" in msg and "stage 1" in msg and "model.net.2" in msg and "set_stage" in msg


def test_a_cycle_between_stages() -> None:
    # stage 0 -> stage 1 (the hidden layer) -> stage 0 (the output layer) -> stage 1 (the loss)
    msg = refused(_staged_mlp({"net.0": 0, "net.1": 1, "net.2": 0, "loss": 1}))
    assert "cycle between stages" in msg, msg
    assert "model.net.2" in msg and "model.net.1" in msg and "set_stage" in msg


def test_fewer_micro_batches_than_stages() -> None:
    job = _staged_mlp({"net.0": 0, "net.1": 0, "net.2": 1, "loss": 1})
    job = replace(job, config=replace(job.config, micro_batches=1))
    msg = refused(job)
    assert "2 stages" in msg and "micro_batches >= 2" in msg, msg


def test_a_placement_larger_than_the_cluster() -> None:
    job = load("mlp").make_job(ranks=4)
    with pytest.raises(PlacementError) as e:
        pipeline.compile(job, cluster_size=2)
    msg = str(e.value)
    for part in (
        "ranks=[0, 1, 2, 3]",
        "4 ranks",
        "2 device(s)",
        "ranks 0..1",
        "at most 2 ranks",
        "larger cluster",
    ):
        assert part in msg, (part, msg)
    assert "x" in msg or "model." in msg  # names a tensor or op that uses the placement
    assert pipeline.compile(job, cluster_size=4).plan is not None  # exactly the cluster is fine


def test_a_cluster_without_devices_is_refused() -> None:
    with pytest.raises(PlacementError, match="cluster_size=0"):
        pipeline.compile(load("mlp").make_job(ranks=2), cluster_size=0)
