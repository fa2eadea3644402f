"""examples/mlp.py widened to float64 (three batches of its data, carried in the Job), as an example file
for the host's ``sbpflow submit``: a run in containers then matches the in-process run to 1e-9, where
float32 rounding, amplified over hundreds of steps, leaves only 1e-3. Needs the repository root on
``PYTHONPATH`` (the test's ``sbpflow submit`` sets it)."""

from __future__ import annotations

from typing import Any

from sbpflow.job import Job
from tests.control_plane.compiler.passes.test_autodiff import as_float64
from tests.examples.test_examples import load


def make_job(**kwargs: Any) -> Job:
    return as_float64(load("mlp").make_job(**kwargs))
