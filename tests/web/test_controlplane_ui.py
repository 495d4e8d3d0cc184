"""The control-plane UI in a real browser: Debian's Chromium driven by Playwright, against a
real `python -m fleet_min controlplane` over fake runners, the fake systemctl on PATH and the
fake GitHub API.

It loads every screen and finds no console error, enters the token and drains a runner through
the confirmation dialog, sees the state change arrive through the stream, checks the keyboard
path, the phone layout, its menu and the dark theme, that read-only mode draws no action button,
and that the page reconnects by itself after the daemon restarts. Over a daemon with weeks of
history (tests/web/conftest.py's cp_busy) it reads the analysis screens: plain figures with
units, the duration and queue-time charts, relative times with the exact time on hover; and a
simulation of a repository without history shows the daemon's own sentence.
Screenshots go to test-artifacts/screenshots/ for a person to look at.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from tests.support import cp_fakes as fakes
from tests.support.controlplane import REPO_ROOT, Daemon, agent_token
from tests.support.cp_fixtures import (
    BUSY_RUNNER,
    DRAIN_RUNNER,
    LOG_SECRET,
    UiDaemon,
    heartbeat,
    make_host,
    populate,
)
from tests.support.fake_github import FakeGitHub

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
SHOTS = REPO_ROOT / "test-artifacts" / "screenshots"
# Analysis routes: a daemon without one answers 404 "no such route", and its panel must then say
# "not available" instead of failing.
ANALYSIS = {"/api/analytics", "/api/concurrency", "/api/billing", "/api/autoscale",
            "/api/admission", "/api/simulate", "/api/forecast", "/api/repo"}
SCREENS = ["analytics", "concurrency", "simulate", "forecast", "hosts", "billing", "settings"]
# What a person must never read on a screen: raw JSON, ISO timestamps, missing values.
RAW = re.compile(r'\{"|\d{4}-\d\d-\d\dT\d\d:\d\d|\b(undefined|NaN|null|None)\b|\[object Object\]')
WAIT_MS = 15_000

UI_DIR = REPO_ROOT / "fleet_min" / "web" / "controlplane"
SHARED_VENDOR = REPO_ROOT / "fleet_min" / "web" / "vendor"

needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium package")

if CHROMIUM.exists():
    from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright


class Console:
    """Every console error and page error of one page; 404s of analysis routes noted apart
    (allowed when the screen says "not available", or shows the daemon's sentence about it)."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        self.unavailable: set[str] = set()
        self.notes: set[str] = set()  # the routes that "not available" notes named
        self.outage = False  # while the daemon is down, failed stream requests are expected
        self.refusal = False  # while a wrong token is tried, the daemon's 403 is expected
        page.on("console", self._message)
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))

    def _message(self, msg: ConsoleMessage) -> None:
        if msg.type != "error":
            return
        path = urlparse(msg.location.get("url") or "").path
        if "status of 404" in msg.text and path in ANALYSIS:
            self.unavailable.add(path)
        elif self.outage and path == "/api/stream":
            pass
        elif self.refusal and "status of 403" in msg.text and path == "/api/action":
            self.refusal = False  # once
        else:
            self.errors.append(f"{msg.text} ({msg.location.get('url')})")


def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"controlplane-{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def github() -> Iterator[FakeGitHub]:
    fake = FakeGitHub()
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, github: FakeGitHub) -> Iterator[UiDaemon]:
    host = make_host(tmp_path_factory.mktemp("cp-ui"), github)
    populate(host)
    daemon = UiDaemon(host).start()
    heartbeat(daemon.url, daemon.token, "pi-shelf-2")
    yield daemon
    daemon.stop()
    fakes.kill_all_listeners(host.root)


def open_page(browser: Browser, url: str, **context: Any) -> tuple[Page, Console]:
    ctx = browser.new_context(viewport=context.pop("viewport", {"width": 1280, "height": 900}),
                              **context)
    page = ctx.new_page()
    console = Console(page)
    page.goto(url)
    return page, console


def runner_row(page: Page, name: str) -> Any:
    return page.locator(f'tr[data-runner="{name}"]')


