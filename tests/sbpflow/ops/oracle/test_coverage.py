"""Every registered op is declared completely and tested; every test case names a registered op.

Per op: a case in some ``cases_<family>.py``, input and output names, a doc, a gradient rule (a
function, or ``NoGrad`` with its reason), SBP rows that are well formed on drawn examples (one entry per
tensor, split axes in range, the all-``B`` row present) and that, for an op with inputs, offer at least
one row other than all-``B`` (else the op can only run replicated). A gradient rule must be checked by
some case (a non-empty ``differentiable``), and a ``NoGrad`` op must not claim differentiable inputs.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sbpflow.ops  # noqa: F401  (registers every op family)
from sbpflow.errors import SbpError
from sbpflow.ops.base import OPS, NoGrad, OpDef, Signature
from sbpflow.ops.eager import meta_of
from sbpflow.sbp import Broadcast, check_axes
from tests.sbpflow.ops import all_cases
from tests.sbpflow.ops.cases import CASES, Example, OpCase

all_cases.load()

CASES_BY_OP: dict[str, list[OpCase]] = {}
for _, _c in CASES.items():
    CASES_BY_OP.setdefault(_c.op, []).append(_c)

QUICK = settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def rows_of(op: OpDef, example: Example) -> list[Signature]:
    metas = tuple(meta_of(x) for x in example.inputs)
    return list(op.rows(metas, op.normalize_attrs(example.attrs)))


def declaration_problems(op: OpDef) -> list[str]:
    problems = []
    if not op.doc.strip():
        problems.append("no doc (defop(..., doc='what it computes, and why its rows hold'))")
    for kind, names in (("input", op.inputs), ("output", op.outputs)):
        bare = [n.lstrip("*") for n in names]
        if not all(n.isidentifier() for n in bare) or len(set(bare)) != len(bare):
            problems.append(f"{kind} names {list(names)} are not distinct identifiers")
    if not op.outputs:
        problems.append("no output names")
    clash = sorted(set(n.lstrip("*") for n in op.inputs) & set(op.attrs))
    if clash:
        problems.append(f"attribute(s) {clash} share a name with an input")
    if isinstance(op.grad, NoGrad):
        if not op.grad.reason.strip():
            problems.append("NoGrad without a reason (say why: a backward op, an integer result, ...)")
    elif not callable(op.grad):
        problems.append(f"gradient rule {op.grad!r} is neither a function nor NoGrad")
    return problems


def case_problems(op: OpDef) -> list[str]:
    cases = CASES_BY_OP.get(op.name, [])
    if not cases:
        return [f"no OpCase: add case(OpCase({op.name!r}, ...)) to the family's tests/sbpflow/ops/cases_*.py"]
    checked = [c.name or c.op for c in cases if c.differentiable or c.stops_gradient]
    if isinstance(op.grad, NoGrad) and checked:
        return [f"takes no gradient ({op.grad.reason}) but case(s) {checked} mark inputs differentiable"]
    if not isinstance(op.grad, NoGrad) and op.inputs and not checked:
        return ["has a gradient rule that no case checks: give some case a non-empty `differentiable`"]
    return []


@pytest.mark.parametrize("name", list(OPS))
def test_op_is_declared_and_covered(name: str) -> None:
    op = OPS.get(name)
    problems = declaration_problems(op) + case_problems(op)
    assert not problems, f"op {name!r}: " + "; ".join(problems)


@pytest.mark.parametrize("name", list(CASES))
def test_case_names_a_registered_op(name: str) -> None:
    c = CASES.get(name)
    assert c.op in OPS, (
        f"case {name!r} is for op {c.op!r}, which is not registered; known ops close to it: "
        f"{[n for n in OPS if n[:3] == c.op[:3]]} (is its family imported in sbpflow/ops/__init__.py?)"
    )


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.op in OPS])
@QUICK
@given(data=st.data())
def test_rows_are_well_formed(name: str, data: st.DataObject) -> None:
    c = CASES.get(name)
    op = OPS.get(c.op)
    example = data.draw(c.examples, label="example")
    op.check_arity(len(example.inputs))
    attrs = op.normalize_attrs(example.attrs)
    metas = tuple(meta_of(x) for x in example.inputs)
    outs = op.run_infer(metas, attrs)
    rows = rows_of(op, example)
    assert Signature((Broadcast(),) * len(metas), (Broadcast(),) * len(outs)) in rows, (
        f"{c.op}: no all-B row for inputs {[list(m.shape) for m in metas]}; every op may run replicated "
        "(rows.all_broadcast)"
    )
    for row in rows:
        assert len(row.ins) == len(metas) and len(row.outs) == len(outs), (
            f"{c.op}: row {row} has {len(row.ins)} -> {len(row.outs)} entries for "
            f"{len(metas)} inputs -> {len(outs)} outputs"
        )
        for what, s, m in zip(
            [
                *(f"input {i}" for i in range(len(metas))),
                *(f"output {op.output_name(i)!r}" for i in range(len(outs))),
            ],
            (*row.ins, *row.outs),
            (*metas, *outs),
            strict=True,
        ):
            try:
                check_axes((s,), m.ndim, f"{c.op} {what} {m}")
            except SbpError as e:
                raise AssertionError(f"{c.op}: row {row}: {e}") from None


def has_sharded_row(op: OpDef, example: Example) -> bool:
    return any(not all(isinstance(s, Broadcast) for s in (*r.ins, *r.outs)) for r in rows_of(op, example))


@pytest.mark.parametrize("name", [n for n in OPS if n in CASES_BY_OP and OPS.get(n).inputs])
def test_op_has_a_row_other_than_broadcast(name: str) -> None:
    op = OPS.get(name)
    found = []

    for c in CASES_BY_OP[name]:

        @settings(QUICK, max_examples=10)
        @given(example=c.examples)
        def probe(example: Example) -> None:
            found.append(has_sharded_row(op, example))

        probe()
        if any(found):
            return
    pytest.fail(
        f"op {name!r}: on none of {len(found)} drawn examples do its rows offer anything but all-B, so it "
        "can only run replicated; add S rows (rows.elementwise / rows.broadcasting / rows.einsum) or P rows where linear"
    )


def test_the_checks_catch_an_incomplete_op() -> None:
    """The harness itself: an op declared with every flaw is named with every flaw."""
    bad = OpDef(
        "not_registered_op",
        ("x", "x"),
        ("y",),
        infer=lambda m, a: m,
        rows=lambda m, a: [],
        kernel=lambda ctx, x, y: x,
        grad=NoGrad(" "),
        attrs={"x": 1},
    )
    problems = " | ".join(declaration_problems(bad) + case_problems(bad))
    for part in ("no doc", "input names", "share a name", "NoGrad without a reason", "no OpCase"):
        assert part in problems, f"{part!r} not reported in {problems!r}"
