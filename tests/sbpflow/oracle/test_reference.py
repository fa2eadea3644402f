"""The one-device reference executor: its forward against hand-written numpy; its training (autodiff,
SGD and AdamW, clipping, schedules, gradient accumulation, mixed precision) against hand-written numpy and
finite differences of its own forward; and its independence: it imports nothing of the compiler, the
runtime or the client."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.data.sources import ArraySource, SyntheticSource
from sbpflow.dtype import DType
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import SGD, AdamW, Job, JobConfig, LossScaling, OptimizerSpec, ParameterSpec, WarmupCosine
from sbpflow.ops.base import OPS, get_op
from sbpflow.oracle import reference
from sbpflow.precision import FP32_OPS, compute_dtype
from sbpflow.random import Normal, RandomKey, kaiming_uniform, tensor_rng_id
from sbpflow.tensor_meta import TensorMeta
from tests.sbpflow.ops.training.cases_optim import lr_factor


class Regression(sf.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.SGD(model.parameters(), lr=0.1))
        self.config.seed = 7

    def build(self, x, y):
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss


def mlp_job():
    mlp = sf.nn.MLP([5, 8, 3], activation="tanh")
    mlp[0].weight.init = kaiming_uniform(5)
    data = SyntheticSource(batch_size=6, kind="regression", params={"in": 5, "out": 3}, seed=3)
    return Regression(mlp).trace(data)


def draw(job, name):
    """A parameter drawn by hand from its initializer, keyed as the runtime keys it."""
    spec = next(p for p in job.parameters if p.tensor == name)
    shape = job.graph.tensors[name].meta.shape
    return spec.init.sample(np, RandomKey(7, tensor_rng_id(name)), shape, None, np.float32)


@pytest.mark.parametrize("step", [0, 3])
def test_mlp_forward_equals_numpy(step: int) -> None:
    job = mlp_job()
    w0, b0, w1, b1 = (draw(job, f"model.{i}.{k}") for i in (0, 2) for k in ("weight", "bias"))
    batch = job.data.read(step)
    pred = np.tanh(batch["x"] @ w0 + b0) @ w1 + b1
    want = ((pred - batch["y"]) ** 2).mean()
    got = reference.forward(job, step=step)
    assert list(got) == [job.loss]
    np.testing.assert_allclose(got[job.loss], want, rtol=1e-5)
    np.testing.assert_array_equal(reference.init_parameters(job)["model.0.weight"], w0)
    assert np.abs(w0).max() <= math.sqrt(6 / 5) and not b0.any()


def test_fetch_override_and_errors() -> None:
    job = mlp_job()
    params = {k: np.zeros_like(v) for k, v in reference.init_parameters(job).items()}
    got = reference.forward(job, parameters=params, fetches=["model.0.add_0"])
    assert not got["model.0.add_0"].any()
    with pytest.raises(sf.SbpflowError, match="names no tensor"):
        reference.forward(job, fetches=["nope"])
    with pytest.raises(sf.ShapeError, match="declared"):
        reference.forward(job, parameters={"model.0.bias": np.zeros(3, np.float32)})


def test_gpt_loss_at_init_is_near_log_vocab() -> None:
    vocab = 128
    cfg = sf.nn.GPTConfig(vocab_size=vocab, seq_len=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)

    class Train(sf.Graph):
        def __init__(self):
            super().__init__()
            self.gpt = sf.nn.GPT(cfg)

        def build(self, tokens, targets):
            loss = self.gpt(tokens, targets)
            loss.backward()
            return loss

    data = SyntheticSource(batch_size=4, kind="tokens", params={"seq_len": 16, "vocab": vocab})
    job = Train().trace(data)
    losses = [float(reference.forward(job, step=s)[job.loss]) for s in (0, 1)]
    assert all(np.isfinite(losses)) and all(abs(loss - math.log(vocab)) < 0.3 for loss in losses)
    assert losses[0] != losses[1]  # a new batch (and new dropout masks) per step
    again = float(reference.forward(job, step=0)[job.loss])
    assert again == losses[0]  # deterministic in (seed, step)


# ---- training -------------------------------------------------------------------------------------------


def one_batch_job(**config) -> sf.Job:
    """The regression MLP fed the same batch every step (one batch of data, repeated per epoch)."""
    job = mlp_job()
    batch = job.data.read(0)
    data = ArraySource(batch_size=6, arrays=batch)
    return replace(job, data=data, config=replace(job.config, steps=5, **config))


def test_train_lowers_the_loss_on_a_repeated_batch_and_is_deterministic() -> None:
    job = one_batch_job()
    result = reference.train(job)
    assert len(result.losses) == 5 and all(np.diff(result.losses) < 0)
    assert result.losses[0] == pytest.approx(float(reference.forward(job)[job.loss]), rel=1e-6)
    assert set(result.parameters) == {p.tensor for p in job.parameters}
    # SGD keeps its buffer even at momentum 0 (it then holds the last step's gradient)
    assert set(result.optimizer_state) == {f"{p.tensor}/momentum" for p in job.parameters}
    again = reference.train(job, steps=2)
    assert again.losses == result.losses[:2]


def test_gradients_are_those_of_the_forward_loss() -> None:
    job = one_batch_job()
    loss, grads = reference.gradients(job)
    assert loss == pytest.approx(float(reference.forward(job)[job.loss]))
    assert {k: v.shape for k, v in grads.items()} == {
        k: v.shape for k, v in reference.init_parameters(job).items()
    }


def test_micro_batch_job_cuts_inputs_and_follows_reshapes() -> None:
    cfg = sf.nn.GPTConfig(vocab_size=16, seq_len=4, n_layer=1, n_head=2, n_embd=8)

    class Train(sf.Graph):
        def __init__(self):
            super().__init__()
            self.gpt = sf.nn.GPT(cfg)

        def build(self, tokens, targets):
            loss = self.gpt(tokens, targets)
            loss.backward()
            return loss

    job = Train().trace(SyntheticSource(batch_size=6, kind="tokens", params={"seq_len": 4, "vocab": 16}))
    micro = reference.micro_batch_job(job, 3)
    assert micro.graph.tensors["tokens"].meta.shape == (2, 4)
    shapes = [o.attrs["shape"] for o in micro.graph.ops if o.op_type == "reshape"]
    assert shapes and all(s[0] == 2 for s in shapes if len(s) > 2)  # [B, T, ...] reshapes follow the cut
    micro.verify()
    assert reference.micro_batch_job(job, 1) is job
    with pytest.raises(sf.SbpflowError, match=r"divisible by 4; the inputs have batch sizes \[6\]"):
        reference.micro_batch_job(job, 4)
    assert [reference.micro_batch_step(5, k, 3) for k in range(3)] == [15, 16, 17]


def test_train_needs_a_loss() -> None:
    job = replace(one_batch_job(), loss="", optimizer=None)
    with pytest.raises(sf.SbpflowError, match="has no loss"):
        reference.train(job)


# ---- training against hand-written numpy ----------------------------------------------------------------

F64 = DType.float64
NAMES = ("model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias")
Params = dict[str, np.ndarray]


def widened(job: Job, batches: int = 3) -> Job:
    """``job`` in float64 (tensors and dtype attrs), fed ``batches`` batches of its data from memory."""

    def widen(value: Any) -> Any:
        return F64 if value is DType.float32 else value

    g = job.graph
    tensors = {
        n: replace(t, meta=TensorMeta(t.meta.shape, widen(t.meta.dtype))) for n, t in g.tensors.items()
    }
    ops = [replace(o, attrs={k: widen(v) for k, v in o.attrs.items()}) for o in g.ops]
    assert job.data is not None
    reads = [job.data.read(b) for b in range(batches)]
    arrays = {k: np.concatenate([r[k] for r in reads]) for k in reads[0]}
    arrays = {k: v.astype(F64.value) if v.dtype == np.float32 else v for k, v in arrays.items()}
    data = ArraySource(batch_size=job.data.batch_size, arrays=arrays)
    return replace(job, graph=Graph(tensors, ops), data=data)


def mlp64(steps: int = 3, **optimizer: Any) -> Job:
    """The tanh MLP (5 -> 8 -> 3, batch 6) in float64, its optimizer fields replaced by ``optimizer``."""
    job = widened(mlp_job())
    assert job.optimizer is not None
    return replace(
        job, optimizer=replace(job.optimizer, **optimizer), config=replace(job.config, steps=steps)
    )


def hand_gradients(p: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
    """Loss and gradients of mean((tanh(x W0 + b0) W1 + b1 - y)^2), by the chain rule."""
    w0, b0, w1, b1 = (p[n] for n in NAMES)
    a = np.tanh(x @ w0 + b0)
    diff = a @ w1 + b1 - y
    d_pred = 2.0 * diff / diff.size
    d_h = (d_pred @ w1.T) * (1.0 - a**2)
    return float(np.mean(diff**2)), dict(
        zip(NAMES, (x.T @ d_h, d_h.sum(0), a.T @ d_pred, d_pred.sum(0)), strict=True)
    )


def torch_sgd(sgd: SGD) -> Callable[..., np.ndarray]:
    def step_fn(step: int, lr: float, p: np.ndarray, g: np.ndarray, state: dict) -> np.ndarray:
        d = g + sgd.weight_decay * p
        state["momentum"] = d if step == 0 else sgd.momentum * state["momentum"] + d
        if sgd.momentum:
            d = d + sgd.momentum * state["momentum"] if sgd.nesterov else state["momentum"]
        return p - lr * d

    return step_fn


def torch_adamw(adamw: AdamW) -> Callable[..., np.ndarray]:
    def step_fn(step: int, lr: float, p: np.ndarray, g: np.ndarray, state: dict) -> np.ndarray:
        b1, b2, t = adamw.beta1, adamw.beta2, step + 1
        state["adam_m"] = b1 * state.get("adam_m", 0.0) + (1 - b1) * g
        state["adam_v"] = b2 * state.get("adam_v", 0.0) + (1 - b2) * g * g
        m_hat, v_hat = state["adam_m"] / (1 - b1**t), state["adam_v"] / (1 - b2**t)
        return p * (1 - lr * adamw.weight_decay) - lr * m_hat / (np.sqrt(v_hat) + adamw.eps)

    return step_fn


def hand_train(job: Job, accumulate: int = 1) -> tuple[list[float], Params, dict[str, dict]]:
    """Train ``job`` by hand: each step's batch in ``accumulate`` equal parts, gradients averaged, clipped
    by the global norm, the learning rate scheduled, one torch-formula update per parameter."""
    spec = job.optimizer
    assert spec is not None and job.data is not None
    update = torch_sgd(spec.algorithm) if isinstance(spec.algorithm, SGD) else torch_adamw(spec.algorithm)
    schedule = spec.schedule
    params = {n: v.copy() for n, v in reference.init_parameters(job).items()}
    state: dict[str, dict] = {n: {} for n in NAMES}
    losses = []
    for step in range(job.config.steps):
        batch = job.data.read(step)
        xs, ys = np.split(batch["x"], accumulate), np.split(batch["y"], accumulate)
        parts = [hand_gradients(params, x, y) for x, y in zip(xs, ys, strict=True)]
        loss = sum(part[0] for part in parts) / accumulate
        grads = {n: sum(part[1][n] for part in parts) / accumulate for n in NAMES}
        if spec.clip_grad_norm:
            norm = np.sqrt(sum(np.sum(g**2) for g in grads.values()))
            grads = {n: g * min(1.0, spec.clip_grad_norm / (norm + 1e-6)) for n, g in grads.items()}
        factor = 1.0
        if isinstance(schedule, WarmupCosine):
            factor = lr_factor(
                step, "warmup_cosine", schedule.warmup_steps, schedule.total_steps, schedule.min_lr_ratio
            )
        lr = spec.algorithm.lr * factor
        params = {n: update(step, lr, params[n], grads[n], state[n]) for n in NAMES}
        losses.append(loss)
    return losses, params, state


TRAININGS: dict[str, dict[str, Any]] = {
    "sgd": {"algorithm": SGD(0.1)},
    "sgd-momentum": {"algorithm": SGD(0.1, momentum=0.9)},
    "sgd-nesterov-decay": {"algorithm": SGD(0.05, momentum=0.9, weight_decay=0.01, nesterov=True)},
    "sgd-clipped": {"algorithm": SGD(0.1, momentum=0.9), "clip_grad_norm": 0.05},
    "adamw": {"algorithm": AdamW(0.01, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)},
    "adamw-cosine-clipped": {
        "algorithm": AdamW(0.02, weight_decay=0.05),
        "schedule": WarmupCosine(2, 4, 0.1),
        "clip_grad_norm": 0.5,
    },
}


@pytest.mark.parametrize("accumulate", [1, 2, 3])
@pytest.mark.parametrize("name", list(TRAININGS))
def test_training_equals_numpy(name: str, accumulate: int) -> None:
    job = mlp64(steps=5, **TRAININGS[name])
    job = replace(job, config=replace(job.config, gradient_accumulation_steps=accumulate))
    want_losses, want, want_state = hand_train(job, accumulate)
    got = reference.train(job)
    np.testing.assert_allclose(got.losses, want_losses, rtol=1e-10)
    assert all(got.losses[i] != got.losses[i + 1] for i in range(4))  # it did move
    for n in NAMES:
        np.testing.assert_allclose(got.parameters[n], want[n], rtol=1e-10, atol=1e-14, err_msg=n)
        for slot, value in want_state[n].items():
            np.testing.assert_allclose(got.optimizer_state[f"{n}/{slot}"], value, rtol=1e-10, atol=1e-14)
    assert len(got.optimizer_state) == sum(len(s) for s in want_state.values())


def test_clipping_bounds_the_first_step_to_lr_times_max_norm() -> None:
    job = mlp64(steps=1, algorithm=SGD(0.1), clip_grad_norm=0.01)
    start, moved = reference.init_parameters(job), reference.train(job).parameters
    length = np.sqrt(sum(np.sum((moved[n] - start[n]) ** 2) for n in NAMES))
    assert length == pytest.approx(0.1 * 0.01, rel=1e-4)  # 1e-6 in the clip factor's denominator


def test_loss_scaling_by_a_power_of_two_changes_no_gradient_bit() -> None:
    job = mlp64()
    scaled = replace(job, config=replace(job.config, loss_scale=1024.0))
    loss, grads = reference.gradients(job)
    loss_s, grads_s = reference.gradients(scaled)
    assert loss == loss_s
    for n in NAMES:
        np.testing.assert_array_equal(grads_s[n], grads[n], err_msg=n)


def test_recompute_and_pipeline_micro_batches_change_no_math() -> None:
    job = mlp64()
    want = reference.train(job)
    for config in (
        {"activation_checkpointing": True},
        {"micro_batches": 2, "gradient_accumulation_steps": 1},
    ):
        other = reference.train(replace(job, config=replace(job.config, **config)))
        accumulated = reference.train(replace(job, config=replace(job.config, gradient_accumulation_steps=2)))
        want_here = accumulated if "micro_batches" in config else want
        assert other.losses == want_here.losses, config
        for n in NAMES:
            np.testing.assert_array_equal(other.parameters[n], want_here.parameters[n], err_msg=n)


# ---- gradients against finite differences of the forward -----------------------------------------------


def gpt64(dropout: float) -> Job:
    """A 2-layer GPT with tied embeddings (``wte`` read twice) in float64, dropout on."""
    cfg = sf.nn.GPTConfig(
        vocab_size=11, seq_len=4, n_layer=2, n_head=2, n_embd=8, dropout=dropout, tie_embeddings=True
    )

    class Train(sf.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = sf.nn.GPT(cfg)
            self.add_optimizer(sf.optim.AdamW(self.gpt.parameters()))

        def build(self, tokens: Any, targets: Any) -> Any:
            loss = self.gpt(tokens, targets)
            loss.backward()
            return loss

    data = SyntheticSource(batch_size=3, kind="tokens", params={"seq_len": 4, "vocab": 11})
    return widened(Train().trace(data), batches=2)


def sampled_entries(params: Params, per_tensor: int, seed: int = 0) -> Iterator[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    for name, value in params.items():
        for i in rng.choice(value.size, size=min(per_tensor, value.size), replace=False):
            yield name, int(i)


@pytest.mark.parametrize("make", [mlp64, lambda: gpt64(dropout=0.2)], ids=["mlp", "gpt-tied-dropout"])
def test_gradients_equal_finite_differences_of_the_forward(make: Callable[[], Job]) -> None:
    # the dropout masks are keyed by (seed, rng_id, step): the forward at step 0 draws the gradient's masks
    job, eps = make(), 1e-6
    params = reference.init_parameters(job)
    _, grads = reference.gradients(job, parameters=params)
    assert set(grads) == {p.tensor for p in job.parameters}

    def loss_at(name: str, i: int, delta: float) -> float:
        moved = params[name].copy()
        moved.flat[i] += delta
        return float(reference.forward(job, parameters={**params, name: moved})[job.loss])

    for name, i in sampled_entries(params, per_tensor=3):
        fd = (loss_at(name, i, eps) - loss_at(name, i, -eps)) / (2 * eps)
        assert grads[name].flat[i] == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, i)


Rows = list[tuple[str, str, tuple[str, ...], dict[str, Any]]]


def hand_job(rows: Rows, params: dict[str, tuple[int, ...]]) -> Job:
    """A float64 job from ``(op_type, output, inputs, attrs)`` rows; input ``x`` [1, 3], the last row's
    output its loss, SGD over ``params``."""
    g = Graph()
    for name, shape in params.items():
        g.add_tensor(TensorDecl(name, TensorMeta(shape, F64), TensorKind.parameter, requires_grad=True))
    g.add_tensor(TensorDecl("x", TensorMeta((1, 3), F64), TensorKind.input))
    for op_type, out, ins, attrs in rows:
        op = get_op(op_type)
        (meta,) = op.run_infer(tuple(g.tensors[i].meta for i in ins), op.normalize_attrs(attrs))
        g.add_tensor(TensorDecl(out, meta))
        g.add_op(OpNode(out, op_type, ins, (out,), attrs))
    data = ArraySource(batch_size=1, arrays={"x": np.array([[0.5, -1.0, 2.0]])})
    specs = [ParameterSpec(p, Normal(0.0, 1.0)) for p in params]
    return Job("hand", g, specs, data, OptimizerSpec(SGD(0.1), tuple(params)), JobConfig(), rows[-1][1])


def test_a_tensor_read_three_times_gets_the_sum_of_its_gradients() -> None:
    # a = x * w;  loss = sum(a * tanh(a)) + sum(w * w): a is read twice, w three times
    rows: Rows = [
        ("mul", "a", ("x", "w"), {}),
        ("tanh", "t", ("a",), {}),
        ("mul", "c", ("a", "t"), {}),
        ("sum", "s", ("c",), {}),
        ("mul", "ww", ("w", "w"), {}),
        ("sum", "sw", ("ww",), {}),
        ("add", "loss", ("s", "sw"), {}),
    ]
    x, w = np.array([0.5, -1.0, 2.0]), np.array([0.3, 0.7, -0.2])
    _, grads = reference.gradients(hand_job(rows, {"w": (3,)}), parameters={"w": w})
    a = x * w
    np.testing.assert_allclose(grads["w"], x * (np.tanh(a) + a * (1 - np.tanh(a) ** 2)) + 2 * w, rtol=1e-12)


def test_what_cannot_be_differentiated_is_an_error_naming_it() -> None:
    unused = hand_job(
        [("mul", "a", ("x", "w"), {}), ("sum", "loss", ("a",), {})], {"w": (3,), "unused": (2,)}
    )
    with pytest.raises(sf.GraphError, match=r"\['unused'\].*requires_grad=False"):
        reference.train(unused)
    no_grad = hand_job(
        [("mul", "a", ("x", "w"), {}), ("relu_grad", "r", ("a", "a"), {}), ("sum", "loss", ("r",), {})],
        {"w": (3,)},
    )
    with pytest.raises(sf.GraphError, match=r"op 'r' \(relu_grad\) takes no gradient"):
        reference.gradients(no_grad)
    vector = hand_job([("mul", "loss", ("x", "w"), {})], {"w": (3,)})
    with pytest.raises(sf.GraphError, match="needs a floating scalar"):
        reference.gradients(vector)


# ---- mixed precision ------------------------------------------------------------------------------------


def test_autocast_policy() -> None:
    f16, f32 = DType.float16, DType.float32
    assert compute_dtype("matmul", [f32, f32], reads_parameter=True, low=f16) == f16  # a weight's matmul
    assert compute_dtype("add", [f16, f32], reads_parameter=False, low=f16) == f16  # low precision flows
    assert compute_dtype("layer_norm", [f16, f32, f32], reads_parameter=True, low=f16) == f32
    assert compute_dtype("div", [f32, f32], reads_parameter=False, low=f16) == f32  # fp32 glue stays
    assert compute_dtype("cast", [f32], reads_parameter=True, low=f16) is None  # as its user wrote it


def test_the_fp32_ops_are_the_ops_declared_fp32() -> None:
    assert FP32_OPS == {name for name, op in OPS.items() if op.fp32}
    assert {"softmax", "layer_norm", "sum", "exp"} <= FP32_OPS and not {"matmul", "add"} & FP32_OPS


def test_fp16_trains_close_to_fp32_with_fp32_master_weights_and_state() -> None:
    job = replace(one_batch_job(), optimizer=OptimizerSpec(AdamW(0.01), tuple(NAMES)))
    want = reference.train(job)
    for scale in (0.0, 1024.0):  # 0: dynamic, from 1024 (GradScaler's 2**16 skips this job's first steps)
        config = replace(
            job.config, precision="fp16", loss_scale=scale, loss_scaling=LossScaling(init=1024.0)
        )
        got = reference.train(replace(job, config=config))
        np.testing.assert_allclose(got.losses, want.losses, rtol=2e-2)
        assert got.losses != want.losses  # it did compute in fp16
        for name, value in (*got.parameters.items(), *got.optimizer_state.items()):
            assert value.dtype == np.float32, name
        for name, value in want.parameters.items():
            np.testing.assert_allclose(got.parameters[name], value, rtol=5e-2, atol=5e-3, err_msg=name)


def test_bf16_trains_on_numpy_close_to_fp32() -> None:
    job = replace(one_batch_job(), optimizer=OptimizerSpec(AdamW(0.01), tuple(NAMES)))
    want = reference.train(job)
    got = reference.train(replace(job, config=replace(job.config, precision="bf16")))
    np.testing.assert_allclose(got.losses, want.losses, rtol=2e-2)
    assert got.losses != want.losses  # it did compute in bf16 (ml_dtypes' bfloat16 on numpy)
    for name, value in want.parameters.items():
        assert got.parameters[name].dtype == np.float32
        np.testing.assert_allclose(got.parameters[name], value, rtol=5e-2, atol=5e-3, err_msg=name)


# ---- independence: the oracle runs no compiler pass -----------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
ABOVE = (
    "sbpflow.control_plane",
    "sbpflow.actor_workers",
    "sbpflow.client",
    "control_plane",
    "actor_workers",
    "client",
)


def imports_of(path: Path, module: str) -> Iterator[str]:
    """Every module an import statement of ``path`` names, wherever it stands (functions, TYPE_CHECKING),
    relative imports resolved, ``import_module("x")`` included (a computed name is refused)."""
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                (name, *_) = node.args
                assert isinstance(name, ast.Constant), f"{path}:{node.lineno} imports a computed name"
                yield str(name.value)


def core_file(module: str) -> Path | None:
    """The file of a core module (``sbpflow.x.y``), or None: a name in a module, or not the core. The
    facade (``sbpflow/__init__.py``) is not followed: it names the client API, loaded on first use."""
    if not module.startswith("sbpflow.") or module.startswith(ABOVE):
        return None
    path = ROOT.joinpath(*module.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


def test_the_oracle_imports_nothing_from_the_layers_above() -> None:
    # Followed through every core module it reaches: an oracle that runs the compiler's passes would
    # check them against themselves.
    seen, todo, bad = set(), ["sbpflow.oracle.reference"], []
    while todo:
        module = todo.pop()
        path = core_file(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        for name in imports_of(path, module if path.name != "__init__.py" else f"{module}.__init__"):
            if name.startswith(ABOVE):
                bad.append(f"{module} imports {name}")
            todo.append(name)
    assert {"sbpflow.oracle.autodiff", "sbpflow.oracle.optim", "sbpflow.precision"} <= seen
    assert not bad, bad


def test_training_loads_no_module_of_the_layers_above() -> None:
    code = (
        "import sys\n"
        "from sbpflow.oracle import reference\n"
        "from tests.sbpflow.oracle.test_reference import mlp64\n"
        "reference.train(mlp64(steps=2))\n"
        "print([m for m in sys.modules if m.startswith(('sbpflow.control_plane', 'sbpflow.actor_workers'))])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
