"""Rewrite pass: forward ops that carry a variable to the next step (batch norm's running statistics).

A ``running_stat`` op (sbpflow/ops/layers/norm_stats.py) computes the next value of its first input, which must
be a parameter that nothing trains (``requires_grad=False``). ``run(state)`` records each one in
``state.updates``, so that lowering writes the value back as it writes an optimizer's updates (a SINK
assign) and SBP inference gives it the variable's SBP: a running mean of ``B`` parameters takes the batch
mean after its all-reduce (``P -> B``), which is synchronised batch norm's statistic.

It runs after ``mixed_precision``, which rebuilds ``state.updates`` from the optimizer alone. A step cut
into micro-batches is refused: each micro-batch's forward would update the statistic once (PyTorch's
behaviour), and the plan has one write-back per variable and step.
"""

from __future__ import annotations

from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError
from sbpflow.graph import TensorKind
from sbpflow.oracle.reference import micro_batches

OP = "running_stat"


def run(state: CompileState) -> None:
    g = state.graph
    ops = [o for o in g.ops if o.op_type == OP]
    if not ops:
        return
    if micro_batches(state.job) > 1:
        raise GraphError(
            f"{ops[0].name!r} updates the running statistic {ops[0].inputs[0]!r} in a step cut into "
            f"{micro_batches(state.job)} micro-batches (gradient_accumulation_steps x micro_batches); "
            "running statistics need one forward per step: use 1, or put the model in eval mode"
        )
    trained = {p.tensor for p in state.job.parameters if p.trainable}
    for o in ops:
        var = o.inputs[0]
        decl = g.tensors[var]
        if decl.kind != TensorKind.parameter or var in trained:
            raise GraphError(
                f"{o.name!r} ({OP}) updates {var!r}, a {decl.kind.value}"
                f"{' that is trained' if var in trained else ''}; its first input must be a parameter "
                "made with requires_grad=False (a running statistic, such as BatchNorm2d.running_mean)"
            )
        if var in state.updates:
            raise GraphError(
                f"{o.name!r} ({OP}) updates {var!r}, which {state.updates[var]!r} already updates; "
                "give each running statistic one update per step"
            )
        state.updates[var] = o.outputs[0]
