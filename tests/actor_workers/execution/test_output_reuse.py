"""Register reuse by lifetime: a kernel writes into its own previous output once nobody holds it.

The engine is real (tasks.OutputReuse decides from CPython's refcount what the plan cannot see); these
tests pin the count (tasks.UNHELD) against the engine's own references, and show that a holder of any
kind — a consumer keeping the array, a view of it, a second slot — keeps the array from being lent.
Every training test (tests/actor_workers/test_equivalence.py against the one-device oracle) runs with
the kernels writing into lent arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.actor_workers.execution.tasks import DonatingKernelContext, OutputReuse
from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.dtype import DType
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.ops.eager import full_index
from sbpflow.tensor_meta import TensorMeta

STEPS = 6


def producer(reuse: OutputReuse, lent: list[bool]) -> Any:
    """An act that writes its iteration into the lent array (or a new one) and keeps its result."""

    def act(it: int, xs: list) -> list:
        (buf,) = reuse.take()
        lent.append(buf is not None)
        out = np.empty(4) if buf is None else buf
        out[:] = it
        reuse.keep([out], xs)
        return [out]

    return act


def run(consume: Any, count: int = 1, stream: str = "compute", keep_last: tuple[int, ...] = ()) -> list[bool]:
    reuse, lent = OutputReuse([count == 1]), []
    acts = [
        ActorSpec(0, "producer", "compute", (), (0,), producer(reuse, lent), STEPS),
        ActorSpec(1, "consumer", stream, (0,), (), consume, STEPS),
    ]
    Engine(acts, [RegisterSpec(0, 0, (1,), count)], keep_last=keep_last).run(timeout=10)
    return lent


def test_a_dead_previous_output_is_lent_and_the_values_stay_right() -> None:
    seen: list[tuple[int, float]] = []
    lent = run(lambda it, xs: seen.append((id(xs[0]), float(xs[0][0]))) or [])
    assert lent == [False] + [True] * (STEPS - 1)  # the first act allocates; every later one reuses
    assert [v for _, v in seen] == [float(i) for i in range(STEPS)]
    assert len({i for i, _ in seen}) == 1  # one array, every step


@pytest.mark.parametrize(
    "holder",
    [
        lambda kept: lambda it, xs: kept.append(xs[0]) or [],  # the consumer keeps the array
        lambda kept: lambda it, xs: kept.append(xs[0][1:]) or [],  # ... or a view of it
    ],
)
def test_an_array_someone_holds_is_never_lent(holder: Any) -> None:
    kept: list[Any] = []
    lent = run(holder(kept))
    assert not any(lent)
    assert [float(np.asarray(k).ravel()[0]) for k in kept] == [float(i) for i in range(STEPS)]


def test_a_value_the_engine_keeps_for_the_result_is_never_lent() -> None:
    assert not any(run(lambda it, xs: [], keep_last=(0,)))  # Engine(keep_last): one reference more


def test_a_register_with_two_slots_is_never_lent() -> None:
    assert not any(run(lambda it, xs: [], count=2))


def _meta(a: np.ndarray) -> TensorMeta:
    return TensorMeta(a.shape, DType(a.dtype.name))


RNG = np.random.default_rng(3)
X, DY = (
    RNG.standard_normal((2, 3, 6, 6)).astype(np.float32),
    RNG.standard_normal((2, 3, 3, 3)).astype(np.float32),
)
C = RNG.standard_normal(3).astype(np.float32)
POOL = {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1)}  # padded: the loop (ResNet's stem pool)
CHAIN = '[["add",{},["in0","in1"]],["relu",{},["s0"]]]'
# ResNet's kernels that write their result into the runtime's dead buffer (the memory plan's or their own
# previous output): (op, inputs, attrs)
LENDING = [
    ("relu", [X], {}),
    ("relu_grad", [X, X], {}),
    ("channel_affine", [X, C, C, C], {}),
    ("channel_var_grad", [X, C, C[:1].reshape(())], {}),
    ("max_pool2d", [X], POOL),
    ("max_pool2d_grad", [X, DY], POOL),
    ("fused_elementwise", [X, X], {"chain": CHAIN}),
]


@pytest.mark.parametrize(("op_type", "inputs", "attrs"), LENDING, ids=[c[0] for c in LENDING])
def test_resnets_kernels_write_into_a_lent_buffer(op_type: str, inputs: list, attrs: dict) -> None:
    op = get_op(op_type)
    attrs = op.normalize_attrs(attrs)
    metas = tuple(map(_meta, inputs))
    if op_type == "channel_var_grad":  # dvar is [C]
        inputs, metas = inputs[:2] + [C], metas[:2] + (_meta(C),)
    outs = op.run_infer(metas, attrs)
    where = (tuple(map(full_index, metas)), tuple(map(full_index, outs)))
    want = op.run_kernel(KernelContext(np, attrs, metas, outs, *where), inputs)
    buf = np.full(outs[0].shape, np.nan, outs[0].dtype.to_numpy())
    ctx = DonatingKernelContext(np, attrs, metas, outs, *where, out_buffers=(buf,))
    got = op.run_kernel(ctx, inputs)
    assert got[0] is buf  # written into the lent buffer, not a new array
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "buf",
    [np.zeros((2, 3)), np.zeros((3, 2)), np.zeros((2, 3), np.float32), np.zeros(6)[::1].reshape(2, 3), None],
    ids=["fits", "shape", "dtype", "view", "none"],
)
def test_a_context_told_its_outputs_lends_exactly_the_buffers_the_metas_would(buf: Any) -> None:
    # kernel_act gives the context its outputs' shapes and dtypes once (out_kinds), not asked of the metas
    # at every out_array: the same buffers must pass
    x = np.zeros((2, 3))
    metas = (_meta(x),)
    where = ((full_index(metas[0]),), (full_index(metas[0]),))
    kinds = ((x.shape, x.dtype),)
    told = DonatingKernelContext(np, {}, metas, metas, *where, out_buffers=(buf,), out_kinds=kinds)
    asked = DonatingKernelContext(np, {}, metas, metas, *where, out_buffers=(buf,))
    assert told.out_array(0) is asked.out_array(0)
    fits = buf is not None and buf.shape == (2, 3) and buf.dtype == x.dtype
    assert told.out_array(0) is (buf if fits else None)
    assert told.out_array(1) is None and told.out_zeros(0).shape == (2, 3)
