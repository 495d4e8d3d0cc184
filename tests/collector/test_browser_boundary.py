"""No web page elsewhere can read or drive a collector on the user's machine or LAN.

- DNS rebinding: a request whose Host is not an IP address, localhost, this machine's name or a
  name in FLEET_ALLOWED_HOSTS gets 421 with a sentence naming the setting.
- Cross-site writes: a change (POST, PUT, PATCH, DELETE) from a page of another origin is 403,
  and a body of a type any page can send without a preflight (text/plain, form, multipart, or
  none) is 415, so a page cannot enqueue, register or post results with a "simple" request.
- Claims, which the agents' protocol makes GETs: one asked for by another page (Sec-Fetch-Site
  other than same-origin or none, a foreign Origin or Referer) is 403, so an `<img>` cannot
  take a device's job.

Real collector processes over real HTTP, and headless Chromium running the attacks: a page on
another site posting to the collector, and a page whose own name is rebound to 127.0.0.1.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import raw_http
from tests.support.browser import chromium, page_server
from tests.support.collector import CollectorProcess, job, registration

pytestmark = pytest.mark.slow

ATTACKER = "attacker.test"  # another site: Chromium resolves it to this machine (see below)
REBOUND = "rebind.test"  # a name an attacker pointed at 127.0.0.1 after serving its page
RESOLVE = f"--host-resolver-rules=MAP {ATTACKER} 127.0.0.1, MAP {REBOUND} 127.0.0.1"
# Chromium alone stops a page it took for a public one from reaching a loopback address (Local
# Network Access); Firefox and Safari have no such check, so the browser here plays one of those.
NO_LOCAL_NETWORK_CHECK = ("--disable-features=LocalNetworkAccessChecks,"
                          "BlockInsecurePrivateNetworkRequests,PrivateNetworkAccessSendPreflights")
SETTING = "add it to FLEET_ALLOWED_HOSTS"


def ask(port: int, method: str, path: str, headers: dict[str, str] | None = None,
        body: bytes | None = None, host: str | None = None) -> tuple[int, Any]:
    return raw_http.ask(f"http://127.0.0.1:{port}", method, path, headers, body, host)


JSON = {"Content-Type": "application/json"}


def as_json(value: Any) -> bytes:
    return json.dumps(value).encode()


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProcess]:
    root = tmp_path_factory.mktemp("boundary")
    proc = CollectorProcess(root / "data", env={
        "FLEET_ALLOWED_HOSTS": "collector.lan, *.fleet.test"}).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium([RESOLVE, NO_LOCAL_NETWORK_CHECK]) as chromium_browser:
        yield chromium_browser


def job_status(proc: CollectorProcess, job_id: str) -> str | None:
    status, body = proc.client.get(f"/jobs/{job_id}")
    return body["status"] if status == 200 else None


def device_ids(proc: CollectorProcess) -> set[str]:
    return {d["device_id"] for d in proc.client.get("/api/devices")[1]["devices"]}


# -- Host ------------------------------------------------------------------------------------


def test_names_the_collector_answers_to(collector: CollectorProcess) -> None:
    port = collector.port
    own = socket.gethostname().lower()
    short = own.split(".")[0]
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"[::1]:{port}", f"localhost:{port}",
                 "LOCALHOST.", f"dash.localhost:{port}", f"{own}:{port}", short, f"{short}.local",
                 f"collector.lan:{port}", "Collector.LAN", f"pi.fleet.test:{port}",
                 "a.b.fleet.test", "192.168.1.20:8788", "[fd7a:115c:a1e0::1]:8788"):
        assert ask(port, "GET", "/api/health", host=host)[0] == 200, host


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8788", "fleet.test",
                                  "collector.lan.evil.example", "localhost.evil.example",
                                  "127.0.0.1.nip.io"])
def test_other_names_are_misdirected(collector: CollectorProcess, host: str) -> None:
    status, body = ask(collector.port, "GET", "/api/devices", host=host)
    name = host.split(":")[0]
    assert status == 421
    assert body == {"error": f"this collector does not answer to the name '{name}'; {SETTING} "
                             "if agents or browsers reach it by that name"}


def test_a_misdirected_change_changes_nothing(collector: CollectorProcess) -> None:
    status, _ = ask(collector.port, "POST", "/jobs", JSON, as_json(job("rebound")),
                    host="evil.example")
    assert status == 421
    assert job_status(collector, "rebound") is None


def test_a_request_without_host_is_answered(collector: CollectorProcess) -> None:
    with socket.create_connection(("127.0.0.1", collector.port), timeout=30) as sock:
        sock.sendall(b"GET /api/health HTTP/1.0\r\n\r\n")
        head = sock.recv(200)
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head


@pytest.mark.parametrize("host", ["evil.example:port", "[evil.example]", "a b", "::1",
                                  "x:99999", "evil.example/x", "user@evil.example"])
def test_a_malformed_host_is_a_400(collector: CollectorProcess, host: str) -> None:
    status, body = ask(collector.port, "GET", "/api/health", host=host)
    assert status == 400 and "Host header" in body["error"]


# -- body types --------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          " Text/Plain ; charset=utf-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_bodies_a_page_can_send_anywhere_are_refused(collector: CollectorProcess,
                                                     content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type is not None else {}
    for path, body in (("/jobs", job("simple")), ("/devices/register", registration("simple")),
                       ("/results", {"schema": 1, "kind": "beacon", "device_id": "simple",
                                     "beacon": {}})):
        status, reply = ask(collector.port, "POST", path, headers, as_json(body))
        assert status == 415, (path, content_type, reply)
        assert "send the body as application/json" in reply["error"]
    assert job_status(collector, "simple") is None
    assert "simple" not in device_ids(collector)


def test_json_scripts_and_bodiless_ticks_keep_working(collector: CollectorProcess) -> None:
    assert ask(collector.port, "POST", "/jobs", JSON, as_json(job("scripted")))[0] == 201
    assert ask(collector.port, "POST", "/jobs", {"Content-Type": "application/json; charset=utf-8"},
               as_json(job("scripted-2")))[0] == 201
    assert ask(collector.port, "POST", "/jobs/sweep")[0] == 200
    assert ask(collector.port, "POST", "/jobs/sweep", body=b"")[0] == 200


def test_artifact_uploads_keep_their_binary_type(collector: CollectorProcess) -> None:
    octets = {"Content-Type": "application/octet-stream"}
    assert ask(collector.port, "POST", "/artifacts", octets, b"a build")[0] == 201
    for refused in ({"Content-Type": "text/plain"}, {}):
        status, reply = ask(collector.port, "POST", "/artifacts", refused, b"a build")
        assert status == 415 and "application/octet-stream" in reply["error"], reply


def test_uploads_and_mirror_frames_take_no_content_encoding(collector: CollectorProcess) -> None:
    """Stored or relayed as the bytes that arrive: one gzip megabyte inflated on the way in
    stored a gigabyte. Refused before the body is read, and nothing is stored."""
    port = collector.port
    bomb = gzip.compress(bytes(8 << 20), compresslevel=1)  # 8 MiB of zeros in ~8 KiB
    stored = hashlib.sha256(bytes(8 << 20)).hexdigest()
    for encoding in ("gzip", "deflate", "GZIP, identity"):
        status, reply = ask(port, "POST", "/artifacts", {
            "Content-Type": "application/octet-stream", "Content-Encoding": encoding}, bomb)
        assert status == 415 and "Content-Encoding" in reply["error"], (encoding, reply)
        status, reply = ask(port, "POST", "/api/jobs/any/mirror?executor=lab", {
            "Content-Type": "image/jpeg", "Content-Encoding": encoding}, bomb)
        assert status == 415 and "Content-Encoding" in reply["error"], (encoding, reply)
    # Two lines: aiohttp's parser inflates by the last, so each one counts.
    for path, kind in (("/artifacts", "application/octet-stream"),
                       ("/api/jobs/any/mirror?executor=lab", "image/jpeg")):
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {kind}\r\n"
                "Content-Encoding: identity\r\nContent-Encoding: gzip\r\n"
                f"Content-Length: {len(bomb)}\r\nConnection: close\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(head + bomb)
            answer = sock.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 415"), (path, answer[:300])
    assert ask(port, "GET", f"/artifacts/{stored}")[0] == 404
    plain = {"Content-Type": "application/octet-stream", "Content-Encoding": "identity"}
    assert ask(port, "POST", "/artifacts", plain, b"a build, plain")[0] == 201


def first_line_of_upload(port: int, host: str, content_type: str) -> bytes:
    """A 10 GiB upload that asks before sending its body (Expect: 100-continue, as curl does
    for large files): the first line the collector answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST /artifacts HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}"
                     f"\r\nContent-Length: {10 << 30}\r\nExpect: 100-continue\r\n\r\n".encode())
        return sock.makefile("rb").readline()


