"""Every op's forward against its case's independent numpy reference.

float64 to a tight tolerance, int and bool outputs exactly, same shapes (no silent broadcasting of a
reference that returns a scalar). A second test runs float32 inputs: outputs must keep the dtype that
inference promises (numpy 2 upcasts ``float32 * np.float64(...)``, a classic kernel slip) and stay close
to the float64 result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.ops.base import get_op
from sbpflow.ops.eager import EagerBuilder
from tests.sbpflow.ops import all_cases
from tests.sbpflow.ops.cases import CASES, Example

all_cases.load()

RTOL, ATOL = 1e-9, 1e-12
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))


def describe(example: Example) -> str:
    shapes = ", ".join(f"{list(x.shape)} {x.dtype}" for x in example.inputs)
    return f"inputs {shapes}, attrs {example.attrs}"


def compare(op: str, i: int, got: Any, want: Any, where: str, rtol: float, atol: float) -> None:
    name = get_op(op).output_name(i)
    want = np.asarray(want)
    assert got.shape == want.shape, (
        f"{op} output {name!r}: kernel gives shape {list(got.shape)}, reference {list(want.shape)} ({where})"
    )
    if got.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{op} output {name!r} ({where})")
    else:
        assert want.dtype.kind == got.dtype.kind or (got.dtype.kind in "iu" and want.dtype.kind in "iu"), (
            f"{op} output {name!r}: kernel gives {got.dtype}, reference {want.dtype} ({where})"
        )
        np.testing.assert_array_equal(got, want, err_msg=f"{op} output {name!r} ({where})")


@pytest.mark.parametrize("name", list(CASES))
@SETTINGS
@given(data=st.data())
def test_forward_matches_reference(name: str, data: st.DataObject) -> None:
    c = CASES.get(name)
    example = data.draw(c.examples, label="example")
    got = EagerBuilder().call(c.op, *example.inputs, **example.attrs)
    want = c.reference(*example.inputs, **example.attrs)
    assert len(got) == len(want), f"{c.op}: kernel gives {len(got)} outputs, reference {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        compare(c.op, i, g, w, describe(example), RTOL, ATOL)


def to_float32(example: Example) -> Example:
    return Example(
        tuple(x.astype(np.float32) if x.dtype == np.float64 else x for x in example.inputs), example.attrs
    )


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not get_op(c.op).random])
@SETTINGS
@given(data=st.data())
def test_float32_keeps_dtype_and_stays_close(name: str, data: st.DataObject) -> None:
    c = CASES.get(name)
    example = data.draw(c.examples, label="example")
    single = to_float32(example)
    if not any(x.dtype == np.float32 for x in single.inputs):
        return  # no float inputs: nothing to narrow
    # the eager runner refuses a kernel whose output dtype differs from the inferred one
    got = EagerBuilder().call(c.op, *single.inputs, **single.attrs)
    want = EagerBuilder().call(
        c.op, *(x.astype(np.float32).astype(x.dtype) for x in example.inputs), **example.attrs
    )
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.dtype.kind == "f" and w.dtype.kind == "f":  # int/bool results may flip on a float32 near-tie
            # float32 sums of n terms are good to about n * eps32 * max|term|; this is a sanity bound
            atol = 1e-4 * max(1.0, float(np.max(np.abs(w), initial=0.0)))
            compare(c.op, i, g, w.astype(g.dtype), describe(single), 1e-3, atol)
