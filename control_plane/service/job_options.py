"""Per-job run options: what a client may set for its own job at Submit (``SubmitJobRequest.options``),
checked against the server's.

The server's :class:`~sbpflow.runs.options.RunOptions` say how every job runs; a client may change, for
its job, only ``CLIENT_FIELDS``: ``timeout`` and ``max_restarts`` up to the server's own (a shared
service's limits), ``trace`` and ``return_parameters``. Where jobs run (``backend``, ``ray_address``) and
the threads they take are the server's: a request that sets one is refused with PERMISSION_DENIED
(:class:`OptionRefused`) naming the field. The options a client set are stored with the job (its record's
``options``, the bytes of the ``sbpflow.v1.RunOptions`` it sent), so a job re-queued after a
control-plane restart runs under them again (``for_run``: checked again under that server's options,
an option over a lowered limit brought down to it).

    job_options(request.options, server)      # the job's RunOptions, or OptionRefused / ValidationError
    for_run(server, record.options)           # the options its run starts with
"""

from __future__ import annotations

from sbpflow.codec.run_options import run_options_from_proto
from sbpflow.codec.wire import WireError
from sbpflow.control_plane.service.validation import ValidationError
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import CLIENT_FIELDS, FIELD_NAMES, RunOptions
from sbpflow.v1 import service_pb2 as sp

SERVER_FIELDS: tuple[str, ...] = tuple(n for n in FIELD_NAMES if n not in CLIENT_FIELDS)
CAPPED: tuple[str, ...] = ("timeout", "max_restarts")  # a job may ask for less than the server's, not more


class OptionRefused(SbpflowError, PermissionError):
    """A Submit that sets a run option the server keeps, or asks for more than the server allows."""


def job_options(m: sp.RunOptions, server: RunOptions) -> RunOptions:
    """The server's options with the job's ``m`` on top, checked (module docstring)."""
    for name in SERVER_FIELDS:
        if m.HasField(name):  # type: ignore[arg-type]
            raise OptionRefused(
                f"SubmitJobRequest.options.{name} is set by the server ({name}={getattr(server, name)!r} for "
                f"every job); leave it unset. A client may set {', '.join(CLIENT_FIELDS)}"
            )
    try:
        mine = run_options_from_proto(m, server)
    except WireError as e:
        raise ValidationError(f"SubmitJobRequest.options: {e}", kind="wire", field="options") from None
    for name in CAPPED:
        if getattr(mine, name) > getattr(server, name):
            raise OptionRefused(
                f"SubmitJobRequest.options.{name}={getattr(mine, name)!r} is more than this server allows; "
                f"give at most {getattr(server, name)!r} (the server's --{name.replace('_', '-')})"
            )
    return mine


def for_run(server: RunOptions, stored: bytes) -> RunOptions:
    """The options a stored job runs under: ``server``'s with the ones its client set (``stored``, the
    record's bytes) on top. A limit of the server lowered since Submit brings the job's down to it; a
    field this server keeps is its own."""
    m = sp.RunOptions.FromString(stored)
    for name in SERVER_FIELDS:
        m.ClearField(name)  # type: ignore[arg-type]
    mine = run_options_from_proto(m, server)
    return mine.replace(**{n: min(getattr(mine, n), getattr(server, n)) for n in CAPPED})
