"""A data source's own values against :class:`sbpflow.limits.Limits`, checked at Submit before any file
is opened (a file format checks its own, ``FileSource.check_limits``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sbpflow.data.sources import ArraySource, DataSource, FileSource, SyntheticSource
from sbpflow.limits import (
    LIMITS,
    Limits,
    check_count,
    check_float,
    check_int,
    check_name,
    check_shape,
    check_whole,
    refuse,
)


def check_data(d: DataSource, limits: Limits = LIMITS) -> None:
    """The source's own fields (file paths by length and characters only: whether a path may be read is
    the data-root policy's to say, and its contents the worker's)."""
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
    elif isinstance(d, FileSource):  # each format checks its own values
        d.check_limits(limits)
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
