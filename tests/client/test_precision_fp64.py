"""``GraphConfig.precision = "fp64"``: the whole job in float64 (parameters, activations, optimizer state),
float32 data cast as it enters, and training as the one-device oracle does to 1e-12."""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.data.sources import ArraySource
from sbpflow.graph import TensorKind
from sbpflow.oracle import reference


class Train(sf.Graph):
    def __init__(self, model: sf.nn.Module, precision: str) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.AdamW(model.parameters(), lr=1e-2))
        self.config.steps, self.config.precision = 3, precision

    def build(self, x: sf.Tensor, y: sf.Tensor) -> sf.Tensor:
        loss = sf.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def job(precision: str, ranks: int = 2) -> sf.Job:
    rng = np.random.default_rng(0)
    data = ArraySource(
        batch_size=8, arrays={"x": rng.normal(size=(24, 6)).astype(np.float32), "y": rng.integers(0, 3, 24)}
    )
    where = sf.placement("cpu", list(range(ranks)))
    return Train(sf.nn.MLP([6, 16, 3]), precision).trace(data, placement=where, input_sbp=sf.sbp.split(0))


def test_an_fp64_job_is_float64_throughout_but_its_float32_data() -> None:
    j = job("fp64")
    floats = {
        t.name: t.meta.dtype for t in j.graph.tensors.values() if t.meta.dtype.value.startswith("float")
    }
    inputs = {t.name for t in j.graph.of_kind(TensorKind.input)}
    assert {floats[n] for n in inputs if n in floats} == {sf.float32}
    assert {d for n, d in floats.items() if n not in inputs} == {sf.float64}


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_fp64_job_trains_as_the_oracle_to_1e_12(ranks: int) -> None:
    j = job("fp64", ranks)
    got = sf.run(j, backend="inprocess")
    np.testing.assert_allclose(got.losses, reference.train(j).losses, rtol=1e-12)
    fp32 = sf.run(job("fp32", ranks), backend="inprocess").losses
    np.testing.assert_allclose(got.losses, fp32, rtol=1e-4)  # the same model: close, but not the same
    assert got.losses != fp32
