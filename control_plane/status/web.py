"""The status pages a person reads in a browser: the login form, the job list and the frame they share.

Every page is one HTML document with its style inline and one small script (:data:`REFRESH_JS`) that
re-reads the page every few seconds and swaps in its ``data-live`` parts, so a chart or a table moves
while the job runs and a plan picture with a block opened stays as it is. The script stops once every
job on the page has finished; "auto-refresh" unticked pauses it. Without script the pages still read
whole (reload by hand). A job's own page is ``web_job.py``.

:data:`CSP` is the Content-Security-Policy every page is served with (``http.py``): the script and the
style blocks run because their hashes are in it, so a new inline ``<script>`` or ``<style>`` on a page
must be one of these constants (or its hash added there), or the browser refuses it.
"""

from __future__ import annotations

import base64
import hashlib
import html
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

from sbpflow.control_plane.render import graph_page, plan_picture
from sbpflow.control_plane.status.charts import Series, fmt, line_chart
from sbpflow.control_plane.store.schema import JobRecord, LossPoint
from sbpflow.runs.states import JobState

REFRESH_SECONDS = 5
TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
STATE_COLORS = {
    JobState.PENDING: "#888",
    JobState.COMPILING: "#b58900",
    JobState.STARTING: "#b58900",
    JobState.RUNNING: "#1f77b4",
    JobState.SUCCEEDED: "#2ca02c",
    JobState.FAILED: "#d62728",
    JobState.CANCELLED: "#666",
}
STYLE = (
    "body{font-family:sans-serif;margin:16px 24px;color:#222}"
    "table{border-collapse:collapse;margin:6px 0 14px}"
    "td,th{padding:3px 10px;text-align:left;border-bottom:1px solid #e4e4e4;vertical-align:top}"
    "th{background:#f4f4f4}.state{color:#fff;border-radius:4px;padding:1px 6px;font-size:12px}"
    "pre{background:#f7f7f7;padding:8px;overflow:auto;max-height:24em}"
    ".failure{border-left:4px solid #d62728;padding-left:10px}"
    ".bar{display:flex;gap:16px;align-items:center;font-size:13px}.bar form{margin:0}"
    ".charts{display:flex;flex-wrap:wrap;gap:12px}.nodata{color:#888}"
)
REFRESH_JS = f"""
(function () {{
  const box = document.getElementById("autorefresh");
  async function tick() {{
    if (!box || !box.checked || document.body.dataset.final === "1") return;
    try {{
      const r = await fetch(location.href, {{credentials: "same-origin"}});
      if (!r.ok) return;
      const doc = new DOMParser().parseFromString(await r.text(), "text/html");
      for (const el of doc.querySelectorAll("[data-live]")) {{
        const here = document.getElementById(el.id);
        if (here) here.replaceWith(el);
      }}
      document.body.dataset.final = doc.body.dataset.final;
      const at = document.getElementById("refreshed");
      if (at) at.textContent = "updated " + new Date().toLocaleTimeString();
    }} catch (e) {{ /* the server is away for a moment: try again next tick */ }}
  }}
  setInterval(tick, {REFRESH_SECONDS * 1000});
}})();
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


_STYLES = " ".join(_sha256(css) for css in (STYLE, plan_picture.CSS, graph_page.PAGE_STYLE))
# The policy of every page: nothing but this script and these style blocks, by their hashes, so an
# injected <script> or <style> would not run. Style attributes are allowed: the plan picture's legend
# colours its swatches with them (plan_picture.py), and an attribute can set a colour, not run code.
CSP = "; ".join(
    (
        "default-src 'none'",
        f"script-src {_sha256(REFRESH_JS)}",
        f"style-src {_STYLES}",
        f"style-src-elem {_STYLES}",
        "style-src-attr 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",  # the refresh script re-reads its own page
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)


def esc(x: object) -> str:
    return html.escape(str(x))


def when(t: float | None) -> str:
    """A time of day as UTC, or an empty cell."""
    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def duration(seconds: float | None) -> str:
    """``1h 02m``, ``3m 05s``, ``4.2 s``; empty for None."""
    if seconds is None or seconds < 0:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(seconds), 60)
    return f"{m}m {s:02d}s" if m < 60 else f"{m // 60}h {m % 60:02d}m"


def ran_for(rec: JobRecord, now: float | None = None) -> str:
    """How long the job has run (up to its finish, or now while it runs)."""
    if rec.started is None:
        return ""
    end = rec.finished if rec.finished is not None else (time.time() if now is None else now)
    return duration(end - rec.started)


def held_out(r: JobRecord) -> str:
    """The latest held-out loss and its step (``config.eval_every``), or an empty cell."""
    if not r.eval_step:
        return ""
    loss = "NaN" if r.eval_loss is None else fmt(r.eval_loss)
    return f"{esc(loss)} <small>at step {r.eval_step}</small>"


def badge(state: JobState) -> str:
    return f"<span class='state' style='background:{STATE_COLORS[state]}'>{esc(state.name)}</span>"


def table(head: Sequence[str], rows: Sequence[Sequence[str]], empty: str = "none yet") -> str:
    """A table of cells already HTML (escape text with :func:`esc`); ``empty`` when there are no rows."""
    if not rows:
        return f"<p class='nodata'>{esc(empty)}</p>"
    ths = "".join(f"<th>{esc(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{ths}</tr>{trs}</table>"


def loss_chart(points: Sequence[LossPoint], width: int = 560, height: int = 220) -> str:
    return line_chart(
        [Series("loss", tuple((float(p.step), p.loss) for p in points))],
        x_label="step",
        y_label="loss",
        width=width,
        height=height,
        title="training loss by step",
    )


def frame(title: str, body: str, *, final: bool, signed_in: bool) -> str:
    """A whole page: head, the bar (home, auto-refresh, sign out), ``body`` and the refresh script."""
    out = (
        "<form method='post' action='/logout'><button type='submit'>sign out</button></form>"
        if signed_in
        else ""
    )
    bar = (
        "<div class='bar'><a href='/'>all jobs</a>"
        "<label><input type='checkbox' id='autorefresh' checked> auto-refresh</label>"
        f"<span id='refreshed'></span>{out}</div>"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
        f"<style>{STYLE}</style></head><body data-final='{int(final)}'>{bar}{body}"
        f"<script>{REFRESH_JS}</script></body></html>"
    )


@dataclass(frozen=True)
class JobFilter:
    """Which jobs a list shows: those in ``states`` (none: any) whose name contains ``name``."""

    states: tuple[JobState, ...] = ()
    name: str = ""

    @property
    def query(self) -> str:
        """As a URL's query (``state=RUNNING&q=bert``), or ""."""
        pairs = [("state", ",".join(s.name for s in self.states))] if self.states else []
        return urlencode(pairs + ([("q", self.name)] if self.name else []))

    def form(self) -> str:
        """The filter as a plain GET form (no script needed), showing what it holds now."""
        one = self.states[0] if len(self.states) == 1 else None
        options = "".join(
            f"<option value='{s.name}'{' selected' if s == one else ''}>{s.name}</option>" for s in JobState
        )
        several = (
            f"<option value='{esc(','.join(s.name for s in self.states))}' selected>"
            f"{esc(', '.join(s.name for s in self.states))}</option>"
            if len(self.states) > 1
            else ""
        )
        clear = "<a href='/' id='clear-filter'>show all</a>" if self.query else ""
        return (
            "<form method='get' action='/' id='filter' class='bar'>"
            f"<label>state <select name='state' id='filter-state'><option value=''>any</option>{several}"
            f"{options}</select></label><label>name contains <input type='search' name='q' id='filter-name' "
            f"value='{esc(self.name)}' maxlength='200' size='24'></label>"
            f"<button type='submit' id='filter-go'>show</button>{clear}</form>"
        )

    def empty(self) -> str:
        """What an empty list says."""
        if not self.query:
            return "no jobs yet: submit one with sbpflow submit"
        states = " or ".join(s.name for s in self.states)
        parts = ([f"in state {states}"] if states else []) + (
            [f"named like {self.name!r}"] if self.name else []
        )
        return f"no jobs {' and '.join(parts)}"


