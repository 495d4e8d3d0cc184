"""URLs a hostile job names, against the agent's address rule, its host executor's adb and its
Chromium. The browser and the collector are real processes; adb is a fake executable that does
what real adb does with `shell` (joins its arguments into one line and gives it to the device's
sh), its "device" a scratch folder."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.agent import WebSite, http_bytes, make_tool

# --- the address rule: IPv6 forms that carry a private IPv4 address ---

REFUSED = [
    "127.0.0.1", "169.254.169.254", "::1", "::ffff:169.254.169.254",
    "64:ff9b::a9fe:a9fe",  # NAT64 (well-known prefix) of 169.254.169.254
    "64:ff9b::c0a8:101",  # NAT64 of 192.168.1.1
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b:1::808:808",  # local-use NAT64 (RFC 8215): refused whatever it carries
    "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
    "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "2001:0:c0a8:101::1",  # Teredo
    "::127.0.0.1", "::a9fe:a9fe", "::8.8.8.8",  # IPv4-compatible (deprecated)
    "::ffff:0:7f00:1", "::ffff:0:c0a8:101",  # IPv4-translated
]
ALLOWED = ["8.8.8.8", "2606:4700:4700::1111", "64:ff9b::808:808", "2002:808:808::1",
           "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", REFUSED)
def test_private_ipv4_inside_ipv6_is_refused(fa, address):
    assert fa.address_allowed(address, False) is False
    assert fa.address_allowed(address, True) is True  # the owner's --allow-private-urls


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_stay_allowed(fa, address):
    assert fa.address_allowed(address, False) is True


def test_an_ipv6_literal_url_is_fetched(fa):
    """web-unfurl's fetch of http://[::ffff:127.0.0.1]:port/ (allowed by the owner) reaches the
    page; http.client took what follows a bare IPv6 host's last colon for a port, so this ended
    in InvalidURL ("nonnumeric port") before any connection."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = b"<html><title>six</title></html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://[::ffff:127.0.0.1]:{server.server_address[1]}/"
        hops, body, _ = fa.fetch_chain(url, 10, True)
        assert [h["status"] for h in hops] == [200] and b"<title>six</title>" in body
        with pytest.raises(PermissionError):  # and without the owner's leave, refused
            fa.fetch_chain(url, 10, False)
    finally:
        server.shutdown()
        server.server_close()


# --- adb: what a job's text becomes on the phone's shell ---

# adb as the real one treats `shell`: the words after it joined with spaces, unquoted, and run
# by the device's sh (here: sh in the device's scratch folder, with the device's commands first
# on its PATH). Every argv is kept, and so is each line the "device" ran.
HOSTILE_ADB = r"""
import subprocess
root = os.environ["HOSTILE_DEVICE"]
args = sys.argv[1:]
with open(os.path.join(root, "adb-argv.jsonl"), "a") as log:
    log.write(json.dumps(args) + "\n")
if args[:2] == ["devices", "-l"]:
    print("List of devices attached")
    print("HOSTILE01              device product:x model:Pixel_7 device:x transport_id:1")
    print()
    sys.exit(0)
if args[:2] != ["-s", "HOSTILE01"]:
    print("adb: device not found", file=sys.stderr)
    sys.exit(1)
rest = args[2:]
if rest[:1] == ["shell"]:
    line = " ".join(rest[1:])
    with open(os.path.join(root, "shell-lines.txt"), "a") as log:
        log.write(line + "\n")
    env = dict(os.environ, PATH=os.path.join(root, "bin") + os.pathsep + "/usr/bin:/bin")
    sys.exit(subprocess.call(["sh", "-c", line], cwd=os.path.join(root, "sdcard"), env=env))
if rest[:3] == ["exec-out", "screencap", "-p"]:
    sys.stdout.buffer.write(b"\x89PNG\r\n\x1a\nscreen")
    sys.exit(0)
sys.exit(0)
"""

# The device's own commands: each keeps the argv it was given (as the device's sh split it).
DEVICE_AM = r"""
with open(os.path.join(os.environ["HOSTILE_DEVICE"], "am.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\n")
if "-W" in sys.argv:
    print("Status: ok")
    print("TotalTime: 120")
"""
DEVICE_CMD = r"""
if sys.argv[1:4] == ["package", "resolve-activity", "--brief"]:
    print("priority=0 preferredOrder=0 match=0x108000 specificIndex=-1 isDefault=true")
    print(sys.argv[-1] + "/.Main$Launcher")  # a nested class: Java names may hold a $
"""
DEVICE_GETPROP = r"""
print("[ro.product.model]: [Pixel 7]")
print("[ro.build.version.release]: [14]")
"""

