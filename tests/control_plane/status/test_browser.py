"""The status pages in a real headless browser: sign in, open a job, see its loss curve and its plan.

Debian's ``chromium`` and ``chromium-driver`` drive it through selenium (``.ci/run`` installs them);
the test is skipped, saying so, where they are missing. Set ``SBPFLOW_SCREENSHOTS=DIR`` to keep a
screenshot of each page.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sbpflow.client.client import JobHandle
from sbpflow.control_plane.service.server import ControlPlane
from tests.control_plane.serving import serving
from tests.examples.test_examples import load

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra")
pytestmark = pytest.mark.skipif(
    not (shutil.which(CHROMIUM) and shutil.which(DRIVER)),
    reason="no Chromium here: apt-get install -y --no-install-recommends chromium chromium-driver",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, JobHandle]]:
    with serving(tmp_path_factory.mktemp("browser"), [load("gpt").make_job(steps=4)]) as (plane, (h,)):
        yield plane, h


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: CSP violations land there
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    driver.implicitly_wait(20)  # a find waits for the page a click or a redirect is loading
    yield driver
    driver.quit()


@pytest.fixture(autouse=True)
def no_policy_violation(browser: Any) -> Iterator[None]:
    """Every page of a test ran under its Content-Security-Policy without a refusal in the console."""
    browser.get_log("browser")  # drop what an earlier test left
    yield
    refused = [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
    assert not refused, refused


def shot(driver: Any, name: str) -> None:
    where = os.environ.get("SBPFLOW_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(where) / f"{name}.png"))


def open_signed_in(d: Any, url: str) -> None:
    """Open ``url``, signing in on the way when the page asks for the token."""
    from selenium.webdriver.common.by import By

    d.get(url)
    if "sign in" in d.title:  # the title, not a find: a find of what is absent waits out the implicit wait
        d.find_element(By.ID, "token").send_keys("tok")
        d.find_element(By.ID, "signin").click()


def test_sign_in_open_a_job_and_see_its_curve(browser: Any, served: tuple[ControlPlane, JobHandle]) -> None:
    from selenium.webdriver.common.by import By

    plane, h = served
    d = browser
    d.get(f"{plane.http_address}/")
    shot(d, "1-sign-in")
    d.find_element(By.ID, "token").send_keys("tok")
    d.find_element(By.ID, "signin").click()
    link = d.find_element(By.LINK_TEXT, h.job_id)
    shot(d, "2-jobs")
    cookies = {c["name"]: c for c in d.get_cookies()}
    assert cookies["sbpflow_session"]["httpOnly"] is True
    assert d.execute_script("return document.cookie") == ""  # script cannot read it
    link.click()
    assert h.job_id in d.title
    # the page's own style and script run under its policy: the style block by its hash
    assert "sans-serif" in d.execute_script("return getComputedStyle(document.body).fontFamily")
    assert (
        d.execute_script("return getComputedStyle(document.querySelector('.state')).color")
        == "rgb(255, 255, 255)"
    )
    chart = d.find_element(By.CSS_SELECTOR, "#curves svg.chart")
    assert chart.size["width"] > 300 and chart.size["height"] > 150  # drawn, not an empty box
    texts = [t.text for t in chart.find_elements(By.TAG_NAME, "text")]
    assert "step" in texts and "loss" in texts and len(texts) > 6  # axis titles and tick values
    points = chart.find_element(By.TAG_NAME, "polyline").get_attribute("points").split()
    assert len(points) == 4  # one point per step
    shot(d, "3-job")


def test_a_block_of_the_plan_opens_on_click(browser: Any, served: tuple[ControlPlane, JobHandle]) -> None:
    from selenium.webdriver.common.by import By

    plane, h = served
    d = browser
    open_signed_in(d, f"{plane.http_address}/jobs/{h.job_id}")
    blocks = d.find_elements(By.CSS_SELECTOR, "section.block")
    assert blocks and not any(b.is_displayed() for b in blocks)
    target = d.find_element(By.CSS_SELECTOR, "#plan svg a")  # a node's link
    href = d.execute_script(
        "return arguments[0].getAttribute('xlink:href') || arguments[0].getAttribute('href')", target
    )
    assert href.startswith("#block-")
    target.find_element(By.TAG_NAME, "text").click()  # a person clicks the node's words
    assert d.current_url.endswith(href)
    opened = d.find_element(By.ID, href[1:])
    assert opened.is_displayed() and opened.find_elements(By.TAG_NAME, "table")
    shot(d, "4-block")
    d.get(f"{plane.http_address}/jobs/{h.job_id}/plan")  # the plan's own page, its own style block
    assert (
        d.execute_script("return getComputedStyle(document.querySelector('table')).borderCollapse")
        == "collapse"
    )


def test_signing_out_locks_the_pages_again(browser: Any, served: tuple[ControlPlane, JobHandle]) -> None:
    from selenium.webdriver.common.by import By

    plane, _ = served
    d = browser
    d.get(f"{plane.http_address}/")
    d.find_element(By.XPATH, "//button[text()='sign out']").click()
    assert d.find_elements(By.ID, "token")  # the sign-in form
    d.get(f"{plane.http_address}/")
    assert d.find_elements(By.ID, "token")


def test_a_running_jobs_page_refreshes_itself(browser: Any, served: tuple[ControlPlane, JobHandle]) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from sbpflow.client.client import Client

    plane, _ = served
    d = browser
    with Client(plane.address, token="tok") as c:
        h = c.submit(load("mlp").make_job(steps=100_000))  # runs until cancelled
        try:
            WebDriverWait(h, 60, 0.2).until(lambda h: h.status().step > 0)
            open_signed_in(d, f"{plane.http_address}/jobs/{h.job_id}")
            first = d.find_element(By.ID, "overview").text
            assert (
                "RUNNING" in first and d.find_element(By.TAG_NAME, "body").get_attribute("data-final") == "0"
            )
            # no reload: the page's own script swaps in the new step within a refresh or two
            swapped = (StaleElementReferenceException,)  # the element read as the script replaced it
            WebDriverWait(d, 60, 0.5, swapped).until(
                lambda d: d.find_element(By.ID, "overview").text != first
            )
            assert d.find_elements(By.CSS_SELECTOR, "#curves svg.chart polyline")
        finally:
            h.cancel("the test has seen the page refresh")


def test_the_job_list_filters_by_state_and_name_without_script(
    browser: Any, served: tuple[ControlPlane, JobHandle]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    plane, h = served
    d = browser
    open_signed_in(d, f"{plane.http_address}/")
    Select(d.find_element(By.ID, "filter-state")).select_by_value("SUCCEEDED")
    d.find_element(By.ID, "filter-name").send_keys("gp")  # the GPT example's job: TrainGPT
    d.find_element(By.ID, "filter-go").click()  # a plain GET form: the browser, not a script, sends it
    WebDriverWait(d, 30, 0.1).until(lambda d: d.current_url.endswith("/?state=SUCCEEDED&q=gp"))
    assert d.find_elements(By.LINK_TEXT, h.job_id)
    assert d.find_element(By.ID, "filter-name").get_attribute("value") == "gp"  # the form keeps it
    shot(d, "5-filtered")
    name = d.find_element(By.ID, "filter-name")
    name.clear()
    name.send_keys("<b>no such job</b>")
    d.find_element(By.ID, "filter-go").click()
    WebDriverWait(d, 30, 0.1).until(lambda d: "no+such+job" in d.current_url)
    jobs = d.find_element(By.ID, "jobs")
    assert (
        jobs.text == "no jobs in state SUCCEEDED and named like '<b>no such job</b>'"
    )  # as text, not markup
    assert not jobs.find_elements(By.TAG_NAME, "b")
    d.find_element(By.ID, "clear-filter").click()
    assert d.find_elements(By.LINK_TEXT, h.job_id)


def test_a_restarted_jobs_curves_mark_its_attempts(
    browser: Any, served: tuple[ControlPlane, JobHandle]
) -> None:
    from selenium.webdriver.common.by import By

    from tests.control_plane.status.test_curves import STEPS, _job, _restarted

    plane, _ = served
    d = browser
    job_id = _restarted(plane.store, _job())  # attempt 2 resumed step 200's checkpoint
    open_signed_in(d, f"{plane.http_address}/jobs/{job_id}")
    charts = d.find_elements(By.CSS_SELECTOR, "#curves svg.chart")
    assert len(charts) == 4  # loss (and held-out), learning rate, throughput, step time
    for chart in charts:
        (marker,) = chart.find_elements(By.CSS_SELECTOR, "g.marker")
        # a vertical line across the plot (no width: selenium does not call it displayed), and its label
        assert marker.find_element(By.TAG_NAME, "line").size["height"] > 100
        label = marker.find_element(By.TAG_NAME, "text")
        assert label.is_displayed() and label.text == "attempt 2 from step 200"
    loss = charts[0]
    points = loss.find_element(By.CSS_SELECTOR, "g.series[data-name='loss'] polyline").get_attribute("points")
    assert len(points.split()) == STEPS  # one point per counted step, not the 412 step events
    legend = [t.text for t in loss.find_elements(By.CSS_SELECTOR, "g.legend text")]
    assert legend == ["loss", "held-out loss"]
    shot(d, "6-restarted")
