"""Dynamic loss scaling (fp16, loss_scale 0): the compiled plan against the numpy GradScaler of
sbpflow/oracle/scaling.py, step by step; skipped steps on every rank under DP and TP; resume."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.actor_workers.execution import executor_analysis
from sbpflow.checkpoint.format import step_dir
from sbpflow.checkpoint.read import read_logical
from sbpflow.codec import wire
from sbpflow.control_plane.compiler import pipeline
from sbpflow.data.sources import ArraySource, SyntheticSource
from sbpflow.errors import SbpflowError
from sbpflow.job import Job, JobConfig, LossScaling
from sbpflow.ops.training.loss_scaling import SCALE, SKIPPED
from sbpflow.oracle import reference
from sbpflow.oracle.scaling import Scaler
from sbpflow.runs.numerics import NonFiniteLoss
from sbpflow.v1 import plan_pb2 as pp
from tests.control_plane.compiler.passes.test_recompute import with_config
from tests.examples.test_examples import load

# 2**20 overflows the MLP's fp16 backward for its first steps, then the scale backs off until it fits,
# and grows every 3 clean steps until it overflows again: skips, backoffs and growths within 12 steps
SCALING = LossScaling(init=2.0**20, growth_interval=3)


def fp16(job: Job, scaling: LossScaling = SCALING, **config: object) -> Job:
    return with_config(job, precision="fp16", loss_scaling=scaling, **config)


def test_scale_sequence_skips_and_parameters_match_the_numpy_scaler() -> None:
    job = fp16(load("mlp").make_job(ranks=1, steps=12))
    got = sf.run(job, backend="inprocess", return_parameters=True)
    want = reference.train(job)
    assert want.scaler is not None
    skipped = want.scaler.skipped
    assert any(skipped) and not all(skipped), skipped  # the case covers both
    assert max(want.scaler.history) > min(want.scaler.history[3:])  # it grew after backing off
    assert got.losses == want.losses  # to the bit: same seeds, same skips
    assert got.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_array_equal(got.parameters[name], value, err_msg=name)
    assert got.loss_scale == float(want.scaler.scale)
    assert got.skipped_steps == want.scaler.skipped_steps == sum(skipped)


def test_the_gated_updates_recycle_their_parameters() -> None:
    """Gated updates are OPTIMIZER tasks, as the plain ones: each writes a parameter's new value, or on a
    skipped step its copy, into the value two steps back (the test above checks the bits with it on)."""
    job = fp16(load("mlp").make_job(ranks=1, steps=12))
    compiled = pipeline.compile(job)
    assert compiled.plan is not None
    device = compiled.plan.devices[0]
    recyclers, _ = executor_analysis.recyclers(device)
    updates = [t for t in device.tasks if t.id in recyclers]
    assert {t.op_type for t in updates} == {"gated_sgd_update"}
    assert all(t.kind == pp.TASK_KIND_OPTIMIZER for t in updates) and len(updates) == len(job.parameters)


def test_adamw_counts_only_the_steps_taken() -> None:
    """GPT with AdamW and a warm-up schedule: bias correction over the steps taken, the schedule over
    the iterations, as torch's AdamW under GradScaler; the compiled plan gives the oracle's bits."""
    job = fp16(load("gpt").make_job(ranks=1, steps=8), LossScaling(init=2.0**20, growth_interval=2))
    got = sf.run(job, backend="inprocess", return_parameters=True)
    want = reference.train(job)
    assert want.scaler is not None and 0 < want.scaler.skipped_steps < 8, want.scaler.skipped
    assert got.losses == want.losses
    assert got.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_array_equal(got.parameters[name], value, err_msg=name)


@pytest.mark.parametrize(
    ("layout", "zero_stage"),
    [
        ({"ranks": 2}, 0),
        ({"ranks": 2, "tp": True}, 0),
        ({"ranks": 4, "tp": True, "layers": 2}, 0),
        ({"ranks": 2}, 3),
    ],
)
def test_an_overflowing_step_is_skipped_on_every_rank(
    layout: dict[str, object], zero_stage: int, tmp_path: Path
) -> None:
    """A scale of 2**100 overflows fp16 on every rank's part: every parameter stays bit-identical to its
    start and the momentum at zero (read back from the checkpoint), under DP, TP and ZeRO-3 alike."""
    job = fp16(load("mlp").make_job(steps=2, **layout), LossScaling(init=2.0**100), zero_stage=zero_stage)
    job = with_config(job, checkpoint_every=2)
    got = sf.run(job, backend="inprocess", return_parameters=True, checkpoint_dir=str(tmp_path))
    assert got.parameters is not None and got.skipped_steps == 2
    start = reference.init_parameters(job)
    for name, value in start.items():
        np.testing.assert_array_equal(got.parameters[name], value, err_msg=name)
    assert got.loss_scale == np.float32(2.0**98)
    state = read_logical(step_dir(tmp_path, 2), kinds=("optimizer_state",))
    momenta = [n for n in state if n.endswith("/momentum")]
    assert len(momenta) == len(start) and not any(state[n].any() for n in momenta)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stages_follow_the_oracle(zero_stage: int) -> None:
    """GPT with AdamW on DP 2 under ZeRO: sharded state and gradients, the same skips and scale as one
    device, parameters within AdamW's step of fp16 rounding (each update moves a weight by up to lr)."""
    job = fp16(
        load("gpt").make_job(ranks=2, steps=6), LossScaling(2.0**20, growth_interval=2), zero_stage=zero_stage
    )
    got = sf.run(job, backend="inprocess", return_parameters=True)
    want = reference.train(job)
    assert want.scaler is not None and 0 < want.scaler.skipped_steps < 6
    assert got.skipped_steps == want.scaler.skipped_steps and got.loss_scale == float(want.scaler.scale)
    assert got.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got.parameters[name], value, rtol=1e-3, atol=1e-3, err_msg=name)


