"""Shared by the tests of the compiler's folds (attention_core, bn_grad): a job's op types after compiling,
and the job trained in float64 with its fold on and off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sbpflow as sf
from sbpflow.control_plane.compiler import pipeline
from sbpflow.job import Job
from tests.control_plane.compiler.passes.test_autodiff import as_float64


def op_types(j: Job) -> list[str]:
    return [o.op_type for o in pipeline.compile(j).state.graph.ops]  # verify_compiled checks each signature


def trained_on_and_off(make: Callable[[bool], Job], folded_op: str, steps: int = 3) -> dict[bool, Any]:
    """``make(fusion)`` widened to float64 and run ``steps`` steps in process, fusion on and off, by that
    flag; each compiled job checked to hold ``folded_op`` exactly when the fold is on."""
    runs = {}
    for on in (True, False):
        j = as_float64(make(on), batches=steps)
        assert (folded_op in op_types(j)) is on
        runs[on] = sf.run(j, steps=steps, return_parameters=True, timeout=120, backend="inprocess")
    return runs
