"""The errors sbpflow raises. Each message names the op, the tensors (shapes, SBPs) and the fix."""

from __future__ import annotations


class SbpflowError(Exception):
    """Base of every error sbpflow raises on purpose."""


class SbpError(SbpflowError, ValueError):
    """An SBP that cannot be, e.g. a split of an axis the tensor does not have."""


class PlacementError(SbpflowError, ValueError):
    """A malformed placement: duplicate ranks, ragged grid, unknown device type."""


class ShapeError(SbpflowError, ValueError):
    """Shapes or dtypes an op cannot accept."""


class UnknownOpError(SbpflowError, KeyError):
    """An op type no registry entry declares."""

    def __str__(self) -> str:  # KeyError quotes its message; this one is a sentence
        return str(self.args[0]) if self.args else ""


class RegistryError(SbpflowError, ValueError):
    """A second registration under a name that is already taken."""


class GraphError(SbpflowError, ValueError):
    """A malformed logical graph, found by the verifier."""