def use_token(page: Page, token: str) -> None:
    page.locator("#token").fill(token)
    page.get_by_role("button", name="Use token").click()
    expect(page.locator(".token-set")).to_contain_text("token set")


def visit(page: Page, console: Console, screen: str) -> None:
    page.get_by_role("navigation", name="Screens").get_by_role("link", name=screen.title()).click()
    main = page.locator(f'main[data-screen="{screen}"]')
    expect(main).to_be_visible()
    expect(main.locator("[aria-busy=true]")).to_have_count(0, timeout=WAIT_MS)
    if screen == "simulate":
        page.get_by_role("button", name="Simulate").click()
        expect(page.locator("#simulation .unavailable, #simulation table, "
                            "#simulation .failed")).not_to_have_count(0, timeout=WAIT_MS)
        console.notes.update(["/api/simulate"] if page.locator("#simulation .failed").count()
                             else [])
    if screen == "hosts":
        expect(page.locator('tr[data-host="pi-shelf-2"]')).to_be_visible()
    if screen == "settings":
        expect(page.locator('tr[data-setting="ceiling"]')).to_be_visible()
    console.notes.update(page.locator("main .unavailable code").all_inner_texts())
    shot(page, screen)


@needs_chromium
@pytest.mark.slow
def test_ui_shows_the_host_and_drains_a_runner_with_the_token(live: UiDaemon,
                                                               browser: Browser) -> None:
    page, console = open_page(browser, live.url, color_scheme="light")
    # runners by group, with state, drift and queue causes; vitals and capacity
    expect(runner_row(page, BUSY_RUNNER)).to_have_attribute("data-state", "working",
                                                            timeout=WAIT_MS)
    expect(page.locator('[data-group="octo/app"]')).to_be_visible()
    expect(page.locator('[data-group="octo/web"]')).to_be_visible()
    expect(runner_row(page, "web-old")).to_contain_text("service-dead")
    expect(runner_row(page, "stray")).to_contain_text("unregistered")
    expect(page.locator("#queue")).to_contain_text("label-mismatch")
    expect(page.locator("#host")).to_contain_text("Capacity")
    expect(page.locator("#conn")).to_have_text("live")
    # buttons come from /api/actions and wait for a token
    drain = page.locator(f'button[data-action="runner.drain"][data-runner="{DRAIN_RUNNER}"]')
    expect(drain).to_be_disabled()
    expect(page.locator('button[data-action="health.check"]')).to_be_disabled()
    shot(page, "overview")

    # runner detail with the redacted log tail
    runner_row(page, BUSY_RUNNER).get_by_role("link", name=BUSY_RUNNER).click()
    expect(page.locator("#runner-title")).to_contain_text(BUSY_RUNNER)
    expect(page.locator("pre.log")).to_contain_text("GH_TOKEN=<redacted>")
    assert LOG_SECRET not in page.content()
    shot(page, "runner")

    for screen in SCREENS:
        visit(page, console, screen)
    # every analysis route that answered 404 was named by a "not available" note
    assert console.unavailable <= console.notes

    # a wrong token is refused by the daemon and the page says so
    page.get_by_role("link", name="Runners").click()
    page.locator("#token").fill("0" * 64)
    page.get_by_role("button", name="Use token").click()
    console.refusal = True
    page.locator('button[data-action="health.check"]').click()
    expect(page.locator(".toast.bad")).to_contain_text("Health check refused")
    expect(page.locator(".token-set")).to_contain_text("token refused")
    page.get_by_role("button", name="Forget token").click()
    page.locator(".toast.bad .close").click()
    assert not console.refusal, "the refused action did not reach the daemon"

    # the right token: typed once, kept in this tab's sessionStorage, enables the buttons
    page.locator("#token").fill(live.token)
    page.get_by_role("button", name="Use token").click()
    expect(drain).to_be_enabled()
    assert page.evaluate("sessionStorage.getItem('fleet-cp-token')") == live.token
    assert page.evaluate("localStorage.getItem('fleet-cp-token')") is None

    # keyboard: a destructive action asks first, and Escape changes nothing
    page.locator('button[data-action="runner.deregister"][data-runner="stray"]').focus()
    page.keyboard.press("Enter")
    dialog = page.locator("dialog.confirm")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("Deregister stray?")
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    expect(runner_row(page, "stray")).to_be_visible()

    # drain: confirm, then the stream brings the new state; the fake listener really stops
    listener = int((live.host.root / DRAIN_RUNNER / "listener.pid").read_text())
    drain.click()
    expect(dialog).to_contain_text(f"Drain {DRAIN_RUNNER}?")
    shot(page, "confirm-drain")
    dialog.locator("[data-confirm=yes]").click()
    expect(page.locator(".toast.ok")).to_contain_text(f"Drain: {DRAIN_RUNNER} done",
                                                      timeout=WAIT_MS)
    expect(runner_row(page, DRAIN_RUNNER)).to_have_attribute("data-state", "drained",
                                                             timeout=WAIT_MS)
    expect(page.locator(f'button[data-action="runner.resume"][data-runner="{DRAIN_RUNNER}"]')
           ).to_be_enabled()
    assert not fakes.pid_alive(listener)
    shot(page, "drained")

    # a live setting changed with the token, its source now "stored"
    page.get_by_role("link", name="Settings").click()
    row = page.locator('tr[data-setting="stuck_queue_s"]')
    row.locator("input").fill("600")
    row.get_by_role("button", name="Save").click()
    expect(page.locator(".toast.ok").last).to_contain_text("stuck_queue_s is now 600")
    expect(row).to_contain_text("stored")
    assert console.errors == []
    page.context.close()