@pytest.mark.parametrize(
    "layout",
    [{"ranks": 2}, {"ranks": 2, "tp": True}, {"ranks": 2, "pp": 2, "layers": 2, "micro_batches": 2}],
)
def test_parallel_layouts_follow_the_oracle(layout: dict[str, object]) -> None:
    """The same skips and scales as one device, and the same parameters to fp16's rounding (each rank's
    part of a gradient is computed and summed in another order)."""
    job = fp16(load("mlp").make_job(steps=8, **layout))
    got = sf.run(job, backend="inprocess", return_parameters=True)
    want = reference.train(job)
    assert want.scaler is not None and any(want.scaler.skipped)
    assert got.skipped_steps == want.scaler.skipped_steps
    assert got.loss_scale == float(want.scaler.scale)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-3)
    assert got.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got.parameters[name], value, rtol=1e-3, atol=2e-4, err_msg=name)


def test_growth_after_growth_interval_clean_steps() -> None:
    job = fp16(load("mlp").make_job(ranks=1, steps=7), LossScaling(init=1.0, growth_interval=3))
    got = sf.run(job, backend="inprocess")
    want = reference.train(job)
    assert want.scaler is not None and not any(want.scaler.skipped)
    assert want.scaler.history == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 4.0]
    assert got.loss_scale == 4.0 and got.skipped_steps == 0
    assert got.losses == want.losses


def test_a_resume_goes_on_with_the_checkpointed_scale(tmp_path: Path) -> None:
    job = fp16(load("mlp").make_job(ranks=2, steps=10), checkpoint_every=5)
    whole = sf.run(job, backend="inprocess", return_parameters=True)
    first = sf.run(with_config(job, steps=5), backend="inprocess", checkpoint_dir=str(tmp_path))
    at = step_dir(tmp_path, 5)
    saved = read_logical(at, kinds=("optimizer_state",))  # what the optimizer state keeps of the scaler
    assert float(saved[SCALE][0]) == first.loss_scale
    assert float(saved[SKIPPED][0]) == first.skipped_steps > 0
    rest = sf.run(job, backend="inprocess", return_parameters=True, resume_from=str(at))
    assert rest.loss_scale == whole.loss_scale and rest.skipped_steps == whole.skipped_steps
    np.testing.assert_array_equal(first.losses + rest.losses, whole.losses)
    assert rest.parameters is not None and whole.parameters is not None
    for name, value in whole.parameters.items():
        np.testing.assert_array_equal(rest.parameters[name], value, err_msg=name)


