"""The attention core folded into qkv_attention and qkv_attention_grad (control_plane/compiler/
attention_core.py): where it folds, where it must not, and that a folded GPT trains as the unfolded one
in float64 on one device and split by heads, bit for bit: the folded kernels run the same GEMMs and
softmax passes on the same strided views (a 1e-9 relative change of qkv_attention_grad's dqkv fails it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from sbpflow.control_plane.compiler import pipeline
from sbpflow.job import Job
from tests.control_plane.compiler.passes.folds import op_types, trained_on_and_off
from tests.examples.test_examples import load

GPT: dict[str, Any] = {"layers": 2, "heads": 4, "width": 16, "vocab": 32, "seq_len": 8, "batch_size": 8}
LAYOUTS: dict[str, dict[str, Any]] = {
    "1": {"ranks": 1},
    "dp2": {"ranks": 2},
    "tp2": {"ranks": 2, "tp": True},  # qkv S(2): each rank whole heads
    "dp2xtp2": {"ranks": 4, "tp": True, "dp": 2},
}
LAYOUT_OPS = ("attention", "attention_grad", "split", "concat", "transpose")


def gpt(layout: str, fusion: bool = True, steps: int = 3, **kw: Any) -> Job:
    made = load("gpt").make_job(steps=steps, **GPT, **LAYOUTS[layout], **kw)
    return replace(made, config=replace(made.config, fusion=fusion))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_attention_and_its_layout_ops_are_one_op_each_way(layout: str) -> None:
    on, off = op_types(gpt(layout)), op_types(gpt(layout, fusion=False))
    assert on.count("qkv_attention") == on.count("qkv_attention_grad") == GPT["layers"]
    assert not set(LAYOUT_OPS) & set(on)
    assert (
        off.count("attention") == off.count("attention_grad") == GPT["layers"] and "qkv_attention" not in off
    )
    assert len(off) - len(on) >= 20 * GPT["layers"]  # 11 ops forward and 11 backward become one each


def test_a_kept_intermediate_stops_the_fold() -> None:
    j = gpt("1")
    probs = next(o.outputs[1] for o in j.graph.ops if o.op_type == "attention")
    on = op_types(replace(j, fetches=(*j.fetches, probs)))
    assert on.count("qkv_attention") == GPT["layers"] - 1 and on.count("attention") == 1


def test_a_forward_only_graph_folds_the_forward() -> None:
    j = gpt("1")
    state = pipeline.compile(replace(j, optimizer=None, loss="", fetches=(j.loss,)), lower="none").state
    ops = [o.op_type for o in state.graph.ops]
    assert ops.count("qkv_attention") == GPT["layers"] and "qkv_attention_grad" not in ops


@pytest.mark.parametrize("layout", ["1", "tp2", "dp2xtp2"])
def test_folded_training_is_bit_identical_to_unfolded_in_float64(layout: str) -> None:
    runs = trained_on_and_off(lambda on: gpt(layout, fusion=on), "qkv_attention")
    assert list(runs[True].losses) == list(runs[False].losses)
    fused, plain = runs[True].parameters, runs[False].parameters
    assert fused is not None and plain is not None and set(fused) == set(plain)
    for name, value in plain.items():
        np.testing.assert_array_equal(fused[name], value, err_msg=name)
