"""The HTTP status endpoint of the control plane (standard library ``http.server``, one thread per request).

| path | answers |
|---|---|
| ``/healthz`` | 200 ``ok`` while the process serves (open: no token needed) |
| ``/readyz`` | 200 ``ready`` once the store is reconciled and jobs are admitted, else 503 (open) |
| ``/v1/jobs`` | JSON ``{"jobs": [JobStatus...]}``, newest first; ``?state=RUNNING&limit=N`` |
| ``/v1/jobs/{id}`` | JSON JobStatus with its workers, plus ``losses`` (the loss history) |
| ``/metrics`` | Prometheus exposition format (``metrics.py``) |
| ``/`` | an HTML page: the jobs, a loss curve each (inline SVG, no script) |

JSON is ``google.protobuf.json_format`` of the same messages gRPC returns (proto field names, enums by
name). With a token every path but ``/healthz`` and ``/readyz`` needs ``Authorization: Bearer <token>``
(401 otherwise); with a certificate and key the endpoint speaks HTTPS.
"""

from __future__ import annotations

import html
import json
import logging
import math
import ssl
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sbpflow.control_plane import status
from sbpflow.control_plane.auth import OPEN_HTTP_PATHS, TokenCheck
from sbpflow.control_plane.jobs import JobManager
from sbpflow.control_plane.metrics import CONTENT_TYPE
from sbpflow.control_plane.store.db import StoreError, UnknownJobError
from sbpflow.control_plane.store.schema import LossPoint
from sbpflow.run_state import JobState

Response = tuple[int, str, bytes]  # status, content type, body
JSON = "application/json"
PAGE_JOBS = 50
MAX_LIMIT = 1000  # ?limit= on /v1/jobs
MAX_ID = 256  # characters of a job id in a path
log = logging.getLogger("sbpflow.control_plane.http")


def _json(code: int, obj: Any) -> Response:
    return code, JSON, json.dumps(obj, indent=1).encode()


def _error(code: int, message: str) -> Response:
    return _json(code, {"error": message})


class StatusEndpoint:
    """The status endpoint of one ``JobManager``; ``start()`` returns the bound port."""

    def __init__(
        self,
        manager: JobManager,
        check: TokenCheck,
        host: str = "127.0.0.1",
        port: int = 0,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        open_paths: frozenset[str] = OPEN_HTTP_PATHS,
        unready: Callable[[], str] = lambda: "",
    ) -> None:
        self.manager, self.store, self.check = manager, manager.store, check
        self.unready = unready  # why the server cannot take calls now ("" when it can): /readyz
        self.open_paths = open_paths  # answered without the token: the probes, and /metrics if asked
        self._server = ThreadingHTTPServer((host, port), _handler_class(self))
        self._server.daemon_threads = True
        if tls_cert and tls_key:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls_cert, tls_key)
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, name="sbpflow-http", daemon=True)
        # exact paths; "/v1/jobs/{id}" is matched by prefix in ``answer``
        self.routes: dict[str, Callable[[dict[str, list[str]]], Response]] = {
            "/healthz": lambda q: (200, "text/plain", b"ok\n"),
            "/readyz": self.readyz,
            "/v1/jobs": self.jobs,
            "/metrics": self.metrics,
            "/": self.page,
        }

    def start(self) -> int:
        self._thread.start()
        return int(self._server.server_address[1])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- routes -----------------------------------------------------------------------------------

    def answer(self, path: str, query: dict[str, list[str]], authorization: str | None) -> Response:
        if path not in self.open_paths and not self.check.check(authorization):
            return _error(401, self.check.problem(authorization))
        try:
            if path.startswith("/v1/jobs/"):
                return self.job(path.removeprefix("/v1/jobs/"))
            route = self.routes.get(path.rstrip("/") or "/")
            if route is None:
                return _error(404, f"no page {path[:80]!r}; try one of {sorted(self.routes)} or /v1/jobs/ID")
            return route(query)
        except UnknownJobError as e:
            return _error(404, str(e)[:4000])
        except (StoreError, ValueError) as e:
            return _error(400, str(e)[:4000])
        except Exception as e:  # the contract: a status and a JSON body, never a dropped connection
            log.exception("internal error answering %s", path[:200])
            return _error(500, f"internal error ({type(e).__name__}); the server's log has the traceback")

    def readyz(self, query: dict[str, list[str]]) -> Response:
        if not self.manager.ready:
            return _json(503, {"ready": False, "reason": "starting or shutting down"})
        self.store.count()  # the store answers
        reason = self.unready()  # the store cannot write, or every unary handler is busy
        if reason:
            return _json(503, {"ready": False, "reason": reason})
        return 200, "text/plain", b"ready\n"

    def jobs(self, query: dict[str, list[str]]) -> Response:
        states = [_state(s) for v in query.get("state", []) for s in v.split(",")] or None
        limit = _int(query, "limit", 100, 1, MAX_LIMIT)
        recs = self.store.list(states, limit=limit)
        return _json(200, {"jobs": [status.as_json(status.job_status(r)) for r in recs]})

    def job(self, job_id: str) -> Response:
        if len(job_id) > MAX_ID or not job_id.isprintable():
            raise ValueError(f"{job_id[:40]!r}... is not a job id; use an id from /v1/jobs")
        rec = self.store.get(job_id)
        body = status.as_json(status.job_status(rec, self.manager.workers(job_id)))
        body["losses"] = [status.json_float(p.loss) for p in self.store.losses(job_id)]
        return _json(200, body)

    def metrics(self, query: dict[str, list[str]]) -> Response:
        assert self.manager.metrics is not None
        return 200, CONTENT_TYPE, self.manager.metrics.exposition()

    def page(self, query: dict[str, list[str]]) -> Response:
        rows = []
        for r in self.store.list(limit=PAGE_JOBS):
            loss = "" if r.loss is None else f"{r.loss:.5g}"
            cells = (r.id, r.name, r.state.name, f"{r.step}/{r.total_steps}", loss, r.reason)
            tds = "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
            rows.append(f"<tr>{tds}<td>{loss_svg(self.store.losses(r.id))}</td></tr>")
        head = "".join(
            f"<th>{h}</th>" for h in ("id", "name", "state", "step", "loss", "reason", "loss curve")
        )
        body = (
            "<!doctype html><html><head><meta charset='utf-8'><title>sbpflow jobs</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}"
            "tr:nth-child(even){background:#f4f4f4}</style></head><body><h1>sbpflow jobs</h1>"
            f"<table><tr>{head}</tr>{''.join(rows)}</table>"
            "<p>JSON: <a href='/v1/jobs'>/v1/jobs</a> · metrics: <a href='/metrics'>/metrics</a></p>"
            "</body></html>"
        )
        return 200, "text/html; charset=utf-8", body.encode()


