"""The status contract of the control plane's gRPC services: every error a call ends with has a code
of :data:`CODES` (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, PERMISSION_DENIED, NOT_FOUND,
UNAVAILABLE)
or INTERNAL, and a message saying what to do; never UNKNOWN.

- :func:`contract` wraps every servicer method (unary and streaming): an sbpflow error gets its row's
  code, anything else INTERNAL with the traceback in the server's log and no internals in the message;
- :func:`guard` runs one step of a method under the same table;
- messages are capped (:data:`MAX_DETAILS`): gRPC carries them in a trailer of bounded size;
- a call refused for capacity (a caller past its fair share, the server saturated: ``isolation.py``) is
  RESOURCE_EXHAUSTED with ``retry-after-ms`` in its trailing metadata; without it RESOURCE_EXHAUSTED is
  a request too large (message, metadata, a job too big for the workers), which no retry cures, or
  gRPC's own backstop past ``maximum_concurrent_rpcs`` ("Concurrent RPC limit exceeded!");
- the request fields a method stores or looks up (job ids, client ids, idempotency keys) are bounded
  before any lookup (:func:`valid_job_id`, :func:`check_keys`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from sbpflow.control_plane.launch.ray_backend import SchedulingError
from sbpflow.control_plane.service.drain import Draining
from sbpflow.control_plane.service.job_options import OptionRefused
from sbpflow.control_plane.service.resume import NotResumable
from sbpflow.control_plane.service.validation import AdmissionError, ValidationError
from sbpflow.control_plane.store.db import StoreError, StoreUnavailable, UnknownJobError
from sbpflow.data.access import DataAccessDenied
from sbpflow.errors import SbpflowError

T = TypeVar("T")

# Exception type -> gRPC status code; the first matching row wins (subclasses before their bases).
CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (DataAccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    (OptionRefused, grpc.StatusCode.PERMISSION_DENIED),
    (AdmissionError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownJobError, grpc.StatusCode.NOT_FOUND),
    (NotResumable, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreError, grpc.StatusCode.INVALID_ARGUMENT),
    # only where a retry can help: the store could not write, the cluster could not be reached
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (SchedulingError, grpc.StatusCode.UNAVAILABLE),
    (SbpflowError, grpc.StatusCode.FAILED_PRECONDITION),
)


log = logging.getLogger("sbpflow.control_plane.service.server")
MAX_DETAILS = 4000  # characters of an error message: gRPC carries it in a trailer, whose size is capped
MAX_ID = 256  # characters of a job id in a request
MAX_OFFSET = 1 << 62  # a page token (an offset) SQLite can bind


def details(message: str) -> str:
    return (
        message
        if len(message) <= MAX_DETAILS
        else f"{message[: MAX_DETAILS - 40]}... ({len(message)} characters)"
    )


def fail(context: grpc.ServicerContext, e: BaseException) -> None:
    """Abort the call for ``e``: an sbpflow error by its row of ``CODES``, anything else INTERNAL (the
    traceback goes to the server's log, the client gets no internals). An abort already made passes."""
    if context.code() not in (None, grpc.StatusCode.OK):
        raise e  # context.abort's own exception, on its way out
    if isinstance(e, SbpflowError):
        context.abort(next(c for t, c in CODES if isinstance(e, t)), details(str(e) or type(e).__name__))
    log.exception("internal error serving a call")
    context.abort(
        grpc.StatusCode.INTERNAL,
        f"internal error in the control plane ({type(e).__name__}); the server's log has the traceback. "
        "Retry; if it persists, report it with the server log",
    )


def guard(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """Run ``fn``; an sbpflow error aborts the call with the code of its row in ``CODES``."""
    try:
        return fn()
    except SbpflowError as e:
        fail(context, e)
        raise  # unreachable: abort raises


def contract(fn: Callable[..., Any], streaming: bool, request_type: Any = None) -> Callable[..., Any]:
    """``fn`` (a servicer method) under the status contract: whatever it raises ends the call with a
    code of ``CODES`` or INTERNAL and a message, never UNKNOWN. With ``request_type`` the method is
    registered for raw bytes and the request is parsed here, so a malformed one is INVALID_ARGUMENT
    (gRPC's own deserializer would answer INTERNAL)."""

    def parsed(request: Any, context: grpc.ServicerContext) -> Any:
        if request_type is None:
            return request
        try:
            return request_type.FromString(request)
        except (DecodeError, ValueError, TypeError) as e:
            name = request_type.DESCRIPTOR.full_name
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name} protobuf ({e}); send a {name}")

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(parsed(request, context), context)
        except Exception as e:
            fail(context, e)

    def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(parsed(request, context), context)
        except Exception as e:
            fail(context, e)

    return stream if streaming else unary


def check_keys(context: grpc.ServicerContext, request: Any) -> None:
    """A Submit's or Resume's ``client_id`` and ``idempotency_key``: stored with the job, so bounded."""
    for name in ("client_id", "idempotency_key"):
        value = getattr(request, name)
        if len(value) > MAX_ID or not value.isprintable():
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{name} is {len(value)} characters{'' if value.isprintable() else ', not all printable'}; "
                f"give at most {MAX_ID} printable characters",
            )


def valid_job_id(context: grpc.ServicerContext, job_id: str) -> str:
    if len(job_id) > MAX_ID or not job_id.isprintable():
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"job_id={details(repr(job_id))[:80]} is not a job id; give the id Submit returned "
            "(`sbpflow list` shows them)",
        )
    return job_id
