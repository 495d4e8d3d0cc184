"""The browser runner page (/runner) in headless Chromium against a live collector: it sends
nothing to the collector until a person presses Start (not when opened directly, by another site's
link, redirect or popup, or by history); a reload of the tab where Start was pressed carries on,
nothing else does; Stop gives back a waiting poll and a running job and forgets Start. Once
started it enrols as a temporary web device, runs synthetic benchmarks with both browser
backends, and posts a summary whose attestation digest equals the reference (decisions.md, and
computed here with hashlib); it stops claiming while hidden and hands back a job it claimed too
late."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.support.collector import CollectorProcess, HttpClient, job
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, DESKTOP, Watch, page_server, shot

pytestmark = pytest.mark.slow


# decisions.md: the hex SHA-256 of a fresh 4,096-byte block (byte i = (i * 31) & 0xff) after
# 1,000 rounds, each hashing the whole block and writing the digest over its first 32 bytes.
ATTESTATION = "d7e8b70dfb48593edebc84967a969e78429f9ac6da8d0c681a4b57a2fe078a84"


def reference_attestation(rounds: int = 1000) -> str:
    block = bytearray((i * 31) & 0xFF for i in range(4096))
    for _ in range(rounds):
        block[:32] = hashlib.sha256(block).digest()
    return hashlib.sha256(block).hexdigest()


def test_the_attestation_constant_is_the_reference_loop() -> None:
    assert reference_attestation() == ATTESTATION


def wait_for_status(client: HttpClient, job_id: str, wanted: set[str], timeout: float = 30
                    ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        detail = client.get(f"/api/jobs/{job_id}")[1]
        if detail["status"] in wanted:
            return dict(detail)
        assert time.monotonic() < deadline, detail
        time.sleep(0.1)


def enrolled(page: Any) -> str:
    page.wait_for_selector("#log >> text=enrolled as")
    return str(page.text_content("#device-id"))


def start(page: Any) -> str:
    """Press Start as a person does (a real click), wait for the enrolment; the device's id."""
    page.get_by_role("button", name="Start", exact=True).click()
    return enrolled(page)


@pytest.fixture
def collector(tmp_path: Path) -> Any:
    proc = CollectorProcess(tmp_path / "data").start()
    yield proc
    proc.stop()


def test_runner_posts_synthetic_benchmarks_matching_the_reference(
        collector: CollectorProcess, open_page: Callable[..., Any]) -> None:
    client = collector.client
    page = open_page(collector.url + "/runner")
    device_id = start(page)
    device = client.get(f"/api/devices/{device_id}")[1]
    assert device["platform"] == "web" and device["kind"] == "browser"
    assert device["temporary"] and device["ttl_s"] > 0
    # http://127.0.0.1 is a secure context, so the platform digest is offered too.
    assert device["capabilities"] == ["benchmark:jssha", "benchmark:webcrypto"]
    # It beacons as soon as it is enrolled: the log line comes first, the beacon's POST just
    # after it, so the beacon is waited for rather than read once.
    deadline = time.monotonic() + 10
    while device["last_beacon"] is None:
        assert time.monotonic() < deadline, f"the runner never beaconed: {device}"
        time.sleep(0.05)
        device = client.get(f"/api/devices/{device_id}")[1]

    params = {"prompt_tokens": 3, "gen_tokens": 2, "warmup_iters": 1, "measure_iters": 2}
    for backend in ("jssha", "webcrypto"):
        spec = job(f"web-{backend}", backend=backend, params=params,
                   targets={"device_id": device_id})
        assert client.post("/jobs", spec)[0] == 201
    for backend in ("jssha", "webcrypto"):
        detail = wait_for_status(client, f"web-{backend}", {"done", "failed"})
        assert detail["status"] == "done", detail
        rows = {r["iter"]: r for r in detail["results"]}
        assert sorted(rows) == [0, 1, 2]
        assert rows[0]["final"] and rows[0]["ok"] and not rows[1]["final"]
        for row in rows.values():
            assert row["metrics"]["decode_tok_s"] > 0 and row["metrics"]["prefill_tok_s"] > 0
            assert row["metrics"]["ttft_ms"] > 0
        # The attestation, computed by this backend on a fresh block, is the summary's.
        assert rows[0]["metrics"]["synthetic_digest"] == ATTESTATION
        assert rows[0]["metrics"]["synthetic_rounds"] == 1000
        assert rows[0]["metrics"]["iterations"] == 2
        assert "synthetic_digest" not in rows[1]["metrics"]
        assert rows[0]["runner"]["backend"] == backend
    page.wait_for_selector("#done >> text=2")
    assert page.text_content("#last-digest") == ATTESTATION
    shot(page, "runner")
    assert page.watch.errors == []


