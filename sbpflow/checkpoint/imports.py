"""Checking a file of tensors against the parameters it is to fill: one comparison, used by
``init_from=`` (the launcher) and ``Module.load_state_dict`` (the client).

Strict (the default) refuses names the file lacks (missing), names the model lacks (unexpected), and
any shape or dtype that differs; ``strict=False`` lets missing and unexpected names pass (what the file
lacks starts from its initializer, what the model lacks is ignored) and casts dtypes, but a shape that
differs is always an error: it is a different model. Every problem is named at once, not the first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sbpflow.checkpoint.format import CheckpointError
from sbpflow.checkpoint.read import CheckpointReader, TensorFile

# name -> (shape, numpy dtype)
Metas = Mapping[str, tuple[tuple[int, ...], np.dtype]]


@dataclass(frozen=True)
class Mismatch:
    """What differs between the tensors a model wants and those it is given."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    shapes: tuple[str, ...] = ()  # "name: [4, 8] given, [8, 4] wanted"
    dtypes: tuple[str, ...] = ()  # "name: float64 given, float32 wanted"

    def problems(self, strict: bool) -> list[str]:
        """The lines that make a load fail under ``strict`` (shapes always do)."""
        parts = [("shape mismatch", self.shapes)]
        if strict:
            parts = [
                ("missing", self.missing),
                ("unexpected", self.unexpected),
                *parts,
                ("dtype mismatch", self.dtypes),
            ]
        return [f"{what} ({len(names)}): {_listed(names)}" for what, names in parts if names]


def _listed(names: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... and {len(names) - most} more" if len(names) > most else "")


def compare(wanted: Metas, given: Metas) -> Mismatch:
    both = [n for n in wanted if n in given]
    return Mismatch(
        missing=tuple(n for n in wanted if n not in given),
        unexpected=tuple(n for n in given if n not in wanted),
        shapes=tuple(
            f"{n}: {list(given[n][0])} given, {list(wanted[n][0])} wanted"
            for n in both
            if tuple(given[n][0]) != tuple(wanted[n][0])
        ),
        dtypes=tuple(
            f"{n}: {np.dtype(given[n][1]).name} given, {np.dtype(wanted[n][1]).name} wanted"
            for n in both
            if np.dtype(given[n][1]) != np.dtype(wanted[n][1])
        ),
    )


def check(wanted: Metas, given: Metas, strict: bool, source: str, fix: str) -> Mismatch:
    """``compare``, raising :class:`CheckpointError` (naming every problem and ``fix``) when the load
    must fail under ``strict``."""
    found = compare(wanted, given)
    problems = found.problems(strict)
    if problems:
        relax = "" if not strict or found.shapes else " (or pass strict=False to load what matches)"
        # ``fix`` is about names and shapes: a file that differs in dtypes only needs a cast
        names = found.missing or found.unexpected or found.shapes
        hint = (
            fix
            if names
            else "cast the values to the model's dtypes, or the model to theirs (model.to(dtype))"
        )
        raise CheckpointError(f"{source} does not fit the model: " + "; ".join(problems) + f"; {hint}{relax}")
    return found


def metas_of(reader: CheckpointReader | TensorFile) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The parameters a file or checkpoint holds, with their shapes and dtypes (nothing read for a
    checkpoint: its manifest says)."""
    if isinstance(reader, CheckpointReader):
        return {
            t.name: (tuple(t.shape), np.dtype(t.dtype))
            for t in reader.manifest.tensors
            if t.kind == "parameter"
        }
    return {n: (tuple(a.shape), a.dtype) for n in reader.names() for a in [reader.read(n)]}
