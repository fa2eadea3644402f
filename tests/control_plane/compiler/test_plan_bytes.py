"""Golden byte counts: what GPT's compiled plans move per step against the best hand-derived plan.

The model is ``examples/gpt.py`` with ``heads=4, width=128, layers=2, batch_size=4, seq_len=16`` and the
default vocabulary of 64, in float32 on 4 ranks. Write B = 4, T = 16, D = 128, V = 64, L = 2 and p for a
group's ranks. The boxing table (docs/ARCHITECTURE.md) prices an all-reduce of |X| bytes over p ranks at
2(p-1)|X|, and a point-to-point send at |X|.

Shared figures:

* an activation [B, T, D] is |A| = 4 * 16 * 128 * 4 = 32,768 B;
* the parameters: per block ln_1 2D + c_attn (D * 3D + 3D) + c_proj (D * D + D) + ln_2 2D + c_fc
  (D * 4D + 4D) + c_proj (4D * D + D) = 256 + 49,536 + 16,512 + 256 + 66,048 + 65,664 = 198,272 floats, of
  which Megatron splits 197,504 (both c_attn tensors, both c_fc tensors, the two projection weights) and
  replicates 768 (the layer norms and the projection biases); outside the blocks wte V * D = 8,192,
  wpe T * D = 2,048, ln_f 2D = 256 and lm_head D * V = 8,192. In all 415,232 floats, |W| = 1,660,928 B.

Each test below derives its hand figure in its docstring; the plan (SBP inference's whole-graph program,
``sbp_ilp.py``) must move no more.
"""

from __future__ import annotations

import math
from typing import Any

from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.passes.micro_batching import layout
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, TensorKind
from sbpflow.sbp import S
from tests.examples.test_examples import load

SHAPE = {"ranks": 4, "heads": 4, "width": 128, "layers": 2, "batch_size": 4, "seq_len": 16}
ACTIVATION = 4 * 16 * 128 * 4  # |A|: [B, T, D] float32
PARAMETERS = 415_232  # floats, see the module docstring
SPLIT_PER_BLOCK, WHOLE_PER_BLOCK = 197_504, 768
OUTSIDE = 8_192 + 2_048 + 256 + 8_192  # wte, wpe, ln_f, lm_head
SCALAR_ALL_REDUCE = 2 * 3 * 4  # one float32 over 4 ranks
L = 2  # blocks


def step_bytes(state: CompileState) -> int:
    """Bytes moved per step: a boxing inside a micro-batch slot runs once per micro-batch, one before or
    after them (a gradient's all-reduce after accumulation) once per step."""
    lay = layout(state)
    return sum(p.bytes * (lay.micro_batches if n in lay.slot_of else 1) for n, p in state.boxings.items())


def compiled(**kwargs: Any) -> CompileState:
    return pipeline.compile(load("gpt").make_job(**SHAPE, **kwargs)).state


def test_the_parameter_count_the_figures_use() -> None:
    """The derivations' parameter count is the model's (a change of GPT's shape must change them)."""
    g = compiled().graph
    got = sum(math.prod(t.meta.shape) for t in g.of_kind(TensorKind.parameter))
    assert got == PARAMETERS == 2 * (SPLIT_PER_BLOCK + WHOLE_PER_BLOCK) + OUTSIDE


MEGATRON_TP4 = 4 * 2 * (2 * 3 * ACTIVATION) + SCALAR_ALL_REDUCE


def test_tp4_moves_no_more_than_megatron() -> None:
    """TP4, ``--tp``: Megatron's layout moves 4 all-reduces of [B, T, D] per block (after attention and
    after the MLP in the forward, and the same two, of the input gradients of c_attn and c_fc, in the
    backward): 4 * L * 2(p-1)|A| = 8 * 6 * 32,768 = 1,572,864 B. Everything else is replicated and
    computed on every rank (the embeddings, the layer norms, the head, the loss), and gradient clipping
    all-reduces one scalar, the squared norm of the split parameters: 24 B. In all 1,572,888 B."""
    assert MEGATRON_TP4 == 1_572_888
    assert step_bytes(compiled(tp=True)) <= MEGATRON_TP4


def test_dp4_moves_no_more_than_data_parallel() -> None:
    """DP4: PyTorch DDP and Megatron all-reduce every gradient, 2(p-1)|W| = 6 * 1,660,928 = 9,965,568 B,
    and the mean loss, 24 B: 9,965,592 B. The plan beats it on this shape (64 tokens against 128-wide
    weights): it gathers the activations a weight gradient reads instead of all-reducing the gradient."""
    hand = 2 * 3 * PARAMETERS * 4 + SCALAR_ALL_REDUCE
    assert hand == 9_965_592
    assert step_bytes(compiled()) <= hand


