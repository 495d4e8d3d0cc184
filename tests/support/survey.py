"""A survey of a service's pages in Chromium: every page at a phone and a laptop width, checked
for what a person would notice at a glance.

A page fails when the document scrolls sideways, when its visible text shows raw data
(`undefined`, `NaN`, `null`, `None`, `[object Object]`, or JSON outside a <pre>/<code> block
meant for it; for the control plane also an ISO timestamp), when a wide table does not keep its
first column in view, when the console reports an error, or when a request fails or is answered
with a status the page did not expect. Each page leaves a screenshot `survey-<page>-<width>.png`.

`STOPS` lists the pages per service (the collector's, the control plane's); each service's test
starts that service with data and without, and visits its list.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.browser import shot
from tests.support.web_seed import APP_BUILD

WIDTHS = {390: {"width": 390, "height": 844}, 1280: {"width": 1280, "height": 800}}


@dataclass(frozen=True)
class Stop:
    """One page of a survey.

    `ready` is a selector that shows once the page has its data (or its sentence about the lack
    of it). `absent` marks a page about one named thing: on a service without data that thing does
    not exist, so its 404 is expected there (and the page must say so in a sentence). `fits` are
    selectors of boxes that must show all of their content at the laptop width, without their own
    sideways scrolling. `labels` select the labels of a chart: with data they must be page text,
    whole (or with the full text as a title) and not overlapping. `act` runs once the page is
    ready (open a menu) and returns what it found wrong.
    """

    name: str
    path: str
    ready: str = "h1"
    absent: bool = False
    fits: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    act: Callable[[Any, int], list[str]] | None = None


def _menu(button: str, link: str) -> Callable[[Any, int], list[str]]:
    """On a phone the navigation is folded behind a Menu button: it must be, and a tap (as a
    thumb would, no hover) must open it. On a laptop the links show as they are."""

    def open_menu(page: Any, width: int) -> list[str]:
        toggle, target = page.locator(button), page.locator(link)
        if width >= 1000:
            return [] if target.is_visible() else [f"{link} is not shown at a laptop width"]
        if not toggle.is_visible() or target.is_visible():
            return [f"the navigation is not folded behind {button} on a phone"]
        toggle.tap()
        target.wait_for(state="visible")
        return []

    return open_menu


def _review(page: Any, width: int) -> list[str]:
    """Open the diverged cell of the review grid and its difference view (seeded by
    web_seed.shelf_visual); nothing to open on a collector without screenshots."""
    cells = page.locator(".cell-btn[aria-label*=diverged]")
    if not cells.count():
        return []
    cells.first.click()
    page.locator("div.visual-review button[role=tab]:has-text('Difference')").click()
    page.wait_for_selector("div.visual-review figcaption:has-text('pixels differ')")
    if not page.locator("div.visual-review figcaption:has-text('4800 of 64000')").count():
        return ["the difference view does not count the seeded stripe (24 x 200 pixels)"]
    return []


def _start_runner(page: Any, width: int) -> list[str]:
    """Press the runner's Start (before it the page sends nothing) and wait for the enrolment."""
    page.get_by_role("button", name="Start", exact=True).click()
    page.wait_for_selector("#log >> text=enrolled as")
    return []


ARTIFACT = hashlib.sha256(APP_BUILD).hexdigest()
DASH_READY = "#page-title"
NOTHING_LOADING = ":root:not(:has(.loading))"  # no "Loading…" line left on the screen
FAILED_BENCH = "bench-gemma-2-2b-it-macbook-air-m2-007"  # seeded by web_seed.seed_shelf

