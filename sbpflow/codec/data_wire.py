"""A job's data source to and from the wire (``DataSource``): in-memory arrays and synthetic data here,
every file format through its registered :class:`~sbpflow.codec.formats.FileFormat` (the ``.npy`` arrays
and token files here, the other formats in their own modules, imported below so that they register)."""

from __future__ import annotations

from typing import Any

from sbpflow.codec import image_wire, table_wire, text_wire  # noqa: F401  (each registers its format)
from sbpflow.codec.formats import FORMATS, FileFormat, format_of, register
from sbpflow.codec.values import WireError, array_from_proto, array_to_proto, dtype_from_proto, dtype_to_proto
from sbpflow.data.sources import (
    ArrayFileSource,
    ArraySource,
    DataField,
    DataSource,
    FileSource,
    SyntheticSource,
    TokenFileSource,
)
from sbpflow.limits import LIMITS, check_whole
from sbpflow.v1 import job_pb2 as pb

register(
    FileFormat(
        "array_files",
        ArrayFileSource,
        lambda s: pb.ArrayFiles(paths=s.paths),
        lambda m, common: ArrayFileSource(paths=dict(sorted(m.paths.items())), **common),
    )
)
register(
    FileFormat(
        "token_file",
        TokenFileSource,
        lambda s: pb.TokenFile(path=s.path, dtype=dtype_to_proto(s.dtype), seq_len=s.seq_len),
        lambda m, common: TokenFileSource(
            path=m.path, dtype=dtype_from_proto(m.dtype), seq_len=m.seq_len, **common
        ),
    )
)


def _field_to_proto(f: DataField) -> pb.DataField:
    return pb.DataField(name=f.name, sample_shape=f.sample_shape, dtype=dtype_to_proto(f.dtype))


def _field_from_proto(m: pb.DataField) -> DataField:
    return DataField(m.name, tuple(m.sample_shape), dtype_from_proto(m.dtype))


def data_to_proto(d: DataSource) -> pb.DataSource:
    m = pb.DataSource(global_batch_size=d.batch_size, shuffle=d.shuffle, seed=d.seed, drop_last=d.drop_last)
    if isinstance(d, ArraySource):
        for k, a in d.arrays.items():
            m.in_memory.arrays[k].CopyFrom(array_to_proto(a))
    elif isinstance(d, FileSource):
        fmt = format_of(d)
        getattr(m, fmt.oneof).CopyFrom(fmt.to_proto(d))
    else:
        m.synthetic.CopyFrom(
            pb.Synthetic(kind=d.kind, params={**d.params, "num_samples": float(d.num_samples)})
        )
        m.fields.extend(_field_to_proto(f) for f in d.sample_fields)
    return m


def data_from_proto(m: pb.DataSource) -> DataSource:
    for unread in ("placement", "sbp"):  # the inputs' placements and SBPs are the graph's input tensors'
        if m.HasField(unread):
            raise WireError(
                f"DataSource.{unread} is set, but sbpflow does not read it: the graph's input tensors carry "
                "the placement and SBP of the data; leave it unset"
            )
    if m.fields and m.WhichOneof("kind") != "synthetic":
        raise WireError(
            "DataSource.fields is set for a non-synthetic source, which declares its own fields; leave it unset"
        )
    common: dict[str, Any] = dict(
        batch_size=m.global_batch_size, shuffle=m.shuffle, seed=m.seed, drop_last=m.drop_last
    )
    kind = m.WhichOneof("kind")
    if kind == "in_memory":
        return ArraySource(
            arrays={k: array_from_proto(m.in_memory.arrays[k]) for k in m.in_memory.arrays}, **common
        )
    if kind is not None and kind in FORMATS:
        return FORMATS.get(kind).from_proto(getattr(m, kind), common)
    if kind == "synthetic":
        params = dict(m.synthetic.params)
        n = check_whole(
            "DataSource.synthetic.params['num_samples']",
            params.pop("num_samples", 1 << 20),
            1,
            LIMITS.samples,
        )
        fields = tuple(_field_from_proto(f) for f in m.fields)
        return SyntheticSource(
            kind=m.synthetic.kind, sample_fields=fields, params=params, num_samples=n, **common
        )
    kinds = ", ".join(["in_memory", "synthetic", *FORMATS])
    raise WireError(f"the DataSource sets no kind; give one of {kinds}")
