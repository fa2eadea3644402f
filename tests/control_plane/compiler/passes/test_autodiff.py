"""Autodiff: gradients of the example jobs against central finite differences (float64), the summation of
multi-consumer gradients, skipped branches, loss scaling, stage stamping, and the errors.

The helpers here (``example``, ``as_float64``, ``compiled``) are shared with the optimizer tests.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from sbpflow.control_plane.compiler.passes import autodiff, optimizer
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.data.sources import ArraySource
from sbpflow.dtype import DType
from sbpflow.errors import GraphError
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import SGD, Job, JobConfig, OptimizerSpec, ParameterSpec
from sbpflow.ops.base import get_op
from sbpflow.oracle import reference
from sbpflow.placement import placement
from sbpflow.random import Normal
from sbpflow.tensor_meta import TensorMeta
from tests.examples.test_examples import load as example


def as_float64(job: Job, batches: int = 3) -> Job:
    """``job`` with every float32 tensor and dtype attr widened to float64, fed ``batches`` batches of its
    data (as float64) from memory: the finite-difference checks need the precision."""

    def widen(value: Any) -> Any:
        return DType.float64 if isinstance(value, DType) and value is DType.float32 else value

    g = job.graph
    tensors = {
        n: replace(t, meta=TensorMeta(t.meta.shape, widen(t.meta.dtype))) for n, t in g.tensors.items()
    }
    ops = [replace(o, attrs={k: widen(v) for k, v in o.attrs.items()}) for o in g.ops]
    assert job.data is not None
    reads = [job.data.read(b) for b in range(batches)]
    arrays = {
        k: np.concatenate([r[k] for r in reads]).astype(
            np.float64 if reads[0][k].dtype == np.float32 else reads[0][k].dtype
        )
        for k in reads[0]
    }
    data = ArraySource(batch_size=job.data.batch_size, arrays=arrays)
    return replace(job, graph=Graph(tensors, ops), data=data)


def compiled(job: Job, with_optimizer: bool = False) -> CompileState:
    """``job`` through autodiff (and the optimizer pass), verifying the graph after each."""
    state = CompileState.start(job)
    autodiff.run(state)
    state.graph.verify()
    read = {i for o in state.graph.ops for i in o.inputs} | set(state.grads.values())
    dead = [o.name for o in state.graph.ops if autodiff.is_backward(o) and not read.intersection(o.outputs)]
    assert not dead, f"backward ops whose results nothing uses: {dead}"
    if with_optimizer:
        optimizer.run(state)
        state.graph.verify()
    return state


def finite_difference(job: Job, params: dict[str, np.ndarray], name: str, index: tuple[int, ...]) -> float:
    h = 1e-6
    losses = []
    for sign in (1, -1):
        moved = {k: v.copy() for k, v in params.items()}
        moved[name][index] += sign * h
        losses.append(float(reference.forward(job, parameters=moved)[job.loss]))
    return (losses[0] - losses[1]) / (2 * h)


def check_against_finite_differences(job: Job, names: list[str], per_param: int = 3) -> None:
    params = reference.init_parameters(job)
    _, grads = reference.gradients(job, parameters=params)
    assert set(grads) == {p.tensor for p in job.parameters}
    rng = np.random.default_rng(0)
    for name in names:
        assert grads[name].shape == params[name].shape and grads[name].dtype == np.float64
        # the largest entry (an embedding's rows of absent tokens are zero) and a few at random
        picks = {int(np.argmax(np.abs(grads[name])))}
        picks.update(
            int(i) for i in rng.choice(params[name].size, min(per_param, params[name].size), replace=False)
        )
        for flat in sorted(picks):
            index = tuple(int(i) for i in np.unravel_index(flat, params[name].shape))
            numeric = finite_difference(job, params, name, index)
            analytic = float(grads[name][index])
            # the difference quotient of a loss ~1 with h = 1e-6 is good to ~1e-9; curvature adds ~h^2
            assert abs(numeric - analytic) <= 1e-8 + 1e-6 * abs(numeric), (
                f"d loss / d {name}{list(index)}: autodiff {analytic:.10g}, finite differences {numeric:.10g}"
            )


# ---- gradients of the examples ------------------------------------------------------------------------


def test_mlp_gradients_equal_finite_differences() -> None:
    job = as_float64(example("mlp").make_job(ranks=1, n_in=5, hidden=7, n_out=3, layers=2, batch_size=6))
    check_against_finite_differences(job, [p.tensor for p in job.parameters])


def test_gpt_gradients_equal_finite_differences() -> None:
    job = as_float64(
        example("gpt").make_job(ranks=1, layers=1, heads=2, width=8, vocab=11, seq_len=4, batch_size=2)
    )
    names = [
        "model.wte.weight",
        "model.wpe.weight",
        "model.blocks.0.ln_1.weight",
        "model.blocks.0.attn.c_attn.weight",
        "model.blocks.0.mlp.c_fc.bias",
        "model.lm_head.weight",
    ]
    check_against_finite_differences(job, names, per_param=2)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("mlp", {"ranks": 4}),
        ("mlp", {"tp": True, "ranks": 4, "layers": 2}),
        ("gpt", {"ranks": 4}),
        ("gpt", {"tp": True}),
        ("gpt", {"tp": True, "dp": 2, "ranks": 4, "heads": 4}),
    ],
)
def test_the_graph_verifies_after_each_pass_on_the_examples(name: str, kwargs: dict[str, Any]) -> None:
    job = example(name).make_job(**kwargs)
    state = compiled(job, with_optimizer=True)
    assert set(state.updates) == set(job.optimizer.parameters) | set(state.state_vars)  # type: ignore[union-attr]


def test_every_trainable_parameter_gets_a_named_gradient_and_the_graph_verifies() -> None:
    job = example("gpt").make_job(ranks=2, layers=1)
    state = compiled(job)
    assert list(state.grads) == list(job.optimizer.parameters)
    for param, grad in state.grads.items():
        decl = state.graph.tensors[grad]
        assert grad == f"grad/{param}" and decl.kind == TensorKind.gradient
        assert (
            decl.meta == state.graph.tensors[param].meta
            and decl.placement == job.graph.tensors[param].placement
        )
    backward = [o for o in state.graph.ops if autodiff.is_backward(o)]
    assert state.graph.ops[: len(job.graph.ops)] == job.graph.ops  # the forward is untouched
    assert len(backward) == len(state.graph.ops) - len(job.graph.ops)


def test_integer_branches_and_input_gradients_are_not_computed() -> None:
    """GPT divides by a count of non-ignored labels (bool -> float): no gradient flows there, and no op
    computes the gradient of the token batch or of the count."""
    job = example("gpt").make_job(ranks=1, layers=1)
    g = compiled(job).graph
    count_branch = {"model.cast_0", "model.sum_1", "model.cast_1", "model.add_1"}
    for node in g.ops:
        if autodiff.is_backward(node):
            assert not any(
                o in {f"grad/{t}" for t in (*count_branch, "tokens", "targets")} for o in node.outputs
            )
    assert not any(n.startswith("grad/model.ne_scalar") for n in g.tensors)


# ---- hand-built graphs --------------------------------------------------------------------------------

F64 = DType.float64
Rows = list[tuple[str, str, tuple[str, ...], dict[str, Any]]]


def hand_job(rows: Rows, params: dict[str, tuple[int, ...]], **config: Any) -> Job:
    """A job from ``(op_type, output, inputs, attrs)`` rows (op and output share a name); its input ``x``
    is one sample [1, 3], its loss the last row's output, its optimizer SGD over ``params``."""
    g = Graph()
    for name, shape in params.items():
        g.add_tensor(TensorDecl(name, TensorMeta(shape, F64), TensorKind.parameter, requires_grad=True))
    g.add_tensor(TensorDecl("x", TensorMeta((1, 3), F64), TensorKind.input))
    for op_type, out, ins, attrs in rows:
        op = get_op(op_type)
        full = op.normalize_attrs(attrs)
        (meta,) = op.run_infer(tuple(g.tensors[i].meta for i in ins), full)
        g.add_tensor(TensorDecl(out, meta))
        g.add_op(OpNode(out, op_type, ins, (out,), full))
    data = ArraySource(batch_size=1, arrays={"x": np.array([[0.5, -1.0, 2.0]])})
    specs = [ParameterSpec(p, Normal(0.0, 1.0)) for p in params]
    return Job(
        "hand", g, specs, data, OptimizerSpec(SGD(lr=0.1), tuple(params)), JobConfig(**config), rows[-1][1]
    )