def test_dp2_tp2_moves_no_more_than_megatron() -> None:
    """DP2 x TP2, ``--tp --dp 2`` (mesh [[0, 1], [2, 3]]): inside each of the 2 tensor groups, 4 * L
    all-reduces of its half batch, 2 groups * 2(2-1) * |A|/2 = 65,536 B each, 524,288 B in all. Across the
    data axis, each gradient is all-reduced by the 2 ranks that hold the same shard: a split parameter's
    halves in 2 groups, 2 * 2(2-1) * |w|/2 = 2|w|, a replicated one whole in 2 groups, 4|w|:
    2 * 2 * 197,504 * 4 = 3,160,064 B and 4 * (2 * 768 + 18,688) * 4 = 323,584 B. The loss over the data
    axis and the clipping norm over the tensor axis each all-reduce a scalar in 2 groups: 16 + 16 B.
    In all 4,007,968 B."""
    hand = 8 * 2 * 2 * (ACTIVATION // 2) + 2 * (L * SPLIT_PER_BLOCK * 4)
    hand += 4 * (L * WHOLE_PER_BLOCK + OUTSIDE) * 4 + 16 + 16
    assert hand == 4_007_968
    assert step_bytes(compiled(tp=True, dp=2)) <= hand


def test_pp2_dp2_moves_no_more_than_megatron() -> None:
    """PP2 x DP2, ``--pp 2 --micro-batches 2`` (stages on ranks [0, 1] and [2, 3]): each of the 2
    micro-batches sends its activation [B/2, T, D] forward and its gradient back, 4 * |A|/2 = 65,536 B,
    and its targets [B/2, T] int64 forward (the data is loaded in stage 0), 2 * 256 = 512 B. Each stage
    all-reduces its gradients over its 2 ranks once per step, 2(2-1)|w|: stage 0 holds wte, wpe and block
    0 (208,512 floats), stage 1 block 1, ln_f and lm_head (206,720 floats): 2 * 415,232 * 4 = 3,321,856 B.
    The scalars: each micro-batch's loss all-reduced in the last stage (2 * 8 B), and clipping: 15 squared
    norms of stage 1 sent to stage 0 (15 * 4 B), their sum all-reduced there (8 B) and the coefficient sent
    back (8 B), 92 B. In all 3,387,996 B."""
    hand = 4 * (ACTIVATION // 2) + 2 * 256 + 2 * PARAMETERS * 4 + 2 * 8 + 15 * 4 + 8 + 8
    assert hand == 3_387_996
    assert step_bytes(compiled(pp=2, micro_batches=2)) <= hand


MEGATRON_TP4_VOCAB = MEGATRON_TP4 + 2 * (2 * 3 * ACTIVATION) + 3 * (2 * 3 * 4 * 16 * 4)


def test_tp4_vocabulary_parallel_moves_no_more_than_megatron() -> None:
    """TP4 with ``vocab_parallel``: Megatron's VocabParallelEmbedding, column-parallel head and parallel
    cross entropy add to the TP4 figure one all-reduce of the embedding's partial output [B, T, D] in
    the forward and one of the head's input gradient in the backward, 2 * 6 * 32,768 = 393,216 B, and
    three all-reduces of [B, T] float32 (the row maximum, the label's logit, the sum of exponentials),
    3 * 6 * 256 = 4,608 B: in all 1,970,712 B. The embedding's and the head's weight gradients stay split
    and local. With a vocabulary of 64 for 64 tokens the plan beats it: gathering the two [V, D] weights
    (3 * 32,768 B each) costs less than the two activation all-reduces."""
    assert MEGATRON_TP4_VOCAB == 1_970_712
    assert step_bytes(compiled(tp=True, vocab_parallel=True)) <= MEGATRON_TP4_VOCAB


def test_tp4_backward_is_megatrons() -> None:
    """The issue's three symptoms are gone: no layer_norm_grad reads batch-split S(0) inputs, no boxing
    feeds the head's weight gradient, and nothing is all-to-all'ed (around softmax or anywhere)."""
    state = compiled(tp=True)
    for o in state.graph.ops:
        if o.op_type == "layer_norm_grad":
            assert all(sbp[0] != S(0) for sbp in state.choices[o.name].signature.ins), o.name
    # the weight gradient's matmul, folded by fusion with its operands' reshapes into a rows_matmul
    head = next(o for o in state.graph.ops if o.name.startswith("grad/model.lm_head.matmul_0/matmul_1"))
    boxed = {out for o in state.graph.ops if o.op_type == BOXING for out in o.outputs}
    assert not boxed & set(head.inputs), head.inputs
    assert not [n for n, p in state.boxings.items() if "all-to-all" in repr(p)]


def test_default_tp_on_4_ranks_moves_no_weight() -> None:
    """``examples/gpt.py --ranks 4 --tp`` with its defaults (4 heads, so the column split keeps whole
    heads) is Megatron's layout: no weight is boxed in the forward (2 heads over 4 ranks all-gathered
    c_proj.weight every step)."""
    job = load("gpt").make_job(ranks=4, tp=True)
    state = pipeline.compile(job).state
    weights = {t.name for t in state.graph.of_kind(TensorKind.parameter)}
    moved = [n for n, p in state.boxings.items() if p.bytes and any(n.startswith(w + ".") for w in weights)]
    assert not moved, moved


def test_tp4_sequence_parallel_moves_no_more_than_megatron() -> None:
    """TP4 with ``sequence_parallel``: Megatron's sequence parallelism turns each of the TP4 figure's
    all-reduces into a reduce-scatter and an all-gather of the same bytes, and all-gathers the final
    norm's sequence-split output for the replicated head, 3 * 32,768 = 98,304 B: 1,671,192 B."""
    hand = MEGATRON_TP4 + 3 * ACTIVATION
    assert hand == 1_671_192
    assert step_bytes(compiled(tp=True, sequence_parallel=True)) <= hand
