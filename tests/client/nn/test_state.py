"""Module values: state_dict / load_state_dict, the trained values written back after sf.run (so a job
traced afterwards continues), and Module.to(dtype)."""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint.format import CheckpointError
from sbpflow.data.sources import ArraySource


class Train(sf.Graph):
    def __init__(self, model: sf.nn.Module, steps: int = 3) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(sf.optim.SGD(model.parameters(), lr=0.5))
        self.config.steps = steps

    def build(self, x: sf.Tensor, y: sf.Tensor) -> sf.Tensor:
        loss = sf.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def data(dtype: type = np.float32) -> ArraySource:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 8)).astype(dtype)
    return ArraySource(batch_size=16, arrays={"x": x, "y": rng.integers(0, 4, size=48)})


def trace(model: sf.nn.Module, steps: int = 3) -> sf.Job:
    where = sf.placement("cpu", [0, 1])
    return Train(model, steps).trace(data(), placement=where, input_sbp=sf.sbp.split(0))


def test_state_dict_names_every_parameter_by_its_path_and_keeps_what_it_drew() -> None:
    net = sf.nn.MLP([8, 16, 4])
    sd = net.state_dict()
    assert list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sd["0.weight"].shape == (8, 16) and sd["0.weight"].dtype == np.float32
    again = net.state_dict()
    assert all(np.array_equal(sd[k], again[k]) for k in sd)  # drawn once, then held
    sd["0.bias"][:] = 7  # a copy: the module is not changed through it
    assert not np.any(net.state_dict()["0.bias"] == 7)


def test_load_state_dict_is_strict_and_names_every_problem() -> None:
    net = sf.nn.MLP([8, 16, 4])
    sd = net.state_dict()
    bad = {**sd, "extra.weight": np.zeros(3, np.float32), "0.bias": sd["0.bias"].astype(np.float64)}
    del bad["2.bias"]
    bad["2.weight"] = np.zeros((4, 16), np.float32)
    with pytest.raises(CheckpointError) as err:
        net.load_state_dict(bad)
    text = str(err.value)
    for part in (
        "missing (1): 2.bias",
        "unexpected (1): extra.weight",
        "2.weight: [4, 16] given, [16, 4] wanted",
    ):
        assert part in text
    assert "0.bias: float64 given, float32 wanted" in text
    with pytest.raises(CheckpointError, match="shape mismatch"):  # a shape is wrong even when not strict
        net.load_state_dict(bad, strict=False)
    bad["2.weight"] = sd["2.weight"] + 1
    found = net.load_state_dict(bad, strict=False)
    assert found.missing == ("2.bias",) and found.unexpected == ("extra.weight",)
    loaded = net.state_dict()
    np.testing.assert_array_equal(loaded["2.weight"], sd["2.weight"] + 1)
    assert loaded["0.bias"].dtype == np.float32  # cast to the parameter's dtype


def test_a_run_writes_the_trained_values_back_and_a_job_traced_then_continues() -> None:
    net = sf.nn.MLP([8, 16, 4])
    job = trace(net, steps=4)
    whole = sf.run(job, backend="inprocess", return_parameters=True)
    assert whole.parameters is not None
    first = sf.run(trace(sf.nn.MLP([8, 16, 4]), steps=2), backend="inprocess")
    np.testing.assert_allclose(first.losses, whole.losses[:2], rtol=1e-6)
    net2 = sf.nn.MLP([8, 16, 4])
    sf.run(trace(net2, steps=2), backend="inprocess")
    for name, value in net2.state_dict().items():
        assert not np.allclose(value, sf.nn.MLP([8, 16, 4]).state_dict()[name]) or name.endswith("bias")
    # the second half of the four steps: the data restarts at batch 0, so feed the batches 2 and 0 again
    second = sf.run(trace(net2, steps=1), backend="inprocess")
    assert second.losses[0] < first.losses[0]
    got = {f"model.{k}": v for k, v in net.state_dict().items()}
    for name, value in whole.parameters.items():
        np.testing.assert_array_equal(got[name], value)  # written back exactly


def test_the_same_job_run_twice_starts_where_it_started() -> None:
    job = trace(sf.nn.MLP([8, 16, 4]))
    a = sf.run(job, backend="inprocess")
    b = sf.run(job, backend="inprocess")
    assert a.losses == b.losses and a.parameters is None  # written back, but not returned unasked


def test_loaded_values_are_where_a_run_starts() -> None:
    net, other = sf.nn.MLP([8, 16, 4]), sf.nn.MLP([8, 16, 4])
    sf.run(trace(other), backend="inprocess")
    net.load_state_dict(other.state_dict())
    a = sf.run(trace(net, steps=1), backend="inprocess")
    b = sf.run(trace(other, steps=1), backend="inprocess")
    assert a.losses == b.losses


def test_to_float64_casts_the_parameters_and_their_values() -> None:
    net = sf.nn.MLP([8, 16, 4])
    held = net.state_dict()
    assert net.to(sf.float64) is net
    assert all(p.dtype is sf.float64 for p in net.parameters())
    assert all(v.dtype == np.float64 for v in net.state_dict().values())
    np.testing.assert_array_equal(net.state_dict()["0.weight"], held["0.weight"].astype(np.float64))
    with pytest.raises(sf.SbpflowError, match="floating dtype"):
        net.to(sf.int32)


def test_state_dict_after_a_trace_is_what_that_jobs_run_starts_from() -> None:
    from sbpflow.oracle import reference

    net = sf.nn.MLP([8, 16, 4])
    job = trace(net)
    start = reference.init_parameters(job)
    for name, value in net.state_dict().items():
        np.testing.assert_array_equal(value, start[f"model.{name}"])


@pytest.mark.usefixtures("ray_local")
def test_a_ray_run_writes_the_trained_values_back_too() -> None:
    net = sf.nn.MLP([8, 16, 4])
    result = sf.run(trace(net, steps=2), backend="ray", timeout=120, return_parameters=True)
    assert result.parameters is not None
    held = net.state_dict()
    for name, value in result.parameters.items():
        np.testing.assert_array_equal(held[name.removeprefix("model.")], value)


def test_a_job_traced_from_modules_holding_values_is_not_sent_to_a_server() -> None:
    from sbpflow.client.client import Client

    net = sf.nn.MLP([8, 16, 4])
    fresh = trace(net)  # traced before any value: the server draws what sf.run would
    sf.run(fresh, backend="inprocess")
    with Client("127.0.0.1:1") as client:  # refused before any call: no server needed
        with pytest.raises(sf.SbpflowError, match="hold values"):
            client.submit(trace(net))
