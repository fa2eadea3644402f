"""Sessions of the status pages against a real control plane (issue 29): ``next`` never leaves the site
and never splits a header, sign-out revokes, a cookie is this server's only, another site cannot sign a
person in or out, and every page carries its security headers."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbpflow.client.client import JobHandle
from sbpflow.control_plane.service.server import ControlPlane
from sbpflow.control_plane.status.http import safe_next
from tests.control_plane.serving import serving
from tests.control_plane.status.test_web import request, sign_in
from tests.examples.test_examples import load

SITE = "http://127.0.0.1:8080"
# the pieces an attacker builds a ``next`` from: encodings, whitespace and control bytes, slashes, schemes
PIECES = st.sampled_from(
    [
        "/",
        "//",
        "\\",
        "%2F",
        "%2f",
        "%5C",
        "%5c",
        "%09",
        "\t",
        "\r",
        "\n",
        "%0D%0A",
        "%0d%0a",
        " ",
        "%20",
        "\x00",
        "\x7f",
        "%00",
        "http:",
        "https://",
        "javascript:",
        "evil.example",
        "@",
        ":",
        "?",
        "#",
        "&",
        "=",
        "a",
        "jobs",
        "é",
        "%",
        "%25",
        "..",
        ".",
        "\u2028",
        "\u3000",
        "\uff0f",
    ]  # fmt: skip
)
NEXTS = st.lists(PIECES, max_size=8).map("".join) | st.text(max_size=30)


def same_origin(location: str) -> bool:
    """Whether a browser sent to ``location`` from SITE stays on SITE, also as a browser reads it (tab and
    newline dropped, backslash as slash)."""
    for seen in (location, re.sub(r"[\t\n\r]", "", location).replace("\\", "/")):
        url = urllib.parse.urlsplit(urllib.parse.urljoin(SITE + "/login", seen))
        if (url.scheme, url.netloc) != ("http", "127.0.0.1:8080"):
            return False
    return location.startswith("/") and not location.startswith("//")


@settings(max_examples=600, deadline=None)
@given(NEXTS)
def test_next_is_always_a_same_origin_path(raw: str) -> None:
    got = safe_next(raw)
    assert same_origin(got), (raw, got)
    assert got.isascii() and got.isprintable() and "\r" not in got and "\n" not in got
    for text in (got, urllib.parse.unquote(got)):  # once decoded too: no second slash or backslash
        assert "//" not in text and "\\" not in text, (raw, got)


@pytest.mark.parametrize(
    "raw",
    [
        "/\t/evil.example/phish",
        "/\r\nX-Injected: yes",
        "/%2F/evil.example",
        "/%5Cevil.example",
        "//evil.example",
        "https://evil.example/",
        "/\\evil.example",
        "javascript:alert(1)",
        " /",
        "/ok\u2028",
    ],  # fmt: skip
)
def test_known_attacks_go_home(raw: str) -> None:
    assert safe_next(raw) == "/"


def test_good_paths_stay(raw: str = "/jobs/abc/plan?x=1#f") -> None:
    assert safe_next(raw) == raw
    assert safe_next("/jobs/é") == "/jobs/%C3%A9"  # non-ASCII %-encoded: the Location header is ASCII


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, JobHandle]]:
    with serving(tmp_path_factory.mktemp("sessions"), [load("mlp").make_job(steps=2)]) as (plane, (h,)):
        yield plane, h


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(NEXTS)
def test_sign_in_redirects_only_within_the_site(served: tuple[ControlPlane, JobHandle], raw: str) -> None:
    code, headers, _ = request(served[0].http_address, "POST", "/login", {"token": "tok", "next": raw})
    assert code == 303 and same_origin(headers["location"]), (raw, headers["location"])
    assert "x-injected" not in headers


def test_the_phishing_link_and_the_header_injection_of_the_report(
    served: tuple[ControlPlane, JobHandle],
) -> None:
    base = served[0].http_address
    code, _, form = request(base, "GET", "/login?next=%2F%09%2Fevil.example%2Fphish")
    assert code == 200 and "name='next' value='/'" in form
    code, headers, _ = request(base, "POST", "/login", {"token": "tok", "next": "/\r\nX-Injected: yes"})
    assert code == 303 and headers["location"] == "/" and "x-injected" not in headers


def test_sign_out_revokes_the_session(served: tuple[ControlPlane, JobHandle]) -> None:
    base = served[0].http_address
    cookie, other = sign_in(base), sign_in(base)
    assert request(base, "GET", "/", cookie=cookie)[0] == 200
    assert request(base, "POST", "/logout", {}, cookie=cookie)[0] == 303
    code, _, page = request(base, "GET", "/", cookie=cookie)  # the old cookie, replayed
    assert code == 401 and "sign in again" in page
    assert request(base, "GET", "/", cookie=other)[0] == 200  # another sign-in stays


def test_a_cookie_of_another_server_with_the_same_token_is_refused(
    served: tuple[ControlPlane, JobHandle], tmp_path_factory: pytest.TempPathFactory
) -> None:
    cookie = sign_in(served[0].http_address)
    with serving(tmp_path_factory.mktemp("second"), []) as (second, _):
        assert request(second.http_address, "GET", "/", cookie=cookie)[0] == 401
        assert request(second.http_address, "GET", "/", cookie=sign_in(second.http_address))[0] == 200
    assert request(served[0].http_address, "GET", "/", cookie=cookie)[0] == 200


@pytest.mark.parametrize(
    "site", [{"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}]
)
def test_another_site_cannot_sign_out_or_in(
    served: tuple[ControlPlane, JobHandle], site: dict[str, str]
) -> None:
    base = served[0].http_address
    cookie = sign_in(base)
    code, headers, body = request(base, "POST", "/logout", {}, cookie=cookie, headers=site)
    assert code == 403 and "another site" in body and "set-cookie" not in headers
    assert request(base, "GET", "/", cookie=cookie)[0] == 200  # still signed in
    code, headers, _ = request(base, "POST", "/login", {"token": "tok", "next": "/"}, headers=site)
    assert code == 403 and "set-cookie" not in headers
    # the site's own page: its origin, or the browser saying same-origin
    own = {"Origin": base, "Sec-Fetch-Site": "same-origin"}
    assert request(base, "POST", "/logout", {}, cookie=cookie, headers=own)[0] == 303
    assert request(base, "GET", "/", cookie=cookie)[0] == 401


def test_every_page_carries_its_policy(served: tuple[ControlPlane, JobHandle]) -> None:
    plane, h = served
    base = plane.http_address
    pages = ["/", f"/jobs/{h.job_id}", f"/jobs/{h.job_id}/plan", "/login"]
    for path, token in [(p, "tok") for p in pages] + [("/", ""), (f"/jobs/{h.job_id}", "")]:
        code, headers, page = request(base, "GET", path, token=token)
        assert code in (200, 401) and headers["content-type"].startswith("text/html"), path
        csp = headers["content-security-policy"]
        assert (
            "default-src 'none'" in csp
            and "frame-ancestors 'none'" in csp
            and "'unsafe-inline'" not in csp.split("style-src-attr")[0]
        ), csp
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "same-origin"
        assert "<script" not in page or "script-src 'sha256-" in csp
    for path in ("/healthz", "/v1/jobs", "/nothing"):  # not pages: no policy needed, but no sniffing
        headers = request(base, "GET", path, token="tok")[1]
        assert headers["x-content-type-options"] == "nosniff" and "content-security-policy" not in headers