def _int(query: dict[str, list[str]], name: str, default: int, lo: int, hi: int) -> int:
    """The query parameter ``name`` as an int in ``lo .. hi`` (ValueError naming it otherwise)."""
    text = query.get(name, [str(default)])[0].strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 12 and lo <= int(text) <= hi):
        raise ValueError(f"{name}={text[:40]!r}: give an integer in {lo}..{hi}")
    return int(text)


def _state(name: str) -> JobState:
    key = name.strip().upper().removeprefix("JOB_STATE_")
    if key not in JobState.__members__:
        raise ValueError(f"state={name[:40]!r} is unknown; use one of {', '.join(JobState.__members__)}")
    return JobState[key]


def loss_svg(points: Sequence[LossPoint], width: int = 240, height: int = 48) -> str:
    """A loss curve as an inline SVG polyline (empty before the first step); a NaN or infinite loss
    is left out of the line (the title still says it)."""
    title = f"loss {points[0].loss:.4g} -> {points[-1].loss:.4g} over {len(points)} steps" if points else ""
    points = [p for p in points if math.isfinite(p.loss)]
    if not points:
        return ""
    lo, hi = min(p.loss for p in points), max(p.loss for p in points)
    first, last = points[0].step, points[-1].step
    sx = (width - 4) / max(last - first, 1)
    sy = (height - 4) / (hi - lo) if hi > lo else 0.0
    xy = " ".join(f"{2 + (p.step - first) * sx:.1f},{height - 2 - (p.loss - lo) * sy:.1f}" for p in points)
    return (
        f"<svg width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img'>"
        f"<title>{html.escape(title)}</title>"
        f"<polyline fill='none' stroke='#1f77b4' stroke-width='1.5' points='{xy}'/></svg>"
    )


def _handler_class(endpoint: StatusEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "sbpflow"
        default_request_version = "HTTP/1.0"  # so even an unparsable request line gets a status line

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            try:
                url = urlsplit(self.path)
                query = parse_qs(url.query, max_num_fields=64)
            except ValueError as e:
                self._reply(_error(400, f"malformed request target: {str(e)[:200]}"))
                return
            self._reply(endpoint.answer(url.path, query, self.headers.get("Authorization")))

        def do_HEAD(self) -> None:  # noqa: N802
            self._reply(_error(405, "HEAD is not served; use GET"), allow=True)

        def _refuse_method(self) -> None:
            self._reply(
                _error(405, f"{self.command} is not served: the status endpoint is read-only; use GET"),
                allow=True,
            )

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method  # noqa: N815

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own refusals (a malformed request line, over-long headers) as JSON too."""
            self.close_connection = True
            self._reply(_error(code, message or explain or "malformed request"))

        def _reply(self, response: Response, allow: bool = False) -> None:
            code, ctype, body = response
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if code == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="sbpflow"')
            if allow:
                self.send_header("Allow", "GET")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # no access log on stderr

    return Handler
