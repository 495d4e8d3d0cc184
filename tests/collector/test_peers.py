"""FLEET_PEERS: two real collectors, one a peer of the other, plus a fake peer that records what
the proxy sends it."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fleet_min.collector.access import peers
from fleet_min.config import ConfigError
from tests.support.collector import free_port, job, registration

FAKE_ID = "col-fakepeer0000"


async def start(collector_factory, monkeypatch, tmp_path, name, peer_urls=()):
    joined = ",".join(peer_urls)
    if joined:
        monkeypatch.setenv("FLEET_PEERS", joined)
    else:
        monkeypatch.delenv("FLEET_PEERS", raising=False)
    monkeypatch.delenv("FLEET_DASH_TOKEN", raising=False)
    return await collector_factory(data_dir=str(tmp_path / name), name=name,
                                   peers=tuple(peer_urls))


def url_of(client):
    return str(client.make_url("")).rstrip("/")


class FakePeer:
    """A local HTTP server that answers like a collector and remembers every request."""

    def __init__(self):
        self.requests = []
        self.devices_body = b'{"devices": []}'
        self.content_type = "application/json"
        self.devices_status = 200
        self.health_body: bytes | None = None  # what /api/health answers, if not a collector's
        self.health_delay_s = 0.0  # answered after this, as it was when asked
        self.devices_delay_s = 0.0
        self.in_flight = self.most_in_flight = 0
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.server = TestServer(app, host="127.0.0.1")

    async def handle(self, request):
        self.requests.append((request.method, request.path_qs, dict(request.headers)))
        if request.path == "/api/health":
            body = self.health_body or json.dumps(
                {"ok": True, "collector": FAKE_ID, "name": "fake"}).encode()
            await asyncio.sleep(self.health_delay_s)
            return web.Response(body=body, content_type="application/json")
        if request.path == "/api/devices":
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.devices_delay_s)
            finally:
                self.in_flight -= 1
            return web.Response(body=self.devices_body, content_type=self.content_type,
                                status=self.devices_status)
        return web.json_response({"error": "no such route"}, status=404)


@pytest.fixture
async def fake_peer():
    peer = FakePeer()
    await peer.server.start_server()
    yield peer
    await peer.server.close()


async def pair(collector_factory, monkeypatch, tmp_path, *extra):
    remote = await start(collector_factory, monkeypatch, tmp_path, "remote")
    remote_id = (await (await remote.get("/api/health")).json())["collector"]
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(remote), *extra])
    return local, remote, remote_id


# -- addresses ------------------------------------------------------------------------------------


def test_peer_addresses_are_normalised_and_checked():
    assert peers.base_url("pi5.local:8788") == "http://pi5.local:8788"
    assert peers.base_url(" https://c.example/ ") == "https://c.example"
    assert peers.base_url("[fd7a:115c:a1e0::2]:8788") == "http://[fd7a:115c:a1e0::2]:8788"
    for bad in ("ftp://x", "http://u:p@x:1", "http://x/api", "http://x?y=1", "http://x:99999",
                "http://]x:1", "[x:1", "http://a\uff03b:1"):  # urlsplit raises on the last 3
        with pytest.raises(ConfigError):
            peers.base_url(bad)


@pytest.mark.parametrize("address", ["http://peer:PEERPW@pi5.local:8788", "peer:PEERPW@pi5:1",
                                     "http://peer:PEERPW@pi5:99999", "http://peer:PEERPW@]x:1"])
def test_a_refused_peer_address_is_quoted_without_its_password(address):
    """The refusal is the start-up error and a log line: a password in FLEET_PEERS was quoted
    whole in both."""
    with pytest.raises(ConfigError) as refused:
        peers.base_url(address)
    assert "PEERPW" not in str(refused.value) and "<credentials>@" in str(refused.value)


@pytest.mark.parametrize(("tail", "path"), [
    ("api/health", "/api/health"),
    ("api/devices/pi%205", "/api/devices/pi%205"),
    ("api/devices/a%2Fb", "/api/devices/a%2Fb"),
    ("api/results/bench", "/api/results/bench"),
    ("api/jobs/j-1", "/api/jobs/j-1"),
])
def test_readable_paths(tail, path):
    assert peers.readable_path(tail) == path


@pytest.mark.parametrize("tail", [
    "api/stream", "jobs", "api/jobs/j/cancel", "api/jobs/j/ci-status", "api/devices/%2e%2e",
    "api/devices/..", "api//health", "api/health/", "", "artifacts/" + "a" * 64, "api/peers",
    "api/devices/a%00b",
])
def test_everything_else_is_refused(tail):
    with pytest.raises(peers.Forbidden):
        peers.readable_path(tail)


# -- two real collectors --------------------------------------------------------------------


async def test_peer_listing_names_the_peer_by_its_stable_id(collector_factory, monkeypatch,
                                                            tmp_path):
    local, remote, remote_id = await pair(collector_factory, monkeypatch, tmp_path)
    listing = await (await local.get("/api/peers?refresh=1")).json()
    [peer] = listing["peers"]
    assert peer["id"] == remote_id and peer["url"] == url_of(remote)
    assert peer["reachable"] is True and peer["error"] is None
    assert peer["last_checked"].endswith("Z") and peer["latency_ms"] >= 0
    own = (await (await local.get("/api/health")).json())["collector"]
    assert own != remote_id


async def test_proxy_reads_allow_listed_endpoints(collector_factory, monkeypatch, tmp_path):
    local, remote, remote_id = await pair(collector_factory, monkeypatch, tmp_path)
    await remote.post("/devices/register", json=registration("pi-on-remote"))
    await remote.post("/jobs", json=job("remote-job"))
    await remote.post("/jobs", json=job("other", workload="install", executor="host"))
    base = f"/api/peers/{remote_id}"
    resp = await local.get(base + "/api/health")
    assert resp.status == 200 and resp.headers["X-Fleet-Peer"] == remote_id
    assert (await resp.json())["collector"] == remote_id
    resp = await local.get(base + "/api/devices/pi-on-remote")
    assert (await resp.json())["device_id"] == "pi-on-remote"
    resp = await local.get(base + "/api/jobs?executor=host")
    assert [j["job_id"] for j in (await resp.json())["jobs"]] == ["other"]
    assert (await local.get(base + "/api/overview")).status == 200
    # the peer's own 404 comes back as it was
    resp = await local.get(base + "/api/jobs/nope")
    assert resp.status == 404 and "error" in await resp.json()


async def test_proxy_never_forwards_a_change(collector_factory, monkeypatch, tmp_path):
    local, remote, remote_id = await pair(collector_factory, monkeypatch, tmp_path)
    await remote.post("/jobs", json=job("keep"))
    base = f"/api/peers/{remote_id}"
    for method, path in [("POST", "/api/jobs/keep/cancel"), ("PATCH", "/api/jobs/keep"),
                         ("DELETE", "/api/devices/x"), ("PUT", "/api/health"),
                         ("POST", "/jobs")]:
        resp = await local.request(method, base + path, json={"priority": 9})
        assert resp.status == 403, (method, path)
        assert "only reads" in (await resp.json())["error"]
    for path in ("/api/stream", "/jobs/keep", "/api/jobs/x/ci-status", "/api/peers"):
        resp = await local.get(base + path)
        assert resp.status == 403, path
    row = await (await remote.get("/jobs/keep")).json()
    assert row["status"] == "queued" and row["priority"] == 0


async def test_unknown_peer_is_404(collector_factory, monkeypatch, tmp_path):
    local, _remote, _ = await pair(collector_factory, monkeypatch, tmp_path)
    resp = await local.get("/api/peers/col-nobody/api/health")
    assert resp.status == 404 and "no peer collector" in (await resp.json())["error"]


async def test_silent_peer_is_listed_unreachable(collector_factory, monkeypatch, tmp_path):
    silent = f"http://127.0.0.1:{free_port()}"
    local, _remote, remote_id = await pair(collector_factory, monkeypatch, tmp_path, silent)
    listing = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
    by_url = {p["url"]: p for p in listing}
    assert by_url[silent]["reachable"] is False and by_url[silent]["id"] is None
    assert "cannot connect" in by_url[silent]["error"]
    assert [p["id"] for p in listing if p["reachable"]] == [remote_id]


# -- a fake peer that records --------------------------------------------------------------------


async def test_client_headers_are_not_forwarded_and_query_passes(
        collector_factory, monkeypatch, tmp_path, fake_peer):
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    resp = await local.get(f"/api/peers/{FAKE_ID}/api/devices?expired=1&q=a%26b",
                           headers={"X-Fleet-Token": "dashboard-secret",
                                    "Cookie": "session=1", "Authorization": "Bearer x"})
    assert resp.status == 200
    method, path_qs, headers = fake_peer.requests[-1]
    assert method == "GET" and path_qs == "/api/devices?expired=1&q=a%26b"
    lowered = {k.lower() for k in headers}
    assert not lowered & {"x-fleet-token", "cookie", "authorization"}


async def test_oversized_or_non_json_answers_are_502(collector_factory, monkeypatch, tmp_path,
                                                    fake_peer):
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    fake_peer.devices_body = b"[" + b"0," * (peers.MAX_BODY // 2) + b"0]"
    resp = await local.get(f"/api/peers/{FAKE_ID}/api/devices")
    assert resp.status == 502 and "larger than" in (await resp.json())["error"]
    fake_peer.devices_body, fake_peer.content_type = b"<html></html>", "text/html"
    resp = await local.get(f"/api/peers/{FAKE_ID}/api/devices")
    assert resp.status == 502 and "no JSON" in (await resp.json())["error"]


async def test_at_most_a_few_proxied_reads_are_in_flight(collector_factory, monkeypatch,
                                                        tmp_path, fake_peer):
    """Each proxied read holds up to MAX_BODY while its JSON is checked: a neighbour asking a
    hundred times at once waits its turn instead of holding a hundred answers."""
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    fake_peer.devices_delay_s = 0.2
    replies = await asyncio.gather(*(local.get(f"/api/peers/{FAKE_ID}/api/devices")
                                     for _ in range(3 * peers.MAX_READS)))
    assert [r.status for r in replies] == [200] * (3 * peers.MAX_READS)
    assert fake_peer.most_in_flight == peers.MAX_READS


@pytest.mark.parametrize(("body", "status", "words"), [
    (b"<script>alert(1)</script>", 200, "not JSON"),
    (b'{"devices": [', 200, "not JSON"),
    (b"[" * 200_000, 200, "nested deeper than 64 levels"),
    (b"[" * 65 + b"]" * 65, 200, "nested deeper than 64 levels"),
    (b'"' + b"a" * (peers.PARSE_INLINE + 1), 200, "not JSON"),  # parsed off the loop
    (b'{"n": NaN, "m": Infinity}', 200, "not JSON"),  # Python reads them; a browser does not
    (b'[-Infinity]', 200, "not JSON"),
    (b'{"x": 1}', 101, "status 101"),
    (b'{"x": 1}', 600, "status 600"),
    (b'{"x": 1}', 302, "status 302"),
], ids=["script", "cut-short", "deep", "65-levels", "large", "nan", "minus-infinity", "101",
        "600", "302"])
async def test_an_answer_the_proxy_cannot_vouch_for_is_502(collector_factory, monkeypatch,
                                                          tmp_path, fake_peer, body, status,
                                                          words):
    """Labelled application/json by the peer is not enough: what is relayed as JSON parses as
    JSON no deeper than the collector takes on input, with a status a client can act on."""
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    fake_peer.devices_body, fake_peer.devices_status = body, status
    resp = await local.get(f"/api/peers/{FAKE_ID}/api/devices")
    assert resp.status == 502 and resp.content_type == "application/json"
    assert words in (await resp.json())["error"]


@pytest.mark.parametrize("status", [200, 201, 299, 400, 418, 503, 599])
async def test_json_answers_with_2xx_4xx_5xx_pass_through(collector_factory, monkeypatch,
                                                           tmp_path, fake_peer, status):
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    deep_enough = b'{"devices": ' + b"[" * 63 + b"]" * 63 + b"}"  # 64 levels: accepted
    fake_peer.devices_body, fake_peer.devices_status = deep_enough, status
    resp = await local.get(f"/api/peers/{FAKE_ID}/api/devices")
    assert resp.status == status and await resp.read() == deep_enough


@pytest.mark.parametrize("health", [b"[" * 5000, b'{"collector": "\\ud800"}', b"\xff\xfe{",
                                    b'{"collector": ".."}', b'{"collector": "."}'],
                         ids=["deep", "surrogate-id", "not-utf8", "dot-dot-id", "dot-id"])
async def test_a_peer_whose_health_makes_no_sense_is_listed_unreachable(
        collector_factory, monkeypatch, tmp_path, fake_peer, health):
    fake_peer.health_body = health
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    resp = await local.get("/api/peers?refresh=1")
    assert resp.status == 200
    [peer] = (await resp.json())["peers"]
    assert peer["reachable"] is False and peer["error"]
    resp = await local.get(f"/api/peers/{FAKE_ID}/api/devices")
    assert resp.status == 404 and "no peer collector" in (await resp.json())["error"]


async def test_a_peer_name_that_is_no_text_is_listed_as_json(collector_factory, monkeypatch,
                                                             tmp_path, fake_peer):
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    fake_peer.health_body = (b'{"collector": "' + FAKE_ID.encode()
                             + b'", "name": "bad \\ud800 name", "instance": "\\udfff"}')
    resp = await local.get("/api/peers?refresh=1")
    assert resp.status == 200
    [peer] = (await resp.json())["peers"]
    assert peer["reachable"] is True and peer["id"] == FAKE_ID


async def test_peer_that_went_away_is_502(collector_factory, monkeypatch, tmp_path, fake_peer):
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    assert (await local.get(f"/api/peers/{FAKE_ID}/api/health")).status == 200
    await fake_peer.server.close()
    resp = await local.get(f"/api/peers/{FAKE_ID}/api/health")
    assert resp.status == 502 and "unreachable" in (await resp.json())["error"]
    [peer] = (await (await local.get("/api/peers")).json())["peers"]
    assert peer["id"] == FAKE_ID and peer["reachable"] is False


# -- a peer's id is bound to its address ---------------------------------------------------------


def health_naming(collector_id):
    return json.dumps({"ok": True, "collector": collector_id, "name": "honest-looking"}).encode()


async def test_a_peer_claiming_another_peers_id_serves_neither(collector_factory, monkeypatch,
                                                              tmp_path, fake_peer):
    """A liar listed first that names the real peer's id must not answer in its place."""
    fake_peer.devices_body = b'{"devices": [{"device_id": "FAKE-from-liar"}]}'
    remote = await start(collector_factory, monkeypatch, tmp_path, "remote")
    remote_id = (await (await remote.get("/api/health")).json())["collector"]
    fake_peer.health_body = health_naming(remote_id)
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server), url_of(remote)])
    listing = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
    assert [p["id"] for p in listing] == [remote_id, remote_id]
    for peer, other in zip(listing, reversed(listing), strict=True):
        assert peer["reachable"] is False
        assert f"also claimed by {other['url']}" in peer["error"]
    resp = await local.get(f"/api/peers/{remote_id}/api/devices")
    assert resp.status == 502
    assert "also claimed by" in (await resp.json())["error"]
    assert not [r for r in fake_peer.requests if r[1].startswith("/api/devices")]


