"""The oracle's companion: which 1-d signatures would be valid but are missing from an op's table?

On a 2-rank mesh every candidate signature is enumerated (each input and output: ``S(i)`` for each
axis, ``B``, ``P``; splits that leave a rank empty or, for ``even_splits`` ops, uneven are left out) and
run through the oracle's harness (partial inputs cut unevenly plus zero-sum noise). One example can make
a wrong signature pass by coincidence (a zero attribute, a size-1 axis, an all-True bool output), so a
candidate is *confirmed* only when it passes on every drawn example it applies to, and on two or more.

Confirmed candidates that the table lacks are *reported*, not failed: a :class:`MissedSignatureWarning`
per case, and the whole table (with the candidates seen on one example only) in
``missed_signatures.txt`` under pytest's base temp dir (or the path in ``$SBPFLOW_MISSED_SIGNATURES``). The test fails only when a declared row does not pass, or when the
check itself crashes. Candidates whose kernel raises are simply invalid.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbpflow.errors import SbpflowError
from sbpflow.ops.base import NdSignature, OpDef, get_op
from sbpflow.ops.eager import EagerBuilder, meta_of
from sbpflow.placement import placement
from sbpflow.sbp import B, P, Sbp, Split
from sbpflow.tensor_meta import TensorMeta
from tests.sbpflow.ops import all_cases
from tests.sbpflow.ops.cases import CASES, Example
from tests.sbpflow.ops.oracle.test_sbp_oracle import outputs_match, run_signature

all_cases.load()

MESH = placement("cpu", [0, 1])
MAX_CANDIDATES = 2000  # beyond this (ops with many tensors) the enumeration is skipped, not sampled
EXAMPLES = 5  # a candidate is reported when it passes on every example it applies to, and on two or more
CONFIRM = 2  # ... examples at least, for a warning (the file lists those seen once too)

REPORT: dict[str, list[str]] = {}  # case name -> report lines, written at the end of the module


class MissedSignatureWarning(UserWarning):
    """A signature that passes the oracle on every example (two or more) but is not in the op's table."""


def options(meta: TensorMeta, even: bool) -> list[Sbp]:
    """The 1-d SBPs a tensor may take on 2 ranks: splits that leave no rank empty, B, and P (not bool)."""
    out: list[Sbp] = [Split(i) for i, d in enumerate(meta.shape) if d >= 2 and (not even or d % 2 == 0)]
    out.append(B)
    if meta.dtype.value != "bool":
        out.append(P)
    return out


def candidates(
    op: OpDef, metas: tuple[TensorMeta, ...], outs: tuple[TensorMeta, ...]
) -> Iterator[NdSignature]:
    per_tensor = [options(m, op.even_splits) for m in (*metas, *outs)]
    for combo in product(*per_tensor):
        yield NdSignature(tuple((s,) for s in combo[: len(metas)]), tuple((s,) for s in combo[len(metas) :]))


def passes(op: OpDef, example: Example, expected: tuple, nd: NdSignature, rng: np.random.Generator) -> bool:
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid candidates feed kernels odd values (log of a share)
            got = run_signature(op, example, MESH, nd, rng)
    except (SbpflowError, ValueError, IndexError, TypeError, ArithmeticError):
        return False  # the kernel refused the local shapes/values, or B copies differ: not a valid row
    return all(outputs_match(g, w) for g, w in zip(got, expected, strict=True))


@dataclass
class Tally:
    """Per case, over its examples: how often each undeclared candidate was tried, and passed."""

    tried: Counter = field(default_factory=Counter)
    passed: Counter = field(default_factory=Counter)
    shapes: dict[str, str] = field(default_factory=dict)  # candidate -> shapes of an example it passed on
    skipped: list[str] = field(default_factory=list)
    degenerate: int = 0  # examples whose outputs are all zero, left out of the tally

    def confirmed(self, min_examples: int) -> list[str]:
        """Candidates valid on every example they were tried on, and tried on ``min_examples`` or more."""
        return [c for c, n in self.tried.items() if self.passed[c] == n >= min_examples]

    def lines(self, op: str) -> list[str]:
        rows = [
            f"{op:<20} {self.shapes[c]:<40} {c}   ({self.tried[c]}/{self.tried[c]} examples)"
            for c in self.confirmed(1)
        ]
        rows += [f"{op:<20} {s:<40} skipped: more than {MAX_CANDIDATES} candidates" for s in self.skipped]
        if self.degenerate:
            rows.append(f"{op:<20} {'':<40} {self.degenerate} example(s) with all-zero outputs left out")
        return rows


def check_example(op: OpDef, example: Example, seed: int, tally: Tally) -> list[NdSignature]:
    """Try every candidate on ``example``; returns the declared rows that fail."""
    attrs = op.normalize_attrs(example.attrs)
    metas = tuple(meta_of(x) for x in example.inputs)
    outs = op.run_infer(metas, attrs)
    rng = np.random.default_rng(seed)
    want = EagerBuilder().call(op.name, *example.inputs, **example.attrs)

    def valid(nd: NdSignature) -> bool:
        return passes(op, example, want, nd, rng)

    declared = op.nd_signatures(metas, attrs, MESH.shape)
    broken = [nd for nd in declared if not valid(nd)]
    shapes = (
        ", ".join(str(list(m.shape)) for m in metas) + " -> " + ", ".join(str(list(m.shape)) for m in outs)
    )
    if int(np.prod([len(options(m, op.even_splits)) for m in (*metas, *outs)])) > MAX_CANDIDATES:
        tally.skipped.append(shapes)
        return broken
    if not any(np.any(y) for y in want):
        tally.degenerate += 1  # all-zero outputs: every B -> P passes, the example tells nothing apart
        return broken
    known = set(declared)
    for nd in candidates(op, metas, outs):
        if nd in known:
            continue
        key = repr(nd)
        tally.tried[key] += 1
        if valid(nd):
            tally.passed[key] += 1
            tally.shapes.setdefault(key, shapes)
    return broken


@pytest.fixture(scope="module")
def report_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where the table goes; it is written once every case of the module has run."""
    env = os.environ.get("SBPFLOW_MISSED_SIGNATURES")
    path = Path(env) if env else tmp_path_factory.getbasetemp() / "missed_signatures.txt"
    yield path
    header = (
        f"{'op':<20} {'shapes (one example)':<40} signature valid on 2 ranks but not in the table "
        "(valid on every example it was tried on)\n"
    )
    lines = [line for name in sorted(REPORT) for line in REPORT[name]]
    path.write_text(header + "\n".join(lines) + "\n")
    print(f"\n{len(lines)} line(s) of missed signatures written to {path}")


@pytest.mark.parametrize("name", list(CASES))
def test_declared_rows_pass_and_report_missed(name: str, report_path: Path) -> None:
    c = CASES.get(name)
    op = get_op(c.op)
    tally = Tally()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        example = data.draw(c.examples, label="example")
        broken = check_example(op, example, data.draw(st.integers(0, 2**32 - 1), label="seed"), tally)
        assert not broken, (
            f"{c.op}: declared row(s) {broken} fail on 2 ranks for inputs "
            f"{[list(x.shape) for x in example.inputs]} (test_sbp_oracle says more)"
        )

    run()
    REPORT[name] = tally.lines(c.op)
    confirmed = tally.confirmed(CONFIRM)
    if confirmed:
        warnings.warn(
            MissedSignatureWarning(
                f"case {name!r}: valid on 2 ranks in every example tried ({EXAMPLES} drawn), but not in "
                f"{c.op!r}'s table: " + "; ".join(confirmed) + f" (table: {report_path})"
            ),
            stacklevel=1,
        )
