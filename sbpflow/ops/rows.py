"""Generators for the SBP rows that many ops share, so that each op's table is one line.

Reading guide: ``S(i)`` on an input means the op can work on a slice along ``i`` and give the matching
slice of its output; ``P`` on an input is allowed only where the op is linear in that input (and every
other input is ``B``), because sum-of-parts in gives sum-of-parts out only for linear maps.
"""

from __future__ import annotations

from collections.abc import Sequence

from sbpflow.ops.base import Metas, Signature
from sbpflow.sbp import B, P, Sbp, Split


def all_broadcast(n_in: int, n_out: int) -> Signature:
    """Every op may run replicated: whole inputs everywhere give whole outputs everywhere."""
    return Signature((B,) * n_in, (B,) * n_out)


def elementwise(metas: Metas, n_out: int = 1, linear: Sequence[bool] = ()) -> list[Signature]:
    """Same-shape inputs and outputs: split any axis alike; ``P`` through the linear inputs."""
    ndim = metas[0].ndim
    rows = [Signature((Split(i),) * len(metas), (Split(i),) * n_out) for i in range(ndim)]
    rows.append(all_broadcast(len(metas), n_out))
    rows += _partial_rows(len(metas), n_out, linear)
    return rows


def _partial_rows(n_in: int, n_out: int, linear: Sequence[bool]) -> list[Signature]:
    rows = []
    for i, lin in enumerate(linear):
        if lin:
            ins = tuple(P if j == i else B for j in range(n_in))
            rows.append(Signature(ins, (P,) * n_out))
    return rows


def broadcasting(
    metas: Metas, out_ndim: int, linear: Sequence[bool] = (), sum_partial: bool = False
) -> list[Signature]:
    """Numpy-broadcasting n-ary op: split an output axis and every input axis aligned with it.

    An input whose aligned axis has size 1 (or is missing) takes the whole of it: ``B`` there.
    ``sum_partial`` adds ``P, P -> P`` (add and sub are linear in all inputs at once).
    """
    rows = []
    out_shape = _broadcast_shape([m.shape for m in metas])
    for axis in range(out_ndim):
        ins: list[Sbp] = []
        for m in metas:
            a = axis - (out_ndim - m.ndim)
            ins.append(Split(a) if a >= 0 and m.shape[a] == out_shape[axis] else B)
        if any(isinstance(s, Split) for s in ins):
            rows.append(Signature(tuple(ins), (Split(axis),)))
    rows.append(all_broadcast(len(metas), 1))
    rows += _partial_rows(len(metas), 1, linear)
    if sum_partial:
        rows.append(Signature((P,) * len(metas), (P,)))
    return rows


def _broadcast_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max(len(s) for s in shapes)
    out = []
    for axis in range(ndim):
        sizes = {s[axis - (ndim - len(s))] for s in shapes if axis - (ndim - len(s)) >= 0}
        sizes.discard(1)
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def einsum(spec: str) -> list[Signature]:
    """Rows of a contraction from its einsum string, e.g. ``"mk,kn->mn"``.

    A letter kept in the output: split it wherever it appears. A contracted letter: split it in every
    input -> the output is a partial sum. Plus ``P`` through any one input (a contraction is linear in
    each input) and the replicated row.
    """
    lhs, out = spec.replace(" ", "").split("->")
    operands = lhs.split(",")
    rows = []
    for letter in dict.fromkeys(lhs.replace(",", "")):
        ins = tuple(Split(op.index(letter)) if letter in op else B for op in operands)
        outs = (Split(out.index(letter)),) if letter in out else (P,)
        rows.append(Signature(ins, outs))
    rows.append(all_broadcast(len(operands), 1))
    rows += _partial_rows(len(operands), 1, [True] * len(operands))
    return rows
