"""Every SBP row of every op, checked against the unsharded result.

For a drawn example and mesh, each valid n-d signature is run per rank on shards (partial inputs cut
into unequal shares), the per-rank outputs are reassembled by the output SBP, and the result must equal
the op run on whole arrays. ``B`` outputs must be equal on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401
from sbpflow.ops.base import get_op
from sbpflow.ops.eager import EagerBuilder, meta_of, run_local
from sbpflow.placement import placement
from sbpflow.sharding import assemble, shard
from tests.sbpflow.ops import all_cases
from tests.sbpflow.ops.cases import CASES

MESHES = [placement("cpu", [0, 1]), placement("cpu", [0, 1, 2]), placement("cpu", [0, 1, 2, 3]),
          placement("cpu", [[0, 1], [2, 3]])]

all_cases.load()


def check_all_signatures(op_name: str, example, mesh) -> int:
    op = get_op(op_name)
    metas = tuple(meta_of(x) for x in example.inputs)
    expected = EagerBuilder().call(op_name, *example.inputs, **example.attrs)
    checked = 0
    for nd in op.nd_signatures(metas, op.normalize_attrs(example.attrs), mesh.shape):
        shards = [shard(x, mesh, s) for x, s in zip(example.inputs, nd.ins, strict=True)]
        per_rank = {r: run_local(op, example.attrs, metas, [s[r] for s in shards], mesh, nd, r) for r in mesh.ranks}
        for i, want in enumerate(expected):
            got = assemble({r: outs[i] for r, outs in per_rank.items()}, want.shape, mesh, nd.outs[i])
            np.testing.assert_allclose(
                got, want, rtol=1e-9, atol=1e-12, err_msg=f"{op_name} {nd} on mesh {mesh.shape}, output {i}"
            )
        checked += 1
    return checked


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_signature_matches_unsharded(name: str, data: st.DataObject) -> None:
    c = CASES.get(name)
    example = data.draw(c.examples)
    mesh = data.draw(st.sampled_from(MESHES))
    check_all_signatures(c.op, example, mesh)
