"""Vocabulary-parallel GPT (``megatron(vocab_parallel=True)``) trains exactly as one device does.

The token embedding's rows, the head's columns and the cross entropy are split over the tensor axis
(``sbpflow/ops/layers/vocab.py``): float64 losses and final parameters within 1e-9 of the one-device oracle, as
in ``test_equivalence.py``, on TP 4 and on DP2 x TP2. And the chunked loss is the plain cross entropy:
on one device the two jobs train alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from sbpflow.control_plane.compiler import pipeline
from sbpflow.oracle import reference
from sbpflow.sbp import S
from tests.actor_workers.test_equivalence import STEPS, assert_trains_like_one_device, gpt_job
from tests.control_plane.compiler.passes.test_autodiff import as_float64

LAYOUTS = {
    "gpt-tp4-vocab": {"ranks": 4, "tp": True, "heads": 4, "vocab_parallel": True},
    "gpt-dp2xtp2-vocab": {"ranks": 4, "tp": True, "dp": 2, "vocab_parallel": True},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_vocab_parallel_training_equals_one_device(name: str) -> None:
    job = as_float64(gpt_job(**LAYOUTS[name]), batches=STEPS)
    ops = {o.op_type for o in job.graph.ops}
    assert {"vocab_chunk_max", "vocab_terms", "vocab_cross_entropy"} <= ops and "cross_entropy" not in ops
    assert_trains_like_one_device(job, tol=1e-9)


def test_the_logits_are_split_by_class_and_never_gathered() -> None:
    """Under TP 4, with a vocabulary of 256 for 64 tokens (gathering the embedding and the head would
    cost more than the activations' all-reduces they save), the head's logits are S(2), and no boxing
    moves them, nor their gradient. With GPT's small test vocabulary of 32 the plan gathers the two
    weights instead: that is cheaper there, and the program finds it."""
    state = pipeline.compile(gpt_job(**LAYOUTS["gpt-tp4-vocab"], vocab=256)).state
    logits = next(o for o in state.graph.ops if o.op_type == "vocab_chunk_max").inputs[0]
    shape = state.graph.tensors[logits].meta.shape
    assert state.graph.tensors[logits].sbp == (S(2),)
    moved = [n for n, p in state.boxings.items() if p.bytes and p.meta.shape == shape]
    assert not moved, f"boxings of {list(shape)} tensors (the logits or their gradient): {moved}"


def test_chunked_loss_trains_as_the_plain_cross_entropy() -> None:
    """The oracle runs both on whole arrays: the four ops compute the cross entropy, to rounding."""
    kw = {"ranks": 4, "tp": True, "heads": 4}
    plain = reference.train(as_float64(gpt_job(**kw), batches=STEPS), steps=STEPS)
    chunked = reference.train(as_float64(gpt_job(**kw, vocab_parallel=True), batches=STEPS), steps=STEPS)
    np.testing.assert_allclose(chunked.losses, plain.losses, rtol=1e-12, atol=0)
    for name, value in plain.parameters.items():
        np.testing.assert_allclose(chunked.parameters[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
