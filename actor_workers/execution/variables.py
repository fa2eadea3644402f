"""The persistent per-rank store: this rank's shards of the parameters and the optimizer state.

A rank draws only its own shard of each parameter from the parameter's initializer, keyed by
(``config.seed``, ``RandomKey.for_tensor(name)``) exactly as :func:`sbpflow.oracle.reference.init_parameters`
keys the whole tensor, so every layout starts from the same logical values without materialising them.
Optimizer state starts at zero. A ``P`` (partial-sum) layout keeps the value on the first rank of each
partial mesh axis and zeros elsewhere, so the shards still sum to the logical value.

SOURCE tasks read the store at the first step, SINK ``assign`` tasks write each step's new value, and
after the run the store holds the trained values (``values()``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow.actor_workers.execution.plan_tables import PlanTables
from sbpflow.errors import SbpflowError
from sbpflow.graph import TensorDecl, TensorKind
from sbpflow.random import RandomKey
from sbpflow.sbp import PartialSum
from sbpflow.sharding import Index, shard_index

VARIABLE_KINDS = (TensorKind.parameter, TensorKind.optimizer_state, TensorKind.constant)

# (variable, this rank's slice of it) -> its starting value, or None to draw it as usual: a checkpoint
StoreSource = Callable[[TensorDecl, Index], Any]


class StoreError(SbpflowError, KeyError):
    """A variable the store cannot provide (a constant without a value, a name it does not hold)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Store:
    """One rank's variables by tensor name (local shards). Each name is written by one SINK task."""

    def __init__(self, rank: int, values: Mapping[str, Any] | None = None) -> None:
        self.rank = rank
        self._values: dict[str, Any] = dict(values or {})

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise StoreError(
                f"rank {self.rank} holds no variable {name!r}; it holds {sorted(self._values)}"
            ) from None

    def __setitem__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def holds(self, name: str, value: Any) -> bool:
        """Whether ``value`` (that very object) is the variable ``name``'s."""
        return self._values.get(name) is value

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def values(self) -> dict[str, Any]:
        return dict(self._values)


def is_partial_elsewhere(decl: TensorDecl, coord: tuple[int, ...]) -> bool:
    """True where a ``P`` layout gives this rank zeros: it is not the first rank of some partial axis."""
    assert decl.sbp is not None
    return any(isinstance(s, PartialSum) and c != 0 for s, c in zip(decl.sbp, coord, strict=True))


def init_store(
    tables: PlanTables, rank: int, xp: ModuleType = np, source: StoreSource | None = None
) -> Store:
    """This rank's shard of every variable of the plan's tensors placed on ``rank``; where ``source``
    gives a value (a checkpoint, imported parameters) it is used instead of the initializer."""
    specs = tables.parameters
    store = Store(rank)
    for decl in tables.tensors.values():
        if decl.kind not in VARIABLE_KINDS or decl.placement is None or rank not in decl.placement.ranks:
            continue
        assert decl.sbp is not None
        coord = decl.placement.coord_of(rank)
        index = shard_index(decl.meta.shape, decl.placement.shape, decl.sbp, coord)
        shape = tuple(s.stop - s.start for s in index)
        dtype = decl.meta.dtype.to_numpy()
        spec = specs.get(decl.name)
        given = None if source is None or is_partial_elsewhere(decl, coord) else source(decl, index)
        if given is not None:
            store[decl.name] = xp.asarray(given)
            continue
        if spec is None and decl.kind is not TensorKind.optimizer_state:
            raise StoreError(
                f"{decl.kind.value} {decl.name!r} {decl.meta} has no initializer: the job's parameters do not "
                "declare it; declare it as a parameter (sf.nn.Parameter) so every rank can draw its shard"
            )
        if spec is None or is_partial_elsewhere(decl, coord):
            store[decl.name] = xp.zeros(shape, dtype=dtype)
            continue
        key = RandomKey.for_tensor(tables.config.seed, decl.name)
        store[decl.name] = spec.init.sample(xp, key, decl.meta.shape, index, dtype)
    return store