def test_runner_stops_claiming_while_hidden_and_refuses_what_it_cannot_run(
        collector: CollectorProcess, open_page: Callable[..., Any]) -> None:
    client = collector.client
    page = open_page(collector.url + "/runner")
    device_id = start(page)
    page.wait_for_selector("#status >> text=Waiting for a job")
    page.evaluate("""() => {
        Object.defineProperty(document, "hidden", {value: true, configurable: true});
        Object.defineProperty(document, "visibilityState", {value: "hidden", configurable: true});
        document.dispatchEvent(new Event("visibilitychange"));
    }""")
    spec = job("while-hidden", backend="jssha", params={"prompt_tokens": 1, "gen_tokens": 1,
                                                        "warmup_iters": 0, "measure_iters": 1},
               targets={"device_id": device_id})
    assert client.post("/jobs", spec)[0] == 201
    # A poll already waiting may claim it, and then the page hands it straight back.
    page.wait_for_selector("#status >> text=Hidden: not claiming")
    time.sleep(3)  # longer than the test collector's 2 s long poll
    detail = client.get("/api/jobs/while-hidden")[1]
    assert detail["status"] == "queued" and detail["results"] == [], detail

    page.evaluate("""() => {
        Object.defineProperty(document, "hidden", {value: false, configurable: true});
        Object.defineProperty(document, "visibilityState", {value: "visible", configurable: true});
        document.dispatchEvent(new Event("visibilitychange"));
    }""")
    assert wait_for_status(client, "while-hidden", {"done", "failed"})["status"] == "done"

    # A constraint the browser cannot check is refused with a sentence, not run.
    spec = job("needs-charging", backend="jssha", constraints={"require_charging": True},
               params={"prompt_tokens": 1, "gen_tokens": 1}, targets={"device_id": device_id})
    page.evaluate("""() => { navigator.getBattery = () => Promise.resolve(
        {level: 0.5, charging: false}); }""")
    assert client.post("/jobs", spec)[0] == 201
    detail = wait_for_status(client, "needs-charging", {"done", "failed"})
    assert detail["status"] == "failed"
    assert "requires charging" in detail["last_error"]
    assert page.watch.errors == []


def test_runner_stops_a_cancelled_job_at_its_next_beacon(
        collector: CollectorProcess, open_page: Callable[..., Any]) -> None:
    client = collector.client
    page = open_page(collector.url + "/runner")
    device_id = start(page)
    # Short iterations (a slow, shared CI machine must still reach the second one quickly) and
    # many of them, so the job is far from done when it is cancelled; an 8 s lease makes the page
    # beacon every 2 s.
    spec = job("long-one", backend="jssha", lease={"ttl_s": 8},
               params={"prompt_tokens": 8, "gen_tokens": 4, "warmup_iters": 0,
                       "measure_iters": 5000}, targets={"device_id": device_id})
    assert client.post("/jobs", spec)[0] == 201
    page.wait_for_selector("#status >> text=Running long-one")
    page.wait_for_function("""() => {
        const m = /iteration (\\d+) of 5000/.exec(document.querySelector("#job-phase").textContent);
        return m !== null && Number(m[1]) >= 2;
    }""", timeout=60000)
    assert client.post("/api/jobs/long-one/cancel")[0] == 200
    page.wait_for_selector("#log >> text=stopped long-one", timeout=20000)
    page.wait_for_selector("#status >> text=Waiting for a job")
    rows = client.get("/api/jobs/long-one")[1]["results"]
    assert rows and all(not r["final"] for r in rows)  # no summary for a cancelled job
    assert page.watch.errors == []


