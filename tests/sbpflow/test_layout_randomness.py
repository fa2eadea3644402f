"""Parameter initialisation and dropout give the same numbers on 1 device and on a 2x2 mesh.

Every rank draws only its shard (the initializer is given the shard's index, never the whole shape
materialised), and the shards reassemble to exactly the single-device values.
"""

from __future__ import annotations

import numpy as np
import pytest

from sbpflow.ops.base import NdSignature, get_op
from sbpflow.ops.eager import EagerBuilder, meta_of, run_local
from sbpflow.oracle.reference import init_parameters
from sbpflow.placement import placement
from sbpflow.random import RandomKey
from sbpflow.sbp import B, S
from sbpflow.sharding import assemble, shard, shard_index
from tests.examples.test_examples import load

MESH = placement("cpu", [[0, 1], [2, 3]])
LAYOUTS = [(S(0), S(1)), (S(1), S(0)), (S(0), S(0)), (B, S(0)), (S(1), B)]


def gpt_job():
    return load("gpt").make_job(layers=1, width=16, heads=2, vocab=11, seq_len=6)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_parameter_shards_assemble_to_the_single_device_init(layout) -> None:
    job = gpt_job()
    whole = init_parameters(job)
    for spec in job.parameters:
        meta = job.graph.tensors[spec.tensor].meta
        nd = tuple(s if not hasattr(s, "axis") or s.axis < meta.ndim else B for s in layout)
        key = RandomKey.for_tensor(job.config.seed, spec.tensor)
        shards = {}
        for coord in MESH.coords():
            index = shard_index(meta.shape, MESH.shape, nd, coord)
            shards[MESH.rank_at(coord)] = spec.init.sample(np, key, meta.shape, index, meta.dtype.to_numpy())
        np.testing.assert_array_equal(
            assemble(shards, meta.shape, MESH, nd), whole[spec.tensor], err_msg=spec.tensor
        )


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_dropout_masks_do_not_depend_on_the_layout(layout) -> None:
    x = np.random.default_rng(1).normal(size=(6, 5))
    attrs = {"rate": 0.3, "rng_id": 1234}
    want = EagerBuilder(seed=7, step=3).call("dropout", x, **attrs)[0]
    op = get_op("dropout")
    sig = NdSignature((layout,), (layout,))
    shards = shard(x, MESH, layout)
    out = {
        r: run_local(op, attrs, (meta_of(x),), [shards[r]], MESH, sig, r, seed=7, step=3)[0]
        for r in MESH.ranks
    }
    np.testing.assert_array_equal(assemble(out, x.shape, MESH, layout), want)
    assert 0 < (want == 0).mean() < 1