async def test_a_peer_that_changes_its_id_is_not_served(collector_factory, monkeypatch,
                                                        tmp_path, fake_peer, caplog):
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    assert (await local.get(f"/api/peers/{FAKE_ID}/api/devices")).status == 200
    fake_peer.health_body = health_naming("col-someone-else")
    caplog.set_level("WARNING", logger="fleet_min.collector.peers")
    for _ in range(2):
        [peer] = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
        assert peer["id"] == FAKE_ID and peer["reachable"] is False
        assert "now names collector col-someone-else" in peer["error"]
    warnings = [r for r in caplog.records if "now names collector" in r.getMessage()]
    assert len(warnings) == 1  # throttled: not one per check
    resp = await local.get(f"/api/peers/{FAKE_ID}/api/devices")
    assert resp.status == 502 and "now names collector" in (await resp.json())["error"]
    resp = await local.get("/api/peers/col-someone-else/api/devices")
    assert resp.status == 404
    fake_peer.health_body = None  # it names its first id again
    [peer] = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
    assert peer["reachable"] is True and peer["error"] is None
    assert (await local.get(f"/api/peers/{FAKE_ID}/api/devices")).status == 200


async def test_a_refresh_asked_for_sees_the_peer_as_it_is_now(collector_factory, monkeypatch,
                                                               tmp_path, fake_peer):
    """Callers arriving during a check share it, but GET /api/peers?refresh=1 asks for the
    peers as they are now: a check already in flight had its answer before the peer changed,
    so the refresh asked for waits for it and checks again."""
    local = await start(collector_factory, monkeypatch, tmp_path, "local",
                        [url_of(fake_peer.server)])
    assert (await local.get(f"/api/peers/{FAKE_ID}/api/devices")).status == 200
    fake_peer.health_delay_s = 0.5
    asked = len(fake_peer.requests)
    earlier = asyncio.ensure_future(local.get("/api/peers?refresh=1"))
    while not any(path == "/api/health" for _, path, _ in fake_peer.requests[asked:]):
        await asyncio.sleep(0.01)
    fake_peer.health_body = health_naming("col-someone-else")  # after the check asked
    fake_peer.health_delay_s = 0.0
    [peer] = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
    assert peer["reachable"] is False and "now names collector col-someone-else" in peer["error"]
    [before] = (await (await earlier).json())["peers"]
    assert before["reachable"] is True  # the check in flight saw the peer as it was