# (brands of navigator.userAgentData, or None for a browser without client hints; user agent;
#  navigator.platform) -> the model the runner enrols with
BRAND_CASES = [
    ([("Not;A=Brand", "8"), ("Chromium", "124")], "", "Linux x86_64", "Chromium 124"),
    ([("Chromium", "124"), ("Google Chrome", "124"), ("Not-A.Brand", "99")], "", "", "Google Chrome 124"),
    ([("Not A(Brand", "99"), ("Microsoft Edge", "121"), ("Chromium", "121")], "", "", "Microsoft Edge 121"),
    ([("(Not(A:Brand", "24"), ("Opera", "110"), ("Chromium", "124")], "", "", "Opera 110"),
    ([(" Not;A Brand", "99"), ("Chromium", "89")], "", "", "Chromium 89"),
    ([("Not_A Brand", "8"), ("Not)A;Brand", "24")], "", "Linux armv8l", "Linux armv8l"),
    ([("Not/A)Brand", "8")], "", "", "browser"),
    (None, "Mozilla/5.0 (X11; Linux x86_64; rv:126.0) Gecko/20100101 Firefox/126.0", "Linux",
     "Firefox 126"),
    (None, "Mozilla/5.0 (iPhone; CPU iPhone OS 17_4 like Mac OS X) AppleWebKit/605.1.15 "
     "(KHTML, like Gecko) Version/17.4 Mobile/15E148 Safari/604.1", "iPhone", "Safari 17"),
]


def test_runner_enrols_with_the_browser_brand_not_the_grease_one(
        collector: CollectorProcess, open_page: Callable[..., Any]) -> None:
    page = open_page(collector.url + "/runner")
    device_id = start(page)
    model = collector.client.get(f"/api/devices/{device_id}")[1]["descriptor"]["model"]
    brands = page.evaluate("navigator.userAgentData.brands.map((b) => [b.brand, b.version])")
    # Debian's Chromium lists "Chromium" and a made-up GREASE brand such as "Not;A=Brand".
    real = [f"{b} {v}" for b, v in brands if not any(c in b for c in "();=/:?_")
            and "brand" not in b.lower()]
    assert real and model in real, (model, brands)
    assert model == next((r for r in real if not r.startswith("Chromium ")), real[0])

    module = page.evaluate("""() => new URL("./brand.js",
        document.querySelector("script[type=module]").src).href""")
    for brands_in, agent, platform, expected in BRAND_CASES:
        ua_data = None if brands_in is None else {
            "brands": [{"brand": b, "version": v} for b, v in brands_in], "platform": platform}
        got = page.evaluate("""async ([url, uaData, agent, platform]) =>
            (await import(url)).browserModel(uaData, agent, platform)""",
                            [module, ua_data, agent, platform])
        assert got == expected, (brands_in, agent, got)
    assert page.watch.errors == []


# -- Start: nothing before a person's click ----------------------------------------------------

QUIET_S = 3.0  # longer than the test collector's 2 s long poll
NOT_STARTED = "#status >> text=Not started"
# Another site's pages. `__RUNNER__` is the collector's /runner.
ELSEWHERE = {
    "/": """<!doctype html><title>cats</title><link rel="icon" href="data:,">
<p><a id="follow" href="__RUNNER__">cute cats</a> <button id="popup">more cats</button></p>
<script>document.getElementById("popup").addEventListener("click",
  () => window.open("__RUNNER__", "_blank"));</script>""",
    "/redirect": """<!doctype html><title>cats</title><link rel="icon" href="data:,">
<meta http-equiv="refresh" content="0; url=__RUNNER__">""",
    "/back": """<!doctype html><title>cats</title><link rel="icon" href="data:,"><p>a moment…</p>
<script>setTimeout(() => history.back(), 300);</script>""",
    "/send": """<!doctype html><title>cats</title><link rel="icon" href="data:,"><p>a moment…</p>
<script>setTimeout(() => location.assign("__RUNNER__"), 300);</script>""",
}


class Tab:
    """A page of a browser context whose requests to the collector are kept as they leave."""

    def __init__(self, page: Any, collector_url: str) -> None:
        self.page = page
        self.collector_url = collector_url
        self.sent: list[str] = []
        page.watch = Watch()
        page.on("console", page.watch.console)
        page.on("pageerror", page.watch.exception)
        page.on("request", self.saw)

    def saw(self, request: Any) -> None:
        if request.url.startswith(self.collector_url + "/"):
            self.sent.append(f"{request.method} {request.url[len(self.collector_url):]}")

    def to_the_collector(self) -> list[str]:
        """What the page asked of the collector beyond its own page and static files."""
        return [s for s in self.sent if not s.startswith(("GET /runner", "GET /static/",
                                                           "GET /favicon.svg"))]


