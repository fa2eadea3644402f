"""The control-plane server: JobService over gRPC, the standard health service, server reflection, the
WorkerService for Ray workers (on a port of its own, ``reports.py``), and the HTTP status endpoint, all
over one job store and job manager.

    inprocess = MANAGER_DEFAULTS.replace(backend="inprocess")  # sbpflow.runs.options: the manager's defaults
    plane = ControlPlane(ServerConfig(port=0, http_port=0, store="jobs.db", run=inprocess, slots=4))
    plane.start()          # binds; plane.address ("127.0.0.1:PORT"), plane.http_address
    ...
    plane.stop()

``sbpflow server`` runs ``serve(config)``, which blocks until SIGINT/SIGTERM. Rules:
- errors map to gRPC codes by the table ``rpc_contract.CODES`` (bad input INVALID_ARGUMENT with
  validate_submit's message; a job too big for the workers RESOURCE_EXHAUSTED; unknown id NOT_FOUND;
  a job that cannot be resumed FAILED_PRECONDITION; shutting down UNAVAILABLE; anything else INTERNAL,
  logged), every message saying what to do, never UNKNOWN;
- Resume makes a new job from an ended job's latest checkpoint (``control_plane/service/resume.py``); a job's
  status carries ``resumed_from``, ``resume_checkpoint`` and ``last_checkpoint``;
- Submit reads its request bytes itself, so a malformed protobuf is INVALID_ARGUMENT, not INTERNAL;
- messages over ``max_message_bytes`` are refused by gRPC (RESOURCE_EXHAUSTED) and the job inside by
  validation; with a token every call but the health service needs it (``auth.py``); with a
  certificate and key both gRPC and HTTP use TLS;
- each client, connection and host holds at most its fair share of the calls and streams in flight, and
  gRPC bounds metadata, streams per connection, handshakes and idle connections before the token is
  checked (``isolation.py``); a refusal is RESOURCE_EXHAUSTED with ``retry-after-ms``, never CANCELLED.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sbpflow.codec.run_options import run_options_to_proto
from sbpflow.control_plane.launch.ports import free_port
from sbpflow.control_plane.launch.worker_pool import PoolConfig, WorkerPool, install, uninstall
from sbpflow.control_plane.service import job_checkpoints as files
from sbpflow.control_plane.service.data_policy import DataPolicy
from sbpflow.control_plane.service.drain import Drained
from sbpflow.control_plane.service.drain import drain as drain_jobs
from sbpflow.control_plane.service.isolation import (
    CallCounter,
    CapacityInterceptor,
    StreamGate,
    check_bind,
    transport_options,
    unready,
)
from sbpflow.control_plane.service.job_options import for_run
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.service.rpc_contract import (
    MAX_DETAILS,
    MAX_OFFSET,
    check_keys,
    contract,
    guard,
    valid_job_id,
)
from sbpflow.control_plane.status import records
from sbpflow.control_plane.status.auth import OPEN_HTTP_PATHS, AuthInterceptor, TokenCheck
from sbpflow.control_plane.status.metrics import Metrics
from sbpflow.control_plane.status.worker_rows import WorkerRows
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import JobRecord
from sbpflow.errors import SbpflowError
from sbpflow.runs.options import MANAGER_DEFAULTS, RunOptions
from sbpflow.runs.states import JobState
from sbpflow.v1 import service_pb2 as sp

T = TypeVar("T")
SERVICE = "sbpflow.v1.JobService"
DEFAULT_PAGE, MAX_PAGE = 100, 1000
POLL_SECONDS = 1.0  # streams re-check their client at least this often


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    http_port: int | None = 0  # None: no HTTP status endpoint
    store: str = "sbpflow-jobs.db"
    run: RunOptions = MANAGER_DEFAULTS  # how every job runs: backend, Ray address, timeout, restarts, ...
    slots: int | None = None
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_bytes: int = 64 * 1024 * 1024
    threads: int = 64  # gRPC handler threads for unary calls; streams have threads of their own
    max_streams: int = 1024  # open Watch/Logs streams at once; beyond: RESOURCE_EXHAUSTED (isolation.py)
    checkpoint_root: str | None = None  # job ID checkpoints to <root>/ID; None: no checkpoints, no Resume
    tensorboard_dir: str | None = None  # job ID's TensorBoard scalars to <dir>/ID (tensorboard_scalars.py)
    open_metrics: bool = False  # /metrics without the token (Prometheus scraping by annotation)
    data_roots: tuple[str, ...] = ()  # jobs' data files only under these (data_policy.py); (): none
    insecure: bool = False  # allow a non-loopback host without auth_token
    device_memory: int | None = None  # bytes per device at Submit; None: Ray's or the machine's; 0: off
    drain_grace: float = 25.0  # SIGTERM: seconds for running jobs to reach a checkpoint (drain.py)
    warm_workers: int = 0  # backend ray: idle worker actors kept for the next job of a shape (worker_pool.py)
    warm_idle_seconds: float = 300.0  # an idle warm worker is killed after this
    worker_service: bool | None = None  # serve WorkerService; None: for the Ray backend (without TLS)
    worker_port: int = 0  # WorkerService's own port (0: any free one), so Get never queues behind reports


class JobServicer:
    """JobService's methods over a ``JobManager``."""

    def __init__(self, manager: JobManager) -> None:
        self.manager = manager
        self.store = manager.store
        self.options = run_options_to_proto(manager.config.run)  # every job runs under the server's
        self.rows = WorkerRows(manager.workers)  # a large job's rows: at most 0.2 s old (worker_rows.py)

    def status_of(self, job_id: str) -> sp.JobStatus:
        rec = self.store.get(job_id)
        m = records.job_status(rec)
        self.rows.merge_into(m, rec)
        m.resumed_from, m.resume_checkpoint = rec.resumed_from, rec.resume_checkpoint
        m.last_checkpoint = self.manager.last_checkpoint(job_id)
        m.options.CopyFrom(self.options_of(rec))
        return m

    def options_of(self, rec: JobRecord) -> sp.RunOptions:
        """The options ``rec``'s job runs under: the server's, with what its client set at Submit."""
        return (
            run_options_to_proto(for_run(self.manager.config.run, rec.options))
            if rec.options
            else self.options
        )

    def Submit(self, request: bytes, context: grpc.ServicerContext) -> sp.SubmitJobResponse:  # noqa: N802
        try:
            req = sp.SubmitJobRequest.FromString(request)
        except DecodeError as e:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed SubmitJobRequest protobuf: {e}; send sbpflow.v1.SubmitJobRequest(job=...)",
            )
        if not req.HasField("job"):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "SubmitJobRequest.job is missing; set it to sbpflow.codec.wire.job_to_proto(job)",
            )
        check_keys(context, req)
        blob, options = req.job.SerializeToString(), req.options.SerializeToString()  # job_options.py
        rec = guard(context, lambda: self.manager.submit(blob, req.client_id, req.idempotency_key, options))
        return sp.SubmitJobResponse(job_id=rec.id, status=self.status_of(rec.id))

    def Resume(self, request: sp.ResumeJobRequest, context: grpc.ServicerContext) -> sp.ResumeJobResponse:  # noqa: N802
        check_keys(context, request)
        blob = request.job.SerializeToString() if request.HasField("job") else None
        rec = guard(
            context,
            lambda: self.manager.resume(
                valid_job_id(context, request.job_id), blob, request.client_id, request.idempotency_key
            ),
        )
        step = 0
        if rec.resume_checkpoint:
            from sbpflow.checkpoint.read import CheckpointReader

            step = guard(context, lambda: CheckpointReader(rec.resume_checkpoint).step)
        return sp.ResumeJobResponse(
            job_id=rec.id,
            status=self.status_of(rec.id),
            checkpoint=rec.resume_checkpoint,
            checkpoint_step=step,
        )

    def Get(self, request: sp.GetJobRequest, context: grpc.ServicerContext) -> sp.JobStatus:  # noqa: N802
        return guard(context, lambda: self.status_of(valid_job_id(context, request.job_id)))

    def List(self, request: sp.ListJobsRequest, context: grpc.ServicerContext) -> sp.ListJobsResponse:  # noqa: N802
        size = request.page_size or DEFAULT_PAGE
        token = request.page_token or "0"
        if not (token.isascii() and token.isdigit() and int(token) <= MAX_OFFSET) or not 0 < size <= MAX_PAGE:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"page_size={request.page_size}, page_token={request.page_token[:40]!r}: give a page size of 1.."
                f"{MAX_PAGE} (0 = {DEFAULT_PAGE}) and a token from a previous ListJobsResponse",
            )
        unknown = [s for s in request.states if s not in sp.JobState.values()]
        if unknown:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"states={list(request.states)[:20]}: {unknown[0]} is not a JobState; use the values of "
                "sbpflow.v1.JobState (e.g. JOB_STATE_RUNNING)",
            )
        states = [JobState(sp.JobState.Name(s)) for s in request.states if s] or None
        offset = int(token)
        recs = guard(context, lambda: self.store.list(states, limit=size + 1, offset=offset))
        more = len(recs) > size
        jobs = [records.job_status(r) for r in recs[:size]]
        for m, r in zip(jobs, recs, strict=False):
            m.options.CopyFrom(self.options_of(r))
        return sp.ListJobsResponse(
            jobs=jobs,
            next_page_token=str(offset + size) if more else "",
        )

    def Watch(self, request: sp.WatchJobRequest, context: grpc.ServicerContext) -> Iterator[sp.JobEvent]:  # noqa: N802
        options = self.options_of(
            guard(context, lambda: self.store.get(valid_job_id(context, request.job_id)))
        )
        for ev in self.manager.follow(request.job_id, request.after_seq, context.is_active, POLL_SECONDS):
            ev.status.options.CopyFrom(options)
            yield ev

    def Cancel(self, request: sp.CancelJobRequest, context: grpc.ServicerContext) -> sp.JobStatus:  # noqa: N802
        guard(
            context,
            lambda: self.manager.cancel(valid_job_id(context, request.job_id), request.reason[:MAX_DETAILS]),
        )
        return self.status_of(request.job_id)

    def Logs(self, request: sp.LogsRequest, context: grpc.ServicerContext) -> Iterator[sp.LogLine]:  # noqa: N802
        guard(context, lambda: self.store.get(valid_job_id(context, request.job_id)))
        seq = 0
        while context.is_active():
            seen = self.manager.version
            terminal = self.store.get(request.job_id).state.terminal
            for line in self.store.logs(request.job_id, int(request.rank), seq):
                seq = line.seq
                if request.rank < 0 or line.rank == request.rank:
                    yield records.log_line(line)
            if not request.follow or terminal:
                return
            self.manager.wait_changed(seen, POLL_SECONDS)

    def ListCheckpoints(  # noqa: N802
        self, request: sp.ListCheckpointsRequest, context: grpc.ServicerContext
    ) -> sp.ListCheckpointsResponse:
        rec = guard(context, lambda: self.store.get(valid_job_id(context, request.job_id)))
        return guard(context, lambda: files.listed(self.manager.config.checkpoint_root, rec.id))

    def ReadCheckpoint(  # noqa: N802
        self, request: sp.ReadCheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[sp.CheckpointChunk]:
        rec = guard(context, lambda: self.store.get(valid_job_id(context, request.job_id)))
        sent = guard(context, lambda: files.chunks(self.manager.config.checkpoint_root, rec.id, request.step))
        first = guard(context, lambda: next(sent, None))  # a missing checkpoint fails the call itself
        if first is not None:
            yield first
            yield from sent

    def GetResult(self, request: sp.GetResultRequest, context: grpc.ServicerContext) -> sp.JobResult:  # noqa: N802
        rec = guard(context, lambda: self.store.get(valid_job_id(context, request.job_id)))
        if not rec.state.terminal:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {rec.id} is {rec.state.name}; its result exists once it has ended: wait for it "
                "(JobHandle.wait() or `sbpflow watch ID`)",
            )
        saved = self.store.result(rec.id)
        result = sp.JobResult.FromString(saved) if saved else sp.JobResult(job_id=rec.id)
        result.state = sp.JobState.Value(str(rec.state))
        if not saved:
            result.losses.extend(p.loss for p in self.store.losses(rec.id))
        missing = sorted(set(request.parameters) - set(result.parameters))
        if missing:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"job {rec.id} has no parameters {missing}; it has {sorted(result.parameters) or 'none'}",
            )
        for name in [n for n in result.parameters if request.parameters and n not in request.parameters]:
            del result.parameters[name]
        return result


