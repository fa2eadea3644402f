"""The status pages over real HTTP: sign-in with the session cookie, the job page, the plan page."""

from __future__ import annotations

import dataclasses
import http.client
import re
import urllib.parse
from collections.abc import Iterator
from http.cookies import SimpleCookie
from pathlib import Path

import pytest

from sbpflow.client.client import JobHandle
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.control_plane.status.auth import COOKIE, SESSION_SECONDS, TokenCheck
from sbpflow.control_plane.status.charts import fmt
from sbpflow.runs.options import MANAGER_DEFAULTS
from tests.control_plane.launch.test_numerics import diverging
from tests.control_plane.serving import serving
from tests.examples.test_examples import load


def request(
    base: str,
    method: str,
    path: str,
    body: dict[str, str] | None = None,
    cookie: str = "",
    token: str = "",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], str]:
    """One request, redirects not followed: status, headers, body."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {**(headers or {}), **({"Cookie": cookie} if cookie else {})}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None
    if body is not None:
        data = urllib.parse.urlencode(body)
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    conn.request(method, path, data, headers)
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    conn.close()
    return out


pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, JobHandle, JobHandle]]:
    tmp = tmp_path_factory.mktemp("web")
    job = load("mlp").make_job(steps=6)
    ok = dataclasses.replace(job, config=dataclasses.replace(job.config, checkpoint_every=3))
    failing = diverging(load("mlp"))  # NON_FINITE_LOSS at step 2
    with serving(tmp, [ok, failing], checkpoint_root=str(tmp / "ckpt")) as (plane, handles):
        yield plane, handles[0], handles[1]


def sign_in(base: str, next_path: str = "/") -> str:
    code, headers, _ = request(base, "POST", "/login", {"token": "tok", "next": next_path})
    assert code == 303 and headers["location"] == next_path
    morsel = SimpleCookie(headers["set-cookie"])[COOKIE]
    return f"{COOKIE}={morsel.value}"


def test_sign_in_sets_an_http_only_strict_cookie(served: tuple[ControlPlane, JobHandle, JobHandle]) -> None:
    base = served[0].http_address
    code, headers, _ = request(base, "POST", "/login", {"token": "tok", "next": "/jobs/x"})
    assert code == 303 and headers["location"] == "/jobs/x"
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    assert "tok" not in SimpleCookie(cookie)[COOKIE].value  # the cookie never holds the token


def test_a_wrong_token_gets_the_form_again(served: tuple[ControlPlane, JobHandle, JobHandle]) -> None:
    code, headers, body = request(served[0].http_address, "POST", "/login", {"token": "nope", "next": "/"})
    assert code == 401 and "set-cookie" not in headers and "the token is wrong" in body


def test_sign_in_never_sends_a_browser_to_another_site(
    served: tuple[ControlPlane, JobHandle, JobHandle],
) -> None:
    base = served[0].http_address
    for evil in ("//evil.example/", "https://evil.example/", "/\\\\evil.example"):
        code, headers, _ = request(base, "POST", "/login", {"token": "tok", "next": evil})
        assert code == 303 and headers["location"] == "/"


def test_the_cookie_opens_the_pages_but_not_the_json_api(
    served: tuple[ControlPlane, JobHandle, JobHandle],
) -> None:
    plane, ok, _ = served
    cookie = sign_in(plane.http_address)
    code, _, page = request(plane.http_address, "GET", "/", cookie=cookie)
    assert code == 200 and ok.job_id in page
    assert request(plane.http_address, "GET", "/v1/jobs", cookie=cookie)[0] == 401
    assert request(plane.http_address, "GET", "/v1/jobs", token="tok")[0] == 200


def test_a_forged_or_expired_cookie_is_refused() -> None:
    check = TokenCheck("tok")
    good = check.session(now=1000.0)
    assert check.check_cookie(f"{COOKIE}={good}", now=1001.0)
    assert not check.check_cookie(f"{COOKIE}={good}", now=1000.0 + SESSION_SECONDS + 1)  # expired
    sid, expiry, mac = good.split(".")
    assert not check.check_cookie(f"{COOKIE}={sid}.{int(expiry) + 999}.{mac}", now=1001.0)  # expiry moved
    assert not check.check_cookie(f"{COOKIE}={'0' * 32}.{expiry}.{mac}", now=1001.0)  # another id
    assert not TokenCheck("other").check_cookie(f"{COOKIE}={good}", now=1001.0)  # another token's server
    assert not TokenCheck("tok").check_cookie(f"{COOKIE}={good}", now=1001.0)  # another server, same token
    for junk in ("", f"{COOKIE}=", f"{COOKIE}=abc", 'x="unterminated'):
        assert not check.check_cookie(junk, now=1001.0)


def test_sign_out_clears_the_cookie(served: tuple[ControlPlane, JobHandle, JobHandle]) -> None:
    cookie = sign_in(served[0].http_address)
    code, headers, _ = request(served[0].http_address, "POST", "/logout", {}, cookie=cookie)
    assert code == 303 and headers["location"] == "/login" and "Max-Age=0" in headers["set-cookie"]
    # without a session (another site's POST carries none) sign-out changes nothing, not even the cookie
    code, headers, _ = request(served[0].http_address, "POST", "/logout", {})
    assert code == 303 and headers["location"] == "/login" and "set-cookie" not in headers


def test_a_job_page_shows_curves_checkpoints_events_configuration_and_plan(
    served: tuple[ControlPlane, JobHandle, JobHandle],
) -> None:
    plane, ok, _ = served
    code, _, page = request(plane.http_address, "GET", f"/jobs/{ok.job_id}", token="tok")
    assert code == 200
    for part in ("training loss by step", "throughput over time", "seconds since the job started"):
        assert part in page
    assert "SUCCEEDED" in page and "data-final='1'" in page  # a finished job's page stops refreshing
    assert "step-00000003" in page and "step-00000006" in page  # its checkpoints
    assert "gradient_accumulation_steps" in page and "optimizer" in page  # configuration
    assert "SBP per op:" in page and "class='plan'" in page and "class='block'" in page  # plan


def test_a_failed_job_page_says_why(served: tuple[ControlPlane, JobHandle, JobHandle]) -> None:
    plane, _, failed = served
    status = failed.status()
    code, _, page = request(plane.http_address, "GET", f"/jobs/{failed.job_id}", token="tok")
    assert code == 200 and "class='failure'" in page and status.reason in page
    assert status.message.split("\n")[0][:60].replace("'", "&#x27;") in page


def test_the_plan_page_stands_alone(served: tuple[ControlPlane, JobHandle, JobHandle]) -> None:
    plane, ok, _ = served
    code, _, page = request(plane.http_address, "GET", f"/jobs/{ok.job_id}/plan", token="tok")
    assert code == 200 and page.startswith("<!doctype html>") and "forward" in page and "Boxing" in page


def test_an_unknown_job_page_is_404(served: tuple[ControlPlane, JobHandle, JobHandle]) -> None:
    assert request(served[0].http_address, "GET", "/jobs/nope", token="tok")[0] == 404


def test_without_a_token_login_goes_straight_through(tmp_path: Path) -> None:
    plane = ControlPlane(
        ServerConfig(store=str(tmp_path / "j.db"), run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=1)
    ).start()
    try:
        assert request(plane.http_address, "GET", "/login?next=/jobs/a")[1]["location"] == "/jobs/a"
        code, _, page = request(plane.http_address, "GET", "/")
        assert code == 200 and "sign out" not in page
    finally:
        plane.stop()


def test_a_malformed_or_oversized_form_is_refused(served: tuple[ControlPlane, JobHandle, JobHandle]) -> None:
    base = served[0].http_address
    many = {f"f{i}": "x" for i in range(40)}
    code, _, body = request(base, "POST", "/login", many)
    assert code == 400 and "malformed form" in body
    code, _, body = request(base, "POST", "/login", {"token": "x" * 10_000})
    assert code == 413 and "at most" in body
    assert request(base, "POST", "/v1/jobs", {})[0] == 405  # the API takes no POST


def test_a_job_that_evaluates_shows_its_held_out_loss(tmp_path: Path) -> None:
    from tests.control_plane.launch.test_evaluation import job as evaluating_job

    with serving(tmp_path, [evaluating_job(every=2, steps=4)], checkpoint_root=str(tmp_path / "c")) as (
        plane,
        (h,),
    ):
        rec = plane.store.get(h.job_id)
        assert rec.eval_step == 4 and rec.eval_loss is not None
        shown = f"{fmt(rec.eval_loss)} <small>at step 4</small>"
        page = request(plane.http_address, "GET", f"/jobs/{h.job_id}", token="tok")[2]
        assert shown in page
        assert shown in request(plane.http_address, "GET", "/", token="tok")[2]
        # the loss chart draws both evaluations (steps 2 and 4) beside the loss; lr has a chart of its own
        held_out = re.search(r"<g class='series' data-name='held-out loss'>(.*?)</g>", page)
        assert held_out is not None and held_out.group(1).count("<circle") == 2
        assert "<title>held-out loss " + fmt(rec.eval_loss) + " at step 4</title>" in held_out.group(1)
        assert "<title>learning rate by step</title>" in page and "data-name='learning rate'" in page