@pytest.fixture
def new_context(browser: Any) -> Iterator[Callable[[], Any]]:
    """Fresh browser contexts (profiles: their own tabs and storage), closed after the test."""
    contexts: list[Any] = []

    def make() -> Any:
        context = browser.new_context(viewport=DESKTOP)
        context.set_default_timeout(15000)
        contexts.append(context)
        return context

    yield make
    for context in contexts:
        with contextlib.suppress(Exception):
            context.close()


def device_ids(collector: CollectorProcess) -> list[str]:
    return [d["device_id"] for d in collector.client.get("/api/devices")[1]["devices"]]


def pinned(job_id: str, device_id: str | None = None, iterations: int = 1) -> dict[str, Any]:
    targets = {"device_id": device_id} if device_id else {}
    return job(job_id, backend="jssha", lease={"ttl_s": 8}, targets=targets,
               params={"prompt_tokens": 2, "gen_tokens": 2, "warmup_iters": 0,
                       "measure_iters": iterations})


def stays_queued(collector: CollectorProcess, job_id: str, wait: bool = True) -> None:
    """The job is still queued, with no row, after longer than a long poll."""
    if wait:
        time.sleep(QUIET_S)
    detail = collector.client.get(f"/api/jobs/{job_id}")[1]
    assert detail["status"] == "queued" and detail["results"] == [], detail


def not_started(tab: Tab) -> bool:
    return str(tab.page.text_content("#status")).startswith("Not started")


def test_the_runner_sends_nothing_until_start_is_pressed(
        collector: CollectorProcess, new_context: Callable[[], Any]) -> None:
    tab = Tab(new_context().new_page(), collector.url)
    tab.page.goto(collector.url + "/runner")  # returns once the page has loaded (its module ran)
    time.sleep(QUIET_S)
    assert device_ids(collector) == [] and tab.to_the_collector() == []
    assert not_started(tab) and tab.page.get_by_role("status").count() == 1
    start_button = tab.page.get_by_role("button", name="Start", exact=True)
    assert start_button.is_visible()
    text = " ".join(str(tab.page.inner_text("main")).split())
    for words in ("enrols this browser as a temporary device", "runs the ones it is sent",
                  "10 minutes", "A reload of this tab carries on"):
        assert words in text, words

    device_id = start(tab.page)
    assert device_ids(collector) == [device_id]
    # (A jssha job can be enqueued once a device offers jssha: the browser, now.)
    assert collector.client.post("/jobs", pinned("for-any-browser"))[0] == 201
    assert wait_for_status(collector.client, "for-any-browser", {"done", "failed"})[
        "status"] == "done"
    assert tab.page.get_by_role("button", name="Stop", exact=True).is_visible()
    assert not start_button.is_visible()
    assert tab.page.watch.errors == []


# Every change of the Start button, as the page makes it: each record is its state once the
# script's step that changed it is over, which is how it is drawn.
START_STATES = """
window.startStates = [];
new MutationObserver(() => {
  const start = document.getElementById("start");
  if (start) window.startStates.push({hidden: start.hidden, disabled: start.disabled});
}).observe(document, {subtree: true, attributes: true, attributeFilter: ["hidden", "disabled"]});
"""


def test_start_answers_only_once_it_has_been_on_screen_a_moment(
        collector: CollectorProcess, new_context: Callable[[], Any]) -> None:
    """A popup opened under the visitor's pointer must not take the second click of a
    double-click as a press of Start: the button is disabled when it first appears."""
    page = new_context().new_page()
    page.add_init_script(START_STATES)
    page.goto(collector.url + "/runner")
    expect(page.get_by_role("button", name="Start", exact=True)).to_be_enabled()
    states = page.evaluate("window.startStates")
    first_shown = next(state for state in states if not state["hidden"])
    assert first_shown["disabled"] is True, states
    assert device_ids(collector) == []
    start(page)  # and once armed, a click starts it


