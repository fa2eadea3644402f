"""Bearer-token authentication for the gRPC services and the HTTP status endpoint.

When the server has a token (``--auth-token`` or ``SBPFLOW_TOKEN``), every call must carry
``authorization: Bearer <token>`` (gRPC metadata, or the HTTP ``Authorization`` header); others get
UNAUTHENTICATED / 401 before any handler runs, so a rejected call changes nothing. Tokens are compared
in constant time.

Open on purpose: the gRPC health service (``grpc.health.v1.Health``) and HTTP ``/healthz`` and
``/readyz``, because load balancers and Kubernetes probes call them without credentials and they
reveal nothing about jobs. Everything else, server reflection included, needs the token — but the
WorkerService, which checks its own per-attempt worker credentials instead (``reports.py``): workers
never hold the client token.

A browser logs in once: the status page's form posts the token to ``/login``, which answers with an
HttpOnly, SameSite=Strict session cookie (:meth:`TokenCheck.session`): ``<id>.<expiry>.<hmac>``, never
the token itself. The HMAC is keyed by the token and a random secret of this TokenCheck, so a cookie made
by another server started with the same token is refused, and so is every cookie after a restart or a
new token. The server also keeps the live session ids in memory (bounded: the oldest drop out past
``MAX_SESSIONS``, until their expiry), so ``/logout`` revokes a session for good — a cookie replayed
after sign-out is refused — and nothing lasts past ``SESSION_SECONDS``. Only the HTML pages accept the
cookie; the JSON API and gRPC take the bearer token.

Wrong tokens are rate-limited per peer address (``throttle.py``), over HTTP and gRPC alike: one
:class:`Throttle` per TokenCheck, so guesses on either count against both.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from typing import Any

import grpc

from sbpflow.control_plane.status.throttle import (
    DEFAULT_LIMIT,
    FailureLimit,
    Throttle,
    peer_host,
    retry_after,
)

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
SELF_CHECKED_GRPC_PREFIXES = ("/sbpflow.v1.WorkerService/",)  # ReportHub checks worker credentials
OPEN_HTTP_PATHS = frozenset({"/healthz", "/readyz"})
COOKIE = "sbpflow_session"
SESSION_SECONDS = 12 * 3600  # a login lasts this long
MAX_SESSIONS = 10_000  # live sessions kept (~150 B each); past it the oldest is signed out


class TokenCheck:
    """``check(header_value)``: whether an ``Authorization`` value carries the token (always, without one).

    Also the sessions the status pages sign in with, and the failed-token :attr:`throttle`."""

    def __init__(self, token: str | None, limit: FailureLimit = DEFAULT_LIMIT) -> None:
        self.token = token or None
        self.throttle = Throttle(limit)
        # this server's own: a cookie another server signed with the same token does not verify here
        self._key = (token or "").encode() + secrets.token_bytes(32)
        self._live: OrderedDict[str, int] = OrderedDict()  # session id -> expiry, oldest first
        self._lock = threading.Lock()  # logins and page loads come from the HTTP executor's threads

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def check(self, authorization: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())

    def session(self, now: float | None = None) -> str:
        """A new session cookie's value, good for ``SESSION_SECONDS`` from ``now``: ``<id>.<expiry>.<hmac>``."""
        if self.token is None:
            raise ValueError("no token: the server runs without auth, so there is no session to make")
        now = time.time() if now is None else now
        sid, expiry = secrets.token_hex(16), int(now + SESSION_SECONDS)
        with self._lock:
            for old, until in list(self._live.items()):  # oldest first: drop the expired ones
                if until > now and len(self._live) < MAX_SESSIONS:
                    break
                del self._live[old]
            self._live[sid] = expiry
        return f"{sid}.{expiry}.{self._sign(sid, str(expiry))}"

    def check_cookie(self, cookie_header: str | None, now: float | None = None) -> bool:
        """Whether a ``Cookie`` header holds a live session of this server (always, without a token)."""
        return self.token is None or self._session_id(cookie_header, now) is not None

    def revoke(self, cookie_header: str | None) -> bool:
        """Signs out the session in ``cookie_header`` (``/logout``); whether there was one."""
        sid = self._session_id(cookie_header, None)
        with self._lock:
            return sid is not None and self._live.pop(sid, None) is not None

    def _session_id(self, cookie_header: str | None, now: float | None) -> str | None:
        try:
            morsel = SimpleCookie(cookie_header or "").get(COOKIE)
        except CookieError:
            return None
        sid, _, rest = (morsel.value if morsel else "").partition(".")
        expiry, _, mac = rest.partition(".")
        if not (expiry.isascii() and expiry.isdigit() and len(expiry) <= 12 and len(sid) == 32):
            return None
        if int(expiry) <= (time.time() if now is None else now):
            return None
        if not hmac.compare_digest(mac.encode(), self._sign(sid, expiry).encode()):
            return None
        with self._lock:
            return sid if self._live.get(sid) == int(expiry) else None

    def _sign(self, sid: str, expiry: str) -> str:
        return hmac.new(self._key, f"sbpflow session {sid} {expiry}".encode(), hashlib.sha256).hexdigest()

    def problem(self, authorization: str | None) -> str:
        """Why a call was refused, for the error message (never echoes the token)."""
        if not authorization:
            return "no credentials: send the header `authorization: Bearer <token>` (sf.Client(token=...))"
        return "the bearer token is wrong: use the token the server was started with (--auth-token)"


def too_many(seconds: float) -> str:
    """Why a locked-out peer is refused (``throttle.py``)."""
    return (
        f"too many wrong tokens from this address: wait {retry_after(seconds)} s, then use the token the "
        "server was started with"
    )


_KINDS = {  # a handler's kind (request streaming, response streaming): its behaviour and its maker
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the token (except the open health service) with UNAUTHENTICATED, and every
    call from a peer that sent too many wrong tokens with RESOURCE_EXHAUSTED (``retry-after`` trailer)."""

    def __init__(self, check: TokenCheck) -> None:
        self._check = check

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        method = details.method  # type: ignore[attr-defined]
        if not self._check.enabled or method.startswith(OPEN_GRPC_PREFIXES + SELF_CHECKED_GRPC_PREFIXES):
            return continuation(details)
        metadata = dict(details.invocation_metadata or ())  # type: ignore[attr-defined]
        auth = metadata.get("authorization")
        if isinstance(auth, bytes):
            auth = auth.decode(errors="replace")
        handler = continuation(details)
        if handler is None:
            return None
        # The peer is known only inside the call (context.peer()), so the check runs there; the
        # replacement keeps the handler's kind (unary/stream in and out) so gRPC accepts it.
        name, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
        guarded = _guard(self._check, method, auth, getattr(handler, name))
        return make(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _guard(
    check: TokenCheck, method: str, auth: str | None, behavior: Callable[..., Any]
) -> Callable[..., Any]:
    ok = check.check(auth)  # compared once, before the call: a refused call runs no handler

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        peer = peer_host(context.peer())
        wait = check.throttle.wait(peer)
        if wait > 0:  # locked out: the token is not even looked at
            context.set_trailing_metadata((("retry-after", retry_after(wait)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {too_many(wait)}")
        if not ok:
            if auth:  # a wrong token, not a missing one, is a guess
                check.throttle.failed(peer)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method}: {check.problem(auth)}")
        return behavior(request, context)

    return call
