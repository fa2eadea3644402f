"""The block picture of a plan: a node per block, a band per phase, boxing labelled, blocks that open."""

from __future__ import annotations

import html
import re
import xml.dom.minidom

import pytest

from sbpflow.control_plane.compiler.pipeline import Compiled, compile
from sbpflow.control_plane.render import plan_blocks, plan_picture
from sbpflow.graph import BOXING
from tests.examples.test_examples import load


@pytest.fixture(scope="module")
def gpt() -> Compiled:
    return compile(load("gpt").make_job(ranks=2, layers=2), lower="none")


def test_every_op_is_in_exactly_one_node_of_its_phase(gpt: Compiled) -> None:
    bg = plan_blocks.block_graph(gpt.state)
    placed = [op.name for n in bg.nodes.values() for op in n.ops]
    assert sorted(placed) == sorted(op.name for op in gpt.state.graph.ops)
    for n in bg.nodes.values():
        assert {plan_blocks.phase_of(op) for op in n.ops} == {n.phase}
    phases = {n.phase for n in bg.nodes.values()}
    assert phases == {"forward", "backward", "optimizer"}


def test_a_transformer_layer_is_one_block_per_phase(gpt: Compiled) -> None:
    bg = plan_blocks.block_graph(gpt.state)
    assert {"forward:model.blocks.0", "backward:model.blocks.0", "optimizer:model.blocks.0"} <= set(bg.nodes)
    layer = bg.nodes["forward:model.blocks.0"]
    assert {op.scope.split(".")[2] for op in layer.ops} == {"0"} and len(layer.ops) > 10


def test_boxing_nodes_say_their_collective_and_bytes(gpt: Compiled) -> None:
    bg = plan_blocks.block_graph(gpt.state)
    boxes = [n for n in bg.nodes.values() if n.boxing]
    assert len(boxes) == sum(op.op_type == BOXING for op in gpt.state.graph.ops)
    for n in boxes:
        plan = gpt.state.boxings[n.ops[0].name]
        assert n.label.endswith(f", {plan.bytes} B") and plan.steps[0].collective.value in n.label


@pytest.mark.skipif(
    not plan_picture.have_dot(), reason="Graphviz's dot is not installed (apt-get install graphviz)"
)
def test_the_dot_picture_is_small_banded_and_every_block_opens(gpt: Compiled) -> None:
    page = plan_picture.picture(gpt.state)
    overview = page[page.index("<svg") : page.index("</svg>") + 6]
    xml.dom.minidom.parseString(overview)
    width, height = (int(x) for x in re.search(r'<svg width="(\d+)pt" height="(\d+)pt"', overview).groups())
    assert width < 2000 and height < 2000  # it was 18,318 x 10,416 px with every op a node
    words = html.unescape(overview)
    assert all(f"<title>cluster_{p}</title>" in words for p in plan_blocks.PHASES)
    links = set(re.findall(r'xlink:href="#(block-\d+)"', overview))
    sections = set(re.findall(r"<section class='block' id='(block-\d+)'", page))
    assert links == sections and len(sections) == len(plan_blocks.block_graph(gpt.state).nodes)


def test_without_dot_the_built_in_layout_draws_the_same_nodes(
    gpt: Compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_picture, "have_dot", lambda: False)
    page = plan_picture.picture(gpt.state)
    overview = page[page.index("<svg") : page.index("</svg>") + 6]
    xml.dom.minidom.parseString(overview)
    links = set(re.findall(r'<a href="#(block-\d+)"', overview))
    assert len(links) == len(plan_blocks.block_graph(gpt.state).nodes)
    assert all(f">{p}</text>" in overview for p in plan_blocks.PHASES)


def test_a_graphviz_label_is_quoted() -> None:
    assert plan_picture.quote('a "b"\\c\nd') == '"a \\"b\\"\\\\c\\nd"'


def test_a_pipeline_block_says_its_stage() -> None:
    c = compile(load("mlp").make_job(ranks=2, pp=2, layers=2, micro_batches=2), lower="none")
    bg = plan_blocks.block_graph(c.state)
    text = plan_picture.overview_dot(bg)
    last = [n for n in bg.nodes.values() if not n.boxing and {op.stage for op in n.ops} == {1}]
    assert last and "stage 1" in text and "stage 0" not in text
