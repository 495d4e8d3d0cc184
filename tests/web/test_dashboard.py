"""The collector dashboard in headless Chromium against a live collector with real data: every
screen loads without a console error; cancel from a job's page and see the change through the
stream; the enqueue form's live match count; the token flow of a guarded collector; a peer's
read-only view. Screenshots go to test-artifacts/screenshots/."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import PHONE, SeededCollector, shot
from tests.support.collector import CollectorProcess, age_rows, job, registration

pytestmark = pytest.mark.slow

# (path, a selector that only appears once the screen shows its data, screenshot name)
SCREENS = [
    ("/dash", "text=Running", "overview"),
    ("/dash/devices", "a:has-text('Pixel on the shelf')", "devices"),
    ("/dash/devices/pixel-7", "canvas", "device-detail"),
    ("/dash/executors", "td >> text=mac-mini", "executors"),
    ("/dash/jobs", "td >> text=bench-pi", "jobs"),
    ("/dash/jobs/bench-pi", "#job-status >> text=done", "job-detail"),
    ("/dash/jobs/fan-bench", "text=fan-out child for pi5", "job-fanout"),
    ("/dash/jobs/chain-bench", "text=depends on", "job-chain"),
    ("/dash/jobs/new", "#match-count [data-count]", "enqueue"),
    ("/dash/results", ".bars .bar-row", "results"),
    ("/dash/schedules", "text=nightly-bench", "schedules"),
    ("/dash/schedules/nightly-bench", "text=manual-", "schedule-detail"),
    ("/dash/artifacts", "text=shelf-app-41.apk", "artifacts"),
    ("/dash/artifacts?tab=gc", "text=old-report.html", "artifacts-gc"),
    ("/dash/alerts", "text=low-battery", "alerts"),
    ("/dash/topics", "text=camera-frames", "topics"),
    ("/dash/topics/camera-frames", "text=pixel-7", "topic-detail"),
    ("/dash/system", "text=Rows per table", "system"),
    ("/dash/peers", "text=No peers are configured", "peers"),
]
LEGACY = ["/dash/legacy", "/dash/legacy/devices", "/dash/legacy/devices/pixel-7",
          "/dash/legacy/jobs", "/dash/legacy/jobs/selfcheck-pi", "/dash/legacy/results",
          "/dash/legacy/schedules", "/dash/legacy/alerts", "/dash/legacy/artifacts"]


def wait_live(page: Any) -> None:
    page.wait_for_selector(".live.live")  # the stream badge reads "live" once hello arrived


def test_every_screen_loads_without_console_errors(seeded: SeededCollector,
                                                   open_page: Callable[..., Any]) -> None:
    page = open_page(seeded.url + "/dash", wait="text=Running")
    wait_live(page)
    for path, ready, name in SCREENS:
        page.goto(seeded.url + path)
        page.wait_for_selector(ready)
        page.wait_for_load_state("networkidle")
        assert not page.locator(".error-box").count(), (path, page.inner_text(".error-box"))
        shot(page, f"dash-{name}")
    assert page.watch.errors == []


def test_a_device_page_charts_load_1m(seeded: SeededCollector,
                                      open_page: Callable[..., Any]) -> None:
    """The load chart reads load_1m, as the agents in the field name it (load is its alias)."""
    page = open_page(seeded.url + "/dash/devices/pi5", wait="canvas")
    page.wait_for_selector("text=Load (1 min)")
    assert page.watch.errors == []


def test_navigation_in_the_page_and_phone_and_dark_layouts(
        seeded: SeededCollector, open_page: Callable[..., Any]) -> None:
    page = open_page(seeded.url + "/dash", viewport=PHONE, wait="text=Running")
    shot(page, "phone-overview")
    page.click("button.menu-toggle")
    page.click("nav#nav >> text=Jobs")  # client-side navigation, no reload
    page.wait_for_selector("td >> text=bench-pi")
    assert page.url.endswith("/dash/jobs")
    shot(page, "phone-jobs")
    page.goto(seeded.url + "/dash/devices/pixel-7")
    page.wait_for_selector("canvas")
    shot(page, "phone-device-detail")
    dark = open_page(seeded.url + "/dash", scheme="dark", wait="text=Running")
    background = dark.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(17, 20, 24)"
    shot(dark, "dark-overview")
    dark.goto(seeded.url + "/dash/results")
    dark.wait_for_selector(".bars .bar-row")
    shot(dark, "dark-results")
    dark.keyboard.press("Tab")  # the first stop is the skip link
    assert dark.evaluate("document.activeElement.textContent") == "Skip to content"
    assert page.watch.errors == [] and dark.watch.errors == []


def test_a_host_job_names_its_executor_and_the_executors_screen_shows_it(
        seeded: SeededCollector, open_page: Callable[..., Any]) -> None:
    page = open_page(seeded.url + "/dash/jobs/ui-login", wait="#job-claimant >> text=mac-mini")
    assert page.locator("dt:text-is('Executor')").count() == 1
    page.click("#job-claimant a")
    row = page.wait_for_selector("#executor-mac-mini")
    text = row.inner_text()
    assert "ui-test:flow_runner" in text and "fleet_agent 0.9.0" in text
    shot(page, "dash-executor-from-job")
    assert page.watch.errors == []


def test_a_job_with_more_rows_than_its_page_carries_says_so_and_links_whole_rows(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    """The job page carries the final rows and the newest 1,000 others, cut down: it says how
    many there are in all, and a row cut down links to the whole of it."""
    proc = CollectorProcess(tmp_path / "rows").start()
    try:
        assert proc.client.post("/devices/register", registration("pi"))[0] == 200
        assert proc.client.post("/jobs", job("many", targets={"device_id": "pi"}))[0] == 201
        assert proc.client.get("/devices/pi/next-job")[0] == 200
        status, _ = proc.client.post("/results", {
            "schema": 1, "kind": "result", "job_id": "many", "device_id": "pi", "iter": 1,
            "ok": True, "metrics": {"decode_tok_s": 9.5, "notes": "n" * 20_000}})
        assert status == 200
        age_rows(proc.data_dir / "fleet.sqlite3", "WITH RECURSIVE n(i) AS (SELECT 2 UNION ALL "
                 "SELECT i + 1 FROM n WHERE i < 1010) INSERT INTO results (job_id, device_id, "
                 "iter, attempt, workload, ok, final, preempted, metrics, artifacts, created_at) "
                 "SELECT job_id, device_id, i, attempt, workload, 1, 0, 0, '{\"n\": 1}', '[]', "
                 "created_at - i FROM n, results WHERE results.iter = 1")
        status, _ = proc.client.post("/results", {
            "schema": 1, "kind": "result", "job_id": "many", "device_id": "pi", "iter": 0,
            "final": True, "ok": True, "metrics": {"decode_tok_s": 9.5, "notes": "n" * 20_000}})
        assert status == 200
        page = open_page(proc.url + "/dash/jobs/many", wait="#job-results-cut")
        assert "1001 of 1011 rows" in page.inner_text("#job-results-cut")
        final_id = proc.client.get("/api/jobs/many")[1]["results"][0]["id"]
        link = page.locator(f"table.results a[href='/api/results/{final_id}']")
        assert link.inner_text() == "whole row"
        shot(page, "dash-job-rows-cut")
        whole = proc.client.get(f"/api/results/{final_id}")[1]
        assert len(whole["metrics"]["notes"]) == 20_000
        assert page.watch.errors == []
    finally:
        proc.stop()


def test_an_executor_that_is_gone_is_forgotten_from_the_executors_screen(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    proc = CollectorProcess(tmp_path / "forget").start()
    try:
        for name in ("old-mac", "lab"):
            assert proc.client.post("/executors/register", {"name": name,
                                                            "capabilities": ["soak"]})[0] == 200
        assert proc.client.post("/jobs", job("soaking", workload="soak", executor="host",
                                             params={"app_id": "com.example"},
                                             targets={"executor": "lab"}))[0] == 201
        assert proc.client.get("/executor/next-job?name=lab")[0] == 200
        for name in ("old-mac", "lab"):  # both silent for ten minutes: offline
            age_rows(proc.data_dir / "fleet.sqlite3", "UPDATE executors SET first_seen = "
                     "first_seen - 600, last_poll = last_poll - 600, registered_at = "
                     "registered_at - 600 WHERE name = ?", (name,))
        assert proc.client.post("/executors/register", {"name": "live"})[0] == 200
        page = open_page(proc.url + "/dash/executors", wait="#executor-lab")
        # One running a job, or one heard from lately, offers no Forget; asked, the other asks
        # again before it acts.
        assert page.locator("#executor-lab button").count() == 0
        assert page.locator("#executor-live button").count() == 0
        page.click("#executor-old-mac button:text-is('Forget')")
        page.wait_for_selector("#executor-old-mac >> text=Its jobs are kept")
        shot(page, "dash-executor-forget")
        page.click("#executor-old-mac .confirm button:text-is('Forget')")
        page.wait_for_selector("#executor-old-mac", state="detached")
        page.wait_for_selector("text=Forgot old-mac.")
        names = [e["name"] for e in proc.client.get("/api/executors")[1]["executors"]]
        assert names == ["lab", "live"]
        assert page.watch.errors == []
    finally:
        proc.stop()


def test_devices_silent_for_a_week_are_forgotten_from_the_devices_screen(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    proc = CollectorProcess(tmp_path / "shelf").start()
    try:
        for name in ("old-1", "old-2", "on-shelf"):
            assert proc.client.post("/devices/register", registration(name))[0] == 200
        # A browser runner's temporary device, expired: not listed, but the count says so.
        assert proc.client.post("/devices/register", registration("tab", ttl_s=60))[0] == 200
        age_rows(proc.data_dir / "fleet.sqlite3", "UPDATE devices SET last_seen = last_seen - "
                 "8 * 86400 WHERE device_id LIKE 'old-%'")
        age_rows(proc.data_dir / "fleet.sqlite3", "UPDATE devices SET last_seen = last_seen - "
                 "61 WHERE device_id = 'tab'")
        page = open_page(proc.url + "/dash/devices",
                         wait="text=3 of 3 devices (1 expired browser device not listed)")
        page.click("#forget-silent button:text-is('Forget 2 not seen for a week')")
        page.wait_for_selector("#forget-silent >> text=Their results are kept")
        page.click("#forget-silent .confirm button:text-is('Forget them')")
        page.wait_for_selector("text=Forgot 2 devices.")
        page.wait_for_selector("text=1 of 1 devices")
        assert page.locator("#forget-silent").count() == 0  # none silent is left
        names = [d["device_id"] for d in proc.client.get("/api/devices")[1]["devices"]]
        assert names == ["on-shelf"]
        assert page.watch.errors == []
    finally:
        proc.stop()


def post_frame(base: str, job_id: str, executor: str, frame: bytes) -> int:
    request = urllib.request.Request(f"{base}/api/jobs/{job_id}/mirror?executor={executor}",
                                     data=frame, method="POST",
                                     headers={"Content-Type": "image/jpeg"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return int(reply.status)


def test_the_job_page_shows_the_live_mirror_of_a_running_host_job(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    proc = CollectorProcess(tmp_path / "mirror").start()
    try:
        assert proc.client.post("/executors/register", {"name": "lab",
                                                        "capabilities": ["soak"]})[0] == 200
        assert proc.client.post("/jobs", job("live-soak", workload="soak", executor="host",
                                             params={"app_id": "com.example"}))[0] == 201
        assert proc.client.get("/executor/next-job?name=lab")[0] == 200
        # A real JPEG: Chromium's own screenshot of a page (the collector's icon).
        frame = open_page(proc.url + "/favicon.svg").screenshot(type="jpeg", quality=60)
        page = open_page(proc.url + "/dash/jobs/live-soak", wait="#job-status >> text=claimed")
        page.wait_for_selector("#mirror-frame")
        assert post_frame(proc.url, "live-soak", "lab", frame) == 204
        page.wait_for_function(
            "() => document.querySelector('#mirror-frame').naturalWidth > 0", timeout=15000)
        shot(page, "dash-job-mirror")
        assert proc.client.post("/api/jobs/live-soak/cancel")[0] == 200
        page.wait_for_selector("#job-status >> text=cancelled")
        page.wait_for_selector("#mirror-frame", state="detached")
        assert page.watch.errors == []
    finally:
        proc.stop()


def test_legacy_pages_load_without_script(seeded: SeededCollector,
                                          open_page: Callable[..., Any]) -> None:
    page = open_page(seeded.url + LEGACY[0], wait="h1")
    for path in LEGACY:
        page.goto(seeded.url + path)
        page.wait_for_selector("h1")
        assert page.evaluate("document.scripts.length") == 0
        assert page.locator("main").count() == 1
    shot(page, "legacy-artifacts")
    page.goto(seeded.url + "/dash/legacy/jobs/selfcheck-pi")
    assert page.locator("text=the state directory is not writable (<b>x</b>)").count() >= 1
    shot(page, "legacy-job")
    page.goto(seeded.url + "/dash/legacy")
    shot(page, "legacy-overview")
    assert page.watch.errors == []


def test_cancel_from_the_job_page_and_see_it_through_the_stream(
        seeded: SeededCollector, open_page: Callable[..., Any]) -> None:
    job_id = seeded.ids.jobs["cancel"]
    page = open_page(f"{seeded.url}/dash/jobs/{job_id}", wait="#job-status >> text=queued")
    wait_live(page)
    page.click("button:has-text('Cancel job')")
    page.click("button:has-text('Yes, cancel')")
    # The page does not reload after the POST: the job event on the stream updates it.
    page.wait_for_selector("#job-status >> text=cancelled")
    # The POST's answer (the toast) and the stream's event race; wait for both.
    page.wait_for_selector(".toast >> text=was queued")
    assert page.locator(".toast >> text=was queued").count() == 1
    assert seeded.proc.client.get(f"/api/jobs/{job_id}")[1]["status"] == "cancelled"
    shot(page, "job-cancelled")

    # A change made elsewhere (another client) reaches the open page by the stream alone.
    other = "selfcheck-ipad"
    page.goto(f"{seeded.url}/dash/jobs/{other}")
    page.wait_for_selector("#job-status >> text=queued")
    wait_live(page)
    status, reply = seeded.proc.client.post(f"/api/jobs/{other}/cancel")
    assert status == 200, reply
    page.wait_for_selector("#job-status >> text=cancelled", timeout=5000)
    assert page.watch.errors == []


def test_enqueue_form_counts_matching_devices_live(seeded: SeededCollector,
                                                   open_page: Callable[..., Any]) -> None:
    client = seeded.proc.client

    def expected(body: dict[str, Any]) -> int:
        status, reply = client.post("/api/jobs/preview-targets", body)
        assert status == 200, reply
        return int(reply["count"])

    page = open_page(seeded.url + "/dash/jobs/new", wait="#match-count [data-count]")
    count = page.locator("#match-count [data-count]")
    everyone = expected({"workload": "benchmark", "backend": "synthetic"})
    assert everyone >= 3 and count.get_attribute("data-count") == str(everyone)

    page.fill("input[name=match]", "platform == 'android'")
    page.wait_for_selector("#match-count [data-count='1']")
    assert page.locator("#match-count >> text=pixel-7").count() == 1
    page.fill("input[name=match]", "ram_mb >= 8192")
    page.wait_for_selector("#match-count [data-count='2']")
    shot(page, "enqueue-matching")

    page.fill("input[name=match]", "ram_mb >=")  # not an expression: the sentence is shown
    page.wait_for_selector("#match-count .bad")
    assert "targets.match" in page.inner_text("#match-count")

    page.fill("input[name=match]", "")
    page.fill("input[name=workload]", "self-check")
    page.fill("input[name=backend]", "")
    page.wait_for_selector(f"#match-count [data-count='{expected({'workload': 'self-check'})}']")
    page.fill("input[name=job_id]", "from-the-form")
    page.fill("input[name=pool]", "sbc")
    page.wait_for_selector("#match-count [data-count='1']")
    page.click("button:has-text('Enqueue')")
    page.wait_for_url("**/dash/jobs/from-the-form")
    page.wait_for_selector("#job-status >> text=queued")
    spec = client.get("/api/jobs/from-the-form")[1]["spec"]
    assert spec["workload"] == "self-check" and spec["targets"] == {"pool": "sbc"}
    # The refused preview (the broken expression) is logged by the browser as a failed request.
    assert [e for e in page.watch.errors if "status of 400" not in e] == []


def test_guarded_collector_asks_for_the_token_and_uses_it(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_DASH_TOKEN": "s3cret-token"}).start()
    try:
        client = proc.client
        assert client.post("/devices/register", registration("d1"))[0] == 200
        assert client.post("/jobs", job("guarded-job", targets={"device_id": "d1"}))[0] == 201
        page = open_page(proc.url + "/dash/jobs/guarded-job", wait="#job-status >> text=queued")
        page.click("button:has-text('Cancel job')")
        page.click("button:has-text('Yes, cancel')")
        page.wait_for_selector(".toast.error >> text=requires X-Fleet-Token")
        assert client.get("/api/jobs/guarded-job")[1]["status"] == "queued"

        page.click(".toast.error >> text=Enter a token")
        page.wait_for_selector("text=guards dashboard changes")
        page.fill("input[name=token]", "wrong")
        page.click("button:has-text('Save token')")
        page.click("button:has-text('Test')")
        page.wait_for_selector("text=The collector refused it.")
        page.fill("input[name=token]", "s3cret-token")
        page.click("button:has-text('Save token')")
        page.click("button:has-text('Test')")
        page.wait_for_selector("text=The collector accepted it.")
        shot(page, "system-token")

        page.goto(proc.url + "/dash/jobs/guarded-job")
        page.click("button:has-text('Cancel job')")
        page.click("button:has-text('Yes, cancel')")
        page.wait_for_selector("#job-status >> text=cancelled")
        assert page.evaluate("localStorage.getItem('fleet.dashToken')") == "s3cret-token"
        # 401 and 403 answers show up as failed requests in the console; nothing else may.
        unexpected = [e for e in page.watch.errors if "status of 401" not in e
                      and "status of 403" not in e]
        assert unexpected == []
    finally:
        proc.stop()


def test_a_replaced_peer_is_pinned_again_from_the_peers_page(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    """A collector replaced at the same address (a new data directory, so a new id) is served
    under neither id until the owner says so; the peers page offers that, in two steps."""
    first = CollectorProcess(tmp_path / "first").start()
    here = CollectorProcess(tmp_path / "here", env={"FLEET_PEERS": first.url}).start()
    replacement = None
    try:
        old_id = first.client.get("/api/health")[1]["collector"]
        deadline = time.monotonic() + 10
        while here.client.get("/api/peers")[1]["peers"][0]["id"] != old_id:
            assert time.monotonic() < deadline, here.client.get("/api/peers")
            time.sleep(0.1)
        first.stop()
        replacement = CollectorProcess(tmp_path / "replacement", port=first.port).start()
        new_id = replacement.client.get("/api/health")[1]["collector"]
        [peer] = here.client.get("/api/peers?refresh=1")[1]["peers"]
        assert peer["id"] == old_id and peer["claimed"] == new_id
        page = open_page(here.url + "/dash/peers", wait=f"text=now names collector {new_id}")
        assert page.locator("text=Open read-only view").count() == 0
        page.click(f"button:has-text('Pin to {new_id}')")
        shot(page, "peers-repin")
        page.click("button:has-text('Replaced: pin the new id')")
        page.wait_for_selector(f"text={first.url} is now pinned to {new_id}.")
        page.wait_for_selector("text=Open read-only view")
        [peer] = here.client.get("/api/peers")[1]["peers"]
        assert peer["id"] == new_id and peer["reachable"] is True and peer["claimed"] is None
        assert page.watch.errors == []
    finally:
        for proc in (replacement, here, first):
            if proc is not None:
                proc.stop()


def upload(proc: CollectorProcess, data: bytes, name: str) -> dict[str, Any]:
    request = urllib.request.Request(proc.url + "/artifacts", data=data, method="POST", headers={
        "Content-Type": "application/octet-stream", "X-Artifact-Name": name})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 201
        return dict(json.loads(resp.read()))


def test_peer_view_is_read_only(tmp_path: Path, open_page: Callable[..., Any]) -> None:
    other = CollectorProcess(tmp_path / "other").start()
    here = CollectorProcess(tmp_path / "here", env={"FLEET_PEERS": other.url}).start()
    try:
        assert other.client.post("/devices/register", registration("far-away-pi"))[0] == 200
        assert other.client.post("/jobs", job("far-job", targets={"device_id": "far-away-pi"}))[
            0] == 201
        peer_id = other.client.get("/api/health")[1]["collector"]
        deadline = time.monotonic() + 10
        while here.client.get("/api/peers")[1]["peers"][0]["id"] != peer_id:
            assert time.monotonic() < deadline, here.client.get("/api/peers")
            time.sleep(0.1)
        page = open_page(here.url + "/dash/peers", wait="text=Open read-only view")
        shot(page, "peers")
        page.click("text=Open read-only view")
        page.wait_for_selector("text=Read-only view of")
        page.click("nav#nav >> text=Devices")
        page.wait_for_selector("text=far-away-pi")
        assert f"/dash/@{peer_id}/devices" in page.url
        page.click("nav#nav >> text=Jobs")
        page.wait_for_selector("td >> text=far-job")
        assert page.locator("text=Enqueue a job").count() == 0
        page.click("text=far-job")
        page.wait_for_selector("#job-status >> text=queued")
        assert page.locator("button:has-text('Cancel job')").count() == 0
        shot(page, "peer-job")
        # A peer's artifacts are listed, but their bytes are not ours to serve, and a link the
        # peer's answer names (its `url`) never reaches our page: no Download in its view.
        stored = upload(other, b"peer build", "peer.apk")
        page.goto(f"{here.url}/dash/@{peer_id}/artifacts")
        page.wait_for_selector("text=peer.apk")
        assert page.locator("a:has-text('Download')").count() == 0
        page.goto(f"{here.url}/dash/@{peer_id}/artifacts/{stored['sha256']}")
        page.wait_for_selector("text=peer.apk")
        assert page.locator("a:has-text('Download')").count() == 0
        # In our own view the button is built from the hash.
        ours = upload(here, b"our build", "ours.apk")
        page.goto(f"{here.url}/dash/artifacts")
        page.wait_for_selector("text=ours.apk")
        assert page.locator("a:has-text('Download')").get_attribute("href") == (
            f"/artifacts/{ours['sha256']}")
        assert page.watch.errors == []
    finally:
        here.stop()
        other.stop()


def test_values_and_refusals_read_as_text(seeded: SeededCollector,
                                          open_page: Callable[..., Any]) -> None:
    """What the screens build their text with never shows null, NaN or true, and a refusal
    from the collector (a phrase) reads as a sentence."""
    page = open_page(seeded.url + "/dash", wait="text=Running")
    module = page.evaluate("""() => new URL("./lib/format.js",
        document.querySelector("script[type=module]").src).href""")
    got = page.evaluate("""async (url) => {
        const f = await import(url);
        return [f.metricText({ decode_tok_s: 12.34567, mem_method: null, ok: true, bad: NaN,
                               nested: { a: 1 }, empty: "" }),
                f.num(NaN), f.num(Infinity), f.num(null),
                f.sentence("no job 'x'"), f.sentence("Refused."), f.sentence(""),
                f.relative("2026-01-01T00:00:00Z", Date.parse("2026-01-01T00:03:00Z"))];
    }""", module)
    assert got == ["bad=– · decode_tok_s=12.346 · empty=– · mem_method=– · ok=yes", "–", "–",
                   "–", "No job 'x'.", "Refused.",
                   "Something went wrong, and the collector did not say what.", "3 min ago"]
    page.goto(seeded.url + "/dash/jobs/no-such-job")
    page.wait_for_selector(".error-box >> text=No job 'no-such-job'.")
    assert page.locator(".error-box button:has-text('Retry')").count() == 0
    # The unknown job's 404 is logged by the browser as a failed request; nothing else may be.
    assert [e for e in page.watch.errors if "status of 404" not in e] == []


def test_a_job_and_a_device_named_new_open_their_own_pages(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    """`/jobs/new` and `/devices/new` are the Enqueue and Add-a-device routes, matched first: a
    job or device of id `new` linked there, and its own page was never reached. Its links now
    encode the first letter, which the router and the server decode back."""
    proc = CollectorProcess(tmp_path / "new").start()
    try:
        assert proc.client.post("/devices/register", registration("new"))[0] == 200
        assert proc.client.post("/jobs", job("new", targets={"device_id": "new"}))[0] == 201
        page = open_page(proc.url + "/dash/jobs", wait="table >> text=new")
        page.click("table a.mono:text-is('new')")
        page.wait_for_selector("#page-title:text-is('new')")
        assert page.url.endswith("/dash/jobs/%6Eew")
        page.wait_for_selector("#job-results")  # the job's page (once it loaded), not the form
        page.goto(proc.url + "/dash/devices")
        page.click("table a:text-is('new')")
        page.wait_for_selector("#page-title:text-is('new')")
        assert page.url.endswith("/dash/devices/%6Eew")
        assert page.watch.errors == []
    finally:
        proc.stop()