def job_list(
    records: Sequence[JobRecord],
    losses: dict[str, list[LossPoint]],
    signed_in: bool,
    shown: JobFilter = JobFilter(),
) -> str:
    """The front page: the jobs ``shown`` asks for (newest first) with their state, progress, times and
    loss curves, under the filter form."""
    rows = []
    for r in records:
        rows.append(
            [
                f"<a href='/jobs/{esc(r.id)}'>{esc(r.id)}</a>",
                esc(r.name),
                badge(r.state),
                f"{r.step}/{r.total_steps}",
                "" if r.loss is None else esc(fmt(r.loss)),
                held_out(r),
                "" if not r.samples_per_second else esc(fmt(r.samples_per_second)),
                esc(when(r.created)),
                esc(ran_for(r)),
                esc(r.reason),
                loss_chart(losses.get(r.id, []), width=300, height=120),
            ]
        )
    head = (
        "id",
        "name",
        "state",
        "step",
        "loss",
        "held-out",
        "samples/s",
        "created",
        "ran for",
        "reason",
        "loss",
    )
    api = "/v1/jobs" + (f"?{shown.query}" if shown.query else "")
    body = (
        f"<h1>sbpflow jobs</h1>{shown.form()}"
        f"<div id='jobs' data-live>{table(head, rows, shown.empty())}</div>"
        f"<p>JSON: <a href='{esc(api)}'>{esc(api)}</a> · metrics: <a href='/metrics'>/metrics</a></p>"
    )
    final = all(r.state in TERMINAL for r in records)
    return frame("sbpflow jobs", body, final=final, signed_in=signed_in)


def login(next_path: str, problem: str = "") -> str:
    """The login form: posts the token to /login, which sets the session cookie and goes to ``next_path``."""
    note = f"<p style='color:#d62728'>{esc(problem)}</p>" if problem else ""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>sbpflow: sign in</title>"
        f"<style>{STYLE}</style></head><body><h1>sbpflow</h1>"
        "<p>This control plane needs its token (the one it was started with: --auth-token or "
        "SBPFLOW_TOKEN).</p>"
        f"{note}<form method='post' action='/login'>"
        f"<input type='hidden' name='next' value='{esc(next_path)}'>"
        "<label>token <input type='password' name='token' id='token' autocomplete='current-password' "
        "autofocus required></label> <button type='submit' id='signin'>sign in</button></form>"
        "</body></html>"
    )
