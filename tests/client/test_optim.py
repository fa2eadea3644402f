from __future__ import annotations

import pytest

import sbpflow as sf
from sbpflow import job as J


def test_optimizers_produce_specs_by_tensor_name() -> None:
    lin = sf.nn.Linear(2, 3)
    names = {id(lin.weight): "m.weight", id(lin.bias): "m.bias"}
    spec = sf.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4).spec(names)
    assert spec == J.OptimizerSpec(J.SGD(0.1, 0.9, 1e-4, True), ("m.weight", "m.bias"))
    lin.bias.requires_grad = False
    sched = sf.optim.lr_scheduler.WarmupCosine(10, 100, 0.1)
    spec = sf.optim.AdamW(lin.parameters(), lr=3e-4, betas=(0.9, 0.95), clip_grad_norm=1.0).spec(names, sched)
    assert spec.algorithm == J.AdamW(3e-4, 0.9, 0.95, 1e-8, 0.01)
    assert spec.parameters == ("m.weight",) and spec.clip_grad_norm == 1.0 and spec.schedule == sched


def test_optimizer_argument_errors() -> None:
    with pytest.raises(sf.SbpflowError, match="no parameters"):
        sf.optim.SGD([])
    with pytest.raises(sf.SbpflowError, match="not a Parameter"):
        sf.optim.SGD([1.0])  # type: ignore[list-item]
    with pytest.raises(sf.SbpflowError, match="nesterov"):
        sf.optim.SGD(sf.nn.Linear(2, 2).parameters(), nesterov=True)
    with pytest.raises(sf.SbpflowError, match="betas"):
        sf.optim.AdamW(sf.nn.Linear(2, 2).parameters(), betas=(0.9, 1.0))
    with pytest.raises(sf.SbpflowError, match="clip_grad_norm"):
        sf.optim.AdamW(sf.nn.Linear(2, 2).parameters(), clip_grad_norm=-1)
