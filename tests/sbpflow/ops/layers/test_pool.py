"""sbpflow/ops/layers/pool.py's geometry, which it checks once for each op and attributes: a bad one
raises on every call, not only the first, and attributes given as lists (unhashable) still work."""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.errors import ShapeError
from sbpflow.ops.eager import EagerBuilder


def test_a_bad_geometry_raises_every_call() -> None:
    x = np.zeros((1, 1, 4, 4))
    for _ in range(2):
        with pytest.raises(ShapeError, match="at most half the kernel"):
            EagerBuilder().call("max_pool2d", x, kernel_size=(2, 2), stride=(2, 2), padding=(2, 2))


def test_list_attributes_pool_as_tuples() -> None:
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    (by_list,) = EagerBuilder().call("avg_pool2d", x, kernel_size=[2, 2], stride=[2, 2], padding=[0, 0])
    (by_tuple,) = EagerBuilder().call("avg_pool2d", x, kernel_size=(2, 2), stride=(2, 2), padding=(0, 0))
    np.testing.assert_array_equal(by_list, by_tuple)