INJECTING_URLS = [
    # the reviewer's: `;` ends am's line, then id and uname run with their output in a file
    "https://example.com/;id>pwned-by-job.txt;echo${IFS}$(uname${IFS}-a)>>pwned-by-job.txt",
    # ; $ ( ) ' & are a URL's own characters, kept as they are: encoding alone stops nothing
    "https://example.com/a;touch$IFS'pwned-semicolon';b?q=$(touch$IFS'pwned-subst')"
    "&r=1|touch$IFS'pwned-pipe'&&touch$IFS'pwned-and'",
]
# What am is given instead: the URL itself, one word (re-encoded where a URL must be).
AS_GIVEN = [
    "https://example.com/;id%3Epwned-by-job.txt;echo$%7BIFS%7D$(uname$%7BIFS%7D-a)%3E%3E"
    "pwned-by-job.txt",
    "https://example.com/a;touch$IFS'pwned-semicolon';b?q=$(touch$IFS'pwned-subst')"
    "&r=1%7Ctouch$IFS'pwned-pipe'&&touch$IFS'pwned-and'",
]


def hostile_device(tmp_path: Path) -> tuple[Path, dict]:
    """The fake adb on PATH and its device folder; the executor's environment."""
    root = tmp_path / "device"
    (root / "sdcard").mkdir(parents=True)
    bin_dir = tmp_path / "fake-bin"
    make_tool(bin_dir, "adb", HOSTILE_ADB)
    make_tool(root / "bin", "am", DEVICE_AM)
    make_tool(root / "bin", "cmd", DEVICE_CMD)
    make_tool(root / "bin", "getprop", DEVICE_GETPROP)
    make_tool(root / "bin", "input", "")
    env = {"HOSTILE_DEVICE": str(root), "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"}
    return root, env


def host_job(job_id: str, workload: str, **fields) -> dict:
    return {"schema": 1, "job_id": job_id, "workload": workload, "executor": "host", **fields}


def jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_web_shots_url_runs_nothing_on_the_phone(procs, tmp_path):
    """web-shots' android-device profile opens the job's URL with `adb shell am start -d URL`:
    the URL reaches am as one word, and none of the commands in it runs on the device."""
    root, env = hostile_device(tmp_path)
    collector = procs.collector()
    jobs = [host_job(f"shots-{n}", "web-shots", targets={"url": url},
                     params={"browser": ["android-device"], "settle_s": 0})
            for n, url in enumerate(INJECTING_URLS)]
    for spec in jobs:
        collector.enqueue(spec)
    procs.agent([collector], "host", "--executor", "host", "--name", "shelf", env=env)
    final = {spec["job_id"]: collector.wait_status(spec["job_id"], ("done", "failed"), 60)
             for spec in jobs}

    assert sorted(p.name for p in (root / "sdcard").iterdir()) == []  # nothing was written
    opened = [argv for argv in jsonl(root / "am.jsonl") if "-d" in argv]
    assert sorted(opened) == sorted(["start", "-a", "android.intent.action.VIEW", "-d", url]
                                    for url in AS_GIVEN)
    for spec in jobs:  # and the screenshot was still taken
        assert final[spec["job_id"]]["status"] == "done", final[spec["job_id"]]


@pytest.mark.slow
def test_an_activity_name_with_a_dollar_reaches_am_as_it_is(procs, tmp_path):
    """cold-start launches the component the device names (`cmd package resolve-activity`);
    a nested class's `$` is quoted for the device's shell, not expanded by it."""
    root, env = hostile_device(tmp_path)
    collector = procs.collector()
    collector.enqueue(host_job("cold", "cold-start", targets={"device_id": "HOSTILE01"},
                               params={"app_id": "com.example.shop", "launches": 1}))
    procs.agent([collector], "host", "--executor", "host", "--name", "shelf", env=env)
    assert collector.wait_status("cold", ("done", "failed"), 60)["status"] == "done"
    launched = [argv for argv in jsonl(root / "am.jsonl") if "-n" in argv]
    assert launched and all(argv[-1] == "com.example.shop/.Main$Launcher" for argv in launched)


