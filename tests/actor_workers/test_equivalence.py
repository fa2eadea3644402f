"""The issue's equivalence suite: every parallel layout trains exactly as one device does.

An MLP and a 2-layer GPT, dropout off, AdamW, 5 steps, run by ``sf.run(backend="inprocess")`` under
1 device; DP 4; TP 4; DP2xTP2 (2-d SBP); PP 2 stages x 4 micro-batches; PP2xDP2; ZeRO 1, 2, 3 on DP 4;
activation checkpointing on DP 4; gradient accumulation 4 on DP 4 — losses and final parameters equal
:func:`sbpflow.oracle.reference.train` within 1e-9 relative in float64 (1e-4 in float32). In float64 a parameter
is compared elementwise, relative to its own scale (its largest entry), so entries that are rounding
noise around zero do not dominate. In float32 the tolerance holds for all parameters together, in norm
(and 10x it for each tensor), because AdamW divides each gradient entry by its own magnitude: a gradient
that is zero in exact arithmetic (the attention's key bias: softmax is shift-invariant) is float32
rounding noise whose sign decides the update, on one device and on four alike, but not the same noise. The models are small (width 16-64, batch 8, sequence 8) so the file runs in well under a minute.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.job import AdamW, Job, OptimizerSpec
from sbpflow.oracle import reference
from sbpflow.sbp import B, S
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load

STEPS = 5
MLP: dict[str, Any] = {"n_in": 8, "hidden": 16, "n_out": 4, "layers": 1, "batch_size": 8, "steps": STEPS}
GPT: dict[str, Any] = {
    "layers": 2,
    "heads": 2,
    "width": 16,
    "vocab": 32,
    "seq_len": 8,
    "batch_size": 8,
    "steps": STEPS,
}


def mlp_job(**kw: Any) -> Job:
    """The MLP example trained by AdamW (the example uses SGD with momentum)."""
    job = load("mlp").make_job(**{**MLP, **kw})
    assert job.optimizer is not None
    adamw = AdamW(lr=1e-2, weight_decay=0.01)
    return dataclasses.replace(job, optimizer=OptimizerSpec(adamw, job.optimizer.parameters))


def mlp_dp2xtp2() -> Job:
    """The MLP on a 2x2 mesh: batch over mesh axis 0, the hidden layer Megatron-split over axis 1."""
    mlp = load("mlp")
    where = sf.placement("cpu", ranks=[[0, 1], [2, 3]])
    model = mlp.MLPRegression(MLP["n_in"], MLP["hidden"], MLP["n_out"], 1)
    sf.nn.parallel.data_parallel(model, where)
    first, last = model.net[0], model.net[len(model.net) - 1]
    first.weight.to_global(where, (B, S(1)))
    first.bias.to_global(where, (B, S(0)))
    last.weight.to_global(where, (B, S(0)))
    data = sf.data.SyntheticSource(batch_size=8, kind="regression", params={"in": 8, "out": 4}, seed=0)
    job = mlp.TrainMLP(model, 0.05, STEPS).trace(data, placement=where, input_sbp=(S(0), B))
    assert job.optimizer is not None
    return dataclasses.replace(job, optimizer=OptimizerSpec(AdamW(lr=1e-2), job.optimizer.parameters))


def gpt_job(**kw: Any) -> Job:
    """The GPT example: AdamW with global-norm clipping and a warm-up cosine schedule, dropout 0."""
    return load("gpt").make_job(**{**GPT, **kw})


def config(make: Callable[[], Job], **overrides: Any) -> Callable[[], Job]:
    def job() -> Job:
        j = make()
        return dataclasses.replace(j, config=dataclasses.replace(j.config, **overrides))

    return job


# Tensor parallelism over 4 ranks needs 4 heads; TP keeps the weights split (annotations are constraints).
LAYOUTS: dict[str, Callable[[], Job]] = {
    "mlp-1": lambda: mlp_job(ranks=1),
    "mlp-dp4": lambda: mlp_job(ranks=4),
    "mlp-tp4": lambda: mlp_job(ranks=4, tp=True),
    "mlp-dp2xtp2": mlp_dp2xtp2,
    "mlp-pp2x4mb": lambda: mlp_job(ranks=2, pp=2, micro_batches=4),
    "mlp-pp2xdp2": lambda: mlp_job(ranks=4, pp=2, micro_batches=4),
    "mlp-zero1": config(lambda: mlp_job(ranks=4), zero_stage=1),
    "mlp-zero2": config(lambda: mlp_job(ranks=4), zero_stage=2),
    "mlp-zero3": config(lambda: mlp_job(ranks=4), zero_stage=3),
    "mlp-checkpointing": config(lambda: mlp_job(ranks=4), activation_checkpointing=True),
    "mlp-accum4": lambda: mlp_job(ranks=4, grad_accum=4, batch_size=16),
    "gpt-1": lambda: gpt_job(ranks=1),
    "gpt-dp4": lambda: gpt_job(ranks=4),
    "gpt-tp4": lambda: gpt_job(ranks=4, tp=True, heads=4),
    "gpt-dp2xtp2": lambda: gpt_job(ranks=4, tp=True, dp=2),
    "gpt-pp2x4mb": lambda: gpt_job(ranks=2, pp=2, micro_batches=4),
    "gpt-pp2xdp2": lambda: gpt_job(ranks=4, pp=2, micro_batches=4),
    "gpt-zero1": config(lambda: gpt_job(ranks=4), zero_stage=1),
    "gpt-zero2": config(lambda: gpt_job(ranks=4), zero_stage=2),
    "gpt-zero3": config(lambda: gpt_job(ranks=4), zero_stage=3),
    "gpt-checkpointing": config(lambda: gpt_job(ranks=4), activation_checkpointing=True),
    "gpt-accum4": lambda: gpt_job(ranks=4, grad_accum=4, batch_size=16),
}


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads left running: {left}"


def assert_trains_like_one_device(job: Job, tol: float) -> None:
    want = reference.train(job, steps=STEPS)
    got = sf.run(job, steps=STEPS, return_parameters=True, timeout=60, backend="inprocess")
    assert len(got.losses) == STEPS
    np.testing.assert_allclose(got.losses, want.losses, rtol=tol, atol=0, err_msg="losses per step")
    assert got.parameters is not None and set(got.parameters) == set(want.parameters)
    diff = total = 0.0
    for name, value in want.parameters.items():
        have = got.parameters[name]
        assert have.dtype == value.dtype, name
        if value.dtype == np.float64:
            scale = float(np.max(np.abs(value))) or 1.0
            np.testing.assert_allclose(have, value, rtol=tol, atol=tol * scale, err_msg=name)
        else:
            error = float(np.linalg.norm(have - value) / (np.linalg.norm(value) or 1.0))
            assert error <= 10 * tol, f"{name}: relative error {error:.3g} in norm"
        diff += float(np.sum((have - value).astype(np.float64) ** 2))
        total += float(np.sum(value.astype(np.float64) ** 2))
    assert np.sqrt(diff / total) <= tol, f"all parameters: relative error {np.sqrt(diff / total):.3g} in norm"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_float64_training_equals_one_device(name: str) -> None:
    assert_trains_like_one_device(as_float64(LAYOUTS[name](), batches=STEPS), tol=1e-9)


@pytest.mark.parametrize("name", ["mlp-dp2xtp2", "gpt-dp2xtp2"])
def test_float32_training_equals_one_device(name: str) -> None:
    job = LAYOUTS[name]()
    assert job.graph.tensors[job.loss].meta.dtype is sf.float32
    assert_trains_like_one_device(job, tol=1e-4)
