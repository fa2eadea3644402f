"""The bounds on every number and name a job carries, in one table, and the check that applies them.

A job is untrusted input at Submit: anything the compiler or a worker does in proportion to a number
the user chose (a stage, a step count, a shape, a name written into every store row and metric label)
must be bounded before that work starts. :class:`Limits` is the table; :func:`check_graph` and
:func:`check_data` walk a job's graph and data source and raise :class:`LimitError` at the first value
outside it, naming the field, the value, the limit and the fix (``sbpflow.job.check_job`` walks the rest of
a job with the same helpers, as part of ``Job.verify``). ``sbpflow.codec.wire`` calls the same helpers while it
converts a protobuf (a shape is checked before numpy multiplies it out).

Every check here is cheap: linear in the size of the job message, never in a number inside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sbpflow.errors import SbpflowError

if TYPE_CHECKING:
    from sbpflow.data.sources import DataSource
    from sbpflow.graph import Graph
    from sbpflow.placement import Placement


class LimitError(SbpflowError, ValueError):
    """A job value outside :class:`Limits` (or not finite); ``field`` names where it is."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Limits:
    """The largest value each kind of job field may take (the smallest is in the check that uses it)."""

    name_chars: int = 256  # job, tensor, op, field, parameter names; op types, scopes, attribute keys
    path_chars: int = 4096  # data file paths
    text_chars: int = 4096  # string attribute values
    steps: int = 10**9  # JobConfig.steps, checkpoint_every, schedule steps
    stage: int = 1023  # OpNode.stage: pipeline stages 0 .. 1023
    micro_batches: int = 1 << 16  # gradient_accumulation_steps x micro_batches
    rank: int = (1 << 16) - 1  # placement ranks 0 .. 65535
    mesh_axes: int = 8  # axes of a placement's mesh (and entries of an nd-SBP)
    ndim: int = 32  # axes of a tensor
    numel: int = 1 << 48  # elements of one tensor (x 8 bytes stays far from int64's 2**63)
    batch_size: int = 1 << 31
    samples: int = 1 << 48  # a synthetic source's num_samples
    list_items: int = 1 << 16  # entries of an int or float list attribute
    count: int = 1 << 20  # tensors, ops, parameters, fetches, data fields, arrays, files of one job
    magnitude: float = 1e30  # any float hyper-parameter or attribute (|x|), besides being finite
    int_attr: int = 1 << 62  # |x| of an integer attribute


LIMITS = Limits()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def refuse(where: str, value: Any, problem: str, fix: str) -> LimitError:
    """The error for ``where=value``: what is wrong (with the limit) and the fix."""
    return LimitError(f"{where}={_shown(value)}: {problem}; {fix}", field=where)


# ---- the checks, one per kind of value ------------------------------------------------------------


def check_int(where: str, value: Any, lo: int, hi: int, fix: str = "") -> int:
    """An int (never a bool) in ``lo .. hi``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse(where, value, "must be an integer", fix or f"give an integer in {lo}..{hi}")
    if not lo <= value <= hi:
        raise refuse(where, value, f"is outside {lo}..{hi}", fix or f"give a value in {lo}..{hi}")
    return value


def check_float(
    where: str, value: Any, lo: float = -LIMITS.magnitude, hi: float = LIMITS.magnitude, fix: str = ""
) -> float:
    """A finite float in ``[lo, hi]`` (NaN and infinities are refused everywhere)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse(where, value, "must be a number", fix or f"give a finite number in [{lo:g}, {hi:g}]")
    if not math.isfinite(value):
        raise refuse(where, value, "is not finite", fix or f"give a finite number in [{lo:g}, {hi:g}]")
    if not lo <= value <= hi:
        raise refuse(where, value, f"is outside [{lo:g}, {hi:g}]", fix or f"give a value in [{lo:g}, {hi:g}]")
    return float(value)


