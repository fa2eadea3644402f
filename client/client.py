"""``sf.Client``: submit jobs to a control plane over gRPC, watch them, cancel them, fetch their results.

    client = sf.Client("127.0.0.1:50051", token=os.environ.get("SBPFLOW_TOKEN"))
    handle = client.submit(job)          # a sbpflow.Job (traced), validated by the server
    handle.watch()                       # progress bar until the job ends; returns its final JobStatus
    result = handle.result()             # JobOutcome: state, losses, parameters (numpy arrays)
    client.list(), client.get(job_id)    # JobStatus messages (sbpflow.v1.JobStatus)
    again = client.resume(job_id, job=make_job(ranks=2, tp=True))  # a new job from its latest checkpoint

Server errors come back as ``ClientError`` with the gRPC status code and the server's message (for a
refused job, the op, the tensors and the fix). ``tls_ca``: a PEM file to trust (the server's certificate
or its CA); without it the channel is plaintext. Each call carries ``sbpflow-client-id`` metadata (the
``client_id`` given, else a fresh one per Client), which the server's fair shares count by.

Retries (``RetryPolicy``): a unary call that ends UNAVAILABLE or DEADLINE_EXCEEDED is tried again after a
jittered, doubling back-off, within the policy's attempts and overall deadline; RESOURCE_EXHAUSTED only
when the server names a wait (trailing metadata ``retry-after-ms``). ``timeout`` bounds each attempt.
Submit and Resume are safe to retry because every logical call carries an idempotency key (a fresh uuid4
unless the caller gives one), the same key on each attempt: the server stores a job once per
(``client_id``, key) and answers a repeat with the job it stored. A call that still fails raises a
``ClientError`` whose ``idempotency_key`` lets the caller retry the same logical call later.
"""

from __future__ import annotations

import builtins
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
import numpy as np

from sbpflow.control_plane.service.isolation import CLIENT_ID_KEY, RETRY_AFTER_KEY
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import CLIENT_FIELDS, FIELD_NAMES
from sbpflow.v1 import job_pb2
from sbpflow.v1 import service_pb2 as sp
from sbpflow.v1 import service_pb2_grpc as sg

TERMINAL = frozenset({sp.JOB_STATE_SUCCEEDED, sp.JOB_STATE_FAILED, sp.JOB_STATE_CANCELLED})
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ClientError(SbpflowError):
    """A call the control plane refused or could not answer; ``code`` is the gRPC status code, ``details``
    the server's (or gRPC's) message. ``text`` replaces ``CODE: details`` as the message where the cause
    is known (no server at the address, a server that does not speak gRPC)."""

    def __init__(self, code: grpc.StatusCode, message: str, text: str = "") -> None:
        super().__init__(text or f"{code.name}: {message}")
        self.code = code
        self.details = message
        self.idempotency_key = ""  # a failed Submit's or Resume's key: pass it again to retry that call


@dataclass(frozen=True)
class RetryPolicy:
    """How a unary call is retried: at most ``attempts`` tries within ``deadline`` seconds in all, the
    n-th wait drawn uniformly from [0, min(``max_backoff``, ``backoff`` * 2**n)] ("full jitter", so that
    many clients refused at once do not come back at once). ``RetryPolicy(attempts=1)``: never retry."""

    attempts: int = 5
    backoff: float = 0.05
    max_backoff: float = 2.0
    deadline: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or not 0 <= self.backoff <= self.max_backoff or not self.deadline > 0:
            raise SbpflowError(
                f"{self}: give attempts >= 1, 0 <= backoff <= max_backoff and a positive deadline"
            )

    def wait(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_backoff, self.backoff * 2**attempt))


# the codes after which a retry may succeed: the server was not reached or did not answer in time (with an
# idempotency key a Submit that did reach it is answered with the same job); RESOURCE_EXHAUSTED only with
# the server's own retry-after-ms, since it also means "this request is too large", which no retry cures
RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
RETRY_AFTER = RETRY_AFTER_KEY