def test_fp32_bf16_and_static_plans_have_no_scaler() -> None:
    base = load("mlp").make_job(ranks=2)
    for job in (
        base,
        with_config(base, precision="bf16"),
        with_config(base, precision="fp16", loss_scale=8.0),
    ):
        ops = {o.op_type for o in pipeline.compile(job).state.graph.ops}
        assert not {"loss_scale_update", "nonfinite_count", "gated_sgd_update"} & ops
    ops = {o.op_type for o in pipeline.compile(fp16(base)).state.graph.ops}
    assert {"loss_scale_update", "nonfinite_count", "gated_sgd_update", "loss_scale_read"} <= ops


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init": 0.0}, "init=0.0: give a positive"),
        ({"growth_factor": 1.0}, "growth_factor=1.0: give a factor > 1"),
        ({"backoff_factor": 1.5}, r"backoff_factor=1.5: give a factor in \(0, 1\)"),
        ({"growth_interval": 0}, "growth_interval=0: give the good steps"),
    ],
)
def test_bad_loss_scaling_is_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(SbpflowError, match=match):
        LossScaling(**kwargs)  # type: ignore[arg-type]


def test_the_scaler_matches_torch_update_scale() -> None:
    """torch's own CPU update rule (``torch._amp_update_scale_``) against the numpy scaler's, step by step."""
    torch = pytest.importorskip("torch")
    config = LossScaling(init=2.0**10, growth_factor=2.0, backoff_factor=0.25, growth_interval=3)
    ours = Scaler(config)
    scale = torch.full((), config.init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    bad = {"g": np.array([np.inf], dtype=np.float32)}
    fine = {"g": np.array([1.0], dtype=np.float32)}
    pattern = [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    for found in pattern:
        ours.step(bad if found else fine)
        torch._amp_update_scale_(
            scale, tracker, torch.full((), float(found)), config.growth_factor, config.backoff_factor,
            config.growth_interval,
        )  # fmt: skip
        assert np.float32(scale.item()) == ours.scale and int(tracker.item()) == ours.good_steps


def test_loss_scaling_survives_the_wire() -> None:
    job = fp16(load("mlp").make_job(ranks=1))
    assert wire.job_from_proto(wire.job_to_proto(job)).config.loss_scaling == SCALING
    assert not wire.config_to_proto(JobConfig()).HasField("loss_scaling")  # the default: as before
    m = wire.job_to_proto(job)
    m.config.loss_scaling.backoff_factor = 2.0  # a client's bad value is refused, naming it
    with pytest.raises(SbpflowError, match=r"backoff_factor=2.0: give a factor in \(0, 1\)"):
        wire.job_from_proto(m)


def test_an_overflowing_forward_is_a_skipped_step_not_a_failure() -> None:
    """Batch 2 holds an input of 1e6, whose fp16 matmul overflows: its loss is not finite, which without
    loss scaling fails the job (NON_FINITE_LOSS); under dynamic scaling the step is skipped like any
    other overflow, and the run goes on to the oracle's parameters."""
    base = load("mlp").make_job(ranks=2, steps=4)
    assert base.data is not None
    batches = [base.data.read(k) for k in range(4)]
    arrays = {f: np.concatenate([b[f] for b in batches]) for f in batches[0]}
    arrays["x"][2 * base.data.batch_size] = 1e6  # the first sample of batch 2
    data = ArraySource(batch_size=base.data.batch_size, arrays=arrays)
    job = fp16(replace(base, data=data), LossScaling(init=1.0))
    with pytest.raises(NonFiniteLoss):
        sf.run(with_config(job, loss_scale=1.0), backend="inprocess")  # static scaling: no skipping
    got = sf.run(job, backend="inprocess", return_parameters=True)
    want = reference.train(job)
    assert want.scaler is not None and want.scaler.skipped == [False, False, True, False]
    assert not np.isfinite(got.losses[2]) and got.skipped_steps == 1
    assert got.parameters is not None
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got.parameters[name], value, rtol=1e-3, atol=2e-4, err_msg=name)


def test_a_graph_sets_loss_scaling_in_its_config() -> None:
    mlp = load("mlp")
    graph = mlp.TrainMLP(mlp.MLPRegression(4, 8, 2, 1), 0.05, 2)
    graph.config.precision = "fp16"
    graph.config.loss_scaling = LossScaling(init=8.0, growth_interval=5)
    data = SyntheticSource(batch_size=4, kind="regression", params={"in": 4, "out": 2})
    job = graph.trace(data)
    assert job.config.loss_scaling == LossScaling(init=8.0, growth_interval=5)
    assert job.config.dynamic_loss_scaling
