"""The HTTP status endpoint of the control plane: its routes (the transport is ``http_server.py``).

| path | answers |
|---|---|
| ``/healthz`` | 200 ``ok`` while the process serves (open: no token needed) |
| ``/readyz`` | 200 ``ready`` once the store is reconciled and jobs are admitted, else 503 (open) |
| ``/v1/jobs`` | JSON ``{"jobs": [JobStatus...]}``, newest first; ``?state=RUNNING,PENDING&q=NAME&limit=N`` |
| ``/v1/jobs/{id}`` | JSON JobStatus with its workers, plus ``losses`` (the loss history) |
| ``/metrics`` | Prometheus exposition format (``metrics.py``) |
| ``/`` | the jobs page: every job with its state, times and loss curve (``web.py``); ``?state=&q=`` |
| ``/jobs/{id}`` | a job's page: failure, curves, workers, checkpoints, events, log, configuration, plan |
| ``/jobs/{id}/plan`` | the job's plan picture on a page of its own (``control_plane/render/graph_page.py``) |
| ``/login`` | GET: the sign-in form (open); POST ``token=...&next=/path``: the session cookie, then ``next`` |
| ``/logout`` | POST: the session revoked on the server and its cookie cleared |

JSON is ``job_json.py``'s schema, the one every ``--json`` of the CLI prints. The job list, page and
JSON alike, takes ``state`` (a state, or several comma-separated) and ``q`` (a part of the job's name, at
most :data:`MAX_QUERY` printable characters, ASCII letters in either case); a bad one is answered 400
naming what is allowed. With a token, the JSON paths and ``/metrics`` need ``Authorization: Bearer <token>`` (401
otherwise); the pages take the bearer token or the session cookie that ``/login`` sets (``auth.py``),
and without either answer 401 with the sign-in form. With a certificate and key the endpoint speaks
HTTPS and the cookie is ``Secure``.

Sign-in and sign-out are POSTs a page of another site could send (login CSRF, a forced sign-out): both
are refused (403) unless the browser says the request is same-origin (``Sec-Fetch-Site: same-origin``
or ``none``, and an ``Origin`` naming this host), and sign-out acts only on a request that carries the
session cookie — SameSite=Strict, so a browser never sends it with another site's request. Clients
that are not browsers send neither header and are let through: they hold the token anyway. After
sign-in the browser goes to ``next`` only when it is a path of this site (:func:`safe_next`).

Every HTML page carries a Content-Security-Policy (``web.CSP``: only the pages' own inline script and
styles, by hash; no framing), and every reply ``X-Content-Type-Options: nosniff`` and
``Referrer-Policy: same-origin`` (with no-referrer a browser sends ``Origin: null``). A peer that sends too many wrong tokens gets 429 (``throttle.py``).
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, unquote, urlsplit

from sbpflow.checkpoint.read import CheckpointInfo
from sbpflow.control_plane.status import job_json, records, web, web_job
from sbpflow.control_plane.status.auth import COOKIE, OPEN_HTTP_PATHS, SESSION_SECONDS, TokenCheck, too_many
from sbpflow.control_plane.status.http_server import Incoming, Limits, Outgoing, Server
from sbpflow.control_plane.status.metrics import CONTENT_TYPE, Metrics
from sbpflow.control_plane.status.plan_view import PlanCache
from sbpflow.control_plane.status.throttle import retry_after
from sbpflow.control_plane.store.db import StoreError, UnknownJobError
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.runs.states import JobState

JSON = "application/json"
HTML = "text/html; charset=utf-8"
PAGE_JOBS = 50
MAX_LIMIT = 1000  # ?limit= on /v1/jobs
MAX_ID = 256  # characters of a job id in a path
MAX_QUERY = 200  # characters of ?q= (a part of a job's name)
MAX_FORM = 8192  # bytes of a POSTed form
FORM_LIMITS = Limits(max_body=MAX_FORM)  # the transport's bounds (http_server.py)
SAFE_NEXT = "!#$%&'()*+,-./:;=?@[]^_`{|}~"  # ASCII kept as it is in a ``next`` path; the rest %-encoded
log = logging.getLogger("sbpflow.control_plane.status.http")


@dataclass(frozen=True)
class Reply:
    code: int
    ctype: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: Mapping[str, list[str]]
    authorization: str | None = None
    cookie: str | None = None
    form: Mapping[str, list[str]] | None = None  # a POST's url-encoded body
    peer: str = ""  # the client's address: wrong tokens are counted per peer
    origin: str | None = None  # the Origin header: a browser's POST names the site it comes from
    fetch_site: str | None = None  # Sec-Fetch-Site: "same-origin", "cross-site", ... (browsers only)
    host: str | None = None  # the Host header


def _json(code: int, obj: Any) -> Reply:
    return Reply(code, JSON, json.dumps(obj, indent=1).encode())


def _error(code: int, message: str) -> Reply:
    return _json(code, {"error": message})


def _html(text: str, code: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(code, HTML, text.encode(), headers)


def _redirect(to: str, *headers: tuple[str, str]) -> Reply:
    return Reply(303, "text/plain", f"see {to}\n".encode(), (("Location", to), *headers))


def _is_page(path: str) -> bool:
    return path == "/" or path.startswith("/jobs/")


def safe_next(path: str) -> str:
    """``path`` when it is a path of this site, else ``"/"``: where a browser goes after sign-in.

    One leading "/" and no "//", "/\\" or backslash — also once %-decoded, as a browser may decode — no
    control character or whitespace (browsers drop a tab or newline from a URL, so "/%09/evil.example"
    would become "//evil.example"), hence no scheme and no host; non-ASCII is %-encoded, so the
    Location header is plain ASCII.
    """
    for text in (path, unquote(path)):
        if not text.startswith("/") or "//" in text or "\\" in text:
            return "/"
        if any(c.isspace() or not c.isprintable() for c in text):
            return "/"
    return quote(path, safe=SAFE_NEXT)


class Jobs(Protocol):
    """What the status endpoint reads of the job manager (``service.jobs.JobManager`` has it)."""

    @property
    def store(self) -> JobStore: ...
    @property
    def ready(self) -> bool: ...
    @property
    def metrics(self) -> Metrics | None: ...

    def workers(self, job_id: str) -> list[WorkerRecord]:
        """Per-worker rows: live ones for a running job, else the stored ones."""
        ...

    def checkpoints(self, job_id: str) -> list[CheckpointInfo]:
        """The job's complete checkpoints, oldest first."""
        ...