def check_whole(where: str, value: float, lo: int, hi: int) -> int:
    """A float that carries an integer (a synthetic source's sizes): finite, whole, in ``lo .. hi``."""
    check_float(where, value, lo, hi, f"give a whole number in {lo}..{hi}")
    if value != int(value):
        raise refuse(where, value, "is not a whole number", f"give a whole number in {lo}..{hi}")
    return int(value)


def check_name(where: str, value: Any, limits: Limits = LIMITS, empty: bool = False, chars: int = 0) -> str:
    """A printable string of at most ``chars`` (default ``limits.name_chars``) characters, non-empty
    unless ``empty``."""
    chars = chars or limits.name_chars
    if not isinstance(value, str):
        raise refuse(where, value, "must be a string", "give a printable name")
    if len(value) > chars:
        raise refuse(
            where, value, f"is {len(value)} characters, over the limit of {chars}", "use a shorter name"
        )
    if not value and not empty:
        raise refuse(where, value, "is empty", "give a non-empty name")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise refuse(
            where, value, f"holds the unprintable character {bad!r}", "use printable characters only"
        )
    return value


def check_count(where: str, items: Any, limits: Limits = LIMITS, most: int = 0) -> None:
    most = most or limits.count
    if len(items) > most:
        raise refuse(
            where, f"<{len(items)} entries>", f"has more than {most} entries", "make the job smaller"
        )


def check_shape(where: str, shape: Any, limits: Limits = LIMITS) -> tuple[int, ...]:
    """At most ``limits.ndim`` sizes, each >= 0, whose product is at most ``limits.numel`` (computed on
    Python ints, so it never wraps as an int64 product does)."""
    shape = tuple(shape)
    if len(shape) > limits.ndim:
        raise refuse(
            where, shape, f"has {len(shape)} axes, over the limit of {limits.ndim}", "use fewer axes"
        )
    numel = 1
    for i, d in enumerate(shape):
        check_int(f"{where}[{i}]", d, 0, limits.numel, f"give a size in 0..{limits.numel}")
        numel *= d
    if numel > limits.numel:
        raise refuse(
            where,
            list(shape),
            f"holds {numel} elements, over the limit of {limits.numel}",
            "use smaller sizes",
        )
    return shape


def check_placement(where: str, p: Placement, limits: Limits = LIMITS) -> None:
    """Ranks in ``0 .. limits.rank`` on at most ``limits.mesh_axes`` axes (``Placement`` itself refuses
    repeated ranks and a mesh that does not hold them)."""
    if p.ndim > limits.mesh_axes:
        raise refuse(
            f"{where}.mesh_shape", list(p.shape), f"has over {limits.mesh_axes} axes", "use a smaller mesh"
        )
    top = max(p.ranks)
    if top > limits.rank:
        raise refuse(
            f"{where}.ranks",
            top,
            f"is over the largest rank {limits.rank}",
            "use ranks 0.. the cluster's size",
        )


