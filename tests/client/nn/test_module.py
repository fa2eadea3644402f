from __future__ import annotations

import pytest

import sbpflow as sf
from sbpflow.random import Zeros


class Net(sf.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = sf.nn.Parameter((3,), Zeros())
        self.body = sf.nn.Sequential(sf.nn.Linear(3, 4), sf.nn.ReLU(), sf.nn.Linear(4, 3, bias=False))
        self.note = "plain attribute"

    def forward(self, x):
        return self.body(x) * self.scale


def test_registration_and_traversal() -> None:
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == ["scale", "body.0.weight", "body.0.bias", "body.2.weight"]
    assert [n for n, _ in net.named_modules()] == ["", "body", "body.0", "body.1", "body.2"]
    assert len(list(net.parameters())) == 4 and net.num_parameters() == 3 + 12 + 4 + 12
    assert net.note == "plain attribute"
    net.scale = None  # replacing a parameter by a plain value unregisters it
    assert [n for n, _ in net.named_parameters()][0] == "body.0.weight"


def test_train_eval_reach_every_submodule() -> None:
    net = Net()
    net.eval()
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())


def test_parameter_reads_as_tensor_inside_build_only() -> None:
    from tests.client.helpers import arrays, trace

    net = Net()
    seen = []

    def build(g, x):
        seen.append(g.net.scale)
        return g.net(x)

    trace(build, arrays(x=((3,), "float32")), modules={"net": net})
    assert isinstance(seen[0], sf.Tensor) and seen[0].name == "net.scale"
    assert isinstance(net.scale, sf.nn.Parameter)


def test_missing_super_init_is_explained() -> None:
    class Bad(sf.nn.Module):
        def __init__(self):
            self.w = sf.nn.Parameter((2,))

    with pytest.raises(sf.SbpflowError, match=r"super\(\).__init__\(\)"):
        Bad()


def test_set_stage_validates() -> None:
    with pytest.raises(sf.SbpflowError, match="non-negative"):
        Net().set_stage(-1, sf.placement("cpu", ranks=[0]))
    with pytest.raises(sf.SbpflowError, match="placement"):
        Net().set_stage(0, [0, 1])


def test_parameter_to_global_and_repr() -> None:
    where = sf.placement("cpu", ranks=[0, 1])
    p = sf.nn.Parameter((4, 6)).to_global(where, sf.sbp.split(1))
    assert p.sbp == (sf.sbp.split(1),) and p.placement == where
    assert "S(1)" in repr(p) and "[4, 6]" in repr(p)
    with pytest.raises(sf.SbpError, match="splits axis 2"):
        sf.nn.Parameter((4, 6)).to_global(where, sf.sbp.split(2))
    with pytest.raises(sf.ShapeError, match="not an initializer"):
        sf.nn.Parameter((4,), init="normal")  # type: ignore[arg-type]
    assert "Linear(3, 4, bias=True)" in repr(Net())