class StatusEndpoint:
    """The status endpoint of one job manager; ``start()`` returns the bound port."""

    def __init__(
        self,
        manager: Jobs,
        check: TokenCheck,
        host: str = "127.0.0.1",
        port: int = 0,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        open_paths: frozenset[str] = OPEN_HTTP_PATHS,
        unready: Callable[[], str] = lambda: "",
        limits: Limits = FORM_LIMITS,
        status_of: Callable[[str], Any] | None = None,
    ) -> None:
        self.manager, self.store, self.check = manager, manager.store, check
        # a job's JobStatus as the gRPC Get answers it (live worker rows, last checkpoint, options), so
        # /v1/jobs/{id} is the object `sbpflow status ID --json` prints; None: the store's record
        self.status_of = status_of
        self.unready = unready  # why the server cannot take calls now ("" when it can): /readyz
        self.open_paths = open_paths | {"/login"}  # answered without the token: the probes, sign-in
        self.secure = bool(tls_cert and tls_key)
        self.plans = PlanCache()
        tls = None
        if tls_cert and tls_key:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.load_cert_chain(tls_cert, tls_key)
        self._server = Server(self.serve, host, port, tls, limits)
        # exact paths; "/v1/jobs/{id}" and "/jobs/{id}[/plan]" are matched by prefix in ``answer``
        self.routes: dict[str, Callable[[Request], Reply]] = {
            "/healthz": lambda q: Reply(200, "text/plain", b"ok\n"),
            "/readyz": self.readyz,
            "/v1/jobs": self.jobs,
            "/metrics": self.metrics,
            "/": self.page,
            "/login": self.login_form,
        }
        self.posts: dict[str, Callable[[Request], Reply]] = {"/login": self.login, "/logout": self.logout}

    def start(self) -> int:
        return self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def serve(self, inc: Incoming) -> Outgoing:
        """One request from the transport (on one of its pool's threads): parsed, answered, headed."""
        req = _parse(inc)
        reply = req if isinstance(req, Reply) else self.answer(req)
        return Outgoing(reply.code, _headers(reply), reply.body)

    # ---- routes -----------------------------------------------------------------------------------

    def answer(self, req: Request) -> Reply:
        path = req.path.rstrip("/") or "/"
        if req.method not in ("GET", "POST"):
            reply = _error(405, f"{req.method[:20]} is not served: the status endpoint is read-only; use GET")
            return Reply(reply.code, reply.ctype, reply.body, (("Allow", "GET, POST"),))
        wait = (
            self.check.throttle.wait(req.peer) if path not in self.open_paths or req.method == "POST" else 0
        )
        if wait > 0:  # a guesser, locked out: its token is not even compared
            reply = _error(429, too_many(wait))
            return Reply(429, reply.ctype, reply.body, (("Retry-After", retry_after(wait)),))
        if req.method == "POST":
            post = self.posts.get(path)
            if post is None:
                return _error(405, f"POST {path[:80]!r} is not served: the status endpoint is read-only")
            if not _same_origin(req, self.secure):
                return _error(403, f"POST {path} from another site is refused: use this site's own form")
            return post(req)
        if path not in self.open_paths and not self.allowed(req, path):
            if _is_page(path):  # a person: the sign-in form, coming back here after it
                return _html(web.login(safe_next(req.path), self._problem(req)), 401)
            return _error(401, self.check.problem(req.authorization))
        try:
            return self._route(path, req)
        except UnknownJobError as e:
            return _error(404, str(e)[:4000])
        except (StoreError, ValueError) as e:
            return _error(400, str(e)[:4000])
        except Exception as e:  # the contract: a status and a JSON body, never a dropped connection
            log.exception("internal error answering %s", path[:200])
            return _error(500, f"internal error ({type(e).__name__}); the server's log has the traceback")

    def _route(self, path: str, req: Request) -> Reply:
        if path.startswith("/v1/jobs/"):
            return self.job(_job_id(path.removeprefix("/v1/jobs/")))
        if path.startswith("/jobs/"):
            rest = path.removeprefix("/jobs/")
            if rest.endswith("/plan"):
                return self.plan_page(_job_id(rest.removesuffix("/plan")))
            return self.job_page(_job_id(rest))
        route = self.routes.get(path)
        if route is None:
            known = sorted(self.routes) + ["/v1/jobs/ID", "/jobs/ID"]
            return _error(404, f"no page {path[:80]!r}; try one of {known}")
        return route(req)

    def allowed(self, req: Request, path: str) -> bool:
        """The bearer token on every path; the session cookie too on the pages (never the JSON API)."""
        if self.check.check(req.authorization):
            return True
        if req.authorization:  # a wrong token (a missing one is no guess)
            self.check.throttle.failed(req.peer)
        return _is_page(path) and self.check.check_cookie(req.cookie)

    def _problem(self, req: Request) -> str:
        return "your sign-in has expired or the token changed: sign in again" if req.cookie else ""

    def readyz(self, req: Request) -> Reply:
        if not self.manager.ready:
            return _json(503, {"ready": False, "reason": "starting or shutting down"})
        self.store.count()  # the store answers
        reason = self.unready()  # the store cannot write, or every unary handler is busy
        if reason:
            return _json(503, {"ready": False, "reason": reason})
        return Reply(200, "text/plain", b"ready\n")

    def jobs(self, req: Request) -> Reply:
        shown = _filter(req.query)
        limit = _int(req.query, "limit", 100, 1, MAX_LIMIT)
        recs = self.store.list(shown.states or None, limit=limit, name_contains=shown.name)
        return _json(200, job_json.jobs(records.job_status(r) for r in recs))

    def job(self, job_id: str) -> Reply:
        if self.status_of is not None:
            status = self.status_of(job_id)
        else:
            status = records.job_status(self.store.get(job_id), self.manager.workers(job_id))
        return _json(200, job_json.document(status, (p.loss for p in self.store.losses(job_id))))

    def metrics(self, req: Request) -> Reply:
        assert self.manager.metrics is not None
        return Reply(200, CONTENT_TYPE, self.manager.metrics.exposition())

    # ---- pages ------------------------------------------------------------------------------------

    def page(self, req: Request) -> Reply:
        shown = _filter(req.query)
        recs = self.store.list(shown.states or None, limit=PAGE_JOBS, name_contains=shown.name)
        losses = {r.id: self.store.losses(r.id) for r in recs}
        return _html(web.job_list(recs, losses, signed_in=self.check.enabled, shown=shown))

    def job_page(self, job_id: str) -> Reply:
        rec = self.store.get(job_id)
        job = _stored_job(rec.job_proto)
        plan = self.plans.get(job_id, job)
        view = web_job.JobView(
            rec=rec,
            job=job,
            workers=self.manager.workers(job_id),
            events=self.store.events(job_id),
            logs=self.store.logs(job_id),
            checkpoints=self.manager.checkpoints(job_id),
            plan_summary=plan.summary,
            plan_picture=plan.picture,
        )
        return _html(web_job.page(view, signed_in=self.check.enabled))

    def plan_page(self, job_id: str) -> Reply:
        rec = self.store.get(job_id)
        plan = self.plans.get(job_id, _stored_job(rec.job_proto))
        return _html(plan.page or f"<!doctype html><p>{web.esc(plan.summary)}</p>")

    def login_form(self, req: Request) -> Reply:
        nxt = safe_next(req.query.get("next", ["/"])[0])
        return _redirect(nxt) if not self.check.enabled else _html(web.login(nxt))

    def login(self, req: Request) -> Reply:
        form = req.form or {}
        nxt = safe_next(form.get("next", ["/"])[0])
        if not self.check.enabled:
            return _redirect(nxt)
        token = form.get("token", [""])[0]
        if not token or not self.check.check(f"Bearer {token}"):
            if token:
                self.check.throttle.failed(req.peer)
            problem = (
                "the token is wrong: use the one the server was started with" if token else "give the token"
            )
            return _html(web.login(nxt, problem), 401)
        return _redirect(nxt, ("Set-Cookie", self._cookie(self.check.session(), SESSION_SECONDS)))

    def logout(self, req: Request) -> Reply:
        """Revokes the request's session; without one (another site's POST carries no SameSite=Strict
        cookie) it changes nothing, not even the cookie."""
        if not self.check.revoke(req.cookie):
            return _redirect("/login" if self.check.enabled else "/")
        return _redirect("/login", ("Set-Cookie", self._cookie("", 0)))

    def _cookie(self, value: str, max_age: int) -> str:
        secure = "; Secure" if self.secure else ""
        return f"{COOKIE}={value}; Max-Age={max_age}; Path=/; HttpOnly; SameSite=Strict{secure}"