def _job_service_handler(servicer: JobServicer) -> grpc.GenericRpcHandler:
    """JobService's handlers under the status contract (``rpc_contract.contract``), each receiving raw
    bytes that the contract parses into its request type (Submit parses its own, see JobServicer.Submit)."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    # name: (kind, request type or None for raw bytes)
    methods: dict[str, tuple[Callable[..., Any], Any]] = {
        "Submit": (unary, None),
        "Get": (unary, sp.GetJobRequest),
        "List": (unary, sp.ListJobsRequest),
        "Watch": (stream, sp.WatchJobRequest),
        "Cancel": (unary, sp.CancelJobRequest),
        "Logs": (stream, sp.LogsRequest),
        "GetResult": (unary, sp.GetResultRequest),
        "Resume": (unary, sp.ResumeJobRequest),
        "ListCheckpoints": (unary, sp.ListCheckpointsRequest),
        "ReadCheckpoint": (stream, sp.ReadCheckpointRequest),
    }
    handlers = {
        name: kind(
            contract(getattr(servicer, name), streaming=kind is stream, request_type=req),
            response_serializer=lambda m: m.SerializeToString(),
        )
        for name, (kind, req) in methods.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


class ControlPlane:
    """One server: store, job manager, gRPC services and (optionally) the HTTP status endpoint."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = JobStore(config.store)
        manager_config = ManagerConfig(
            run=config.run,
            slots=config.slots,
            max_job_bytes=config.max_message_bytes,
            checkpoint_root=config.checkpoint_root,
            tensorboard_dir=config.tensorboard_dir,
            data_policy=DataPolicy.under(config.data_roots),
            device_memory=config.device_memory,
        )
        self.hub = _report_hub(config)
        self.manager = JobManager(self.store, manager_config, report_hub=self.hub)
        self.manager.metrics = Metrics(self.store, self.manager.workers)
        self.check = TokenCheck(config.auth_token)
        self.health = health.HealthServicer()
        self.streams = StreamGate(config.max_streams)
        self.unary = CallCounter(config.threads)
        self.capacity = CapacityInterceptor(self.streams, self.unary)  # and each caller's fair share
        self.port = 0
        self.http_port: int | None = None
        self._grpc: grpc.Server | None = None
        self._http: Any = None
        self.pool: WorkerPool | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def http_address(self) -> str | None:
        scheme = "https" if self.config.tls_cert else "http"
        return None if self.http_port is None else f"{scheme}://{self.config.host}:{self.http_port}"

    def start(self) -> ControlPlane:
        cfg = self.config
        check_bind(cfg.host, cfg.auth_token, cfg.insecure)
        limit = cfg.max_message_bytes
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        pool = cfg.threads + cfg.max_streams
        server = grpc.server(
            # streams beyond max_streams are refused, so `threads` threads stay for unary calls
            futures.ThreadPoolExecutor(pool, thread_name_prefix="sbpflow-grpc"),
            # the token first: a call refused for it costs nothing and counts against no one's share
            interceptors=[AuthInterceptor(self.check), self.capacity],
            options=options + transport_options(),
            # past this gRPC answers RESOURCE_EXHAUSTED itself, at once: no call queues for long
            maximum_concurrent_rpcs=2 * pool,
        )
        self.servicer = JobServicer(self.manager)
        server.add_generic_rpc_handlers([_job_service_handler(self.servicer)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        where = f"{cfg.host}:{free_port(cfg.host, cfg.port)}"
        try:
            if cfg.tls_cert or cfg.tls_key:
                key, cert = _tls_pair(cfg)
                self.port = server.add_secure_port(where, grpc.ssl_server_credentials([(key, cert)]))
            else:
                self.port = server.add_insecure_port(where)
        except RuntimeError:  # grpc's "Failed to bind": in use, or not an address of this machine
            self.port = 0
        if self.port == 0:
            raise SbpflowError(
                f"cannot bind gRPC to {where}: the port is in use or the host is not this machine's; pick "
                "another --port (0 = any free port) or --host"
            )
        if self.hub is not None:  # its own server: its thousand calls a second have their own event thread
            self.hub.serve(cfg.host, cfg.worker_port)
            self.hub.address = f"{_advertised(cfg.host)}:{self.hub.port}"
        self.manager.start()
        if cfg.run.backend == "ray" and cfg.warm_workers > 0:  # after manager.start, which brings Ray up
            self.pool = WorkerPool(PoolConfig(cfg.warm_workers, cfg.warm_idle_seconds))
            install(self.pool)
        server.start()
        self._grpc = server
        if cfg.http_port is not None:
            from sbpflow.control_plane.status.http import StatusEndpoint

            self._http = StatusEndpoint(
                self.manager,
                self.check,
                cfg.host,
                cfg.http_port,
                cfg.tls_cert,
                cfg.tls_key,
                open_paths=OPEN_HTTP_PATHS | ({"/metrics"} if cfg.open_metrics else set()),
                unready=self._unready,
                status_of=self.servicer.status_of,
            )
            self.http_port = self._http.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def _unready(self) -> str:
        if self.manager.draining:
            return "the control plane is draining (SIGTERM); send new jobs to another server"
        return self.manager.unready_reason() or unready(self.store, self.unary)  # checkpoint root, store

    def drain(self, grace: float | None = None) -> Drained:
        """SIGTERM's way out: refuse new jobs (UNAVAILABLE), let running jobs reach a checkpoint within
        ``grace`` seconds (default ``config.drain_grace``), stop them in flight for the next server on
        the same store to resume, then stop (:mod:`.drain`)."""
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        drained = drain_jobs(self.manager, self.config.drain_grace if grace is None else grace)
        self.stop()
        return drained

    def stop(self, grace: float = 2.0) -> None:
        """Stop taking calls, cancel running jobs (reason CONTROL_PLANE_SHUTDOWN), close the store."""
        self.health.enter_graceful_shutdown()
        self.manager.shutdown(timeout=grace + 10.0)
        if self.pool is not None:
            uninstall(self.pool)
            self.pool.close()
        if self._http is not None:
            self._http.stop()
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
        if self.hub is not None:
            self.hub.stop(grace)
        # a stream's handler notices its cancelled call within a poll; the store closes after it returns
        self.manager.feed.notify()
        self.streams.wait_closed(2 * POLL_SECONDS)
        self.store.close()


def _tls_pair(cfg: ServerConfig) -> tuple[bytes, bytes]:
    if not (cfg.tls_cert and cfg.tls_key):
        raise SbpflowError("TLS needs both --tls-cert and --tls-key (PEM files); give both or neither")
    return Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes()


def _advertised(host: str) -> str:
    """An address workers can reach for a server bound to ``host`` (a wildcard becomes this host's IP)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostbyname(socket.gethostname())
    return host


def _report_hub(cfg: ServerConfig) -> Any:
    """The WorkerService for Ray workers, beside this server on ``worker_port`` (workers send their
    attempt's credential with their reports, see reports.py); None (the run serves its own, on loopback)
    for the in-process backend, or when TLS guards the port (workers do not carry the CA yet)."""
    wanted = cfg.run.backend == "ray" if cfg.worker_service is None else cfg.worker_service
    if not wanted or cfg.tls_cert:
        return None
    from sbpflow.control_plane.launch.report_hub import ReportHub

    return ReportHub()


def serve(config: ServerConfig, announce: Callable[[str], None] = print) -> None:
    """Run a control plane until SIGINT (stop: running jobs are cancelled) or SIGTERM (drain: running
    jobs are saved at a checkpoint for the next server on the store, see ``drain.py``)."""
    plane = ControlPlane(config).start()
    announce(f"sbpflow control plane: gRPC on {plane.address}" + (" (TLS)" if config.tls_cert else ""))
    if plane.http_address:
        announce(f"status endpoint: {plane.http_address}/  (/healthz /readyz /v1/jobs /metrics)")
    if plane.hub is not None:
        announce(
            f"worker reports: {plane.hub.address} (WorkerService, --worker-port; Ray workers must reach it)"
        )
    announce(f"store: {config.store}; backend: {config.run.backend}; {plane.manager.capacity} slot(s)")
    roots = ", ".join(config.data_roots) or "none (--data-root DIR): only synthetic or inline data"
    announce(f"data roots: {roots}")
    if config.checkpoint_root is not None:
        announce(f"checkpoints: {config.checkpoint_root}/<job id>; a lost worker restarts a job up to "
                 f"{config.run.max_restarts} time(s)")  # fmt: skip
    got: list[int] = []
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    done.wait()
    if got[0] != signal.SIGTERM:
        plane.stop()
        return
    announce(f"SIGTERM: draining (admitting nothing; up to {config.drain_grace:g} s for jobs to checkpoint)")
    d = plane.drain()
    saved = ", ".join(f"{j} at step {s}" for j, s in sorted(d.saved.items())) or "none"
    announce(f"drained in {d.seconds:.1f} s: saved {saved}; without a checkpoint {list(d.unsaved)}; "
             f"ended {list(d.ended)}")  # fmt: skip