def forward_op_of(node: OpNode) -> str:
    """``grad/<forward op>/<op>_<n>`` -> ``<forward op>``."""
    return node.name.removeprefix(autodiff.GRAD).rpartition("/")[0]


def test_a_tensor_read_twice_gets_the_sum_of_both_gradients() -> None:
    # a = x * w;  loss = sum(a * tanh(a)) + sum(w): a and w are each read by two ops
    rows: Rows = [
        ("mul", "a", ("x", "w"), {}),
        ("tanh", "t", ("a",), {}),
        ("mul", "c", ("a", "t"), {}),
        ("sum", "s", ("c",), {}),
        ("sum", "sw", ("w",), {}),
        ("add", "loss", ("s", "sw"), {}),
    ]
    job = hand_job(rows, {"w": (3,)})
    state = compiled(job)
    sums = {o.outputs[0] for o in state.graph.ops if autodiff.is_backward(o) and o.op_type == "add"}
    assert {"grad/a", "grad/w"} <= sums
    x, w = np.array([0.5, -1.0, 2.0]), np.array([0.3, 0.7, -0.2])
    _, grads = reference.gradients(job, parameters={"w": w})
    a = x * w
    np.testing.assert_allclose(grads["w"], x * (np.tanh(a) + a * (1 - np.tanh(a) ** 2)) + 1.0, rtol=1e-12)


