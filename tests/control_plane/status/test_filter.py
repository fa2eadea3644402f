"""The job list's filter, over real HTTP: ``?state=`` and ``?q=`` (a part of the name) on the page and on
``/v1/jobs`` alike; hostile values are escaped where shown, and bad ones refused with what is allowed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.control_plane.status.http import MAX_QUERY
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from tests.control_plane.status.test_web import request

HOSTILE = "<script>alert(1)</script>' onmouseover='x"
NAMES = {  # name -> where its job ends
    "bert-base": JobState.SUCCEEDED,
    "BERT large": JobState.CANCELLED,
    "mlp": JobState.SUCCEEDED,
    HOSTILE: JobState.FAILED,
}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A control plane over a store that already holds ended jobs of these names."""
    path = tmp_path_factory.mktemp("filter") / "jobs.db"
    store = JobStore(str(path))
    for name, end in NAMES.items():
        rec = store.create(b"", name)
        if end != JobState.CANCELLED:
            for st in (JobState.COMPILING, JobState.STARTING, JobState.RUNNING):
                store.transition(rec.id, st)
        store.transition(rec.id, end)
    store.close()
    cfg = ServerConfig(
        store=str(path), run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=1, auth_token="tok"
    )
    p = ControlPlane(cfg).start()
    yield p
    p.stop()


def _names(plane: ControlPlane, query: str) -> list[str]:
    code, _, body = request(plane.http_address, "GET", f"/v1/jobs?{query}", token="tok")
    assert code == 200, body
    return sorted(j["name"] for j in json.loads(body)["jobs"])


def test_the_api_filters_by_state_and_by_a_part_of_the_name(plane: ControlPlane) -> None:
    assert _names(plane, "q=bert") == ["BERT large", "bert-base"]  # ASCII letters in either case
    assert _names(plane, "q=bert&state=SUCCEEDED") == ["bert-base"]
    assert _names(plane, "state=cancelled,failed") == sorted(["BERT large", HOSTILE])
    assert _names(plane, f"q={quote('<script>')}") == [HOSTILE]
    assert _names(plane, "q=%25") == [] and _names(plane, "q=_") == []  # no wildcards: % and _ are letters
    assert _names(plane, "q=") == sorted(NAMES)


def test_the_page_filters_and_keeps_its_form_filled(plane: ControlPlane) -> None:
    code, _, page = request(plane.http_address, "GET", "/?state=SUCCEEDED&q=Bert", token="tok")
    assert code == 200
    listed = re.findall(r"<a href='/jobs/[^']*'>[^<]*</a></td><td>([^<]*)</td>", page)
    assert listed == ["bert-base"]
    assert "<option value='SUCCEEDED' selected>" in page and "value='Bert'" in page
    assert "href='/v1/jobs?state=SUCCEEDED&amp;q=Bert'" in page  # the same list as JSON
    code, _, page = request(plane.http_address, "GET", "/?state=RUNNING", token="tok")
    assert code == 200 and "no jobs in state RUNNING" in page


def test_hostile_text_is_shown_escaped(plane: ControlPlane) -> None:
    code, _, page = request(plane.http_address, "GET", f"/?q={quote(HOSTILE)}", token="tok")
    assert code == 200 and "<script>alert" not in page and "onmouseover='" not in page
    assert "value='&lt;script&gt;alert(1)&lt;/script&gt;&#x27; onmouseover=&#x27;x'" in page


BAD = [
    ("state=SLEEPING", "use one of PENDING, COMPILING"),
    (f"q={'a' * (MAX_QUERY + 1)}", f"give at most {MAX_QUERY} printable characters"),
    ("q=a%0Ab", "give at most"),  # a newline
    ("q=a&q=b", "give it once"),
]


@pytest.mark.parametrize(
    ("path", "query", "says"),
    [(path, q, says) for path in ("/", "/v1/jobs") for q, says in BAD]
    + [("/v1/jobs", "limit=0", "give an integer in 1..1000")],
)
def test_a_bad_filter_is_refused_saying_what_is_allowed(
    plane: ControlPlane, path: str, query: str, says: str
) -> None:
    code, headers, body = request(plane.http_address, "GET", f"{path}?{query}", token="tok")
    assert code == 400 and headers["content-type"] == "application/json"
    assert says in json.loads(body)["error"] and len(body) < 1000
