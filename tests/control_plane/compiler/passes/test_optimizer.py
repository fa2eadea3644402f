"""Optimizer insertion: state variables, the update ops at every step of the schedule, clipping by the
global norm, and ``reference.train`` (SGD, AdamW, gradient accumulation) against hand-written numpy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sbpflow.control_plane.compiler.passes import autodiff, optimizer
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import TensorKind
from sbpflow.job import SGD, AdamW, ConstantLR, Job, WarmupCosine
from sbpflow.ops.eager import EagerBuilder
from sbpflow.oracle import reference
from sbpflow.sbp import Split
from tests.control_plane.compiler.passes.test_autodiff import as_float64, compiled, example
from tests.sbpflow.ops.training.cases_optim import adamw_reference, lr_factor, sgd_reference

Params = dict[str, np.ndarray]
NAMES = ("model.net.0.weight", "model.net.0.bias", "model.net.2.weight", "model.net.2.bias")


def mlp(**optim: object) -> Job:
    """The MLP example in float64 (4 -> 6 -> 2, batch 8), with the optimizer replaced by ``optim``."""
    job = as_float64(example("mlp").make_job(ranks=1, n_in=4, hidden=6, n_out=2, batch_size=8, steps=3))
    assert job.optimizer is not None
    return replace(job, optimizer=replace(job.optimizer, **optim)) if optim else job


def mlp_grads(p: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
    """Loss and gradients of mean((relu(x W0 + b0) W1 + b1 - y)^2), by hand."""
    w0, b0, w1, b1 = (p[n] for n in NAMES)
    h = x @ w0 + b0
    r = np.maximum(h, 0.0)
    diff = r @ w1 + b1 - y
    d_pred = 2.0 * diff / diff.size
    d_h = (d_pred @ w1.T) * (h > 0)
    grads = (x.T @ d_h, d_h.sum(0), r.T @ d_pred, d_pred.sum(0))
    return float(np.mean(diff**2)), dict(zip(NAMES, grads, strict=True))


def hand_train(job: Job, step_fn, steps: int = 3, clip: float = 0.0) -> tuple[list[float], Params]:
    """Train by hand: ``step_fn(step, name, param, grad, state) -> param`` per parameter, per step."""
    params = {n: v.copy() for n, v in reference.init_parameters(job).items()}
    state: dict[str, dict] = {n: {} for n in NAMES}
    losses = []
    for step in range(steps):
        batch = job.data.read(step)  # type: ignore[union-attr]
        loss, grads = mlp_grads(params, batch["x"], batch["y"])
        if clip:
            norm = np.sqrt(sum(np.sum(g**2) for g in grads.values()))
            grads = {n: g * min(1.0, clip / (norm + 1e-6)) for n, g in grads.items()}
        params = {n: step_fn(step, params[n], grads[n], state[n]) for n in NAMES}
        losses.append(loss)
    return losses, params


def torch_sgd(lr: float, momentum: float, weight_decay: float, nesterov: bool):
    def step_fn(step: int, p: np.ndarray, g: np.ndarray, state: dict) -> np.ndarray:
        d = g + weight_decay * p
        if momentum:
            state["buf"] = d.copy() if step == 0 else momentum * state["buf"] + d
            d = d + momentum * state["buf"] if nesterov else state["buf"]
        return p - lr * d

    return step_fn


def torch_adamw(lr: float, b1: float, b2: float, eps: float, wd: float, schedule=lambda step: 1.0):
    def step_fn(step: int, p: np.ndarray, g: np.ndarray, state: dict) -> np.ndarray:
        t, lr_t = step + 1, lr * schedule(step)
        state["m"] = b1 * state.get("m", 0.0) + (1 - b1) * g
        state["v"] = b2 * state.get("v", 0.0) + (1 - b2) * g * g
        m_hat, v_hat = state["m"] / (1 - b1**t), state["v"] / (1 - b2**t)
        return p * (1 - lr_t * wd) - lr_t * m_hat / (np.sqrt(v_hat) + eps)

    return step_fn


def assert_same_training(job: Job, want_losses: list[float], want: Params, rtol: float = 1e-10) -> None:
    got = reference.train(job, steps=len(want_losses))
    np.testing.assert_allclose(got.losses, want_losses, rtol=rtol)
    for n in NAMES:
        np.testing.assert_allclose(got.parameters[n], want[n], rtol=rtol, atol=1e-14, err_msg=n)


# ---- reference.train against hand-written numpy ---------------------------------------------------------


@pytest.mark.parametrize(
    "sgd", [SGD(0.1, 0.9), SGD(0.05, 0.9, weight_decay=0.01, nesterov=True), SGD(0.1)], ids=repr
)
def test_sgd_steps_equal_numpy(sgd: SGD) -> None:
    job = mlp(algorithm=sgd)
    losses, params = hand_train(job, torch_sgd(sgd.lr, sgd.momentum, sgd.weight_decay, sgd.nesterov))
    assert_same_training(job, losses, params)


def test_adamw_steps_equal_numpy() -> None:
    adamw = AdamW(lr=0.01, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
    job = mlp(algorithm=adamw)
    losses, params = hand_train(job, torch_adamw(0.01, 0.8, 0.95, 1e-6, 0.1))
    assert_same_training(job, losses, params)


def test_adamw_with_warmup_cosine_and_clipping_equals_numpy() -> None:
    adamw = AdamW(lr=0.02, weight_decay=0.05)
    job = mlp(algorithm=adamw, schedule=WarmupCosine(2, 4, 0.1), clip_grad_norm=0.05)
    factor = lambda step: lr_factor(step, "warmup_cosine", 2, 4, 0.1)  # noqa: E731
    losses, params = hand_train(job, torch_adamw(0.02, 0.9, 0.999, 1e-8, 0.05, factor), clip=0.05)
    assert_same_training(job, losses, params)


@pytest.mark.parametrize("max_norm", [0.01, 1e6])
def test_clipping_scales_by_the_global_norm(max_norm: float) -> None:
    job = mlp(algorithm=SGD(0.1), clip_grad_norm=max_norm)
    losses, params = hand_train(job, torch_sgd(0.1, 0.0, 0.0, False), steps=2, clip=max_norm)
    assert_same_training(job, losses, params)
    if max_norm < 1:  # the step's length over all parameters together is lr * max_norm
        start = reference.init_parameters(job)
        moved = reference.train(job, steps=1).parameters
        length = np.sqrt(sum(np.sum((moved[n] - start[n]) ** 2) for n in NAMES))
        assert length == pytest.approx(0.1 * max_norm, rel=1e-4)


@pytest.mark.parametrize("algorithm", [SGD(0.1, 0.9), AdamW(0.01)], ids=["sgd", "adamw"])
def test_gradient_accumulation_4_equals_one_full_batch_step(algorithm: SGD | AdamW) -> None:
    one = mlp(algorithm=algorithm, clip_grad_norm=0.5)
    four = replace(one, config=replace(one.config, gradient_accumulation_steps=4))
    big, small = reference.train(one), reference.train(four)
    np.testing.assert_allclose(small.losses, big.losses, rtol=1e-12)
    for n in NAMES:
        np.testing.assert_allclose(small.parameters[n], big.parameters[n], rtol=1e-11, atol=1e-15, err_msg=n)


def test_gradient_accumulation_on_gpt_follows_its_batch_sized_reshapes() -> None:
    job = as_float64(
        example("gpt").make_job(
            ranks=1, layers=1, heads=2, width=8, vocab=11, seq_len=4, batch_size=4, steps=2
        )
    )
    two = replace(job, config=replace(job.config, gradient_accumulation_steps=2))
    big, small = reference.train(job), reference.train(two)
    np.testing.assert_allclose(small.losses, big.losses, rtol=1e-12)
    for n, v in big.parameters.items():
        np.testing.assert_allclose(small.parameters[n], v, rtol=1e-9, atol=1e-13, err_msg=n)


# ---- the update ops at later steps ----------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 2, 3, 5, 9, 12])
def test_warmup_cosine_learning_rate_at_step(step: int) -> None:
    schedule = {"schedule": "warmup_cosine", "warmup_steps": 3, "total_steps": 10, "min_lr_ratio": 0.1}
    p, g, buf = np.zeros(2), np.ones(2), np.zeros(2)
    new_p, _ = EagerBuilder(step=step).call("sgd_update", p, g, buf, lr=0.5, **schedule)
    want = 0.5 * WarmupCosine(3, 10, 0.1).factor(step)
    assert -new_p[0] == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(0.5 * lr_factor(step, **schedule), rel=1e-12)  # an independent formula
    if step >= 10:
        assert want == pytest.approx(0.05)


@pytest.mark.parametrize("step", [0, 4, 50])
def test_update_kernels_at_later_steps_equal_their_formulas(step: int) -> None:
    rng = np.random.default_rng(step)
    p, g, m = (rng.standard_normal((3, 2)) for _ in range(3))
    v = rng.uniform(0.0, 1.0, (3, 2))
    attrs = {
        "lr": 0.1,
        "schedule": "warmup_cosine",
        "warmup_steps": 2,
        "total_steps": 40,
        "min_lr_ratio": 0.0,
    }
    got = EagerBuilder(step=step).call("adamw_update", p, g, m, v, weight_decay=0.1, **attrs)
    for x, w in zip(got, adamw_reference(p, g, m, v, weight_decay=0.1, step=step, **attrs), strict=True):
        np.testing.assert_allclose(x, w, rtol=1e-12)
    got = EagerBuilder(step=step).call("sgd_update", p, g, m, momentum=0.9, nesterov=True, **attrs)
    for x, w in zip(
        got, sgd_reference(p, g, m, momentum=0.9, nesterov=True, step=step, **attrs), strict=True
    ):
        np.testing.assert_allclose(x, w, rtol=1e-12)


# ---- the pass -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm, slots", [(SGD(0.1, 0.9), ("momentum",)), (AdamW(), ("adam_m", "adam_v"))]
)
def test_state_variables_copy_the_parameter_and_every_variable_is_updated(algorithm, slots) -> None:
    job = example("mlp").make_job(ranks=4, tp=True)
    job = replace(job, optimizer=replace(job.optimizer, algorithm=algorithm, clip_grad_norm=1.0))
    state = compiled(job, with_optimizer=True)
    g = state.graph
    params = job.optimizer.parameters
    assert state.state_vars == [f"{p}/{s}" for p in params for s in slots]
    for p in params:
        for s in slots:
            decl, pd = g.tensors[f"{p}/{s}"], g.tensors[p]
            assert decl.kind == TensorKind.optimizer_state
            assert (decl.meta, decl.placement, decl.sbp) == (pd.meta, pd.placement, pd.sbp)
    assert g.tensors["model.net.0.weight/" + slots[0]].sbp == (Split(1),)  # the TP annotation carries over
    assert set(state.updates) == set(params) | set(state.state_vars)
    for var, new in state.updates.items():
        assert g.tensors[new].meta == g.tensors[var].meta
    (norm,) = [o for o in g.ops if o.op_type == "clip_coef"]
    assert norm.name == "optimizer/clip_coef"
    assert sum(o.op_type == algorithm_op(algorithm) for o in g.ops) == len(params)


def algorithm_op(algorithm: SGD | AdamW) -> str:
    return optimizer.RULES[type(algorithm)].op


def test_update_ops_take_the_schedule_and_the_gradient_stage() -> None:
    job = mlp(schedule=WarmupCosine(1, 5, 0.2))
    state = compiled(job, with_optimizer=True)
    (update, *_) = [o for o in state.graph.ops if o.op_type == "sgd_update"]
    assert update.attrs["schedule"] == "warmup_cosine" and update.attrs["total_steps"] == 5
    assert update.attrs["momentum"] == 0.9 and update.inputs[1] == state.grads[update.inputs[0]]
    assert optimizer.schedule_attrs(ConstantLR()) == {"schedule": "constant"}


def test_the_pass_needs_autodiff_first() -> None:
    state = CompileState.start(mlp())
    with pytest.raises(GraphError, match="run autodiff before the optimizer pass"):
        optimizer.run(state)
    autodiff.run(state)
    optimizer.run(state)
    state.graph.verify()


def test_a_job_without_optimizer_gets_no_update() -> None:
    state = CompileState.start(replace(mlp(), optimizer=None))
    optimizer.run(state)
    assert state.updates == {} and state.state_vars == []
