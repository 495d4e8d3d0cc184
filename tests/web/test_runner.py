"""The browser runner page (/runner) in headless Chromium against a live collector: once Start is
pressed it enrols as a temporary web device, runs synthetic benchmarks with both browser
backends, and posts a summary whose attestation digest equals the reference (decisions.md, and
computed here with hashlib); it stops claiming while hidden and hands back a job it claimed too
late."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.collector import CollectorProcess, HttpClient, job
from tests.support.browser import shot

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
