"""Templates of the legacy dashboard (/dash/legacy): plain HTML, no script.

Every value is escaped with html.escape unless it is Markup, which only this module's helpers
make, and shows any reordering character written out (validate.written_out). Pages take the
same dictionaries the /api routes return, so they show the same facts.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from fleet_min.collector.automation.alerts import AlertRule, AlertState
from fleet_min.collector.jobs.kinds import JOB_STATUSES
from fleet_min.timeutil import parse_iso
from fleet_min.validate import written_out

BASE = "/dash/legacy"
NAV = (("", "Overview"), ("/devices", "Devices"), ("/jobs", "Jobs"), ("/results", "Results"),
       ("/schedules", "Schedules"), ("/artifacts", "Artifacts"), ("/alerts", "Alerts"))
VOID = frozenset({"input", "meta", "link", "br"})
# The alert rules whose subject is a device (linked to its page).
DEVICE_RULES = frozenset({AlertRule.DEVICE_OFFLINE, AlertRule.THERMAL_CRITICAL,
                          AlertRule.LOW_BATTERY})
BENCH_PAGE_ROWS = 500  # configuration x device rows on the legacy bench page
DEVICE_COUNTS = ("online", "stale", "offline")  # the overview's counts (not its device lists)
DASH = "\u2013"  # an en dash: "nothing here", and ranges
# Parts of a job spec shown on its page as key/value lines (the whole spec is below, as JSON).
SPEC_PARTS = (("model", "Model"), ("constraints", "Constraints"), ("lease", "Lease"),
              ("params", "Parameters"), ("app", "App"), ("suite", "Suite"))


class Markup(str):
    """Text that is already HTML (made by the helpers below from escaped parts).

    Adding plain text to Markup escapes the text, so a concatenation stays safe.
    """

    def __add__(self, other: object) -> Markup:
        return Markup(str.__add__(self, esc(other)))

    def __radd__(self, other: object) -> Markup:
        return Markup(str.__add__(esc(other), self))


def esc(value: Any) -> Markup:
    if isinstance(value, Markup):
        return value
    if value is None:
        return Markup(f'<span class="muted">{DASH}</span>')
    if isinstance(value, bool):
        return Markup("yes" if value else "no")
    return Markup(escape(written_out(str(value)), quote=True))


def join(parts: Iterable[Any], sep: str = "") -> Markup:
    return Markup(escape(sep).join(esc(p) for p in parts))


def _attribute(name: str, value: Any) -> str:
    """An attribute's text; a link keeps its characters (they are percent-encoded there)."""
    return str(value) if name in ("href", "src", "action") else written_out(str(value))


def tag(name: str, content: Any = "", /, **attrs: Any) -> Markup:
    rendered = "".join(
        f' {k.rstrip("_").replace("_", "-")}="{escape(_attribute(k, v), quote=True)}"'
        for k, v in attrs.items() if v is not None and v is not False)
    if name in VOID:
        return Markup(f"<{name}{rendered}>")
    return Markup(f"<{name}{rendered}>{esc(content) if content != '' else ''}</{name}>")


def link(path: str, text: Any, **query: Any) -> Markup:
    wanted = {k: v for k, v in query.items() if v not in (None, "")}
    return tag("a", text, href=BASE + path + ("?" + urlencode(wanted) if wanted else ""))


def seg(value: str) -> str:
    """One path segment, percent-encoded."""
    return quote(value, safe="")


def job_link(job_id: str | None) -> Markup:
    return link(f"/jobs/{seg(job_id)}", job_id) if job_id else esc(None)


def device_link(device_id: str | None) -> Markup:
    return link(f"/devices/{seg(device_id)}", device_id) if device_id else esc(None)


def pill(status: Any) -> Markup:
    return tag("span", status, class_=f"pill s-{status}")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], empty: str = "Nothing yet."
          ) -> Markup:
    body = [tag("tr", join(tag("td", cell) for cell in row)) for row in rows]
    if not body:
        return tag("p", empty, class_="muted")
    head = tag("thead", tag("tr", join(tag("th", h, scope="col") for h in headers)))
    return tag("div", tag("table", head + tag("tbody", join(body))), class_="scroll")