def _job_id(text: str) -> str:
    if not text or len(text) > MAX_ID or not text.isprintable() or "/" in text:
        raise ValueError(f"{text[:40]!r} is not a job id; use an id from /v1/jobs")
    return text


def _stored_job(data: bytes) -> Any:
    """The stored Job, or None when it no longer decodes."""
    from sbpflow.codec import wire
    from sbpflow.v1 import job_pb2

    try:
        return wire.job_from_proto(job_pb2.Job.FromString(data))
    except Exception:  # noqa: BLE001 - an old or damaged record: the page says so
        log.warning("a stored job does not decode", exc_info=True)
        return None


def _int(query: Mapping[str, list[str]], name: str, default: int, lo: int, hi: int) -> int:
    """The query parameter ``name`` as an int in ``lo .. hi`` (ValueError naming it otherwise)."""
    text = query.get(name, [str(default)])[0].strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 12 and lo <= int(text) <= hi):
        raise ValueError(f"{name}={text[:40]!r}: give an integer in {lo}..{hi}")
    return int(text)


def _filter(query: Mapping[str, list[str]]) -> web.JobFilter:
    """The jobs ``?state=`` and ``?q=`` ask for (ValueError naming what is allowed otherwise)."""
    states = tuple(_state(s) for v in query.get("state", []) for s in v.split(",") if s.strip())
    names = query.get("q", [])
    if len(names) > 1:
        raise ValueError(f"q= is given {len(names)} times; give it once (a part of the job's name)")
    name = names[0].strip() if names else ""
    if len(name) > MAX_QUERY or not name.isprintable():
        more = "..." if len(name) > 40 else ""
        raise ValueError(
            f"q={name[:40]!r}{more} ({len(name)} characters) is refused: give at most {MAX_QUERY} printable "
            "characters of a job's name"
        )
    return web.JobFilter(tuple(dict.fromkeys(states)), name)


