from __future__ import annotations

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.oracle import reference
from tests.client.helpers import arrays, trace


def op_types(job: sf.Job) -> list[str]:
    return [o.op_type for o in job.graph.ops]


def test_operators_emit_the_named_ops() -> None:
    def build(g, x, y):
        return (x + y, x - 1.0, 2.0 - x, x * y, x * 3, x / 2.0, 1.0 / x, x / y, -x, x**2, x @ y.T)

    job = trace(build, arrays(x=((4,), "float32"), y=((4,), "float32")))
    assert op_types(job) == [
        "add", "add_scalar", "rsub_scalar", "mul", "mul_scalar", "mul_scalar", "rdiv_scalar", "div",
        "neg", "pow_scalar", "transpose", "matmul",
    ]  # fmt: skip
    assert job.graph.ops[1].attrs["value"] == -1.0
    out = reference.forward(job)
    x, y = job.data.read(0)["x"], job.data.read(0)["y"]
    expected = (x + y, x - 1, 2 - x, x * y, x * 3, x / 2, 1 / x, x / y, -x, x**2, x @ y.T)
    for name, want in zip(job.fetches, expected, strict=True):
        np.testing.assert_allclose(out[name], want, rtol=1e-5)


def test_comparisons_reductions_and_shape_methods() -> None:
    def build(g, x, labels):
        return (
            labels == 3,
            labels != 3,
            x.sum(),
            x.mean(axis=-1, keepdims=True),
            x.max(axis=1),
            x.reshape(4, 2, 3),
            x.view(-1),
            x.reshape(4, 2, 3).transpose(0, 2),
            x.reshape(4, 2, 3).permute(2, 0, 1),
            x.exp(),
            x.softmax(),
            x.to(sf.float64),
        )

    job = trace(build, arrays(x=((6,), "float32"), labels=((6,), "int64")))
    out = reference.forward(job)
    batch = job.data.read(0)
    x, labels = batch["x"], batch["labels"]
    vals = [out[n] for n in job.fetches]
    np.testing.assert_array_equal(vals[0], labels == 3)
    np.testing.assert_array_equal(vals[1], labels != 3)
    np.testing.assert_allclose(vals[2], x.sum(), rtol=1e-5)
    np.testing.assert_allclose(vals[3], x.mean(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(vals[4], x.max(1))
    assert vals[5].shape == (4, 2, 3) and vals[6].shape == (24,)
    np.testing.assert_array_equal(vals[7], x.reshape(4, 2, 3).transpose(2, 1, 0))
    np.testing.assert_array_equal(vals[8], x.reshape(4, 2, 3).transpose(2, 0, 1))
    assert vals[11].dtype == np.float64
    assert job.graph.ops[4].attrs["axes"] == (1,)  # negative axes are normalised in the graph


def test_getitem_lowers_to_slice_and_reshape() -> None:
    def build(g, x):
        return x[:, 1:3], x[0], x[..., -1], x[:, None, :2], x[:]

    job = trace(build, arrays(x=((5,), "float32")))
    x = job.data.read(0)["x"]
    out = reference.forward(job)
    for name, want in zip(job.fetches, (x[:, 1:3], x[0], x[..., -1], x[:, None, :2], x[:]), strict=True):
        np.testing.assert_array_equal(out[name], want)
    assert job.fetches[-1] == "x"  # a full slice emits nothing


def test_getitem_refuses_steps() -> None:
    with pytest.raises(sf.ShapeError, match="step 2"):
        trace(lambda g, x: x[:, ::2], arrays(x=((5,), "float32")))


def test_to_global_annotates_its_output() -> None:
    where = sf.placement("cpu", ranks=[0, 1])

    def build(g, x):
        return x.to_global(where, sf.sbp.split(1)) * 2.0

    job = trace(build, arrays(x=((4,), "float32")), placement=where)
    node = job.graph.ops[0]
    assert node.op_type == "identity" and node.name == "to_global_0"
    decl = job.graph.tensors[node.outputs[0]]
    assert decl.sbp == (sf.sbp.split(1),) and decl.placement == where
    assert job.graph.tensors[job.graph.ops[1].outputs[0]].sbp is None  # only the annotated one


def test_to_global_checks_the_axis() -> None:
    where = sf.placement("cpu", ranks=[0, 1])
    with pytest.raises(sf.SbpError, match="splits axis 2"):
        trace(lambda g, x: x.to_global(where, sf.sbp.split(2)), arrays(x=((4,), "float32")))


def test_tensor_outside_build_is_a_clear_error() -> None:
    kept = []

    def build(g, x):
        kept.append(x)
        return x * 2.0

    trace(build, arrays(x=((4,), "float32")))
    with pytest.raises(sf.TracingError, match="only inside the sf.Graph.build"):
        kept[0] + 1.0


def test_tensor_truth_value_is_refused() -> None:
    with pytest.raises(sf.TracingError, match="control flow"):
        trace(lambda g, x: x if x.sum() else x, arrays(x=((4,), "float32")))


def test_backward_needs_a_scalar() -> None:
    with pytest.raises(sf.TracingError, match="must be a scalar"):
        trace(lambda g, x: x.backward(), arrays(x=((4,), "float32")))