def fields(pairs: Iterable[tuple[str, Any]]) -> Markup:
    return tag("dl", join(tag("dt", k) + tag("dd", v) for k, v in pairs), class_="fields")


def section(title: str, content: Any) -> Markup:
    return tag("section", tag("h2", title) + esc(content))


def pretty(value: Any) -> Markup:
    return tag("pre", json.dumps(value, indent=2, sort_keys=True))


def value(v: Any) -> Markup:
    """One value as a person reads it: a dash for nothing, yes/no, plain text and numbers, a list
    of plain values joined by commas; anything nested as compact JSON in <code>, which says it is
    data (no recursion: a client shaped it)."""
    if isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v):
        return join([str(x) for x in v], ", ") if v else esc(None)
    if isinstance(v, (dict, list)):
        return tag("code", json.dumps(v, sort_keys=True, ensure_ascii=False))
    return esc(v)


def pairs(mapping: Any) -> Markup | None:
    """A mapping (a job's targets, constraints, lease, params) as `key value` lines; None when
    there is nothing to show."""
    if not isinstance(mapping, dict) or not mapping:
        return None if not mapping else value(mapping)
    return tag("span", join(tag("span", tag("span", f"{k}:", class_="k") + " " + value(v))
                            for k, v in sorted(mapping.items())), class_="kv")


def _span(seconds: float) -> str:
    s = abs(seconds)
    if s < 60:
        return f"{round(s)} s"
    if s < 3600:
        return f"{round(s / 60)} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h" if s < 36000 else f"{round(s / 3600)} h"
    return f"{round(s / 86400)} d"


def relative(value: str, at: float) -> str:
    """`3 min ago`, `in 2 h`, `just now`: the dashboard's wording, as of `at`."""
    delta = parse_iso(value) - at
    if abs(delta) < 1:
        return "just now"
    return f"in {_span(delta)}" if delta > 0 else f"{_span(delta)} ago"


def short_time(value: str | None, at: float | None = None) -> Markup:
    """An ISO-8601 UTC time as the dashboard shows it: relative to when the page was made
    (`3 min ago`), the exact time as its title (in UTC: a page without script cannot know the
    reader's zone)."""
    if not value:
        return esc(None)
    try:
        shown = relative(value, time.time() if at is None else at)
    except ValueError:
        return esc(value)
    exact = value[:19].replace("T", " ") + " UTC"
    return tag("time", shown, datetime=value, title=exact)


def metrics(values: Mapping[str, Any] | None) -> Markup:
    if not values:
        return esc(None)
    shown = [k + "=" + value(v) for k, v in sorted(values.items())
             if not isinstance(v, (list, dict))]
    return join(shown, " · ")


def short_sha(sha: str) -> Markup:
    """The first 12 digits of a SHA-256, the whole value as its title."""
    return tag("abbr", sha[:12] + "\u2026", title=sha, class_="sha")


def page(title: str, active: str, content: Any, collector: str, refresh_s: int | None = None
         ) -> str:
    nav = join(tag("a", label, href=BASE + path, aria_current="page" if path == active else None)
               for path, label in NAV)
    # On a phone the links fold behind a Menu label that toggles a checkbox: it works by touch
    # and keyboard with no script (these pages have none).
    menu = (tag("input", type="checkbox", id="menu", class_="menu-state")
            + tag("label", "Menu", for_="menu", class_="menu-button"))
    head = Markup(
        '<meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">'
        '<meta name="color-scheme" content="light dark">'
        + (f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s else "")
        + '<link rel="icon" href="/favicon.svg" type="image/svg+xml">'
        + '<link rel="stylesheet" href="/dash/legacy/style.css">')
    body = (tag("header", tag("strong", f"fleet · {collector}") + menu
                + tag("nav", nav + tag("a", "Live dashboard", href="/dash", class_="alt"),
                      aria_label="Main"))
            + tag("main", tag("h1", title) + esc(content), id="main")
            + tag("footer", "Plain pages without script: they show the state when loaded"
                  + (f" and reload every {refresh_s} s." if refresh_s else ". Reload to update.")))
    document = tag("html", tag("head", head + tag("title", f"{title} · fleet"))
                   + tag("body", body), lang="en")
    return shown_as_text(str(Markup("<!doctype html>\n") + document))