# -- pins across restarts -------------------------------------------------------------------------


async def test_a_pin_outlives_a_restart_and_only_forget_moves_it(collector_factory, monkeypatch,
                                                                 tmp_path, fake_peer):
    """The pin lived in memory: whoever answered first after a restart of this collector took
    the address, so a neighbour who made the peer's address answer with another id (or an
    impostor started in its place while this collector was down) was served under it."""
    address = url_of(fake_peer.server)
    local = await start(collector_factory, monkeypatch, tmp_path, "local", [address])
    [peer] = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
    assert peer["id"] == FAKE_ID and peer["reachable"] is True
    await local.close()

    fake_peer.health_body = health_naming("col-impostor")
    local = await start(collector_factory, monkeypatch, tmp_path, "local", [address])
    [peer] = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
    assert peer["id"] == FAKE_ID and peer["reachable"] is False
    assert "now names collector col-impostor" in peer["error"]
    assert "POST /api/peers/forget" in peer["error"] and peer["claimed"] == "col-impostor"
    assert (await local.get("/api/peers/col-impostor/api/devices")).status == 404
    assert (await local.get(f"/api/peers/{FAKE_ID}/api/devices")).status == 502

    # The owner replaced the peer on purpose: forgetting pins the id it names now, at once.
    resp = await local.post("/api/peers/forget", json={"url": address.removeprefix("http://")})
    assert resp.status == 200
    body = await resp.json()
    assert body["ok"] is True and body["forgotten"] == FAKE_ID
    assert body["peer"]["id"] == "col-impostor" and body["peer"]["reachable"] is True
    assert body["peer"]["error"] is None and body["peer"]["claimed"] is None
    assert (await local.get("/api/peers/col-impostor/api/devices")).status == 200
    await local.close()

    fake_peer.health_body = None  # the old id again: now that is the change
    local = await start(collector_factory, monkeypatch, tmp_path, "local", [address])
    [peer] = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
    assert peer["id"] == "col-impostor" and peer["reachable"] is False
    assert f"now names collector {FAKE_ID}" in peer["error"]