def _state(name: str) -> JobState:
    key = name.strip().upper().removeprefix("JOB_STATE_")
    if key not in JobState.__members__:
        raise ValueError(f"state={name[:40]!r} is unknown; use one of {', '.join(JobState.__members__)}")
    return JobState[key]


def _same_origin(req: Request, secure: bool) -> bool:
    """Whether a POST comes from this site's own page, by what the browser says (nothing: not a browser)."""
    if req.fetch_site not in (None, "same-origin", "none"):
        return False
    if req.origin is None:
        return True
    scheme = "https" if secure else "http"
    return req.origin == f"{scheme}://{req.host}"


def _parse(inc: Incoming) -> Request | Reply:
    """The request ``answer`` reads, or the 400 a malformed target or form gets."""
    try:
        url = urlsplit(inc.target)
        query = parse_qs(url.query, max_num_fields=64)
    except ValueError as e:
        return _error(400, f"malformed request target: {str(e)[:200]}")
    form = None
    if inc.method == "POST":
        try:
            form = parse_qs(inc.body.decode("utf-8", errors="replace"), max_num_fields=16)
        except ValueError as e:
            return _error(400, f"malformed form: {str(e)[:200]}; send token=...&next=/path")
    h = inc.headers
    return Request(
        inc.method,
        url.path,
        query,
        h.get("authorization"),
        h.get("cookie"),
        form,
        inc.peer,
        h.get("origin"),
        h.get("sec-fetch-site"),
        h.get("host"),
    )


def _headers(r: Reply) -> tuple[tuple[str, str], ...]:
    """The reply's headers: its own and the ones every reply carries, the HTML pages' policy too."""
    out = [
        ("Content-Type", r.ctype),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "same-origin"),
    ]
    if r.ctype == HTML:  # the pages run only their own inline script and styles, and no one frames them
        out += [
            ("Content-Security-Policy", web.CSP),
            ("X-Frame-Options", "DENY"),
            ("Cache-Control", "no-store"),
        ]
    if r.code == 401:
        out.append(("WWW-Authenticate", 'Bearer realm="sbpflow"'))
    return (*out, *r.headers)