_SURROGATE = re.compile("[\ud800-\udfff]")


def shown_as_text(html: str) -> str:
    """The page with any lone surrogate (from a row stored before bodies holding one were
    refused) as U+FFFD, the replacement character: a page is UTF-8, which cannot carry one."""
    return _SURROGATE.sub("\ufffd", html)


def counts(values: Mapping[str, int], link_path: str | None = None) -> Markup:
    items = []
    for name, n in values.items():
        label = join([tag("b", n), " ", name])
        items.append(tag("li", link(link_path, label, status=name) if link_path else label))
    return tag("ul", join(items), class_="counts")


# -- pages --------------------------------------------------------------------------------------


def overview(data: Mapping[str, Any], schedules: Sequence[Mapping[str, Any]],
             alerts: Sequence[Mapping[str, Any]], recent: Sequence[Mapping[str, Any]] = (),
             bench_data: Mapping[str, Any] | None = None) -> Markup:
    devices = {k: v for k, v in data["devices"].items() if k in DEVICE_COUNTS}
    queue = {k: v for k, v in data["queue"].items() if k in JOB_STATUSES}
    running = table(("Job", "Workload", "Device", "Rows", "Lease until"), (
        (job_link(r["job_id"]), r["workload"], device_link(r["claimed_by"]),
         r["progress"]["rows"], short_time(r["lease_deadline"])) for r in data["running"]),
        "No job is running.")
    failures = table(("Job", "Workload", "Outcome", "Error", "Finished"), (
        (job_link(r["job_id"]), r["workload"], gave_up(r), r["last_error"],
         short_time(r["finished_at"])) for r in data["recent_failures"]), "No failures.")
    upcoming = sorted((s for s in schedules if s.get("enabled") and s.get("next_run")),
                      key=lambda s: s["next_run"])
    nexts = table(("Schedule", "Cron", "Next run"), (
        (s["id"], s["cron"], short_time(s["next_run"])) for s in upcoming[:8]),
        "No enabled schedule.")
    return (section(f"Devices ({data['devices']['total']})", counts(devices))
            + section("Queue", counts(queue, "/jobs"))
            + section("Running", running) + section("Recent failures", failures)
            + section("Recent jobs", job_table(recent))
            + section("Latest benchmarks", bench_summary(bench_data or {"configs": []})
                      + tag("p", link("/bench", "All benchmarks by configuration")))
            + section("Open alerts",
                      alert_table([a for a in alerts if a["state"] == AlertState.OPEN]))
            + section("Next schedules", nexts))


def gave_up(failure: Mapping[str, Any]) -> str | None:
    """The original's sentence for a job that used every attempt it had."""
    attempts, most = failure.get("attempts"), failure.get("max_attempts")
    if isinstance(attempts, int) and isinstance(most, int) and attempts >= most:
        return f"gave up after {attempts}/{most} attempts"
    return None


def tok_s(value: Any) -> str | None:
    return None if value is None else f"{value:g} tok/s"


def bench_summary(data: Mapping[str, Any], limit: int = 10) -> Markup:
    """Each configuration's newest run per device, decode and prefill apart, in tok/s."""
    cells = [(c, d) for c in data["configs"] for d in c["devices"]]
    cells.sort(key=lambda cd: cd[1]["latest"]["at"] or "", reverse=True)
    return table(("Configuration", "Device", "Decode", "Prefill", "Memory", "Job", "When"), (
        (c["config"], device_link(d["device_id"]), tok_s(d["latest"]["decode_tok_s"]),
         tok_s(d["latest"]["prefill_tok_s"]),
         join([d["latest"]["peak_mem_mb"] if d["latest"]["peak_mem_mb"] is not None else DASH,
               f" MB ({d['latest']['mem_method']})" if d["latest"]["mem_method"] else ""]),
         job_link(d["latest"]["job_id"]), short_time(d["latest"]["at"]))
        for c, d in cells[:limit]), "No benchmark results.")


