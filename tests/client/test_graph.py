from __future__ import annotations

import pytest

import sbpflow as sf
from sbpflow.graph import TensorKind
from sbpflow.job import AdamW, Precision, WarmupCosine
from tests.client.helpers import arrays


class TrainMLP(sf.Graph):
    def __init__(self, model: sf.nn.Module, optimizer: bool = True) -> None:
        super().__init__()
        self.model = model
        if optimizer:
            self.add_optimizer(
                sf.optim.AdamW(model.parameters(), lr=1e-3, clip_grad_norm=1.0),
                lr_scheduler=sf.optim.lr_scheduler.WarmupCosine(2, 10, 0.1),
            )

    def build(self, x, y):
        loss = sf.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def data():
    return arrays(batch=8, x=((6,), "float32"), y=((2,), "float32"))


def test_mlp_traces_into_a_verified_job() -> None:
    where = sf.placement("cpu", ranks=[0, 1])
    graph = TrainMLP(sf.nn.MLP([6, 16, 2]))
    graph.config.gradient_accumulation_steps = 2
    graph.config.zero_stage = 1
    graph.config.precision = "bf16"
    job = graph.trace(data(), steps=7, placement=where, input_sbp=sf.sbp.split(0))
    job.verify()
    ops = ["matmul", "add", "relu", "matmul", "add", "sub", "mul", "mean"]
    assert [o.op_type for o in job.graph.ops] == ops
    params = {t.name: t.meta.shape for t in job.graph.of_kind(TensorKind.parameter)}
    assert params == {
        "model.0.weight": (6, 16), "model.0.bias": (16,), "model.2.weight": (16, 2), "model.2.bias": (2,),
    }  # fmt: skip
    assert [p.tensor for p in job.parameters] == list(params)
    inputs = {t.name: t for t in job.graph.of_kind(TensorKind.input)}
    assert inputs["x"].meta.shape == (8, 6) and inputs["x"].sbp == (sf.sbp.split(0),)
    assert inputs["y"].placement == where
    assert job.loss == "mean_0" == job.fetches[0]
    assert job.optimizer is not None and isinstance(job.optimizer.algorithm, AdamW)
    assert job.optimizer.parameters == tuple(params) and job.optimizer.clip_grad_norm == 1.0
    assert job.optimizer.schedule == WarmupCosine(2, 10, 0.1)
    c = job.config
    assert (c.steps, c.gradient_accumulation_steps, c.zero_stage, c.precision) == (7, 2, 1, Precision.bf16)


def test_parameter_annotations_land_on_the_decls() -> None:
    where = sf.placement("cpu", ranks=[[0, 1], [2, 3]])
    mlp = sf.nn.MLP([6, 16, 2])
    mlp[0].weight.to_global(where, (sf.sbp.broadcast, sf.sbp.split(1)))
    job = TrainMLP(mlp).trace(data(), placement=where, input_sbp={"x": (sf.sbp.split(0), sf.sbp.broadcast)})
    t = job.graph.tensors
    assert t["model.0.weight"].sbp == (sf.sbp.broadcast, sf.sbp.split(1))
    assert t["model.0.bias"].sbp is None  # left to the compiler
    assert t["x"].sbp == (sf.sbp.split(0), sf.sbp.broadcast) and t["y"].sbp is None


def test_input_names_must_match_the_fields() -> None:
    class Wrong(sf.Graph):
        def build(self, features, labels):
            return features

    with pytest.raises(sf.TracingError, match=r"build\('features', 'labels'\).*fields \('x', 'y'\)"):
        Wrong().trace(data())


def test_optimizer_without_backward_is_an_error() -> None:
    class NoBackward(TrainMLP):
        def build(self, x, y):
            return self.model(x).sum()

    with pytest.raises(sf.TracingError, match="never called loss.backward"):
        NoBackward(sf.nn.MLP([6, 2])).trace(data())


def test_inference_graph_has_no_loss() -> None:
    class Infer(sf.Graph):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def build(self, x, y):
            return {"pred": self.model(x)}

    job = Infer(sf.nn.MLP([6, 2])).trace(data())
    assert job.loss == "" and job.optimizer is None and job.fetches == ("model.0.add_0",)


def test_optimizer_parameters_must_belong_to_the_graph() -> None:
    class Stray(TrainMLP):
        def __init__(self):
            super().__init__(sf.nn.MLP([6, 2]), optimizer=False)
            self.add_optimizer(sf.optim.SGD(sf.nn.Linear(3, 3).parameters(), lr=0.1))

    with pytest.raises(sf.SbpflowError, match="no module of the graph owns"):
        Stray().trace(data())


def test_tied_parameters_are_declared_once() -> None:
    class Tied(sf.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = sf.nn.Linear(6, 2, bias=False)
            self.dec = sf.nn.Linear(6, 2, bias=False)
            self.dec.weight = self.enc.weight  # one Parameter, two modules

        def forward(self, x):
            return self.enc(x) + self.dec(x)

    job = TrainMLP(Tied()).trace(data())
    assert [p.tensor for p in job.parameters] == ["model.enc.weight"]
    assert job.graph.ops[1].inputs == ("x", "model.enc.weight")
    assert job.optimizer.parameters == ("model.enc.weight",)


def test_graph_is_not_called() -> None:
    with pytest.raises(sf.TracingError, match="trace it"):
        TrainMLP(sf.nn.MLP([6, 2]))()