@needs_chromium
@pytest.mark.slow
def test_duplicate_offers_the_name_the_daemon_will_use(live: UiDaemon, browser: Browser) -> None:
    """The dialog's suggested name is the daemon's default: app-build-1 with app-build-2 taken
    is copied as app-build-3 (a trailing -N left out, the lowest free number), not
    app-build-1-2."""
    page, console = open_page(browser, live.url)
    use_token(page, live.token)
    page.locator(f'button[data-action="runner.duplicate"][data-runner="{BUSY_RUNNER}"]').click()
    dialog = page.locator("dialog.confirm")
    expect(dialog).to_be_visible()
    expect(dialog.locator('input[name="new_name"]')).to_have_attribute("placeholder",
                                                                      "app-build-3")
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    assert console.errors == []
    page.context.close()


@needs_chromium
@pytest.mark.slow
def test_a_remote_runner_offers_working_actions_and_shows_the_forwarded_outcome(
        tmp_path: Path, github: FakeGitHub, browser: Browser) -> None:
    """A coordinator and a real agent daemon: at 1280 px the agent's runner is marked with its
    host, its row offers the actions that the agent really runs (forwarded in order), and a
    forwarded Duplicate's notice shows the agent's result with the new runner's name."""
    coord_host, edge_host = make_host(tmp_path / "coord", github), make_host(tmp_path / "edge",
                                                                            github)
    edge_host.add_runner("edge-1", "octo/edge", labels=["linux"])
    edge_host.start_unit("edge-1", "octo/edge")
    agent_token(coord_host, edge_host)
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord"})
    edge = Daemon(edge_host, {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1"},
                  args=("--coordinator", coord.url))
    try:
        page, console = open_page(browser, coord.url)
        row = runner_row(page, "edge-1")
        expect(row).to_have_attribute("data-host", "edge", timeout=WAIT_MS)
        expect(row.locator(".badge.info")).to_have_text("edge")
        use_token(page, coord.token)
        buttons = row.locator("button[data-action]")
        expect(buttons).to_have_count(3)
        assert sorted(buttons.evaluate_all("all => all.map((b) => b.dataset.action)")) == [
            "runner.deregister", "runner.drain", "runner.duplicate"]
        for index in range(3):
            expect(buttons.nth(index)).to_be_enabled()
        row.locator('button[data-action="runner.duplicate"]').click()
        dialog = page.locator("dialog.confirm")
        expect(dialog.locator('input[name="new_name"]')).to_have_attribute("placeholder",
                                                                          "edge-2")
        dialog.locator("[data-confirm=yes]").click()
        expect(page.locator(".toast").first).to_contain_text("Duplicate: edge-1 sent to edge")
        expect(page.locator(".toast.ok")).to_contain_text("Duplicate: edge-1 on edge done: edge-2",
                                                          timeout=60_000)
        expect(runner_row(page, "edge-2")).to_have_attribute("data-host", "edge",
                                                             timeout=WAIT_MS)
        edge_host.wait_listener("edge-2", timeout=20)
        shot(page, "remote-duplicated")
        # Its page: what the agent reported, the forwarded actions, no bundle to download.
        row.get_by_role("link", name="edge-1").click()
        expect(page.locator("#runner-title")).to_contain_text("edge-1")
        expect(page.locator("#remote")).to_contain_text("runs on the agent host edge")
        expect(page.locator("#facts")).to_contain_text("registered")
        expect(page.locator("main")).not_to_contain_text("undefined")
        expect(page.get_by_role("button", name="Download bundle")).to_have_count(0)
        expect(page.locator('main button[data-action="runner.drain"]')).to_be_enabled()
        shot(page, "remote-runner")
        assert console.errors == []
        page.context.close()
    finally:
        edge.stop()
        coord.stop()
        fakes.kill_all_listeners(edge_host.root)
        fakes.kill_all_listeners(coord_host.root)


@needs_chromium
@pytest.mark.slow
def test_an_agents_runner_named_like_one_of_this_hosts_gets_its_own_row_and_page(
        tmp_path: Path, github: FakeGitHub, browser: Browser) -> None:
    """Cloned images give two hosts runners of one name. The overview kept runners by name:
    the agent's row replaced this host's (shown twice, the local one gone) and its buttons sent
    the actions to the agent; the runner page by name opened this host's. Each now has its row,
    and the agent's its own page (#/runner/<name>@<host>)."""
    host = make_host(tmp_path / "coord", github)
    host.add_runner("app-1", "octo/shelf", labels=["linux"])
    coord = Daemon(host, {"FLEET_HOST_NAME": "coord"})
    try:
        heartbeat(coord.url, coord.token, "zz", runners=["app-1"], repo="octo/shelf")
        page, console = open_page(browser, coord.url)
        mine = page.locator('tr[data-runner="app-1"][data-host="coord"]')
        theirs = page.locator('tr[data-runner="app-1"][data-host="zz"]')
        expect(mine).to_have_count(1, timeout=WAIT_MS)
        expect(theirs).to_have_count(1)
        expect(theirs.locator(".badge.info")).to_have_text("zz")
        expect(mine.locator(".badge.info")).to_have_count(0)
        theirs.get_by_role("link", name="app-1").click()
        expect(page).to_have_url(re.compile(r"#/runner/app-1@zz$"))
        expect(page.locator("#remote")).to_contain_text("runs on the agent host zz")
        page.go_back()
        mine.get_by_role("link", name="app-1").click()
        expect(page).to_have_url(re.compile(r"#/runner/app-1$"))
        expect(page.locator("#runner-title")).to_contain_text("app-1")
        expect(page.locator("#remote")).to_have_count(0)
        assert console.errors == []
        page.context.close()
    finally:
        coord.stop()
        fakes.kill_all_listeners(host.root)


@needs_chromium
@pytest.mark.slow
def test_an_agent_host_shows_its_coordinator_and_a_refusal(tmp_path: Path, github: FakeGitHub,
                                                           browser: Browser) -> None:
    """An agent's Hosts screen says where it reports and how that went: a second agent under a
    name another is using (a cloned image) shows the coordinator's refusal, the first shows
    its last answer. Before, an agent's screen said only that no agent reports to it."""
    coord_host = make_host(tmp_path / "coord", github)
    agents_hosts = [make_host(tmp_path / which, github) for which in ("first", "clone")]
    for host in agents_hosts:
        agent_token(coord_host, host)
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord"})
    agents: list[Daemon] = []
    try:
        for host in agents_hosts:
            agents.append(Daemon(host, {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1"},
                                 args=("--coordinator", coord.url)))
            page, console = open_page(browser, agents[-1].url + "/#/hosts")
            link = page.locator("#coordinator-link")
            expect(link).to_contain_text(coord.url, timeout=WAIT_MS)
            if len(agents) == 1:
                expect(link).to_contain_text("last answered", timeout=WAIT_MS)
                expect(link).to_have_attribute("data-ok", "true")
            else:
                # The screen refreshes every 10 s: wait past one refresh for the refusal.
                expect(link).to_contain_text("in use by another agent", timeout=30_000)
                expect(link).to_have_attribute("data-ok", "false")
                expect(link).to_contain_text("FLEET_HOST_NAME")
                shot(page, "hosts-agent-refused")
            expect(page.locator("#hosts")).not_to_contain_text("No agent host reports")
            assert console.errors == []
            page.context.close()
    finally:
        for agent in agents:
            agent.stop()
        coord.stop()


@needs_chromium
@pytest.mark.slow
def test_hosts_screen_fits_a_laptop_screen(tmp_path: Path, github: FakeGitHub,
                                           browser: Browser) -> None:
    """A dozen hosts (this one and eleven agents reporting over HTTP), 80 admission decisions
    and autoscale on: the Hosts screen is one 1280x800 screen; the decision logs scroll inside
    their panels."""
    host = make_host(tmp_path, github)
    host.add_runner("lap-1", "octo/app", labels=["linux"])
    host.state.mkdir(parents=True, exist_ok=True)
    with open(host.state / "admission.log", "w", encoding="utf-8") as log:
        for n in range(80):
            log.write(json.dumps({
                "at": f"2026-01-01T00:{n % 60:02d}:00Z", "decision": ("admitted", "held",
                                                                       "released")[n % 3],
                "wait_s": n, "reason": "load per core 2.1 above 1.5", "load": 2.1,
                "runner": "lap-1", "repo": "octo/app", "run_id": 5000 + n, "job": "build",
                "workflow": "CI"}) + "\n")
    daemon = UiDaemon(host, {"FLEET_AUTOSCALE": "on"}).start()
    try:
        for n in range(11):
            heartbeat(daemon.url, daemon.token, f"pi-{n:02d}",
                      [f"pi-{n:02d}-r{k}" for k in range(3)])
        page, console = open_page(browser, daemon.url + "/#/hosts",
                                  viewport={"width": 1280, "height": 800})
        expect(page.locator("#hosts tbody tr")).to_have_count(12, timeout=WAIT_MS)
        expect(page.locator("#admission")).to_contain_text("released", timeout=WAIT_MS)
        expect(page.locator("#autoscale")).to_contain_text("enabled", timeout=WAIT_MS)
        height = page.evaluate("document.documentElement.scrollHeight")
        assert height <= 800, height
        box = page.locator("#admission .capped")
        assert box.evaluate("box => box.scrollHeight > box.clientHeight")  # it scrolls inside
        shot(page, "hosts-dozen")
        assert console.errors == []
        page.context.close()
    finally:
        daemon.stop()
        fakes.kill_all_listeners(host.root)


def _hostile_heartbeat(url: str, token: str) -> None:
    """An agent (it holds the agent token) whose capacity and vitals hold objects where
    figures belong: String() of `{"toString": null}` throws."""
    body = {"host": "evil-agent", "runners": [{"name": "evil-1", "repo": "octo/shelf"}],
            "capacity": {"busy": {"toString": None}, "ceiling": 2},
            "vitals": {"cores": {"toString": None}, "load": [{"toString": None}, 1, 1]},
            "load": [0.1, 0.2, 0.3]}
    request = urllib.request.Request(f"{url}/api/host/heartbeat", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@needs_chromium
@pytest.mark.slow
def test_a_hostile_agent_report_leaves_the_hosts_screen_whole(tmp_path: Path,
                                                             github: FakeGitHub,
                                                             browser: Browser) -> None:
    """One agent's `"capacity": {"busy": {"toString": null}}` made the Hosts table throw on
    every render: no row was drawn, this host's included. The coordinator keeps figures only,
    and the page's formatters show a value that is neither a number nor text as a dash."""
    host = make_host(tmp_path, github)
    host.add_runner("lap-1", "octo/app", labels=["linux"])
    daemon = UiDaemon(host).start()
    try:
        heartbeat(daemon.url, daemon.token, "pi-good")
        _hostile_heartbeat(daemon.url, daemon.token)
        page, console = open_page(browser, daemon.url + "/#/hosts")
        expect(page.locator("#hosts tbody tr")).to_have_count(3, timeout=WAIT_MS)
        evil = page.locator('#hosts tr[data-host="evil-agent"]')
        expect(evil).to_contain_text("– / 2")
        expect(evil).to_contain_text("0.10 / 0.20 / 0.30")
        expect(page.locator('#hosts tr[data-host="pi-good"]')).to_contain_text("1 / 2")
        # The formatters themselves, given what no daemon of ours sends.
        module = page.evaluate(
            '() => new URL("js/format.js", document.querySelector("script[type=module]").src).href')
        shown = page.evaluate("""async (url) => {
            const f = await import(url);
            const odd = [{ toString: null }, { valueOf: null, toString: null }, [1], true];
            return odd.flatMap((v) => [f.num(v), f.dur(v), f.pct(v), f.share(v)]);
        }""", module)
        assert set(shown) == {"–"}, shown
        readable(page, "#hosts")
        assert console.errors == []
        page.context.close()
    finally:
        daemon.stop()
        fakes.kill_all_listeners(host.root)


def readable(page: Page, where: str = "main") -> str:
    """The text a person reads in `where`, checked for raw data (JSON, ISO times, null...)."""
    text = page.locator(where).inner_text()
    found = RAW.search(text)
    if found:
        context = text[max(0, found.start() - 80):found.end() + 80]
        raise AssertionError(f"raw data {found.group(0)!r} in {where}: ...{context}...")
    return text


DURATION = re.compile(r"^\d+ (s|min|min \d+ s|h|h \d+ min|d|d \d+ h)$")


def analytics_reads_as_figures(page: Page) -> None:
    page.get_by_role("navigation", name="Screens").get_by_role("link", name="Analytics").click()
    row = page.locator('#analytics tr[data-repo="octo/app"]')
    expect(row).to_be_visible(timeout=WAIT_MS)
    heads = page.locator("#analytics thead th").all_inner_texts()
    assert {"Duration p50", "Duration p90", "Queue p50", "Failure rate", "Outcomes"} <= set(heads)
    cells = row.locator("td").all_inner_texts()
    assert DURATION.match(cells[heads.index("Duration p50") - 1]), cells
    assert re.search(r"success \d+(,\d{3})* \(\d+\.\d %\)", row.inner_text()), row.inner_text()
    chart = page.locator("#analytics figure", has_text="Job duration by repository")
    expect(chart.locator("canvas").first).to_be_visible()
    when = page.locator("#history time").first
    expect(when).to_have_text(re.compile(r"(ago|just now)$"))
    assert when.get_attribute("title") and "T" not in (when.get_attribute("title") or "T")
    readable(page)
    shot(page, "analytics-busy")
    row.get_by_role("link", name="octo/app").click()
    expect(page.locator("#repo-title")).to_have_text("octo/app")
    expect(page.locator("#repo-workflows tbody tr").first).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#repo-detail .figures")).to_contain_text("Failure rate")
    readable(page)


@needs_chromium
@pytest.mark.slow
def test_analysis_screens_read_as_figures_and_charts(cp_busy: UiDaemon, browser: Browser) -> None:
    """Over weeks of history, every analysis screen is a table of plain figures (durations with
    units, outcomes as counts and shares) or a chart, with local relative times: Analytics with
    its duration chart, a repository, concurrency findings, the simulation with its queue-time
    chart, the forecast, the hosts with autoscale and admission decisions, billing."""
    page, console = open_page(browser, cp_busy.url)
    expect(runner_row(page, BUSY_RUNNER)).to_be_visible(timeout=WAIT_MS)
    analytics_reads_as_figures(page)

    page.get_by_role("link", name="Concurrency").click()
    expect(page.locator("#concurrency li[data-kind]")).not_to_have_count(0, timeout=WAIT_MS)
    readable(page)

    page.get_by_role("link", name="Simulate").click()
    expect(page.locator("#simulate input[name=repo]")).to_have_value("octo/app")
    page.get_by_role("button", name="Simulate").click()
    expect(page.locator('#simulation tr[data-runners="2"]')).to_be_visible(timeout=WAIT_MS)
    chart = page.locator("#simulation figure", has_text="Queue time by runner count")
    expect(chart.locator("canvas").first).to_be_visible()
    expect(page.locator("#simulation")).to_contain_text("Replayed")
    readable(page)
    shot(page, "simulate-busy")

    page.get_by_role("link", name="Forecast").click()
    expect(page.locator('#forecast tr[data-repo="octo/app"]')).to_be_visible(timeout=WAIT_MS)
    readable(page)

    page.get_by_role("link", name="Hosts").click()
    expect(page.locator('#hosts tr[data-host="edge"]')).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#autoscale li[data-outcome]").first).to_contain_text(
        "duplicate", timeout=WAIT_MS)
    expect(page.locator('#admission li[data-decision="released"]').first).to_contain_text(
        "waited")
    readable(page)

    page.get_by_role("link", name="Billing").click()
    expect(page.locator("#billing")).to_contain_text("1,234 min", timeout=WAIT_MS)
    readable(page)
    assert console.errors == []
    page.context.close()


@needs_chromium
@pytest.mark.slow
def test_simulate_shows_the_daemons_sentence(live: UiDaemon, browser: Browser) -> None:
    """The form as pre-filled, for a repository without finished jobs: the daemon's 404 says why
    ("no recorded jobs ... to replay") and the page shows that, not "not available"."""
    page, console = open_page(browser, live.url + "/#/simulate")
    expect(page.locator("#simulate input[name=repo]")).to_have_value("octo/app",
                                                                     timeout=WAIT_MS)
    page.get_by_role("button", name="Simulate").click()
    expect(page.locator("#simulation .failed")).to_contain_text(
        "No recorded jobs of octo/app in the last 30 days to replay.", timeout=WAIT_MS)
    expect(page.locator("#simulation .unavailable")).to_have_count(0)
    assert console.errors == []
    page.context.close()


@needs_chromium
@pytest.mark.slow
def test_phone_navigation_folds_into_a_menu(live: UiDaemon, browser: Browser) -> None:
    """At 390 px the screens hide behind Menu; a tap opens them, choosing one goes there and
    folds the menu again; no screen scrolls the document sideways."""
    page, console = open_page(browser, live.url, viewport={"width": 390, "height": 844},
                              is_mobile=True, has_touch=True)
    expect(runner_row(page, BUSY_RUNNER)).to_be_visible(timeout=WAIT_MS)
    menu = page.locator("button.menu-toggle")
    settings = page.get_by_role("navigation", name="Screens").get_by_role("link", name="Settings")
    expect(menu).to_be_visible()
    expect(settings).to_be_hidden()
    for screen in SCREENS:
        menu.tap()
        expect(menu).to_have_attribute("aria-expanded", "true")
        link = page.get_by_role("navigation", name="Screens").get_by_role(
            "link", name=screen.title())
        link.tap()
        expect(page.locator(f'main[data-screen="{screen}"]')).to_be_visible()
        expect(menu).to_have_attribute("aria-expanded", "false")
        expect(settings).to_be_hidden()
        expect(page.locator("main [aria-busy=true]")).to_have_count(0, timeout=WAIT_MS)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{screen}: the document is {width} px wide"
    shot(page, "phone-menu")
    assert console.errors == []
    page.context.close()


@needs_chromium
@pytest.mark.slow
def test_phone_layout_and_dark_theme(live: UiDaemon, browser: Browser) -> None:
    page, console = open_page(browser, live.url, viewport={"width": 390, "height": 844},
                              color_scheme="dark", is_mobile=True, has_touch=True,
                              device_scale_factor=2)
    expect(runner_row(page, BUSY_RUNNER)).to_be_visible(timeout=WAIT_MS)
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(13, 17, 23)"  # the dark palette, chosen by the system setting
    # runner rows are cards: nothing wider than the screen
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    shot(page, "phone-overview")
    runner_row(page, BUSY_RUNNER).get_by_role("link", name=BUSY_RUNNER).click()
    expect(page.locator("pre.log")).to_be_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    shot(page, "phone-runner")
    assert console.errors == []
    page.context.close()


@needs_chromium
@pytest.mark.slow
def test_page_reconnects_after_the_daemon_restarts(live: UiDaemon, browser: Browser) -> None:
    page, console = open_page(browser, live.url)
    conn = page.locator("#conn")
    expect(conn).to_have_text("live", timeout=WAIT_MS)
    console.outage = True
    live.stop()
    expect(conn).to_have_text(re.compile("reconnecting"), timeout=WAIT_MS)
    live.start()
    expect(conn).to_have_text("live", timeout=30_000)
    console.outage = False
    expect(runner_row(page, BUSY_RUNNER)).to_be_visible()
    assert console.errors == []
    page.context.close()


@needs_chromium
@pytest.mark.slow
def test_read_only_mode_draws_no_action_buttons(tmp_path: Path, github: FakeGitHub,
                                                browser: Browser) -> None:
    host = make_host(tmp_path, github)
    host.add_runner("ro-1", "octo/ro", labels=["linux"])
    host.start_unit("ro-1", "octo/ro")
    daemon = UiDaemon(host, {"FLEET_READ_ONLY": "1"}).start()
    try:
        page, console = open_page(browser, daemon.url)
        expect(runner_row(page, "ro-1")).to_be_visible(timeout=WAIT_MS)
        expect(page.get_by_text("read-only", exact=True)).to_be_visible()
        expect(page.locator("#token")).to_have_count(0)
        expect(page.locator("button[data-action]")).to_have_count(0)
        shot(page, "read-only")
        runner_row(page, "ro-1").get_by_role("link", name="ro-1").click()
        expect(page.locator("#runner-title")).to_contain_text("ro-1")
        expect(page.locator("main button")).to_have_count(0)  # no actions, no bundle
        page.get_by_role("link", name="Settings").click()
        expect(page.locator('tr[data-setting="ceiling"]')).to_be_visible()
        expect(page.locator("main input, main select")).to_have_count(0)
        assert console.errors == []
        page.context.close()
    finally:
        daemon.stop()
        fakes.kill_all_listeners(host.root)


def test_the_ui_keeps_no_copy_of_the_shared_libraries() -> None:
    """The control plane serves /public/vendor/ from fleet_min/web/vendor/ (one copy in the
    tree and in fleet.pyz), and the UI folder holds no symbolic link, which zipapp.py would not
    follow into fleet.pyz."""
    assert SHARED_VENDOR.is_dir() and not (UI_DIR / "vendor").exists()
    assert not [p for p in UI_DIR.rglob("*") if p.is_symlink()]


@needs_chromium
@pytest.mark.slow
def test_escape_right_after_enter_leaves_no_dialog_open(live: UiDaemon, browser: Browser) -> None:
    """A keyboard user who opens a confirmation and presses Escape at once is left with nothing
    open: the dialog opens in the same frame as its content, so no keypress falls between."""
    page, console = open_page(browser, live.url)
    use_token(page, live.token)
    button = page.locator(f'button[data-action="runner.duplicate"][data-runner="{BUSY_RUNNER}"]')
    dialog = page.locator("dialog.confirm")
    for _ in range(10):
        button.focus()
        page.keyboard.press("Enter")
        page.keyboard.press("Escape")
        expect(dialog).to_be_hidden()
        assert page.evaluate("document.querySelector('dialog.confirm').open") is False
    assert console.errors == []
    page.context.close()
