from __future__ import annotations

import pytest

import sbpflow as sf
from sbpflow.client.tracing import Tracer
from sbpflow.errors import UnknownOpError
from sbpflow.graph import TensorKind
from sbpflow.tensor_meta import TensorMeta
from tests.client.helpers import arrays, trace


class Pair(sf.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = sf.nn.Linear(4, 4)
        self.b = sf.nn.Linear(4, 4)

    def forward(self, x: sf.Tensor) -> sf.Tensor:
        return self.b(self.a(x).relu()).relu()


def test_names_are_scoped_and_counted_per_scope() -> None:
    job = trace(lambda g, x: g.m(x), arrays(x=((4,), "float32")), modules={"m": Pair()})
    names = [o.name for o in job.graph.ops]
    assert names == [
        "m.a.matmul_0", "m.a.add_0", "m.relu_0", "m.b.matmul_0", "m.b.add_0", "m.relu_1",
    ]  # fmt: skip
    assert [o.scope for o in job.graph.ops] == ["m.a", "m.a", "m", "m.b", "m.b", "m"]
    assert job.graph.ops[0].outputs == ("m.a.matmul_0",)


def test_multi_output_ops_name_each_output() -> None:
    job = trace(lambda g, x: sf.nn.functional.split(x, 2, axis=1), arrays(x=((4,), "float32")))
    assert job.graph.ops[0].outputs == ("split_0:0", "split_0:1")
    assert job.fetches == ("split_0:0", "split_0:1")


def test_a_module_called_twice_keeps_counting() -> None:
    lin = sf.nn.Linear(4, 4)
    job = trace(lambda g, x: g.lin(g.lin(x)), arrays(x=((4,), "float32")), modules={"lin": lin})
    assert [o.name for o in job.graph.ops] == ["lin.matmul_0", "lin.add_0", "lin.matmul_1", "lin.add_1"]


def test_stage_and_checkpoint_flags_land_on_the_ops() -> None:
    p0, p1 = sf.placement("cpu", ranks=[0, 1]), sf.placement("cpu", ranks=[2, 3])
    model = Pair()
    model.a.set_stage(0, p0)
    model.b.set_stage(1, p1)
    model.b.activation_checkpointing = True
    job = trace(lambda g, x: g.m(x), arrays(x=((4,), "float32")), modules={"m": model}, placement=p0)
    by_name = {o.name: o for o in job.graph.ops}
    assert by_name["m.a.matmul_0"].stage == 0 and by_name["m.a.matmul_0"].placement == p0
    assert by_name["m.b.matmul_0"].stage == 1 and by_name["m.b.matmul_0"].placement == p1
    assert by_name["m.b.matmul_0"].checkpoint and not by_name["m.a.matmul_0"].checkpoint
    # outside any stage an op follows its input, which came from stage 1
    assert by_name["m.relu_1"].placement == p1 and by_name["m.relu_1"].stage == 0
    assert job.graph.tensors["m.b.weight"].placement == p1  # parameters live on their stage
    assert job.graph.tensors["m.a.weight"].placement == p0


def test_mixed_placements_outside_a_stage_need_a_move() -> None:
    p0, p1 = sf.placement("cpu", ranks=[0]), sf.placement("cpu", ranks=[1])
    lin = sf.nn.Linear(4, 4)
    lin.weight.to_global(p1, sf.sbp.broadcast)
    with pytest.raises(sf.TracingError, match="mixes placements"):
        trace(lambda g, x: g.lin(x), arrays(x=((4,), "float32")), modules={"lin": lin}, placement=p0)


def test_linear_shape_mismatch_names_both_shapes() -> None:
    with pytest.raises(sf.ShapeError) as e:
        trace(lambda g, x: g.lin(x), arrays(x=((5,), "float32")), modules={"lin": sf.nn.Linear(4, 3)})
    msg = str(e.value)
    assert "lin.matmul_0" in msg and "[4, 5]" in msg and "[4, 3]" in msg and "lin.weight" in msg
    assert "test_tracing.py" in msg  # points at the user's line


def test_unknown_op_names_the_node() -> None:
    from sbpflow.client.tensor import emit

    with pytest.raises(UnknownOpError, match="no_such_op_0"):
        trace(lambda g, x: emit("no_such_op", x), arrays(x=((4,), "float32")))


def test_non_tensor_input_is_refused() -> None:
    import numpy as np

    with pytest.raises(sf.TracingError, match="must be sbpflow tensors"):
        trace(lambda g, x: sf.nn.functional.relu(np.ones(3)) and x, arrays(x=((4,), "float32")))


def test_tracer_is_a_builder() -> None:
    tracer = Tracer(sf.placement("cpu", ranks=[0]))
    x = tracer.declare("x", TensorMeta((2, 3), sf.float32), TensorKind.input, tracer.default_placement)
    (y,) = tracer.call("mul_scalar", x, value=2.0)
    assert tracer.meta(y) == x.meta and y.name == "mul_scalar_0"


def test_module_call_outside_build() -> None:
    with pytest.raises(sf.TracingError, match="needs a running trace"):
        sf.nn.Linear(2, 2)(None)
