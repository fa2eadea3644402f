"""``bench/compiler/auto_plan.py --scale``: the automatic plan search on a GPT-175B-shaped job over 1,024
devices (``control_plane/compiler/search/auto_blocks.py``: one block priced, multiplied), its wall time and
peak memory against the targets (< 60 s, < 8 GB), and its winner beside compile_scale.py's hand layout (TP 8 x
PP 16 x DP 8, 16 micro-batches)."""

from __future__ import annotations

import dataclasses
import resource
import time

import sbpflow as sf
from bench.compiler.compile_scale import LossHead, Shape, TrainGPT
from sbpflow.control_plane.compiler.search import auto_blocks
from sbpflow.control_plane.compiler.search.auto_layouts import Layout
from sbpflow.data.sources import SyntheticSource

SHAPE = Shape()  # 96 layers, width 12,288, 96 heads, sequence 2,048, vocabulary 50,257
BATCH = 128  # sequences a step: compile_scale.py's dp * micro_batch * micro_batches


def make(blocks: int, batch: int) -> sf.Job:
    """The GPT-175B-shaped job cut to ``blocks`` blocks, ``batch`` sequences, traced data parallel on one
    rank (the search re-lays it out); built symbolically, nothing of it is allocated."""
    s = dataclasses.replace(SHAPE, layers=blocks)
    cfg = sf.nn.GPTConfig(vocab_size=s.vocab, seq_len=s.seq, n_layer=blocks, n_head=s.heads, n_embd=s.width)
    graph = TrainGPT(sf.nn.GPT(cfg), LossHead())
    data = SyntheticSource(batch_size=batch, kind="tokens", params={"seq_len": s.seq, "vocab": s.vocab})
    return graph.trace(data, placement=sf.placement("cpu", ranks=[0]), input_sbp=sf.sbp.split(0))


def main(profile: str) -> None:
    t, cpu = time.perf_counter(), time.process_time()
    found = auto_blocks.search(make, SHAPE.layers, BATCH, SHAPE.devices, profile=profile)
    took, cpu = time.perf_counter() - t, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(found.table())
    print(found.why())
    hand = Layout(pp=SHAPE.pp, tp=SHAPE.tp, dp=SHAPE.dp, micro_batches=SHAPE.micro_batches)
    rows = [c for c in found.candidates if dataclasses.replace(c.layout, zero=0) == hand]
    for c in rows:
        if c.estimate is not None:
            w = found.winner.estimate
            assert w is not None
            print(
                f"hand layout {c.layout}: {c.estimate.step_s:.3g} s modelled; the winner's / it = "
                f"{w.step_s / c.estimate.step_s:.2f}x"
            )
    print(
        f"target: the search on {SHAPE.devices} devices took {took:.1f} s wall, {cpu:.1f} s CPU (< 60 s), peak RSS {rss:.2f} GB (< 8 GB), "
        f"{len(found.candidates)} layouts priced"
    )
