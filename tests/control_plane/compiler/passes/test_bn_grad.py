"""Batch norm's backward folded into channel_input_grad (control_plane/compiler/bn_grad.py): where it
folds, and that a folded ResNet trains as the unfolded one. Not bit for bit: the three terms of dx are
summed in one expression, in another order, so float64 runs agree to a tight relative tolerance instead."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from sbpflow.graph import Graph, OpNode
from sbpflow.job import Job
from tests.control_plane.compiler.passes.folds import op_types, trained_on_and_off
from tests.examples.test_examples import load

SMALL: dict[str, Any] = {"depth": 18, "width": 4, "image_size": 8, "classes": 5, "batch_size": 8, "steps": 3}


def resnet(ranks: int, fusion: bool = True) -> Job:
    made = load("resnet").make_job(ranks=ranks, **SMALL)
    return replace(made, config=replace(made.config, fusion=fusion))


@pytest.mark.parametrize("ranks", [1, 2])
def test_each_batch_norm_backward_is_one_input_grad_pass(ranks: int) -> None:
    on, off = op_types(resnet(ranks)), op_types(resnet(ranks, fusion=False))
    assert on.count("channel_input_grad") == 20  # ResNet-18's 20 BNs
    # each mean is x's own: channel_var_grad's dmean is zero, so no channel_var_dmean (and no add of it)
    assert "channel_var_dmean" not in on
    assert "channel_var_grad" not in on and "mean_grad" not in on
    assert on.count("channel_affine") == 20  # the forward's; backward's dy * scale is folded
    assert off.count("channel_var_grad") == off.count("mean_grad") == 20 and "channel_input_grad" not in off
    assert off.count("full") - on.count("full") == 20  # the zeros of channel_affine's gradient


@pytest.mark.parametrize("ranks", [1, 2])
def test_folded_training_equals_unfolded_in_float64(ranks: int) -> None:
    runs = trained_on_and_off(lambda on: resnet(ranks, fusion=on), "channel_input_grad")
    np.testing.assert_allclose(runs[True].losses, runs[False].losses, rtol=1e-12)
    fused, plain = runs[True].parameters, runs[False].parameters
    assert fused is not None and plain is not None and set(fused) == set(plain)
    for name, value in plain.items():
        np.testing.assert_allclose(fused[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def foreign_mean(j: Job) -> Job:
    """``j`` with its first batch norm's variance centred on ``mean + 0.0``: the same value, but not x's
    own mean as far as the pass can tell (an ``add_scalar`` makes it), so its channel_var_grad's dmean,
    which reaches the mean's gradient through that op's, must stay."""
    g = Graph(dict(j.graph.tensors), [])
    done = False
    for o in j.graph.ops:
        if o.op_type == "channel_var" and not done:
            x, mean = o.inputs
            g.add_tensor(dataclasses.replace(j.graph.tensors[mean], name=f"{mean}.same"))
            g.add_op(OpNode(f"{o.name}.same", "add_scalar", (mean,), (f"{mean}.same",), {"value": 0.0},
                            o.placement, o.stage, o.checkpoint, o.scope))  # fmt: skip
            o = dataclasses.replace(o, inputs=(x, f"{mean}.same"))
            done = True
        g.add_op(o)
    return replace(j, graph=g)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_variance_centred_on_another_mean_keeps_its_dmean(ranks: int) -> None:
    on = op_types(foreign_mean(resnet(ranks)))
    assert on.count("channel_var_dmean") == 1 and on.count("channel_input_grad") == 20
    runs = trained_on_and_off(lambda on: foreign_mean(resnet(ranks, fusion=on)), "channel_var_dmean")
    np.testing.assert_allclose(runs[True].losses, runs[False].losses, rtol=1e-12)