async def test_forget_refuses_what_it_cannot_name_and_changes_nothing(
        collector_factory, monkeypatch, tmp_path, fake_peer):
    address = url_of(fake_peer.server)
    local = await start(collector_factory, monkeypatch, tmp_path, "local", [address])
    await local.get("/api/peers?refresh=1")
    refused = [({"url": "http://127.0.0.1:1"}, 404), ({"url": address, "also": 1}, 400),
               ({"url": ""}, 400), ({"url": 5}, 400), ({"url": "ftp://x:1"}, 400),
               ({"url": "http://x:99999"}, 400), ({"url": "\udcff"}, 400),
               ({"url": "x" * 5000}, 400), ([address], 400), ({}, 400),
               ({"url": "http://]x:1"}, 400), ({"url": "\u00a5=\u0087\u00ec]B"}, 400),
               ({"url": "http://a\uff03b:1"}, 400)]
    for body, status in refused:
        resp = await local.post("/api/peers/forget", json=body)
        assert resp.status == status, (body, await resp.text())
        assert "error" in await resp.json()
    [peer] = (await (await local.get("/api/peers")).json())["peers"]
    assert peer["id"] == FAKE_ID and peer["reachable"] is True
    fake_peer.health_body = health_naming("col-someone-else")
    [peer] = (await (await local.get("/api/peers?refresh=1")).json())["peers"]
    assert peer["id"] == FAKE_ID and "now names collector" in peer["error"]


