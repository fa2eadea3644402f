"""The memory estimate's gradient figure under accumulation: never below the gradients the update reads.

Without ZeRO every parameter's gradient reaches the update whole on the rank that holds the parameter,
so a rank holds at least its parameters' bytes of gradients (fp32 both). With micro-batches the
gradients are summed in ACCUMULATE buffers; where a sum is boxed on its way to the update (a
replicated head's gradient summed ``P x S(1)``, then all-reduced) the estimate used to count only the
smaller sum: 3.03 GB of gradients against 5.19 GB of parameters in the last stage of the 48-layer
GPT-3-shaped job (bench/compiler/compile_scale.py). This is that job's layout, small.
"""

from __future__ import annotations

import sbpflow as sf
from sbpflow.control_plane.compiler import pipeline
from sbpflow.data.sources import SyntheticSource
from sbpflow.sbp import B, S


class _Head(sf.nn.Module):
    def forward(self, logits: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        return sf.nn.functional.cross_entropy(logits, targets)


class _Train(sf.Graph):
    def __init__(self, model: sf.nn.GPT, head: _Head) -> None:
        super().__init__()
        self.model, self.head = model, head
        self.add_optimizer(sf.optim.AdamW(model.parameters(), lr=1e-3))

    def build(self, tokens: sf.Tensor, targets: sf.Tensor) -> sf.Tensor:
        loss = self.head(self.model(tokens), targets)
        loss.backward()
        return loss


def _job() -> sf.Job:
    """TP 2 x PP 2 x DP 2: each stage a 2 x 2 mesh, Megatron on the blocks, the head replicated; a long
    sequence and a wide vocabulary, so the head's gradient is summed as a partial and all-reduced."""
    cfg = sf.nn.GPTConfig(vocab_size=2048, seq_len=256, n_layer=2, n_head=4, n_embd=32)
    model, head = sf.nn.GPT(cfg), _Head()
    stages = [sf.placement("cpu", ranks=[[4 * k, 4 * k + 1], [4 * k + 2, 4 * k + 3]]) for k in range(2)]
    model.set_stage(0, stages[0])
    for i, block in enumerate(model.blocks):
        block.set_stage(i, stages[i])
        sf.nn.parallel.megatron(block, stages[i], tp_axis=-1)
    for m in (model.ln_f, model.lm_head, head):
        m.set_stage(1, stages[1])
    graph = _Train(model, head)
    graph.config.micro_batches = 2
    data = SyntheticSource(batch_size=4, kind="tokens", params={"seq_len": 256, "vocab": 2048})
    return graph.trace(data, placement=stages[0], input_sbp=(S(0), B))


def test_every_rank_holds_at_least_its_parameters_in_gradients() -> None:
    c = pipeline.compile(_job())
    head = c.state.graph.tensors[c.state.grads["model.lm_head.weight"]]
    boxed = [p for p in c.state.boxings.values() if p.dst_sbp == head.sbp and p.meta == head.meta]
    assert boxed, "the layout this test is about: the head's gradient is boxed on its way to the update"
    for rank, m in c.memory.items():
        assert m.gradients >= m.parameters, f"rank {rank}: {m}"
