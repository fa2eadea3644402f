"""Validation of a Submit call's job, before anything is stored or scheduled.

``validate_submit`` parses the serialised ``sbpflow.v1.Job``, converts it, verifies the graph, checks
that the job can train (a data source and a loss), and runs the compiler's graph passes (no lowering)
so that an impossible SBP, a bad pipeline staging or a placement larger than the cluster is refused at
Submit. :func:`compile_submit` returns that compile (a ``Compiled`` after the graph passes): the job
manager keeps it for the run, which only lowers it (``pipeline.finish``), so a job is compiled once.
Every failure is a ``ValidationError`` whose message keeps the underlying error's text (the op,
the tensors, the fix); the server maps it to INVALID_ARGUMENT. Nothing is written anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.v1 import job_pb2
from sbpflow.wire import WireError, job_from_proto

if TYPE_CHECKING:
    from sbpflow.control_plane.compiler.pipeline import Compiled
    from sbpflow.control_plane.data_policy import DataPolicy


class ValidationError(SbpflowError, ValueError):
    """A submitted job that cannot run; ``kind`` says which check refused it, ``field`` what it is about.

    kinds: ``malformed`` (not a Job protobuf), ``wire`` (a protobuf that does not describe a job),
    ``graph`` (the graph verifier), ``missing`` (no data source or loss), ``compile`` (a compiler pass:
    SBP, stages, placement vs the cluster), ``too_large`` (over the size limit).
    """

    def __init__(self, message: str, *, kind: str, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.field = field

    def __str__(self) -> str:
        return self.message


def _message(e: BaseException) -> str:
    return str(e) or type(e).__name__


def validate_submit(job_bytes: bytes, cluster_size: int | None, max_bytes: int | None = None) -> Job:
    """Parse, convert, verify and compile (without lowering) ``job_bytes``; return the ``Job``."""
    return compile_submit(job_bytes, cluster_size, max_bytes).state.job


def compile_submit(
    job_bytes: bytes,
    cluster_size: int | None,
    max_bytes: int | None = None,
    data_policy: DataPolicy | None = None,
) -> Compiled:
    """Parse, convert, verify and compile (without lowering) ``job_bytes``; return the compiled job, its
    graph passes done (``Compiled.state.job`` is the submitted ``Job``; lower it with ``pipeline.finish``).

    ``cluster_size``: the number of devices the job may use, or ``None`` to skip that check.
    ``max_bytes``: refuse a larger message before parsing it (``None``: no limit here).
    """
    if max_bytes is not None and len(job_bytes) > max_bytes:
        raise ValidationError(
            f"the job is {len(job_bytes)} bytes, over the limit of {max_bytes} bytes; make the job smaller "
            "(e.g. fewer inline arrays) or raise the server's message size limit",
            kind="too_large",
            field="job",
        )
    m = job_pb2.Job()
    try:
        m.ParseFromString(job_bytes)
    except (DecodeError, ValueError, TypeError) as e:
        raise ValidationError(
            f"malformed Job protobuf: {_message(e)}; send sbpflow.wire.job_to_proto(job).SerializeToString()",
            kind="malformed",
            field="job",
        ) from e
    try:
        job = job_from_proto(m)
    except WireError as e:
        raise ValidationError(_message(e), kind="wire", field="job") from e
    except SbpflowError as e:  # e.g. a JobConfig out of range, raised while converting
        raise ValidationError(_message(e), kind="wire", field="job.config") from e
    try:
        job.verify()
    except SbpflowError as e:
        raise ValidationError(_message(e), kind="graph", field="job.graph") from e
    if data_policy is not None:  # before anything opens a file the job names (PERMISSION_DENIED)
        data_policy.check(job)
    if job.data is None:
        raise ValidationError(
            f"job {job.name!r} has no data source; give the job one (e.g. pass a sbpflow.data source to "
            "Graph.trace(data, ...)) so that its inputs can be fed",
            kind="missing",
            field="job.data",
        )
    if not job.loss:
        raise ValidationError(
            f"job {job.name!r} has no loss tensor; return the loss from Graph.build and call "
            "loss.backward() so that the job has something to train on",
            kind="missing",
            field="job.loss",
        )
    from sbpflow.control_plane.compiler import pipeline

    try:
        return pipeline.compile(job, cluster_size=cluster_size, lower="none")
    except SbpflowError as e:
        raise ValidationError(_message(e), kind="compile", field="job.graph") from e
