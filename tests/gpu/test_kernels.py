"""Every registered op's kernel on cupy against the same kernel on numpy, in float64 and float32.

Inputs are drawn from the op tests' own cases (``tests/sbpflow/ops/cases_*.py``, one or more per op; the
backward ops are registered ops with cases, so they run here too). Per case: the forward outputs, and,
where the case has differentiable inputs, the gradient rule run eagerly on cupy (``vjp`` with a cupy
``EagerBuilder``) against the same rule on numpy. Outputs must be cupy arrays (no silent trip through the
host), of the same shape and dtype; float outputs agree to a few ulp of the GPU's math library (float64
1e-9 relative, float32 1e-5, both relative to the output's scale where values cancel), integer and bool
outputs exactly.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.base import OPS
from sbpflow.ops.eager import EagerBuilder, vjp
from tests.sbpflow.ops import all_cases
from tests.sbpflow.ops.cases import CASES, Example

all_cases.load()

# derandomized: a GPU run is scarce, so each one checks the same examples and a failure reproduces
SETTINGS = settings(
    max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
DTYPES = {"float64": np.float64, "float32": np.float32}
TOLERANCE = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-5}
GRAD_CASES = [name for name, c in CASES.items() if c.differentiable]


def narrowed(example: Example, dtype: Any) -> Example:
    """The example with its float64 inputs cast to ``dtype`` (cases draw float64)."""
    return Example(
        tuple(x.astype(dtype) if x.dtype == np.float64 else x for x in example.inputs), example.attrs
    )


def same(cp: ModuleType, got: Any, want: Any, what: str) -> None:
    assert isinstance(got, cp.ndarray), (
        f"{what}: the cupy run returned {type(got).__name__}, not a cupy array"
    )
    want = np.asarray(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (
        f"{what}: cupy gives {list(got.shape)} {got.dtype}, numpy {list(want.shape)} {want.dtype}"
    )
    host = cp.asnumpy(got)
    if want.dtype.kind in "fc":
        tol = TOLERANCE.get(want.dtype, 1e-3)
        scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(host, want, rtol=tol, atol=tol * scale, err_msg=what)
    else:
        np.testing.assert_array_equal(host, want, err_msg=what)


def test_every_registered_op_has_a_case_here() -> None:
    missing = sorted(set(OPS) - {c.op for _, c in CASES.items()})
    assert not missing, f"ops with no case, so untested on cupy: {missing}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
@SETTINGS
@given(data=st.data())
def test_forward_on_cupy_matches_numpy(cp: ModuleType, name: str, dtype: str, data: st.DataObject) -> None:
    c = CASES.get(name)
    example = narrowed(data.draw(c.examples, label="example"), DTYPES[dtype])
    want = EagerBuilder(np).call(c.op, *example.inputs, **example.attrs)
    got = EagerBuilder(cp).call(c.op, *(cp.asarray(x) for x in example.inputs), **example.attrs)
    assert len(got) == len(want)
    shapes = ", ".join(f"{list(x.shape)} {x.dtype}" for x in example.inputs)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        same(cp, g, w, f"{c.op} output {i} ({dtype}; inputs {shapes}; attrs {example.attrs})")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", GRAD_CASES)
@SETTINGS
@given(data=st.data())
def test_gradient_rule_on_cupy_matches_numpy(
    cp: ModuleType, name: str, dtype: str, data: st.DataObject
) -> None:
    c = CASES.get(name)
    example = narrowed(data.draw(c.examples, label="example"), DTYPES[dtype])
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    outs = EagerBuilder(np).call(c.op, *example.inputs, **example.attrs)
    dys = [rng.standard_normal(y.shape).astype(y.dtype) if y.dtype.kind == "f" else None for y in outs]
    want = vjp(c.op, example.inputs, dys, **example.attrs)
    got = vjp(
        c.op,
        [cp.asarray(x) for x in example.inputs],
        [None if d is None else cp.asarray(d) for d in dys],
        EagerBuilder(cp),
        **example.attrs,
    )
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        what = f"{c.op} gradient of input {i} ({dtype}; attrs {example.attrs})"
        if w is None:
            assert g is None or not bool(cp.any(g)), f"{what}: numpy gives none, cupy a non-zero one"
        else:
            same(cp, g, w, what)