def check_attr(where: str, value: Any, limits: Limits = LIMITS) -> None:
    """An op attribute: bounded ints, finite floats, printable strings, bounded lists."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        check_int(where, value, -limits.int_attr, limits.int_attr)
    elif isinstance(value, float):
        check_float(where, value, -limits.magnitude, limits.magnitude)
    elif isinstance(value, str):
        check_name(where, value, limits, empty=True, chars=limits.text_chars)
    elif isinstance(value, tuple):
        check_count(where, value, limits, limits.list_items)
        for i, v in enumerate(value):
            check_attr(f"{where}[{i}]", v, limits)


# ---- the graph and the data ------------------------------------------------------------------------


def check_graph(g: Graph, limits: Limits = LIMITS) -> None:
    check_count("job.graph.tensors", g.tensors, limits)
    check_count("job.graph.ops", g.ops, limits)
    for name, t in g.tensors.items():
        where = f"tensor {name[:40]!r}"
        check_name(f"{where}.name", name, limits)
        check_shape(f"{where}.shape", t.meta.shape, limits)
        if t.placement is not None:
            check_placement(f"{where}.placement", t.placement, limits)
    for node in g.ops:
        where = f"op {node.name[:40]!r}"
        check_name(f"{where}.name", node.name, limits)
        check_name(f"{where}.op_type", node.op_type, limits)
        check_name(f"{where}.scope", node.scope, limits, empty=True, chars=limits.text_chars)
        check_int(f"{where}.stage", node.stage, 0, limits.stage, f"number pipeline stages 0..{limits.stage}")
        for names, what in ((node.inputs, "inputs"), (node.outputs, "outputs")):
            check_count(f"{where}.{what}", names, limits, limits.list_items)
        check_count(f"{where}.attrs", node.attrs, limits, limits.list_items)
        for key, value in node.attrs.items():
            check_name(f"{where}.attrs key", key, limits)
            check_attr(f"{where}.attrs[{key!r}]", value, limits)
        if node.placement is not None:
            check_placement(f"{where}.placement", node.placement, limits)


def check_data(d: DataSource, limits: Limits = LIMITS) -> None:
    """The source's own fields (file paths by length and characters only: whether a path may be read is
    the data-root policy's to say, and its contents the worker's)."""
    from sbpflow.data.sources import ArrayFileSource, ArraySource, SyntheticSource, TokenFileSource

    check_int("job.data.global_batch_size", d.batch_size, 1, limits.batch_size)
    check_int("job.data.seed", d.seed, 0, (1 << 64) - 1)
    if isinstance(d, SyntheticSource):
        check_name("job.data.synthetic.kind", d.kind, limits)
        check_int(
            "job.data.synthetic.num_samples",
            d.num_samples,
            d.batch_size,
            limits.samples,
            f"give at least one batch ({d.batch_size}) and at most {limits.samples} samples",
        )
        check_count("job.data.synthetic.params", d.params, limits, limits.list_items)
        for key, value in d.params.items():
            check_name("job.data.synthetic.params key", key, limits)
            check_float(f"job.data.synthetic.params[{key!r}]", value)
        for key in ("in", "out", "seq_len", "vocab"):
            if key in d.params:
                check_whole(f"job.data.synthetic.params[{key!r}]", d.params[key], 1, limits.numel)
        _check_fields("job.data.fields", d.sample_fields, limits)
    elif isinstance(d, TokenFileSource):
        check_name("job.data.token_file.path", d.path, limits, chars=limits.path_chars)
        check_int("job.data.token_file.seq_len", d.seq_len, 1, limits.numel)
    elif isinstance(d, ArrayFileSource):
        check_count("job.data.array_files.paths", d.paths, limits)
        for key, path in d.paths.items():
            check_name("job.data.array_files.paths key", key, limits)
            check_name(f"job.data.array_files.paths[{key!r}]", path, limits, chars=limits.path_chars)
    elif isinstance(d, ArraySource):
        check_count("job.data.in_memory.arrays", d.arrays, limits)
        lengths = {k: len(a) if a.ndim else 0 for k, a in d.arrays.items()}
        for key in d.arrays:
            check_name("job.data.in_memory.arrays key", key, limits)
            check_int(
                f"job.data.in_memory.arrays[{key!r}] samples",
                lengths[key],
                d.batch_size,
                limits.samples,
                f"give every array at least one batch ({d.batch_size}) of samples",
            )
        if len(set(lengths.values())) > 1:
            raise refuse(
                "job.data.in_memory.arrays",
                lengths,
                "hold different sample counts",
                "give every array the same first dimension",
            )


def _check_fields(where: str, items: Iterable[Any], limits: Limits) -> None:
    items = tuple(items)
    check_count(where, items, limits)
    for i, f in enumerate(items):
        check_name(f"{where}[{i}].name", f.name, limits)
        check_shape(f"{where}[{i}].sample_shape", f.sample_shape, limits)
