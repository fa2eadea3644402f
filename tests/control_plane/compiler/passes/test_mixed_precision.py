"""Mixed precision: fp16 compute, fp32 master weights and updates, static loss scaling; bf16 on numpy."""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.passes import autodiff, mixed_precision, optimizer
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.dtype import DType
from sbpflow.graph import TensorKind
from sbpflow.job import Job, LossScaling
from sbpflow.oracle import reference
from tests.control_plane.compiler.passes.test_recompute import with_config
from tests.examples.test_examples import load

f16, f32 = DType.float16, DType.float32


def through_mixed_precision(job: Job) -> CompileState:
    state = CompileState.start(job)
    for p in (autodiff, optimizer, mixed_precision):
        p.run(state)
        state.graph.verify()
    return state


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_fp16_compute_with_fp32_master_weights_and_updates(name: str) -> None:
    state = through_mixed_precision(with_config(load(name).make_job(), precision="fp16", loss_scale=128.0))
    g = state.graph
    dtype = {n: t.meta.dtype for n, t in g.tensors.items()}
    matmuls = [o for o in g.ops if o.op_type in ("matmul", "batch_matmul")]
    assert matmuls and all(dtype[t] == f16 for o in matmuls for t in (*o.inputs, *o.outputs))
    for kind in (TensorKind.parameter, TensorKind.optimizer_state, TensorKind.gradient):
        assert all(t.meta.dtype == f32 for t in g.of_kind(kind)), kind
    for var, new in state.updates.items():  # the optimizer reads and writes fp32
        assert dtype[var] == dtype[new] == f32
    updates = [o for o in g.ops if o.op_type in ("sgd_update", "adamw_update")]
    assert len(updates) == len(state.grads) and all(dtype[t] == f32 for o in updates for t in o.inputs)
    assert dtype[state.job.loss] == f32  # the loss reduction runs in fp32
    # every parameter fed to a low-precision op is cast once and its gradient cast back
    casts = {o.inputs[0] for o in g.ops if o.op_type == "cast" and dict(o.attrs)["dtype"] == f16}
    weights = {
        p.tensor for p in state.job.parameters if p.tensor.endswith("weight") and ".ln" not in p.tensor
    }
    assert weights and weights <= casts  # every matmul / embedding weight; layer norms stay fp32
    assert not {p.tensor for p in state.job.parameters if ".ln" in p.tensor} & casts
    seed = next(o for o in g.ops if o.op_type == "full" and o.name.startswith(autodiff.GRAD))
    assert dict(seed.attrs)["value"] == 128.0  # static loss scaling


def test_fp16_mlp_trains_close_to_fp32() -> None:
    job = load("mlp").make_job(ranks=1, steps=5)
    want = reference.train(job)
    for scale in (0.0, 1024.0):  # 0: dynamic, from 1024 (GradScaler's 2**16 skips this job's first steps)
        fp16 = with_config(job, precision="fp16", loss_scale=scale, loss_scaling=LossScaling(init=1024.0))
        got = sf.run(fp16, backend="inprocess", return_parameters=True)  # the pass's graph, run
        assert got.parameters is not None
        assert got.losses == reference.train(fp16).losses  # the independent oracle's fp16, to the bit
        np.testing.assert_allclose(got.losses, want.losses, rtol=2e-2)
        assert got.losses != want.losses  # it did compute in fp16
        for name, value in want.parameters.items():
            assert got.parameters[name].dtype == np.float32
            np.testing.assert_allclose(got.parameters[name], value, rtol=5e-2, atol=5e-3, err_msg=name)


@pytest.mark.parametrize(("name", "ranks"), [("mlp", 1), ("mlp", 2), ("gpt", 1)])
def test_bf16_trains_on_numpy_close_to_fp32(name: str, ranks: int) -> None:
    """bf16 end to end on numpy (ml_dtypes' bfloat16): the compiled plan, data-parallel over the in-process
    transport too, gives the oracle's bf16 losses (to the bit on one rank), within 1 % of fp32's (bf16 keeps 8 bits of
    mantissa; the master weights and the update stay fp32)."""
    job = load(name).make_job(ranks=ranks, steps=5)
    want = reference.train(job)
    bf16 = with_config(job, precision="bf16")
    c = pipeline.compile(bf16)
    assert any(t.meta.dtype == DType.bfloat16 for t in c.state.graph.tensors.values())
    got = sf.run(bf16, backend="inprocess", return_parameters=True)
    assert got.parameters is not None
    oracle = reference.train(bf16).losses
    if ranks == 1:
        assert got.losses == oracle
    else:  # each rank's partial gradient is summed in bf16 (the oracle sums the whole batch at once)
        np.testing.assert_allclose(got.losses, oracle, rtol=1e-2)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-2)
    assert got.losses != want.losses  # it did compute in bf16
    for n, value in want.parameters.items():
        assert got.parameters[n].dtype == np.float32
        np.testing.assert_allclose(got.parameters[n], value, rtol=5e-2, atol=5e-3, err_msg=n)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_fp16_gpt_compiles_on_dp_4_with_checkpointing(zero_stage: int) -> None:
    job = with_config(
        load("gpt").make_job(ranks=4, batch_size=8),
        precision="fp16",
        loss_scale=1024.0,
        activation_checkpointing=True,
        zero_stage=zero_stage,
    )
    c = pipeline.compile(job)  # verify_compiled runs inside
    assert c.plan is not None and not [n for n in c.notes if "mixed_precision" in n]
