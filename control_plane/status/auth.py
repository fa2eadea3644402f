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
HttpOnly, SameSite=Strict session cookie (:meth:`TokenCheck.session`). The cookie holds an expiry and an
HMAC of it keyed by the token, never the token itself, so it lapses after ``SESSION_SECONDS`` and every
cookie dies with a new token. Only the HTML pages accept it; the JSON API and gRPC take the bearer token.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from typing import Any

import grpc

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
SELF_CHECKED_GRPC_PREFIXES = ("/sbpflow.v1.WorkerService/",)  # ReportHub checks worker credentials
OPEN_HTTP_PATHS = frozenset({"/healthz", "/readyz"})
COOKIE = "sbpflow_session"
SESSION_SECONDS = 12 * 3600  # a login lasts this long


class TokenCheck:
    """``check(header_value)``: whether an ``Authorization`` value carries the token (always, without one)."""

    def __init__(self, token: str | None) -> None:
        self.token = token or None

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def check(self, authorization: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())

    def session(self, now: float | None = None) -> str:
        """A session cookie's value, good for ``SESSION_SECONDS`` from ``now``: ``<expiry>.<hmac>``."""
        if self.token is None:
            raise ValueError("no token: the server runs without auth, so there is no session to make")
        expiry = str(int((time.time() if now is None else now) + SESSION_SECONDS))
        return f"{expiry}.{self._sign(expiry)}"

    def check_cookie(self, cookie_header: str | None, now: float | None = None) -> bool:
        """Whether a ``Cookie`` header holds an unexpired session of this token (always, without one)."""
        if self.token is None:
            return True
        try:
            morsel = SimpleCookie(cookie_header or "").get(COOKIE)
        except CookieError:
            return False
        expiry, _, mac = (morsel.value if morsel else "").partition(".")
        if not (expiry.isascii() and expiry.isdigit() and len(expiry) <= 12):
            return False
        fresh = int(expiry) > (time.time() if now is None else now)
        return fresh and hmac.compare_digest(mac.encode(), self._sign(expiry).encode())

    def _sign(self, expiry: str) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), f"sbpflow session {expiry}".encode(), hashlib.sha256).hexdigest()

    def problem(self, authorization: str | None) -> str:
        """Why a call was refused, for the error message (never echoes the token)."""
        if not authorization:
            return "no credentials: send the header `authorization: Bearer <token>` (sf.Client(token=...))"
        return "the bearer token is wrong: use the token the server was started with (--auth-token)"


def _aborter(code: grpc.StatusCode, details: str) -> Callable[..., Any]:
    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    return abort


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the token (except the open health service) with UNAUTHENTICATED."""

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
        if self._check.check(auth):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        abort = _aborter(grpc.StatusCode.UNAUTHENTICATED, f"{method}: {self._check.problem(auth)}")
        # Keep the handler's kind (unary/stream in and out) so gRPC accepts the replacement.
        kinds = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        make = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(
            abort,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