def test_a_page_on_another_site_cannot_start_the_runner(
        collector: CollectorProcess, new_context: Callable[[], Any]) -> None:
    """A link followed, a popup opened, a redirect: each lands on the runner page, and none of
    them enrols or polls."""
    runner = collector.url + "/runner"
    pages = {path: html.replace("__RUNNER__", runner) for path, html in ELSEWHERE.items()}
    with page_server(pages) as port:
        elsewhere = f"http://127.0.0.1:{port}"
        context = new_context()
        followed = Tab(context.new_page(), collector.url)
        followed.page.goto(elsewhere + "/")
        with followed.page.expect_navigation(url=runner):
            followed.page.click("#follow")

        opener = context.new_page()
        opener.goto(elsewhere + "/")
        with context.expect_page() as opened:
            opener.click("#popup")
        popup = Tab(opened.value, collector.url)
        popup.page.wait_for_load_state()

        redirected = Tab(context.new_page(), collector.url)
        redirected.page.goto(elsewhere + "/redirect")
        redirected.page.wait_for_url(runner)
        redirected.page.wait_for_load_state()

        time.sleep(QUIET_S)  # the three runner pages open all along
        assert device_ids(collector) == []
        for each in (followed, popup, redirected):
            assert each.page.url == runner and not_started(each)
    for each in (followed, redirected):
        assert each.to_the_collector() == [] and each.page.watch.errors == []
        assert any(s.startswith("GET /runner") for s in each.sent), each.sent
    # The popup's own load started before it could be watched: the collector says no more.
    assert popup.to_the_collector() == [] and popup.page.watch.errors == []


def test_a_reload_resumes_and_a_new_tab_asks_again(
        collector: CollectorProcess, new_context: Callable[[], Any]) -> None:
    context = new_context()
    tab = Tab(context.new_page(), collector.url)
    tab.page.goto(collector.url + "/runner")
    device_id = start(tab.page)

    tab.page.reload()
    tab.page.wait_for_selector("#log >> text=resumed after a reload")
    tab.page.wait_for_selector("#status >> text=Waiting for a job")
    assert tab.page.text_content("#device-id") == device_id
    assert tab.page.get_by_role("button", name="Stop", exact=True).is_visible()
    assert collector.client.post("/jobs", pinned("after-reload", device_id))[0] == 201
    assert wait_for_status(collector.client, "after-reload", {"done", "failed"})[
        "status"] == "done"

    # A new tab of the same browser, and another browser profile: a new device, not started.
    others = [Tab(context.new_page(), collector.url), Tab(new_context().new_page(),
                                                          collector.url)]
    for other in others:
        other.page.goto(collector.url + "/runner")
        other.page.wait_for_selector(NOT_STARTED)
        assert other.page.text_content("#device-id") != device_id
    assert collector.client.post("/jobs", pinned("for-any-browser"))[0] == 201
    # The started tab takes it; wait for that, then nothing else may have enrolled or polled.
    assert wait_for_status(collector.client, "for-any-browser", {"done", "failed"})[
        "claimed_by"] == device_id
    time.sleep(QUIET_S)
    assert device_ids(collector) == [device_id]
    for other in others:
        assert other.to_the_collector() == [] and other.page.watch.errors == []
    assert tab.page.watch.errors == []


def test_a_tab_sent_back_to_the_runner_by_another_site_asks_again(
        collector: CollectorProcess, new_context: Callable[[], Any]) -> None:
    """Start was pressed in a tab, and then the tab went to another site. That site can send
    the tab back with history.back() or to the runner's address, or open the runner in a popup
    (which starts with a copy of the tab's sessionStorage): none of these is a reload, and none
    starts the runner again."""
    runner = collector.url + "/runner"
    pages = {path: html.replace("__RUNNER__", runner) for path, html in ELSEWHERE.items()}
    context = new_context()
    with page_server(pages) as port:
        elsewhere = f"http://127.0.0.1:{port}"
        back = Tab(context.new_page(), collector.url)
        back.page.goto(runner)
        first = start(back.page)
        back.page.wait_for_selector("#status >> text=Waiting for a job")
        back.sent.clear()
        back.page.goto(elsewhere + "/back")
        back.page.wait_for_selector("#log >> text=not resumed")
        assert back.page.url == runner and back.page.text_content("#device-id") == first

        sent = Tab(context.new_page(), collector.url)
        sent.page.goto(runner)
        second = start(sent.page)
        sent.page.wait_for_selector("#status >> text=Waiting for a job")
        sent.page.goto(elsewhere + "/")
        sent.sent.clear()
        with context.expect_page() as opened:
            sent.page.click("#popup")
        popup = Tab(opened.value, collector.url)
        popup.page.wait_for_selector("#log >> text=not resumed")
        assert popup.page.text_content("#device-id") == second  # the copied storage's
        sent.page.goto(elsewhere + "/send")
        sent.page.wait_for_selector("#log >> text=not resumed")
        assert sent.page.url == runner

        for job_id, device_id in (("pinned-first", first), ("pinned-second", second)):
            assert collector.client.post("/jobs", pinned(job_id, device_id))[0] == 201
        stays_queued(collector, "pinned-first")
        stays_queued(collector, "pinned-second", wait=False)
    for each in (back, sent, popup):
        assert each.to_the_collector() == [] and each.page.watch.errors == []