COLLECTOR: list[Stop] = [
    Stop("overview", "/dash", NOTHING_LOADING,
         fits=("section[aria-labelledby=ov-failures] .table-wrap",)),
    Stop("menu", "/dash", NOTHING_LOADING,
         act=_menu("button.menu-toggle", "nav#nav a:has-text('Artifacts')")),
    Stop("devices", "/dash/devices", NOTHING_LOADING),
    Stop("devices-expired", "/dash/devices?expired=1", NOTHING_LOADING),
    Stop("enroll", "/dash/devices/new", "#enroll-qr",
         fits=("section[aria-labelledby=enroll-agent]",)),
    Stop("device", "/dash/devices/galaxy-s23", NOTHING_LOADING, absent=True),
    Stop("executors", "/dash/executors", NOTHING_LOADING),
    Stop("jobs", "/dash/jobs", NOTHING_LOADING),
    Stop("jobs-failed", "/dash/jobs?status=failed", NOTHING_LOADING),
    Stop("jobs-open", "/dash/jobs?status=queued%2Cwaiting%2Cclaimed", NOTHING_LOADING),
    Stop("job", f"/dash/jobs/{FAILED_BENCH}", NOTHING_LOADING, absent=True),
    Stop("job-chain", "/dash/jobs/chain-bench", NOTHING_LOADING, absent=True),
    Stop("job-host", "/dash/jobs/ui-login", NOTHING_LOADING, absent=True),
    Stop("job-fanout", "/dash/jobs/fan-bench", NOTHING_LOADING, absent=True),
    Stop("enqueue", "/dash/jobs/new", "#match-count :is([data-count], .bad)"),
    Stop("results", "/dash/results", NOTHING_LOADING, labels=(".bars .bar-label",)),
    Stop("results-device", "/dash/results?device=galaxy-s23", NOTHING_LOADING),
    Stop("schedules", "/dash/schedules", NOTHING_LOADING),
    Stop("schedule", "/dash/schedules/nightly-bench", NOTHING_LOADING, absent=True),
    Stop("artifacts", "/dash/artifacts", NOTHING_LOADING),
    Stop("artifacts-builds", "/dash/artifacts?tab=builds", NOTHING_LOADING),
    Stop("artifacts-pinned", "/dash/artifacts?tab=pinned", NOTHING_LOADING),
    Stop("artifacts-gc", "/dash/artifacts?tab=gc", NOTHING_LOADING),
    Stop("artifact", f"/dash/artifacts/{ARTIFACT}", NOTHING_LOADING, absent=True),
    Stop("visual", "/dash/visual", NOTHING_LOADING, fits=(".visual-grid",)),
    Stop("visual-diff", "/dash/visual?suite=shop.example", NOTHING_LOADING, act=_review),
    Stop("alerts", "/dash/alerts", NOTHING_LOADING),
    Stop("alerts-all", "/dash/alerts?state=all", NOTHING_LOADING),
    Stop("topics", "/dash/topics", NOTHING_LOADING),
    Stop("topic", "/dash/topics/camera-frames", NOTHING_LOADING),
    Stop("system", "/dash/system", NOTHING_LOADING),
    Stop("peers", "/dash/peers", NOTHING_LOADING),
    Stop("not-found", "/dash/no/such/screen", DASH_READY),
    Stop("legacy-overview", "/dash/legacy"),
    Stop("legacy-menu", "/dash/legacy/jobs",
         act=_menu("label.menu-button", "header nav a:has-text('Artifacts')")),
    Stop("legacy-devices", "/dash/legacy/devices"),
    Stop("legacy-device", "/dash/legacy/devices/galaxy-s23", absent=True),
    Stop("legacy-jobs", "/dash/legacy/jobs"),
    Stop("legacy-job", f"/dash/legacy/jobs/{FAILED_BENCH}", absent=True),
    Stop("legacy-results", "/dash/legacy/results"),
    Stop("legacy-schedules", "/dash/legacy/schedules"),
    Stop("legacy-alerts", "/dash/legacy/alerts"),
    Stop("legacy-artifacts", "/dash/legacy/artifacts"),
    Stop("runner", "/runner", "#start"),
    # Last: Start enrols this browser as a device, which the other pages would then show.
    Stop("runner-started", "/runner", "#start", act=_start_runner),
]



def _ready(selector: str) -> str:
    """`selector`, once no panel of the control plane's page says it is loading."""
    return f"html:not(:has([aria-busy=true])) {selector}"


def _simulate(page: Any, width: int) -> list[str]:
    """Run the simulation as the form offers it (a repository typed in when the daemon knows
    none) and wait for its comparison, or for the daemon's sentence about why there is none."""
    repo = page.locator("#simulate input[name=repo]")
    if not repo.input_value():
        repo.fill("octo/app")
    page.locator("#simulate button[type=submit]").click()
    page.wait_for_selector(_ready("#simulation :is(table, .failed, .unavailable)"))
    if page.locator("#simulation .unavailable").count():
        return ["the simulation says it is not available on a daemon that offers it"]
    return []


CONTROLPLANE: list[Stop] = [
    Stop("runners", "/#/", _ready("#runners"), fits=("#runners .table-wrap",)),
    Stop("menu", "/#/", _ready("#runners"),
         act=_menu("button.menu-toggle", "nav a:has-text('Settings')")),
    Stop("runner", "/#/runner/app-build-1", _ready("main[data-screen=runner] "
                                                   ":is(#runner-title, .empty)")),
    Stop("runner-agent", "/#/runner/pi-runner-1", _ready("main[data-screen=runner] "
                                                         ":is(#remote, .empty)")),
    Stop("analytics", "/#/analytics", _ready("#analytics :is(table, .empty, .failed)"),
         fits=("#analytics .table-wrap",), labels=("#analytics .u-legend .u-label",)),
    Stop("repo", "/#/repo/octo%2Fapp", _ready("#repo-detail :is(.figures, .failed)"),
         absent=True),
    Stop("concurrency", "/#/concurrency", _ready("#concurrency :is(ul, .empty, .failed)")),
    Stop("simulate", "/#/simulate", _ready("#simulate form"), absent=True, act=_simulate,
         labels=("#simulation .u-legend .u-label",)),
    Stop("forecast", "/#/forecast", _ready("#forecast :is(table, .empty, .failed)")),
    Stop("hosts", "/#/hosts", _ready("#admission .capped > :is(p, ul, div)"),
         fits=("#hosts .table-wrap",)),
    Stop("billing", "/#/billing", _ready("#billing :is(table, p)")),
    Stop("settings", "/#/settings", _ready("#settings table")),
]