def test_a_refused_upload_is_refused_before_its_body_is_invited(
        collector: CollectorProcess) -> None:
    port = collector.port
    assert first_line_of_upload(port, "evil.example", "application/octet-stream").startswith(
        b"HTTP/1.1 421")
    assert first_line_of_upload(port, f"127.0.0.1:{port}", "text/plain").startswith(
        b"HTTP/1.1 415")
    # the limit still answers first for a name it answers to (10 GiB is past the 4 GiB default)
    assert first_line_of_upload(port, f"127.0.0.1:{port}", "application/octet-stream"
                                ).startswith(b"HTTP/1.1 413")


# -- Origin ------------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{"Origin": "http://evil.example"},
                                     {"Origin": "null"},
                                     {"Origin": "http://127.0.0.1:1"},
                                     {"Origin": "http://127.0.0.1"},
                                     {"Origin": "http://localhost:{port}"},
                                     {"Sec-Fetch-Site": "cross-site"}])
def test_a_foreign_origin_cannot_change_anything(collector: CollectorProcess,
                                                 headers: dict[str, str]) -> None:
    port = collector.port
    headers = {k: v.format(port=port) for k, v in headers.items()}
    assert ask(port, "POST", "/devices/register", JSON, as_json(registration("victim")))[0] == 200
    assert ask(port, "POST", "/jobs", JSON, as_json(job("queued")))[0] in (201, 409)
    attempts = [("POST", "/jobs", as_json(job("foreign"))), ("POST", "/jobs/sweep", None),
                ("POST", "/api/jobs/queued/cancel", None),
                ("PATCH", "/api/devices/victim", as_json({"name": "owned"})),
                ("DELETE", "/api/devices/victim", None),
                ("POST", "/devices/register", as_json(registration("foreign")))]
    for method, path, body in attempts:
        status, reply = ask(port, method, path, {**JSON, **headers}, body)
        assert status == 403 and "another site" in reply["error"], (method, path, reply)
    assert job_status(collector, "foreign") is None
    assert job_status(collector, "queued") == "queued"
    assert "victim" in device_ids(collector) and "foreign" not in device_ids(collector)
    # A page cannot read an answer (no CORS grant), but it could still make every visitor's
    # browser ask for listings: API reads are refused too, all but the health check.
    assert ask(port, "GET", "/api/health", headers)[0] == 200
    for path in ("/api/jobs", "/api/devices", "/api/stream"):
        status, reply = ask(port, "GET", path, headers)
        assert status == 403 and "another site" in reply["error"], (path, reply)