def device_table(devices: Sequence[Mapping[str, Any]]) -> Markup:
    def battery(d: Mapping[str, Any]) -> Any:
        b = d.get("last_beacon") or {}
        if b.get("battery_pct") is None:
            return None
        return f"{b['battery_pct']}%" + (" charging" if b.get("charging") else "")

    return table(("Device", "Name", "Status", "Platform", "Model", "Battery", "Thermal", "Pools",
                  "Capabilities", "Last seen"), (
        (device_link(d["device_id"]), d.get("name"), pill(d["status"]), d.get("platform"),
         (d.get("descriptor") or {}).get("model"), battery(d),
         (d.get("last_beacon") or {}).get("thermal"), ", ".join(d.get("pools") or []),
         ", ".join(d.get("capabilities") or []), short_time(d.get("last_seen")))
        for d in devices), "No device has registered yet.")


def device(d: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]]) -> Markup:
    descriptor = d.get("descriptor") or {}
    info = fields([("Name", d.get("name")), ("Notes", d.get("notes")),
                   ("Status", pill(d["status"])),
                   ("Temporary", d.get("temporary")), ("Pools", ", ".join(d.get("pools") or [])),
                   ("Capabilities", ", ".join(d.get("capabilities") or [])),
                   ("First seen", short_time(d.get("first_seen"))),
                   ("Last seen", short_time(d.get("last_seen"))), ("Address", d.get("address"))]
                  + [(k, value(v)) for k, v in sorted(descriptor.items())])
    running = table(("Job", "Workload", "Lease until"), (
        (job_link(r["job_id"]), r["workload"], short_time(r["lease_deadline"]))
        for r in d.get("running") or []), "Not running anything.")
    return (section("Device", info)
            + section("Last beacon", fields((k, value(v)) for k, v in
                                            sorted((d.get("last_beacon") or {}).items()))
                      if d.get("last_beacon") else tag("p", "No beacon yet.", class_="muted"))
            + section("Running", running) + section("Recent jobs", job_table(jobs)))


def job_table(jobs: Sequence[Mapping[str, Any]]) -> Markup:
    return table(("Job", "Status", "Workload", "Executor", "Claimed by", "Attempts", "Priority",
                  "Created", "Last error"), (
        (job_link(j["job_id"]), pill(j["status"]), j["workload"], j["executor"],
         device_link(j.get("claimed_by")), f"{j['attempts']}/{j['max_attempts']}", j["priority"],
         short_time(j["created_at"]), j.get("last_error")) for j in jobs), "No jobs.")


def job_filters(query: Mapping[str, str]) -> Markup:
    options = join(tag("option", s or "any status", value=s,
                       selected="selected" if query.get("status", "") == s else None)
                   for s in ("", *JOB_STATUSES))
    return tag("form", join([
        tag("label", join(["Status ", tag("select", options, name="status")])),
        tag("label", join(["Search ", tag("input", name="q", value=query.get("q", ""),
                                          type="search")])),
        tag("button", "Filter", type="submit")]), method="get", action=BASE + "/jobs",
        class_="filters")


def pager(path: str, listing: Mapping[str, Any], query: Mapping[str, str]) -> Markup:
    page_no, pages = int(listing["page"]), int(listing["pages"])
    kept = {k: v for k, v in query.items() if k != "page"}
    parts: list[Any] = [f"page {page_no} of {pages} ({listing['total']} in all)"]
    if page_no > 1:
        parts.insert(0, link(path, "previous", **kept, page=page_no - 1))
    if page_no < pages:
        parts.append(link(path, "next", **kept, page=page_no + 1))
    return tag("p", join(parts, " · "), class_="pager")


def jobs(listing: Mapping[str, Any], query: Mapping[str, str]) -> Markup:
    return (job_filters(query) + job_table(listing["jobs"]) + pager("/jobs", listing, query))