def test_a_parameter_the_loss_does_not_depend_on_is_an_error_naming_it() -> None:
    job = hand_job([("mul", "a", ("x", "w"), {}), ("sum", "loss", ("a",), {})], {"w": (3,), "unused": (2,)})
    with pytest.raises(GraphError, match=r"\['unused'\].*requires_grad=False"):
        autodiff.run(CompileState.start(job))


def test_a_no_grad_op_between_parameters_and_loss_is_an_error_naming_it() -> None:
    rows: Rows = [
        ("mul", "a", ("x", "w"), {}),
        ("relu_grad", "r", ("a", "a"), {}),
        ("sum", "loss", ("r",), {}),
    ]
    with pytest.raises(GraphError, match=r"op 'r' \(relu_grad\) takes no gradient"):
        autodiff.run(CompileState.start(hand_job(rows, {"w": (3,)})))


def test_loss_scaling_seeds_the_scale_and_unscales_the_gradients() -> None:
    rows: Rows = [("mul", "a", ("x", "w"), {}), ("tanh", "t", ("a",), {}), ("sum", "loss", ("t",), {})]
    plain, scaled = hand_job(rows, {"w": (3,)}), hand_job(rows, {"w": (3,)}, loss_scale=1024.0)
    state = compiled(scaled)
    (seed,) = [o for o in state.graph.ops if o.op_type == "full"]
    assert seed.attrs["value"] == 1024.0
    (unscale,) = [o for o in state.graph.ops if o.outputs == ("grad/w",)]
    assert unscale.op_type == "mul_scalar" and unscale.attrs["value"] == 1 / 1024
    w = {"w": np.array([0.3, 0.7, -0.2])}
    want = reference.gradients(plain, parameters=w)[1]["w"]
    np.testing.assert_allclose(reference.gradients(scaled, parameters=w)[1]["w"], want, rtol=1e-12)


def test_backward_ops_run_in_the_stage_and_placement_of_their_forward_op() -> None:
    rows: Rows = [
        ("mul", "a", ("x", "w"), {}),
        ("tanh", "t", ("a",), {}),
        ("mul", "u", ("t", "v"), {}),
        ("sum", "loss", ("u",), {}),
    ]
    job = hand_job(rows, {"w": (3,), "v": (3,)})
    head = placement("cpu", [2, 3])
    job.graph.ops[2:] = [replace(o, stage=1, placement=head, scope="head") for o in job.graph.ops[2:]]
    g = compiled(job).graph
    forward = {o.name: o for o in g.ops if not autodiff.is_backward(o)}
    stages = {}
    for node in g.ops:
        if autodiff.is_backward(node) and forward_op_of(node) in forward:
            f = forward[forward_op_of(node)]
            assert (node.stage, node.placement, node.scope) == (f.stage, f.placement, f.scope), node
            stages[forward_op_of(node)] = node.stage
    assert stages == {"loss": 1, "u": 1, "t": 0, "a": 0}


def test_a_forward_only_job_is_left_alone() -> None:
    job = hand_job([("mul", "a", ("x", "w"), {}), ("sum", "loss", ("a",), {})], {"w": (3,)})
    state = CompileState.start(replace(job, loss="", optimizer=None))
    autodiff.run(state)
    assert state.grads == {} and state.graph.ops == job.graph.ops
