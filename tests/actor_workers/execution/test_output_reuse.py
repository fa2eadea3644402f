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

from sbpflow.actor_workers.execution.tasks import OutputReuse
from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine

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


def run(consume: Any, count: int = 1, stream: str = "compute") -> list[bool]:
    reuse, lent = OutputReuse([count == 1]), []
    acts = [
        ActorSpec(0, "producer", "compute", (), (0,), producer(reuse, lent), STEPS),
        ActorSpec(1, "consumer", stream, (0,), (), consume, STEPS),
    ]
    Engine(acts, [RegisterSpec(0, 0, (1,), count)]).run(timeout=10)
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


def test_a_register_with_two_slots_is_never_lent() -> None:
    assert not any(run(lambda it, xs: [], count=2))