def job(j: Mapping[str, Any]) -> Markup:
    spec = j.get("spec") or {}
    info = fields([("Status", pill(j["status"])), ("Workload", j["workload"]),
                   ("Executor", j["executor"]), ("Backend", j.get("backend")),
                   ("Priority", j["priority"]),
                   ("Attempts", f"{len(j['attempts'])} of {j['max_attempts']}"),
                   ("Claimed by", device_link(j.get("claimed_by"))),
                   ("Targets", pairs(spec.get("targets")) or "any device that can run it"),
                   *((label, pairs(spec[key])) for key, label in SPEC_PARTS if spec.get(key)),
                   ("Last error", j.get("last_error")),
                   ("Parent", job_link(j.get("parent_job_id"))),
                   ("Schedule", j.get("template_id")), ("Created", short_time(j["created_at"])),
                   ("Claimed", short_time(j.get("claimed_at"))),
                   ("Finished", short_time(j.get("finished_at")))])
    attempts = table(("Attempt", "Claimed by", "Claimed", "Ended", "Outcome", "Error"), (
        (a["attempt"], device_link(a["claimed_by"]), short_time(a["claimed_at"]),
         short_time(a["ended_at"]), a["outcome"], a["error"]) for a in j["attempts"]),
        "Not claimed yet.")
    results = table(("Attempt", "Device", "Iter", "OK", "Final", "Metrics", "Error"), (
        (r["attempt"], device_link(r["device_id"]), r["iter"], r["ok"], r["final"],
         metrics(r["metrics"]), r["error"]) for r in j["results"]), "No result rows.")
    if j["results_total"] > len(j["results"]):
        results = tag("p", f"{len(j['results'])} of {j['results_total']} rows: the final rows "
                      "and the newest others.") + results
    chain = table(("Job", "Status", "Relation"), [
        *((job_link(d["job_id"]), pill(d["status"]), "depends on") for d in j["dependencies"]),
        *((job_link(d["job_id"]), pill(d["status"]), "waits for this") for d in j["dependents"]),
        *((job_link(c["job_id"]), pill(c["status"]), "fan-out child") for c in j["children"])],
        "No dependencies or children.")
    artifacts = table(("SHA-256", "Role", "Name"), (
        (tag("a", short_sha(a["sha256"]), href=a["url"]), a["role"], a["name"])
        for a in j["artifacts"]), "No artifacts.")
    return (section("Job", info) + section("Attempts", attempts) + section("Results", results)
            + section("Chain and children", chain) + section("Artifacts", artifacts)
            + section("Spec", pretty(j.get("spec"))))


def bench(data: Mapping[str, Any], ui: Mapping[str, Any]) -> Markup:
    def stat(cell: Mapping[str, Any] | None) -> Any:
        if not cell or cell.get("median") is None:
            return None
        return f"{cell['median']} ({cell['min']}{DASH}{cell['max']}, n={cell['n']})"

    names = list(data["metrics"])
    rows = table(("Device", "Model", "Runs", *names), (
        (device_link(r["device_id"]), r["model"], r["runs"], *(stat(r.get(m)) for m in names))
        for r in data["rows"]), "No benchmark results.")
    flows = table(("Job", "Status", "Pass", "Fail", "Failing flows"), (
        (job_link(j["job_id"]), pill(j["status"]), j["pass"], j["fail"],
         ", ".join(f["flow"] for f in j["flows"] if f["fail"])) for j in ui["jobs"]),
        "No UI test results.")
    return section(f"Benchmarks (median, min{DASH}max)", rows) + section("UI tests", flows)


def schedules(items: Sequence[Mapping[str, Any]]) -> Markup:
    return table(("Schedule", "Cron", "Enabled", "Workload", "Next run", "Last run", "Last skip"), (
        (s["id"], s["cron"], s["enabled"], (s.get("template") or {}).get("workload"),
         short_time(s.get("next_run")), short_time(s.get("last_run")), s.get("last_skip"))
        for s in items), "No schedules.")


def alert_table(items: Sequence[Mapping[str, Any]]) -> Markup:
    def subject(a: Mapping[str, Any]) -> Any:
        if a["rule"].startswith("job-"):
            return job_link(a["subject"])
        if a["rule"] in DEVICE_RULES:
            return device_link(a["subject"])
        return a["subject"]

    return table(("Rule", "Subject", "State", "Seen", "Last seen", "Detail", "Muted"), (
        (a["rule"], subject(a), pill(a["state"]), a["seen_count"], short_time(a["last_seen"]),
         a.get("detail"), a.get("muted")) for a in items), "No alerts.")