def test_the_same_origin_may_change_things(collector: CollectorProcess) -> None:
    port = collector.port
    # A TLS proxy that keeps Host: the page is https://name, Host is the bare name.
    for index, (origin, host) in enumerate((
            (f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"),
            (f"http://localhost:{port}", f"localhost:{port}"),
            (f"http://[::1]:{port}", f"[::1]:{port}"),
            ("https://collector.lan", "collector.lan"),
            ("http://collector.lan", "collector.lan:80"),
            ("https://pi.fleet.test", "PI.fleet.test:443"))):
        status, _ = ask(port, "POST", "/jobs", {**JSON, "Origin": origin,
                                                "Sec-Fetch-Site": "same-origin"},
                        as_json(job(f"same-origin-{index}")), host=host)
        assert status == 201, origin


# -- claims, which are GETs -------------------------------------------------------------------

# What browsers send with a GET another page asked for: an <img>, a link, a no-cors fetch.
PAGE_ASKED = [{"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors",
               "Sec-Fetch-Dest": "image", "Referer": "https://evil.example/"},
              {"Sec-Fetch-Site": "same-site"},  # a page on another port of this host, too
              {"Origin": "http://evil.example"}, {"Origin": "null"},
              {"Referer": "http://evil.example/cats.html"},  # a browser with no Sec-Fetch-*
              {"Referer": "http://127.0.0.1:1/"},
              {"Sec-Fetch-Site": "same-origin", "Origin": "http://evil.example"}]


def executor_names(proc: CollectorProcess) -> set[str]:
    return {e["name"] for e in proc.client.get("/api/executors")[1]["executors"]}


def test_a_page_elsewhere_cannot_claim_a_job_with_a_get(collector: CollectorProcess) -> None:
    """The agents' protocol claims with GET, and a browser sends a page's GET with no Origin:
    the boundary reads Sec-Fetch-Site, Origin and Referer on the two claiming routes."""
    port = collector.port
    assert ask(port, "POST", "/devices/register", JSON, as_json(registration("claimed")))[0] == 200
    assert ask(port, "POST", "/jobs", JSON, as_json(
        job("pinned-claim", targets={"device_id": "claimed"}, priority=1000)))[0] == 201
    for headers in PAGE_ASKED:
        for path in ("/devices/claimed/next-job", "/executor/next-job?name=page-exec&slots=64"):
            status, reply = ask(port, "GET", path, headers)
            assert status == 403 and "another site" in reply["error"], (headers, path, reply)
    assert job_status(collector, "pinned-claim") == "queued"
    assert "page-exec" not in executor_names(collector)
    # The collector's own pages (the runner page polls), an address typed by the person, and
    # agents, which send none of these headers, claim as before.
    own = {"Sec-Fetch-Site": "same-origin", "Referer": f"http://127.0.0.1:{port}/runner"}
    status, claimed = ask(port, "GET", "/devices/claimed/next-job", own)
    assert status == 200 and claimed["job_id"] == "pinned-claim"
    assert ask(port, "GET", "/executor/next-job?name=typed&slots=1",
               {"Sec-Fetch-Site": "none"})[0] in (200, 204)
    assert "typed" in executor_names(collector)


def test_a_page_elsewhere_cannot_make_the_originals_reads_or_hold_its_long_poll(
        collector: CollectorProcess) -> None:
    """The original's JSON reads outside /api/ follow the /api/ reads' rule: a page elsewhere
    could not read them, but could hold a topic's long poll open from every visitor."""
    port = collector.port
    assert ask(port, "POST", "/jobs", JSON, as_json(job("read-me")))[0] == 201
    reads = ("/events/page-topic/poll?wait_s=3", "/jobs/read-me", "/schedules",
             "/status-reports")
    for headers in PAGE_ASKED:
        for path in reads:
            started = time.monotonic()
            status, reply = ask(port, "GET", path, headers)
            assert status == 403 and "another site" in reply["error"], (headers, path, reply)
            assert time.monotonic() - started < 2.5, path  # refused, not held for its wait
    # Agents and scripts (no page headers), the collector's own pages and a typed address
    # read them as before.
    own = {"Sec-Fetch-Site": "same-origin", "Referer": f"http://127.0.0.1:{port}/dash"}
    for headers in ({}, own, {"Sec-Fetch-Site": "none"}):
        assert ask(port, "GET", "/jobs/read-me", headers)[0] == 200, headers
        assert ask(port, "GET", "/status-reports", headers)[0] == 200, headers
        assert ask(port, "GET", "/events/page-topic/poll?wait_s=0", headers)[0] in (200, 204)


# -- Chromium ----------------------------------------------------------------------------------

ATTACK_PAGE = """<!doctype html><title>cats</title><script>
const target = "__TARGET__";
const spec = (id) => JSON.stringify({schema: 1, job_id: id, workload: "benchmark",
                                     executor: "device", backend: "synthetic"});
async function attempt(name, path, init) {
  try { await fetch(target + path, {mode: "no-cors", ...init}); return [name, "sent"]; }
  catch (e) { return [name, "blocked"]; }
}
window.attack = async () => Object.fromEntries([
  await attempt("text", "/jobs", {method: "POST", body: spec("page-text")}),
  await attempt("form", "/devices/register", {method: "POST", body: new URLSearchParams(
      {device_id: "page-form"})}),
  await attempt("blob", "/jobs", {method: "POST", body: new Blob([spec("page-blob")])}),
  await attempt("sweep", "/jobs/sweep", {method: "POST"}),
  await attempt("cancel", "/api/jobs/victim/cancel", {method: "POST"}),
  await attempt("json", "/jobs", {mode: "cors", method: "POST", body: spec("page-json"),
                                  headers: {"Content-Type": "application/json"}}),
]);
</script>
<form id="forged" method="post" enctype="text/plain" action="__TARGET__/jobs">
<input name='{"schema": 1, "job_id": "page-form-post", "workload": "benchmark",
 "executor": "device", "backend": "synthetic", "pad": "' value='"}'>
</form>"""


def test_a_page_on_another_site_cannot_drive_the_collector(collector: CollectorProcess,
                                                          browser: Any) -> None:
    assert collector.client.post("/jobs", job("victim"))[0] in (201, 409)
    page_html = ATTACK_PAGE.replace("__TARGET__", collector.url)
    with page_server({"/": page_html}) as port:
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(f"http://{ATTACKER}:{port}/")
            outcomes = page.evaluate("window.attack()")
            # no-cors requests leave the browser (the page only cannot read the answer); the
            # JSON one needs a preflight the collector never grants, so it never leaves.
            assert outcomes == {"text": "sent", "form": "sent", "blob": "sent", "sweep": "sent",
                                "cancel": "sent", "json": "blocked"}, outcomes
            with page.expect_navigation():
                page.evaluate("document.getElementById('forged').submit()")
            assert "another site" in page.content()
        finally:
            context.close()
    for job_id in ("page-text", "page-blob", "page-json", "page-form-post"):
        assert job_status(collector, job_id) is None, job_id
    assert job_status(collector, "victim") == "queued"
    assert "page-form" not in device_ids(collector)


CLAIM_PAGE = """<!doctype html><title>cats</title><script>
const target = "__TARGET__";
const load = (src) => new Promise((done) => {
  const img = new Image(); img.onload = img.onerror = () => done(); img.src = src; });
window.attack = async () => {
  await load(target + "/devices/img-victim/next-job");
  await fetch(target + "/executor/next-job?name=page-exec&slots=64", {mode: "no-cors"})
    .catch(() => null);
  return "done";
};
</script>"""


def test_a_page_on_another_site_cannot_claim_through_an_image(collector: CollectorProcess,
                                                              browser: Any) -> None:
    port = collector.port
    assert ask(port, "POST", "/devices/register", JSON,
               as_json(registration("img-victim")))[0] == 200
    assert ask(port, "POST", "/jobs", JSON, as_json(
        job("img-pinned", targets={"device_id": "img-victim"})))[0] == 201
    with page_server({"/": CLAIM_PAGE.replace("__TARGET__", collector.url)}) as page_port:
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(f"http://{ATTACKER}:{page_port}/")
            assert page.evaluate("window.attack()") == "done"
        finally:
            context.close()
    assert job_status(collector, "img-pinned") == "queued"
    assert "page-exec" not in executor_names(collector)


REBIND_PAGE = """<!doctype html><title>cats</title><script>
window.attack = async () => {
  const read = await fetch("/api/devices");
  const write = await fetch("/jobs", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({schema: 1, job_id: "rebound-page", workload: "benchmark",
                          executor: "device", backend: "synthetic"})});
  return {read: read.status, body: await read.text(), write: write.status};
};
</script>"""


def rebinding_attack(browser: Any, port: int) -> dict[str, Any]:
    """The page an attacker served at http://rebind.test:<port>/ (its first answer), and then
    that page's own requests, which now reach the collector: the name resolves to 127.0.0.1,
    so to the browser they are same-origin and the page may read every answer."""
    context = browser.new_context()
    try:
        context.route(f"http://{REBOUND}:{port}/attack.html",
                      lambda route: route.fulfill(status=200, body=REBIND_PAGE,
                                                  content_type="text/html"))
        page = context.new_page()
        page.goto(f"http://{REBOUND}:{port}/attack.html")
        result: dict[str, Any] = page.evaluate("window.attack()")
        return result
    finally:
        context.close()


def test_a_rebound_name_cannot_read_or_drive_the_collector(collector: CollectorProcess,
                                                          browser: Any) -> None:
    outcome = rebinding_attack(browser, collector.port)
    assert outcome["read"] == 421 and outcome["write"] == 421, outcome
    assert f"'{REBOUND}'; {SETTING}" in outcome["body"]
    assert "devices" not in json.loads(outcome["body"])
    assert job_status(collector, "rebound-page") is None


def test_a_name_in_the_setting_is_answered_through_the_browser(tmp_path: Path,
                                                               browser: Any) -> None:
    # The same page and requests against a collector that lists the name: they go through,
    # so the refusal above is the Host check's and not the browser's or the test's doing.
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_ALLOWED_HOSTS": REBOUND}).start()
    try:
        outcome = rebinding_attack(browser, proc.port)
        assert outcome["read"] == 200 and outcome["write"] == 201, outcome
        assert job_status(proc, "rebound-page") == "queued"
    finally:
        proc.stop()


def test_the_collectors_own_pages_still_change_things(collector: CollectorProcess,
                                                      browser: Any) -> None:
    context = browser.new_context()
    try:
        page = context.new_page()
        for index, base in enumerate((collector.url, f"http://localhost:{collector.port}")):
            page.goto(base + "/dash/legacy")
            status = page.evaluate("""async (id) => (await fetch("/jobs", {method: "POST",
                headers: {"Content-Type": "application/json"},
                body: JSON.stringify({schema: 1, job_id: id, workload: "benchmark",
                                      executor: "device", backend: "synthetic"})})).status""",
                                   f"own-page-{index}")
            assert status == 201, base
    finally:
        context.close()