def test_stop_gives_back_the_poll_and_the_job_and_forgets_start(
        collector: CollectorProcess, new_context: Callable[[], Any]) -> None:
    tab = Tab(new_context().new_page(), collector.url)
    page = tab.page
    page.goto(collector.url + "/runner")
    device_id = start(page)
    stop = page.get_by_role("button", name="Stop", exact=True)
    # Stopped while its long poll waits: the poll is given up, nothing more is sent.
    page.wait_for_selector("#status >> text=Waiting for a job")
    stop.click()
    page.wait_for_selector("#status >> text=Stopped")
    # Focus follows the controls, once Start is armed (a disabled button cannot take it).
    expect(page.locator("#start")).to_be_focused()
    assert stop.is_hidden() and page.locator("#pause").is_hidden()
    tab.sent.clear()
    spec = pinned("long-one", device_id, iterations=5000)
    assert collector.client.post("/jobs", spec)[0] == 201
    stays_queued(collector, "long-one")
    assert tab.to_the_collector() == []

    # Started again and stopped while running a job: the job is handed back, queued again.
    page.get_by_role("button", name="Start", exact=True).click()
    page.wait_for_function("""() => {
        const m = /iteration (\\d+) of 5000/.exec(document.querySelector("#job-phase").textContent);
        return m !== null && Number(m[1]) >= 2;
    }""", timeout=60000)
    stop.click()
    page.wait_for_selector("#log >> text=handed long-one back: Stop pressed")
    page.wait_for_selector("#status >> text=Stopped")
    detail = wait_for_status(collector.client, "long-one", {"queued"})
    final = [r for r in detail["results"] if r["final"]]
    assert len(final) == 1 and final[0]["preempted"] and not final[0]["ok"], final
    assert "stopped on the browser runner page" in final[0]["error"]
    assert page.get_by_role("button", name="Start", exact=True).is_visible()

    # Stop also forgot Start: a reload asks again.
    page.reload()
    page.wait_for_selector(NOT_STARTED)
    tab.sent.clear()
    time.sleep(QUIET_S)
    again = collector.client.get("/api/jobs/long-one")[1]
    assert again["status"] == "queued" and again["results"] == detail["results"], again
    assert tab.to_the_collector() == [] and page.watch.errors == []


def test_a_runner_page_back_from_the_back_forward_cache_is_stopped(
        collector: CollectorProcess, browser: Any) -> None:
    """Chromium keeps even a running runner page in its back/forward cache, and history.back()
    from another site would bring it back running. (The browser the other tests share has the
    cache off, as Playwright launches it; this one has it on.)"""
    runner = collector.url + "/runner"
    pages = {path: html.replace("__RUNNER__", runner) for path, html in ELSEWHERE.items()}
    cached = browser.browser_type.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                         ignore_default_args=["--disable-back-forward-cache"])
    try:
        context = cached.new_context(viewport=DESKTOP)
        context.set_default_timeout(15000)
        tab = Tab(context.new_page(), collector.url)
        tab.page.goto(runner)
        device_id = start(tab.page)
        tab.page.wait_for_selector("#status >> text=Waiting for a job")
        tab.page.evaluate("window.leftAt = 'runner'")
        with page_server(pages) as port:
            tab.page.goto(f"http://127.0.0.1:{port}/back")
            tab.page.wait_for_selector("#log >> text=back from the browser's history")
            tab.page.wait_for_selector("#status >> text=Stopped")
            # The same document, kept: the cache brought it back, not a new load.
            assert tab.page.evaluate("window.leftAt") == "runner"
            tab.sent.clear()
            assert collector.client.post("/jobs", pinned("pinned-here", device_id))[0] == 201
            stays_queued(collector, "pinned-here")
        assert tab.to_the_collector() == [] and tab.page.watch.errors == []
    finally:
        cached.close()