def _retry_after(e: grpc.RpcError) -> float | None:
    """The server's retry hint of a RESOURCE_EXHAUSTED answer, in seconds (None: no hint)."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
        return None
    for key, value in e.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == RETRY_AFTER:
            try:
                return max(0.0, int(value) / 1000)
            except (TypeError, ValueError):  # a hint we cannot read is no hint
                return None
    return None


# gRPC's words for "nothing answered" and for "something answered, but not in HTTP/2" (an HTTP/1 server)
_NOBODY = ("failed to connect to all addresses", "Connection refused", "errors resolving", "Socket closed")
_NOT_GRPC = ("Failed parsing HTTP/2", "http1.x server", "Expected SETTINGS frame")


def _error(e: grpc.RpcError, address: str) -> ClientError:
    """A ``ClientError`` for a failed call, in plain words where the channel never reached a server."""
    code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
    text = ""
    if code == grpc.StatusCode.UNAVAILABLE and any(w in details for w in _NOT_GRPC):
        text = (
            f"{address} answers, but not as a gRPC control plane (an HTTP port? `sbpflow server` serves "
            "gRPC on --port, 50051 by default, and its status page on --http-port)"
        )
    elif code == grpc.StatusCode.UNAVAILABLE and any(w in details for w in _NOBODY):
        text = (
            f"no control plane at {address}: start one with `sbpflow server`, or point --address "
            f"(env SBPFLOW_ADDRESS) at yours ({details.rsplit(': ', 1)[-1]})"
        )
    return ClientError(code, details, text)


def _call(fn: Any, request: Any, address: str, policy: RetryPolicy, timeout: float, **kwargs: Any) -> Any:
    """``fn(request)`` under ``policy``: each attempt within ``timeout`` seconds and what is left of the
    policy's deadline; the last failure as a ``ClientError``."""
    end = time.monotonic() + policy.deadline
    attempt = 0
    while True:
        try:
            return fn(request, timeout=max(0.001, min(timeout, end - time.monotonic())), **kwargs)
        except grpc.RpcError as e:
            hint = _retry_after(e)
            if hint is None and e.code() not in RETRIED:  # type: ignore[attr-defined]
                raise _error(e, address) from None
            attempt += 1
            pause = policy.wait(attempt - 1) if hint is None else hint
            if attempt >= policy.attempts or time.monotonic() + pause >= end:
                raise _error(e, address) from None
            time.sleep(pause)


def _job_proto(job: Any) -> job_pb2.Job:
    """A ``sbpflow.Job`` as its protobuf (a protobuf as it is)."""
    if isinstance(job, job_pb2.Job):
        return job
    from sbpflow.codec.wire import job_to_proto

    return job_to_proto(job)


def _refuse_held_values(job: Any) -> None:
    """A job traced from modules that hold values (trained by ``sf.run``, loaded, or drawn by
    ``state_dict``) would start on a server from its initializers: the values do not cross the wire."""
    bound = getattr(job, "bound", None)
    if bound is not None and bound.held():
        raise SbpflowError(
            f"job {job.name!r} was traced from modules that hold values (trained by sf.run, loaded with "
            "load_state_dict, or drawn by state_dict); a server cannot be sent them and would start from the "
            "initializers: run it here with sf.run, or trace it from fresh modules"
        )


@dataclass(frozen=True)
class JobOutcome:
    """What a finished job produced: its end state, the loss per step, the trained parameters and the last
    value of each tensor ``build`` returned besides the loss."""

    job_id: str
    state: str  # "SUCCEEDED", "FAILED" or "CANCELLED"
    losses: list[float]
    parameters: dict[str, np.ndarray]
    fetches: dict[str, np.ndarray] = field(default_factory=dict)  # each fetch's last step (logits, ...)
    omitted_fetches: list[str] = field(default_factory=list)  # over the result's size limit


def _inside(root: Path, checkpoint: str, file: str) -> Path:
    """Where a checkpoint file from the server goes: under ``root``, never outside it."""
    parts = [checkpoint, *file.split("/")]
    if not checkpoint or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise ClientError(
            grpc.StatusCode.DATA_LOSS,
            f"the server named a checkpoint file {checkpoint!r}/{file!r} outside its folder; refused",
        )
    return root.joinpath(*parts)