async def test_forget_needs_the_dashboard_token_when_one_is_set(collector_factory, monkeypatch,
                                                                tmp_path, fake_peer):
    address = url_of(fake_peer.server)
    monkeypatch.setenv("FLEET_PEERS", address)
    monkeypatch.setenv("FLEET_DASH_TOKEN", "t" * 32)
    local = await collector_factory(data_dir=str(tmp_path / "local"), peers=(address,))
    await local.get("/api/peers?refresh=1")
    assert (await local.post("/api/peers/forget", json={"url": address})).status == 401
    resp = await local.post("/api/peers/forget", json={"url": address},
                            headers={"X-Fleet-Token": "t" * 31 + "u"})
    assert resp.status == 403
    resp = await local.post("/api/peers/forget", json={"url": address},
                            headers={"X-Fleet-Token": "t" * 32})
    assert resp.status == 200 and (await resp.json())["forgotten"] == FAKE_ID


def test_stored_pins_skip_rows_that_name_no_collector_id(tmp_path):
    conn = sqlite3.connect(tmp_path / "pins.sqlite3")
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    peers.store_pin(conn, "http://a:1", "col-a")
    peers.store_pin(conn, "http://a:1", "col-later")  # the first pin stays
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [
        ("peer_pin http://b:1", "not an id!"), ("peer_pin http://c:1", "col\u202ex"),
        ("peer_pim http://d:1", "col-d"), ("peer_pin!", "col-e"), ("scheduler_clock", "{}")])
    assert peers.stored_pins(conn) == {"http://a:1": "col-a"}
    peers.drop_pin(conn, "http://a:1")
    assert peers.stored_pins(conn) == {}