STOPS: dict[str, list[Stop]] = {"collector": COLLECTOR, "controlplane": CONTROLPLANE}
# Screenshot names: survey-<prefix><page>-<width>.png (survey-<prefix>empty-... without data).
PREFIX = {"collector": "", "controlplane": "cp-"}

CHECKS = (Path(__file__).parent / "survey_checks.js").read_text()


def run_check(page: Any, name: str, arg: Any = None) -> Any:
    """One of survey_checks.js's functions, run in the page."""
    return page.evaluate(f"([name, arg]) => ({CHECKS})[name](arg)", [name, arg])


@dataclass
class Requests:
    """Failed requests, and answers of 400 and above, while one page is under survey."""

    expected: frozenset[int] = frozenset()
    problems: list[str] = field(default_factory=list)

    def failed(self, request: Any) -> None:
        self.problems.append(f"request failed: {request.method} {request.url} "
                             f"({request.failure})")

    def answered(self, response: Any) -> None:
        if response.status >= 400 and response.status not in self.expected:
            self.problems.append(f"answer {response.status} to {response.request.method} "
                                 f"{response.url}")


@dataclass
class InFlight:
    """The page's requests still open, live streams left out (they never end), and when that
    set last changed: a page has its data once it has asked for nothing new for a moment."""

    open: set[Any] = field(default_factory=set)
    changed: float = field(default_factory=time.monotonic)

    def started(self, request: Any) -> None:
        if request.resource_type not in ("eventsource", "websocket"):
            self.open.add(request)
            self.changed = time.monotonic()

    def ended(self, request: Any) -> None:
        if request in self.open:
            self.open.discard(request)
            self.changed = time.monotonic()


def settle(page: Any, in_flight: InFlight, quiet: float = 0.2, limit: float = 3.0) -> None:
    """Wait until the page has had no request open for `quiet` seconds, at most `limit`.
    Playwright's "networkidle" waits for 500 ms without any connection, which every page paid
    in full (about a tenth of the survey); a long poll still holds it to `limit` here."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not in_flight.open and time.monotonic() - in_flight.changed >= quiet:
            return
        page.wait_for_timeout(50)  # events reach the listeners meanwhile


@contextlib.contextmanager
def watching(page: Any, requests: Requests, in_flight: InFlight) -> Iterator[None]:
    listeners = (("requestfailed", requests.failed), ("response", requests.answered),
                 ("request", in_flight.started), ("requestfinished", in_flight.ended),
                 ("requestfailed", in_flight.ended))
    for event, listener in listeners:
        page.on(event, listener)
    try:
        yield
    finally:
        # Stop listening before the page goes: leaving aborts its stream and long polls.
        for event, listener in listeners:
            page.remove_listener(event, listener)


def visit(context: Any, base: str, stop: Stop, width: int, empty: bool,
          prefix: str = "", times: bool = False) -> list[str]:
    """Open one page in a fresh tab, check it, keep its screenshot; the problems found.
    `times`: an ISO timestamp in the visible text is raw data too."""
    from tests.support.browser import Watch

    page = context.new_page()
    watch = Watch()
    page.on("console", watch.console)
    page.on("pageerror", watch.exception)
    expected = frozenset({404}) if empty and stop.absent else frozenset()
    requests = Requests(expected)
    in_flight = InFlight()
    problems: list[str] = []
    try:
        with watching(page, requests, in_flight):
            page.goto(base + stop.path)
            page.wait_for_selector(stop.ready)
            settle(page, in_flight)
            if stop.act:
                problems += stop.act(page, width)
            problems += check(page, stop, width, empty, times)
            shot(page, f"survey-{prefix}{'empty-' if empty else ''}{stop.name}-{width}")
        # A 404 the page expected is still logged by the browser as a console error.
        problems += [e for e in watch.errors
                     if not (expected and "status of 404" in e)]
    finally:
        page.close()
    return [f"{stop.path} at {width} px: {p}" for p in problems + requests.problems]


def check(page: Any, stop: Stop, width: int, empty: bool, times: bool = False) -> list[str]:
    problems: list[str] = []
    sideways = run_check(page, "sideways")
    if sideways:
        problems.append(f"the document scrolls sideways ({sideways[0]} px wide in "
                        f"{sideways[1]} px)")
    problems += run_check(page, "visibleRaw", {"times": times}) + run_check(page, "cutText")
    problems += run_check(page, "keptColumn")
    if width >= 1000:
        for selector in stop.fits:
            problems += run_check(page, "clipped", selector)
    if not empty:
        for selector in stop.labels:
            problems += run_check(page, "labels", selector)
    return problems
