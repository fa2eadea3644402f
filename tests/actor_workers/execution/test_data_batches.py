"""A rank's loaders share each batch read (``RankContext.read_rows``), and the context keeps only the
batches of the last two steps read: a run's older batches are not held to its end."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from sbpflow.actor_workers.execution.tasks import RankContext
from sbpflow.actor_workers.execution.variables import Store


class Counting:
    """A data source that counts its reads: batch ``b``'s rows hold ``b``."""

    def __init__(self) -> None:
        self.reads: list[int] = []

    def read(self, batch: int, rows: slice) -> dict[str, Any]:
        self.reads.append(batch)
        return {"x": np.full((rows.stop - rows.start, 2), batch, np.float32)}


def test_loaders_share_a_read_and_batches_two_steps_back_are_dropped() -> None:
    source = Counting()
    rc = RankContext(0, SimpleNamespace(data=source), 1, Store(0))  # type: ignore[arg-type]
    first = rc.read_rows(0, 0, 4)
    assert rc.read_rows(0, 0, 4) is first and source.reads == [0]  # the other loader of step 0
    for step in (1, 2):
        rc.read_rows(step, 0, 4)
    assert source.reads == [0, 1, 2]
    assert rc.read_rows(1, 0, 4)["x"][0, 0] == 1 and source.reads == [0, 1, 2]  # step 1 still held
    assert rc.read_rows(0, 0, 4)["x"][0, 0] == 0 and source.reads == [0, 1, 2, 0]  # step 0's read again
