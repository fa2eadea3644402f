"""The functional API and layers of issue 16's non-convolutional ops, traced and run by the reference:
sigmoid, exact GELU, BCE with logits, gather / index_select, one_hot, topk, flatten."""

from __future__ import annotations

import math

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.data.sources import ArraySource
from sbpflow.errors import ShapeError
from sbpflow.oracle import reference
from tests.client.helpers import arrays, trace

F = sf.nn.functional


def _run(build, data: ArraySource) -> list[np.ndarray]:
    job = trace(build, data)
    out = reference.forward(job)
    return [out[n] for n in job.fetches]


def test_activations_and_the_logistic_loss() -> None:
    data = arrays(batch=4, x=((3,), "float64"), t=((3,), "float64"))
    got = _run(
        lambda g, x, t: (
            F.sigmoid(x),
            F.gelu(x, approximate="none"),
            F.gelu(x),
            sf.nn.Sigmoid()(x),
            sf.nn.GELU("none")(x),
            F.binary_cross_entropy_with_logits(x, F.sigmoid(t)),
            F.binary_cross_entropy_with_logits(x, F.sigmoid(t), reduction="sum"),
        ),
        data,
    )
    b = data.read(0)
    x, t = b["x"], 1 / (1 + np.exp(-b["t"]))
    sig = 1 / (1 + np.exp(-x))
    exact = x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    per = -(t * np.log(sig) + (1 - t) * np.log(1 - sig))
    for g, w in zip(got, [sig, exact, tanh, sig, exact, per.mean(), per.sum()], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    with pytest.raises(ShapeError, match="approximate"):
        trace(lambda g, x, t: F.gelu(x, approximate="erf"), data)


def test_gather_index_select_one_hot_topk_and_flatten() -> None:
    rng = np.random.default_rng(0)
    data = ArraySource(
        batch_size=4,
        arrays={"x": rng.standard_normal((4, 5, 2)), "i": rng.integers(0, 5, size=(4,)).astype(np.int64)},
    )
    got = _run(
        lambda g, x, i: (
            F.gather(x, i, axis=1),
            F.index_select(x, 1, i),
            F.one_hot(i, 6, dtype=sf.float64),
            *F.topk(x.reshape(4, 10), 3),
            F.flatten(x, 1),
            sf.nn.Flatten()(x),
        ),
        data,
    )
    x, i = data.read(0)["x"], data.read(0)["i"]
    order = np.argsort(-x.reshape(4, 10), axis=-1, kind="stable")[:, :3]
    want = [
        x[:, i],
        x[:, i],
        np.eye(6)[i],
        np.take_along_axis(x.reshape(4, 10), order, -1),
        order,
        x.reshape(4, 10),
        x.reshape(4, 10),
    ]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ShapeError, match="1-d"):
        trace(lambda g, x, i: F.index_select(x, 0, i.reshape(2, 2)), data)