def test_web_urls_are_checked_and_re_encoded(fa):
    web = fa.web_url
    assert web({"targets": {"url": "https://shop.test/a?b=1&c=2#top"}}) == \
        "https://shop.test/a?b=1&c=2#top"
    assert web({"targets": {"url": 'http://shop.test/<a\\href="x">`id`{x}|^'}}) == \
        "http://shop.test/%3Ca%5Chref=%22x%22%3E%60id%60%7Bx%7D%7C%5E"
    assert web({"targets": {"url": "http://shop.test/caf\u00e9"}}) == \
        "http://shop.test/caf%C3%A9"
    assert web({"targets": {"url": "http://[::1]:8080/"}}) == "http://[::1]:8080/"
    for bad in ("http://shop.test/a b", "http://shop.test/\n", "http://user:pw@shop.test/",
                "http://sh$op.test/", "http://a;b/", "http://shop.test:99999/", "http:///x",
                "http://caf\u00e9.test/", "http://127.0.0.%31/"):
        with pytest.raises(fa.Refusal):
            web({"targets": {"url": bad}})


# --- the executor's Chromium: no way to this machine or its LAN ---

SECRET = b"SecretAccessKey=wJalrXUtnFEMI-K7MDENG-bPxRfiCY"
PUBLIC_NAME = "public.test"
PUBLIC_ADDRESS = "93.184.216.34"  # any global address: connections to it are made locally


@pytest.fixture
def secret_site():
    """The loopback-only page a job wants: what a cloud metadata service or a router's admin
    page is to a machine."""
    site = WebSite({"/latest/meta-data/iam/security-credentials/role.json":
                 (200, b"<html><body>" + SECRET + b"</body></html>",
                  {"content-type": "text/html", "access-control-allow-origin": "*"})})
    yield site
    site.close()


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or \
        shutil.which("google-chrome")
    if not found:
        pytest.skip("no Chromium on this machine")
    return found


def browser_jobs(prefix: str, url: str) -> list[dict]:
    return [host_job(f"{prefix}-test", "web-test", targets={"url": url},
                     params={"browser": "chromium"}),
            host_job(f"{prefix}-shots", "web-shots", targets={"url": url},
                     params={"browser": ["chromium"], "settle_s": 0}),
            host_job(f"{prefix}-audit", "web-audit", targets={"url": url},
                     params={"settle_s": 0, "timeout_s": 30})]


def artifacts_of(collector, job_id: str) -> list[bytes]:
    return [http_bytes(f"{collector.url}/artifacts/{sha}")
            for row in collector.results(job_id) for sha in row.get("artifacts") or []]


@pytest.mark.slow
@pytest.mark.browser
def test_a_browser_job_naming_a_loopback_page_is_refused(procs, tmp_path, secret_site):
    """web-test, web-shots and web-audit refuse a page on this machine by its loopback address,
    by localhost and by an IPv4-mapped IPv6 literal: the real Chromium never asks for it."""
    browser = chromium()
    collector = procs.collector()
    path = "/latest/meta-data/iam/security-credentials/role.json"
    port = secret_site.port
    jobs = [*browser_jobs("loop", f"http://127.0.0.1:{port}{path}"),
            *browser_jobs("name", f"http://localhost:{port}{path}"),
            *browser_jobs("mapped", f"http://[::ffff:7f00:1]:{port}{path}")]
    for spec in jobs:
        collector.enqueue(spec)
    procs.agent([collector], "host", "--executor", "host", "--name", "shelf", "--chromium",
                browser)
    for spec in jobs:
        job = collector.wait_status(spec["job_id"], ("done", "failed"), 120)
        assert job["status"] == "failed", job
        assert "a private or local address" in job["last_error"], job
        assert "--allow-private-urls" in job["last_error"]
        assert not any(SECRET in blob for blob in artifacts_of(collector, spec["job_id"]))
    assert secret_site.hits == []


PUBLIC_LOOKUP = """\
import socket

# {name} is a public web site at {address}, served from 127.0.0.1 on this machine: the name
# resolves to that global address, and a connection to it is made to 127.0.0.1 instead.
_lookup = socket.getaddrinfo
_connect = socket.socket.connect


def _getaddrinfo(host, port, *args, **kwargs):
    if isinstance(host, str) and host.lower() == {name!r}:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                 ({address!r}, int(port)))]
    return _lookup(host, port, *args, **kwargs)


def _connect_to(self, address):
    if isinstance(address, tuple) and address[0] == {address!r}:
        address = ("127.0.0.1", address[1])
    return _connect(self, address)


socket.getaddrinfo = _getaddrinfo
socket.socket.connect = _connect_to
"""

