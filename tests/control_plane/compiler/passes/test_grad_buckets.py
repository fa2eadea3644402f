"""Gradient bucketing: which all-reduces are packed, in what order, and that training is bit-identical."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.codec import wire
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.passes import grad_buckets, micro_batching
from sbpflow.graph import BOXING
from sbpflow.job import GRAD_BUCKET_BYTES, Job, JobConfig
from tests.actor_workers.test_equivalence import gpt_job, mlp_job
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load


def with_config(job: Job, **fields: Any) -> Job:
    return dataclasses.replace(job, config=dataclasses.replace(job.config, **fields))


def packs(c: pipeline.Compiled) -> list[Any]:
    return [o for o in c.state.graph.ops if o.op_type == "pack"]


def grad_boxings(c: pipeline.Compiled) -> list[str]:
    return [o.name for o in c.state.graph.ops if o.op_type == BOXING and o.name.startswith("grad/")]


def test_the_default_is_ddps_25_mib_and_a_message_without_the_field_gets_it() -> None:
    assert JobConfig().grad_bucket_bytes == GRAD_BUCKET_BYTES == 25 * 2**20
    m = wire.config_to_proto(JobConfig())
    m.ClearField("grad_bucket_bytes")  # a client that predates the field
    assert wire.config_from_proto(m).grad_bucket_bytes == GRAD_BUCKET_BYTES
    off = wire.config_from_proto(wire.config_to_proto(JobConfig(grad_bucket_bytes=0)))
    assert off.grad_bucket_bytes == 0


def test_a_negative_bucket_size_is_refused_naming_the_field() -> None:
    with pytest.raises(sf.SbpflowError, match="grad_bucket_bytes"):
        JobConfig(grad_bucket_bytes=-1)


def test_data_parallel_gradients_share_one_all_reduce_in_backward_order() -> None:
    job = gpt_job(ranks=2)
    c = pipeline.compile(job)
    (pack,) = packs(c)
    unpacked = next(o for o in c.state.graph.ops if o.op_type == "unpack")
    # every gradient is in the bucket, the last layer's first (backward order), and keeps its name
    assert set(unpacked.outputs) == set(c.state.grads.values())
    assert unpacked.outputs[0] == "grad/model.lm_head.weight"
    assert grad_boxings(c) == ["grad/bucket_0.box"]
    assert repr(c.state.boxings["grad/bucket_0.box"]).startswith("P -> B: all-reduce")
    assert "gradient bucket 0: " in pipeline.summarize(c)  # what ``sbpflow plan`` prints
    off = pipeline.compile(with_config(job, grad_bucket_bytes=0))
    assert not packs(off) and len(grad_boxings(off)) == len(c.state.grads)
    assert c.plan is not None and off.plan is not None
    assert len(c.plan.communicators[0].order) < len(off.plan.communicators[0].order)


def test_a_bucket_closes_once_it_holds_the_cap() -> None:
    job = with_config(gpt_job(ranks=2), grad_bucket_bytes=2048)
    c = pipeline.compile(job)
    sizes = [c.state.graph.tensors[p.outputs[0]].meta.nbytes for p in packs(c)]
    assert len(sizes) >= 2
    assert all(s >= 2048 for s in sizes[:-1])
    # a bucket's gradients, but its last, held less than the cap before it
    g = c.state.graph
    for p in packs(c):
        parts = [g.tensors[t].meta.nbytes for t in p.inputs]
        assert sum(parts[:-1]) < 2048
    bucketed = {t for p in packs(c) for t in p.inputs}
    plain = [b for b in grad_boxings(c) if not b.startswith(grad_buckets.PREFIX)]
    assert len(bucketed) + len(plain) == len(c.state.grads)  # a lone gradient keeps its own all-reduce


def test_nothing_but_a_whole_making_all_reduce_is_bucketed() -> None:
    # ZeRO 2 reduce-scatters the gradients (P -> S(0)); tensor parallelism keeps its weights' split
    for job in (with_config(gpt_job(ranks=4), zero_stage=2), gpt_job(ranks=4, tp=True, heads=4)):
        c = pipeline.compile(job)
        for p in packs(c):
            for t in p.inputs:
                assert all(repr(s) in ("P", "B") for s in c.state.graph.tensors[t].sbp or ())


def test_a_partial_value_on_one_rank_is_not_packed() -> None:
    """On one device batch norm's gradients still pass a P -> B boxing that moves nothing (the executor
    bypasses it); packing them would copy each one twice a step for no all-reduce. On a 2 x 1 mesh only
    the axis of two ranks sums."""
    c = pipeline.compile(load("resnet").make_job(ranks=1), lower="none")
    assert not packs(c)
    assert grad_boxings(c)  # the no-op boxings are still there, one a gradient
    two = pipeline.compile(gpt_job(ranks=2), lower="none")
    assert packs(two)


def test_accumulation_averages_the_packed_bucket_once_per_micro_batch() -> None:
    c = pipeline.compile(gpt_job(ranks=2, grad_accum=2, batch_size=16), lower="none")
    lay = micro_batching.layout(c.state)
    assert "grad/bucket_0.from_P" in lay.accumulate
    assert not any(t in lay.accumulate for t in c.state.grads.values())
    assert "grad/bucket_0.box" in lay.step  # one all-reduce per step, not one per micro-batch


def train(job: Job) -> tuple[list[float], dict[str, np.ndarray]]:
    got = sf.run(job, steps=3, return_parameters=True, timeout=60, backend="inprocess")
    assert got.parameters is not None
    return list(got.losses), got.parameters


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("gpt-dp2", lambda: gpt_job(ranks=2)),
        ("gpt-dp4-accum2", lambda: gpt_job(ranks=4, grad_accum=2, batch_size=16)),
        ("mlp-dp2", lambda: mlp_job(ranks=2)),
    ],
)
def test_bucketed_training_is_bit_identical_to_unbucketed(name: str, make: Any) -> None:
    job = as_float64(make(), batches=3)
    base_losses, base_params = train(with_config(job, grad_bucket_bytes=0))
    for cap in (GRAD_BUCKET_BYTES, 1024):  # one bucket; several
        assert packs(pipeline.compile(with_config(job, grad_bucket_bytes=cap), lower="none"))
        losses, params = train(with_config(job, grad_bucket_bytes=cap))
        assert losses == base_losses, (name, cap)
        for k, v in base_params.items():
            assert v.dtype == np.float64 and np.array_equal(params[k], v), (name, cap, k)