class Client:
    """A connection to one control plane."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy = RetryPolicy(),
        client_id: str | None = None,
    ) -> None:
        self.address, self.timeout, self.retry = address, timeout, retry
        # which client this is, for the server's fair shares (two Clients of one process share a
        # connection, since gRPC pools them): a fresh id unless the caller names one
        self.client_id = client_id or uuid.uuid4().hex
        auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._metadata = ((CLIENT_ID_KEY, self.client_id), *auth)
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]  # fmt: skip
        if tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = sg.JobServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, name: str, request: Any) -> Any:
        """One call, retried under ``self.retry`` (each unary method is safe to repeat: reads, Cancel of a
        job that is already stopping, and Submit/Resume with their idempotency key)."""
        try:
            return _call(
                getattr(self._stub, name),
                request,
                self.address,
                self.retry,
                self.timeout,
                metadata=self._metadata,
            )
        except ClientError as e:
            e.idempotency_key = getattr(request, "idempotency_key", "")
            raise

    def _stream(self, name: str, request: Any) -> Iterator[Any]:
        stream = getattr(self._stub, name)(request, metadata=self._metadata)
        try:
            yield from stream
        except grpc.RpcError as e:
            raise _error(e, self.address) from None
        finally:
            stream.cancel()

    # ---- the API ----------------------------------------------------------------------------------

    def submit(
        self, job: Any, client_id: str = "", idempotency_key: str = "", **options: float | int | bool | None
    ) -> JobHandle:
        """Submit a ``sbpflow.Job`` (or its ``sbpflow.v1.Job`` protobuf); returns a handle once stored.

        ``options``: this job's own run options, within the server's — ``timeout`` (seconds) and
        ``max_restarts`` up to the server's, ``trace``, ``return_parameters``; None or absent: the
        server's (``client.submit(job, timeout=600, max_restarts=2)``). The server refuses the rest
        (backend, ray_address, threads: PERMISSION_DENIED, "set by the server") and more than it allows.

        ``idempotency_key``: this logical submission's (default a fresh uuid4); a retry with the same key
        and ``client_id`` returns the job stored first instead of a second one."""
        unknown = sorted(set(options) - set(FIELD_NAMES))
        if unknown:
            raise TypeError(
                f"submit() got unexpected keyword(s) {unknown}; a job's run options are {list(CLIENT_FIELDS)}"
            )
        given = {k: v for k, v in options.items() if v is not None}
        _refuse_held_values(job)
        req = sp.SubmitJobRequest(
            job=_job_proto(job),
            client_id=client_id,
            idempotency_key=idempotency_key or uuid.uuid4().hex,
            options=sp.RunOptions(**given),  # type: ignore[arg-type]
        )
        resp = self._unary("Submit", req)
        return JobHandle(self, resp.job_id)

    def resume(
        self, job_id: str, job: Any = None, client_id: str = "", idempotency_key: str = ""
    ) -> JobHandle:
        """A new job that goes on from the ended job ``job_id``'s latest checkpoint: ``job`` (a
        ``sbpflow.Job`` or its protobuf, e.g. the same model re-traced under another layout) or, if None,
        the job as it was submitted. The server refuses a job that does not match the checkpoint
        (INVALID_ARGUMENT, naming the tensors) and a job that runs or has no checkpoint
        (FAILED_PRECONDITION). The new job's status says ``resumed_from`` and ``resume_checkpoint``;
        ``idempotency_key`` as ``submit``'s."""
        key = idempotency_key or uuid.uuid4().hex
        req = sp.ResumeJobRequest(job_id=job_id, client_id=client_id, idempotency_key=key)
        if job is not None:
            req.job.CopyFrom(_job_proto(job))
        resp = self._unary("Resume", req)
        return JobHandle(self, resp.job_id)

    def get(self, job_id: str) -> sp.JobStatus:
        return self._unary("Get", sp.GetJobRequest(job_id=job_id))  # type: ignore[no-any-return]

    def handle(self, job_id: str) -> JobHandle:
        """A handle on a job submitted earlier (checks that it exists)."""
        self.get(job_id)
        return JobHandle(self, job_id)

    def list(self, states: builtins.list[str] | None = None, limit: int = 100) -> builtins.list[sp.JobStatus]:
        """Jobs, newest first; ``states`` like ["RUNNING", "PENDING"]."""
        codes = [sp.JobState.Value("JOB_STATE_" + s.upper().removeprefix("JOB_STATE_")) for s in states or []]
        out: builtins.list[sp.JobStatus] = []
        token = ""
        while len(out) < limit:
            req = sp.ListJobsRequest(page_size=min(limit - len(out), 1000), page_token=token, states=codes)
            page = self._unary("List", req)
            out.extend(page.jobs)
            token = page.next_page_token
            if not token:
                break
        return out

    def watch_events(self, job_id: str, after_seq: int = 0) -> Iterator[sp.JobEvent]:
        return self._stream("Watch", sp.WatchJobRequest(job_id=job_id, after_seq=after_seq))

    def logs(self, job_id: str, rank: int = -1, follow: bool = False) -> Iterator[sp.LogLine]:
        return self._stream("Logs", sp.LogsRequest(job_id=job_id, rank=rank, follow=follow))

    def cancel(self, job_id: str, reason: str = "") -> sp.JobStatus:
        return self._unary("Cancel", sp.CancelJobRequest(job_id=job_id, reason=reason))  # type: ignore[no-any-return]

    def checkpoints(self, job_id: str) -> builtins.list[sp.CheckpointInfo]:
        """The job's complete checkpoints on the server, oldest first."""
        r = self._unary("ListCheckpoints", sp.ListCheckpointsRequest(job_id=job_id))
        return list(r.checkpoints)

    def download_checkpoint(self, job_id: str, into: str | Path, step: int = 0) -> Path:
        """Copy the job's checkpoint at ``step`` (0: its latest) from the server into ``into`` (made if
        missing) as ``into/<step folder>``; returns that folder, which ``sbpflow.checkpoint.read`` reads."""
        into = Path(into)
        folder: Path | None = None
        out = None
        try:
            for chunk in self._stream("ReadCheckpoint", sp.ReadCheckpointRequest(job_id=job_id, step=step)):
                path = _inside(into, chunk.checkpoint, chunk.file)
                folder = into / chunk.checkpoint
                if chunk.offset == 0:
                    if out is not None:
                        out.close()
                    path.parent.mkdir(parents=True, exist_ok=True)
                    out = open(path, "wb")  # noqa: SIM115  closed at the next file or the end
                assert out is not None
                out.write(chunk.data)
        finally:
            if out is not None:
                out.close()
        if folder is None:
            raise ClientError(grpc.StatusCode.NOT_FOUND, f"the server sent no checkpoint of job {job_id}")
        return folder

    def result(self, job_id: str, parameters: builtins.list[str] | None = None) -> JobOutcome:
        from sbpflow.codec.values import array_from_proto

        r = self._unary("GetResult", sp.GetResultRequest(job_id=job_id, parameters=parameters or []))
        return JobOutcome(
            job_id=r.job_id or job_id,
            state=sp.JobState.Name(r.state).removeprefix("JOB_STATE_"),
            losses=list(r.losses),
            parameters={k: array_from_proto(v) for k, v in r.parameters.items()},
            fetches={k: array_from_proto(v) for k, v in r.fetches.items()},
            omitted_fetches=list(r.omitted_fetches),
        )


