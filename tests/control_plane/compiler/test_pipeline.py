"""compile(job): the passes in order, the graph verified after each, timings, notes, the plan and its picture."""

from __future__ import annotations

import html
import importlib
import re
import xml.dom.minidom

import pytest

from sbpflow.control_plane.compiler import comm_order, pipeline
from sbpflow.control_plane.compiler.lowering.tasks import OPTIMIZER_OPS
from sbpflow.control_plane.compiler.pipeline import compile
from sbpflow.control_plane.render import graph_page, plan_blocks
from sbpflow.errors import GraphError
from sbpflow.graph import BOXING, OpNode
from sbpflow.v1 import plan_pb2 as pp
from tests.control_plane.compiler.lowering.test_lower import mlp
from tests.examples.test_examples import load

CONFIGS = [
    ("mlp", {"ranks": 4}),
    ("mlp", {"ranks": 4, "tp": True, "hidden": 10}),
    ("gpt", {"ranks": 2}),
    ("gpt", {"ranks": 4, "tp": True, "dp": 2, "heads": 4}),
]


@pytest.fixture(scope="module")
def compiled() -> dict[str, pipeline.Compiled]:
    return {f"{name}{kw}": compile(load(name).make_job(**kw)) for name, kw in CONFIGS}


@pytest.mark.parametrize("name, kw", CONFIGS, ids=lambda x: str(x))
def test_examples_compile_to_a_checked_plan(compiled, name: str, kw: dict) -> None:
    c = compiled[f"{name}{kw}"]
    if c.plan is None:
        pytest.skip("; ".join(c.notes))
    ranks = kw["ranks"]
    assert [d.rank for d in c.plan.devices] == list(range(ranks))
    comm_order.check(c.plan)
    assert all(d.memory.total > 0 and d.memory.parameters > 0 for d in c.plan.devices)
    assert set(c.memory) == set(range(ranks))
    kernels = {t.op_name for d in c.plan.devices for t in d.tasks if t.kind == pp.TASK_KIND_KERNEL}
    assert kernels >= {
        o.name for o in c.state.graph.ops if o.op_type != BOXING and o.op_type not in OPTIMIZER_OPS
    }
    assert pp.Plan.FromString(c.plan.SerializeToString()) == c.plan


def test_every_pass_is_timed_or_noted(compiled) -> None:
    c = compiled[f"mlp{CONFIGS[0][1]}"]
    for p in pipeline.PASSES:
        assert pipeline.pass_name(p) in c.timings, pipeline.pass_name(p)
    if c.plan is not None:
        assert {"lowering", "memory", "comm_order", "total"} <= set(c.timings)
    assert all(v >= 0 for v in c.timings.values())


def test_passes_is_every_pass_module_once_the_rewrites_first() -> None:
    from pathlib import Path

    from sbpflow.control_plane.compiler.passes import rewrites

    folder = Path(rewrites.__file__).parent
    passes = {p.stem for p in folder.glob("*.py") if "def run(" in p.read_text()}
    assert [pipeline.pass_name(p) for p in pipeline.PASSES] == list(
        dict.fromkeys(pipeline.pass_name(p) for p in pipeline.PASSES)
    )
    assert {pipeline.pass_name(p) for p in pipeline.PASSES} == passes
    assert pipeline.PASSES[: len(rewrites.REWRITES)] == rewrites.REWRITES


def test_a_fully_annotated_forward_graph_lowers_without_any_pass(monkeypatch) -> None:
    monkeypatch.setattr(pipeline, "PASSES", ())
    c = compile(mlp("dp").job)
    assert c.plan is not None and len(c.plan.devices) == 4


def test_lowering_is_skipped_when_nothing_gives_the_layout(monkeypatch) -> None:
    monkeypatch.setattr(pipeline, "PASSES", ())
    c = compile(load("mlp").make_job(ranks=2))
    assert c.plan is None and "lowering skipped" in c.notes[-1]
    assert "lowering skipped" in c.summary()


def test_a_pass_that_breaks_the_graph_is_caught_right_after_it(monkeypatch) -> None:
    autodiff = importlib.import_module("sbpflow.control_plane.compiler.passes.autodiff")

    def broken(state) -> None:
        state.graph.ops.append(OpNode("bad", "relu", ("nowhere",), ("x",)))

    monkeypatch.setattr(autodiff, "run", broken)
    with pytest.raises(GraphError, match="bad"):
        compile(load("mlp").make_job(ranks=2))


def test_summary_lists_sbp_boxing_and_memory(compiled) -> None:
    c = compiled[f"gpt{CONFIGS[3][1]}"]
    text = c.summary()
    assert "SBP per op:" in text and "boxing:" in text and "B per step" in text
    if c.plan is not None:
        assert "memory per device" in text and "rank 3:" in text and "communicator cpu:0,1" in text


def test_html_picture_is_self_contained_svg(compiled) -> None:
    c = compiled[f"mlp{CONFIGS[1][1]}"]
    page = graph_page.html_page(c.state, c.memory, c.notes)
    namespaces = re.sub(r'xmlns(:xlink)?="http://www\.w3\.org/[^"]*"', "", page)
    assert page.startswith("<!doctype html>") and "<script" not in page and "http://" not in namespaces
    svg = page[page.index("<svg") : page.index("</svg>") + 6]  # the overview
    xml.dom.minidom.parseString(svg)  # well-formed
    words = html.unescape(svg)  # dot writes a hyphen as &#45;
    for op in c.state.graph.ops:
        if op.op_type == BOXING:
            assert plan_blocks.boxing_label(c.state.boxings.get(op.name)) in words
    assert ">S(1)<" in page  # an edge labelled with the SBP of the column-split weight (in its block)
    if c.memory:
        assert "Memory per device" in page


def test_dot_text_has_every_op_and_edge(compiled) -> None:
    c = compiled[f"mlp{CONFIGS[0][1]}"]
    text = graph_page.dot(c.state)
    assert text.startswith("digraph plan {") and text.rstrip().endswith("}")
    edges = [line for line in text.splitlines() if re.match(r'^  ".*" -> ".*" \[label=', line)]
    assert len(edges) == sum(len(o.inputs) for o in c.state.graph.ops)
    for op in c.state.graph.ops:
        assert f'"{op.name}" [' in text