# The browser's view of the same: Chromium resolves the name itself when it has no proxy.
BROWSER_LOOKUP = """
os.execv({chromium!r}, [{chromium!r}, "--host-resolver-rules=MAP {name} 127.0.0.1",
                        *sys.argv[1:]])
"""


@pytest.mark.slow
@pytest.mark.browser
def test_a_public_page_cannot_lead_the_browser_to_a_private_one(procs, tmp_path, secret_site):
    """A page on a public address that redirects to a loopback page, or loads one in a frame,
    an image or a fetch(), gets nothing from it: Chromium's every request goes through the
    agent's guard, which refuses private and local addresses as web-unfurl does.

    This machine has no public web site of its own, so one is made: public.test resolves to a
    global address in the executor (a sitecustomize module replaces only the name lookup and
    the connect to that address) and to the same local server in its Chromium (a
    --host-resolver-rules wrapper, which matters only to a Chromium that resolves names
    itself)."""
    browser = chromium()
    secret = f"http://127.0.0.1:{secret_site.port}/latest/meta-data/iam/security-credentials/" \
        "role.json"
    page = textwrap.dedent(f"""\
        <!doctype html><html lang="en"><head><title>Public</title></head><body>
        <p>a public page</p>
        <iframe title="frame" src="{secret}?frame"></iframe>
        <img alt="pixel" src="{secret.replace('127.0.0.1', 'localhost')}?img">
        <pre id="out"></pre>
        <script>fetch("{secret}?fetch").then(r => r.text()).then(
          t => {{ document.getElementById("out").textContent = t; }}, () => {{}});</script>
        </body></html>""").encode()
    public = WebSite({"/redirect": (302, b"", {"location": secret}),
                   "/page": (200, page, {"content-type": "text/html"}),
                   "/plain": (200, b"<!doctype html><html lang=en><head><title>Plain</title>"
                              b"</head><body><p>a plain public page</p></body></html>",
                              {"content-type": "text/html"})})
    try:
        folder = tmp_path / "public-lookup"
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(PUBLIC_LOOKUP.format(
            name=PUBLIC_NAME, address=PUBLIC_ADDRESS))
        wrapper = make_tool(tmp_path / "browser", "chromium",
                            BROWSER_LOOKUP.format(chromium=browser, name=PUBLIC_NAME))
        base = f"http://{PUBLIC_NAME}:{public.port}"
        jobs = [host_job("plain", "web-test", targets={"url": base + "/plain"},
                         params={"browser": "chromium", "expect_text": "a plain public page"}),
                *browser_jobs("redirect", base + "/redirect"),
                *browser_jobs("page", base + "/page")]
        collector = procs.collector()
        for spec in jobs:
            collector.enqueue(spec)
        procs.agent([collector], "host", "--executor", "host", "--name", "shelf",
                    "--chromium", str(wrapper), env={"PYTHONPATH": str(folder)})
        final = {spec["job_id"]: collector.wait_status(spec["job_id"], ("done", "failed"), 120)
                 for spec in jobs}

        # nothing reached the loopback page, by any of the ways the pages tried
        assert secret_site.hits == []
        for spec in jobs:
            assert not any(SECRET in blob for blob in artifacts_of(collector, spec["job_id"]))
        # a public page that asks for nothing private is loaded through the guard
        assert final["plain"]["status"] == "done", final["plain"]
        assert any(b"a plain public page" in blob for blob in artifacts_of(collector, "plain"))
        # what the guard refused is said
        for job_id in ("redirect-test", "page-test", "redirect-shots", "page-shots"):
            assert final[job_id]["status"] == "failed", final[job_id]
            error = final[job_id]["last_error"]
            assert "refused the page's requests to private or local addresses: " in error
            assert f"127.0.0.1:{secret_site.port}" in error, error
        dom = b"".join(artifacts_of(collector, "page-test"))
        assert b"a public page" in dom
        assert final["redirect-audit"]["last_error"].endswith(", 1 refused request")
        assert final["page-audit"]["last_error"].endswith(", 2 refused requests")
        assert public.hits.count("/page") == 3 and public.hits.count("/redirect") == 3
    finally:
        public.close()
