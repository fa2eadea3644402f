"""The run options (``sbpflow.v1.RunOptions``, service.proto's) to and from their protobuf, for the job
services: what a client sets for its job at Submit, and what Get shows a job runs under."""

from __future__ import annotations

from sbpflow.codec.wire import WireError
from sbpflow.runs.options import FIELD_NAMES, RunOptions, RunOptionsError
from sbpflow.v1 import service_pb2 as sp


def run_options_to_proto(o: RunOptions) -> sp.RunOptions:
    """Every field set (``ray_address`` only when there is one)."""
    values = {f: getattr(o, f) for f in FIELD_NAMES}
    return sp.RunOptions(**{k: v for k, v in values.items() if v is not None})


def run_options_from_proto(m: sp.RunOptions, base: RunOptions | None = None) -> RunOptions:
    """``base`` (default ``RunOptions()``) with the fields ``m`` sets; a value out of range is a WireError
    naming the field, as for a job."""
    given = {fd.name: value for fd, value in m.ListFields()}  # the fields it sets
    try:
        return (base or RunOptions()).replace(**given)
    except RunOptionsError as e:
        raise WireError(f"RunOptions.{e}") from None
