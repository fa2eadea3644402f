"""The paper's case-study models under their parallel layouts train exactly as one device does.

Each model's example, in float64 for 5 steps on the in-process runtime, against
:func:`sbpflow.oracle.reference.train` (losses and final parameters within 1e-9 relative), as
``test_equivalence.py`` does for the MLP and the GPT.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from sbpflow.control_plane.compiler.pipeline import compile as compile_job
from sbpflow.graph import BOXING
from sbpflow.job import Job
from tests.actor_workers.test_equivalence import STEPS, assert_trains_like_one_device
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load

# ---- ResNet-18, data parallel (batch norm synchronised by P -> B of its batch statistics) ----------

RESNET: dict[str, Any] = {
    "depth": 18,
    "width": 4,
    "image_size": 8,
    "classes": 5,
    "batch_size": 8,
    "steps": STEPS,
}


def resnet_job(ranks: int) -> Job:
    return load("resnet").make_job(ranks=ranks, **RESNET)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_resnet18_data_parallel_equals_one_device(ranks: int) -> None:
    assert_trains_like_one_device(as_float64(resnet_job(ranks), batches=STEPS), tol=1e-9)


def test_resnet18_batch_norm_statistics_are_reduced_across_ranks_under_data_parallelism() -> None:
    """A batch-norm mean over a batch split S(0) is P per rank and reaches its readers only through a
    boxing that sums it over the ranks (all-reduce to B, or reduce-scatter over channels): synchronised
    BN. (Where SBP inference replicates a layer's batch, B, its statistics are whole already.) The
    running statistics' update reads a reshape of it, which is linear and stays P until its boxing."""
    job = resnet_job(4)  # unfused: each statistic and update an op of its own (fusion puts a running
    # variance's update side by side with the per-channel scale taken from the same variance)
    compiled = compile_job(replace(job, config=replace(job.config, fusion=False)), lower=False)
    graph, plans = compiled.state.graph, compiled.state.boxings
    # only batch norm takes means: the mean, and the variance centred on it
    means = [o for o in graph.ops if o.op_type in ("mean", "channel_var")]
    assert len(means) == 2 * 20, "a mean and a variance per batch norm: ResNet-18 has 20"
    # a batch split gives partial means; a channel split (the small late layers) whole channels' own
    expect = {"(S(0),)": "(P,)", "(S(1),)": "(S(0),)"}
    for o in means:
        x_sbp = str(graph.tensors[o.inputs[0]].sbp)
        assert str(graph.tensors[o.outputs[0]].sbp) == expect.get(x_sbp, "(B,)"), o.name
    stats = {o.outputs[0] for o in means}
    partial = {m for m in stats if str(graph.tensors[m].sbp) == "(P,)"}
    assert len(partial) >= len(stats) // 2, "the batch is split over the ranks for most layers"
    partial |= {o.outputs[0] for o in graph.ops if o.op_type == "reshape" and partial & set(o.inputs)}
    for o in graph.ops:
        read = partial.intersection(o.inputs)
        if read and not (o.op_type == "reshape" and o.outputs[0] in partial):
            assert o.op_type == BOXING, f"{o.name} reads the partial statistic {read} unreduced"
            assert repr(plans[o.name]).startswith("P -> "), plans[o.name]
    producer = {out: o for o in graph.ops for out in o.outputs}

    def source(t: str) -> str:  # through reshapes and boxings, to the op that computed the statistic
        o = producer[t]
        return source(o.inputs[0]) if o.op_type in ("reshape", BOXING) else o.op_type

    running = [o for o in graph.ops if o.op_type == "running_stat"]
    assert {source(o.inputs[1]) for o in running} == {"mean", "channel_var"}, "each reads its batch statistic"
    updated = {o.inputs[0] for o in running}
    assert len(updated) == 40 and updated <= set(compiled.state.updates), "every running statistic"


# ---- Wide & Deep: embedding tables split by rows S(0) (or columns S(1)), the dense tower data parallel -


@pytest.mark.parametrize(
    "kwargs",
    [{"ranks": 2}, {"ranks": 4}, {"ranks": 2, "columns": True}],
    ids=["rows-2", "rows-4", "columns-2"],
)
def test_wide_deep_float64_equals_one_device(kwargs: dict[str, Any]) -> None:
    """The tables looked up vocabulary parallel (table S(0), ids B -> P, reduce-scattered onto the batch
    split), the deep one by columns with ``columns``; AdamW, BCE with logits."""
    job = load("wide_deep").make_job(steps=STEPS, batch_size=16, **kwargs)
    assert_trains_like_one_device(as_float64(job, batches=STEPS), tol=1e-9)


# ---- BERT masked-LM: tensor x data parallel on a 2-d mesh ---------------------------------------------

BERT: dict[str, Any] = {"batch_size": 8, "steps": STEPS, "lr": 1e-2}


@pytest.mark.parametrize("ranks, dp", [(1, 1), (2, 1), (2, 2), (4, 2)], ids=["one", "tp2", "dp2", "dp2xtp2"])
def test_bert_masked_lm_float64_equals_one_device(ranks: int, dp: int) -> None:
    """Encoder Megatron-split over mesh axis 1, the word embedding (tied to the MLM decoder) split by
    vocabulary rows there, the batch over axis 0; the loss at the masked positions only."""
    job = load("bert").make_job(ranks=ranks, dp=dp, **BERT)
    assert_trains_like_one_device(as_float64(job, batches=STEPS), tol=1e-9)


# ---- InsightFace: the backbone data parallel, the classifier split by classes S(1) --------------------

FACE: dict[str, Any] = {"batch_size": 8, "steps": STEPS, "classes": 24}


@pytest.mark.parametrize(
    "kwargs",
    [{"ranks": 1}, {"ranks": 2}, {"ranks": 4}, {"ranks": 2, "model_parallel": False}],
    ids=["one", "mp2", "mp4", "dp2"],
)
def test_insightface_float64_equals_one_device(kwargs: dict[str, Any]) -> None:
    """ResNet-18 backbone over the batch, the margin classifier's weight [D, K] split by identities, and
    the two-stage softmax cross entropy over the split logits."""
    job = load("insightface").make_job(**FACE, **kwargs)
    assert_trains_like_one_device(as_float64(job, batches=STEPS), tol=1e-9)


def test_insightface_never_moves_the_logits_only_per_face_numbers() -> None:
    """Under model parallelism no boxing carries the [N, K] logits (forward or backward): the classifier
    exchanges the [N, D] embeddings, N labels and the loss's per-face maxima and sums. (At the equivalence
    tests' toy sizes SBP inference may rightly gather everything: a few KB; here the logits are 0.5 MB.)"""
    n, k = 32, 4000
    job = load("insightface").make_job(ranks=4, classes=k, embedding=64, batch_size=n, image_size=16, width=8)
    graph = compile_job(job, lower=False).state.graph
    moved = {o.name: graph.tensors[o.inputs[0]].meta.shape for o in graph.ops if o.op_type == BOXING}
    assert not [name for name, shape in moved.items() if shape == (n, k)], moved
    weight = graph.tensors["head.weight"]
    assert str(weight.sbp) == "(S(1),)" and weight.meta.shape == (64, k)
    assert any(shape == (n, 4) for shape in moved.values()), "the per-rank maxima are gathered"