def artifacts(listing: Mapping[str, Any]) -> Markup:
    return table(("Name", "App", "Build", "Platform", "Size", "Created", "Pinned", "SHA-256"), (
        (a.get("name"), a.get("app"), a.get("build"), a.get("platform"), size(a["size"]),
         short_time(a["created_at"]),
         a.get("pinned_reason") if a.get("pinned") else False,
         tag("a", short_sha(a["sha256"]), href=a["url"]))
        for a in listing["artifacts"]), "No artifacts.")


def size(n: int | None) -> str:
    if n is None:
        return DASH
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def not_found(sentence: str) -> Markup:
    return tag("p", sentence) + tag("p", link("", "Back to the overview"))


STYLE = """
:root{color-scheme:light dark;--fg:#1b1f24;--bg:#fff;--mut:#5b6470;--line:#d5dae0;--acc:#0b62c4}
@media (prefers-color-scheme:dark){:root{--fg:#e6e8eb;--bg:#14171b;--mut:#9aa4af;--line:#333a42;
--acc:#6cb0ff}}
*{box-sizing:border-box}
body{margin:0;font:15px/1.45 system-ui,sans-serif;color:var(--fg);background:var(--bg)}
header{display:flex;flex-wrap:wrap;gap:.5rem 1rem;align-items:center;padding:.6rem 1rem;
border-bottom:1px solid var(--line)}
nav{display:flex;flex-wrap:wrap;gap:.25rem .75rem;flex:1}a{color:var(--acc)}
nav a[aria-current]{font-weight:700;text-decoration:none}.alt{margin-left:auto}
.menu-state{position:absolute;opacity:0;width:1px;height:1px;margin:0}.menu-button{display:none}
.menu-state:focus-visible+.menu-button{outline:3px solid #ffb020;outline-offset:2px}
@media (max-width:700px){
.menu-button{display:inline-block;margin-left:auto;padding:.3rem .8rem;border:1px solid var(--line);
border-radius:6px;cursor:pointer;user-select:none}
header nav{display:none;flex-basis:100%;flex-direction:column;gap:0}
header nav a{padding:.55rem .2rem;border-top:1px solid var(--line)}
.alt{margin-left:0}
.menu-state:checked~nav{display:flex}}
main{padding:0 1rem 2rem;max-width:80rem}h1{font-size:1.4rem;overflow-wrap:anywhere}
h2{font-size:1.1rem;margin-top:1.6rem}
.scroll{overflow-x:auto}table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:.3rem .5rem;border-bottom:1px solid var(--line);vertical-align:top}
th:first-child,td:first-child{position:sticky;left:0;background:var(--bg)}
td:first-child{min-width:7rem;overflow-wrap:anywhere}td time{white-space:nowrap}
th{font-weight:600;color:var(--mut)}.muted{color:var(--mut)}
.counts{display:flex;flex-wrap:wrap;gap:.5rem 1.5rem;list-style:none;padding:0}
.fields{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:.2rem 1rem}
.fields dt{color:var(--mut)}.fields dd{margin:0;overflow-wrap:anywhere}
.kv{display:flex;flex-direction:column}.kv .k{color:var(--mut)}
code{font-size:.9em;overflow-wrap:anywhere}abbr.sha{text-decoration:none;font-family:monospace}
pre{overflow:auto;padding:.6rem;border:1px solid var(--line);border-radius:4px}
.pill{padding:0 .4rem;border-radius:3px;border:1px solid var(--line);white-space:nowrap}
.s-failed,.s-offline,.s-open{border-color:#c23;color:#c23}.s-done,.s-online{border-color:#1a7f37;
color:#1a7f37}
.filters{display:flex;flex-wrap:wrap;gap:.5rem 1rem;align-items:end;margin:1rem 0}
footer{padding:1rem;color:var(--mut);border-top:1px solid var(--line)}
"""