class JobHandle:
    """One submitted job."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id

    def __repr__(self) -> str:
        return f"JobHandle({self.job_id!r} on {self.client.address})"

    def status(self) -> sp.JobStatus:
        return self.client.get(self.job_id)

    def events(self, after_seq: int = 0) -> Iterator[sp.JobEvent]:
        """Every event of the job after ``after_seq``, then new ones as they happen, until it ends."""
        return self.client.watch_events(self.job_id, after_seq)

    def watch(self, stream: TextIO | None = None, progress: bool = True) -> sp.JobStatus:
        """Follow the job to its end, drawing a progress bar on ``stream`` (stdout); its final status."""
        from sbpflow.client.progress_bar import ProgressBar

        bar = ProgressBar(stream) if progress else None
        try:
            for ev in self.events():
                if bar is not None:
                    bar.update(ev)
        finally:
            if bar is not None:
                bar.close()
        return self.status()

    def wait(self, timeout: float | None = None) -> sp.JobStatus:
        """Block until the job ends (TimeoutError after ``timeout`` seconds); its final status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.status()
            if st.state in TERMINAL:
                return st
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {self.job_id} is still {sp.JobState.Name(st.state)} after {timeout} s; "
                    "wait longer or cancel it"
                )
            time.sleep(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))

    def cancel(self, reason: str = "") -> sp.JobStatus:
        return self.client.cancel(self.job_id, reason)

    def result(self, parameters: list[str] | None = None) -> JobOutcome:
        """Losses and trained parameters; waits for the job to end first."""
        self.wait()
        return self.client.result(self.job_id, parameters)

    def logs(self, rank: int = -1, follow: bool = False) -> Iterator[sp.LogLine]:
        return self.client.logs(self.job_id, rank, follow)
