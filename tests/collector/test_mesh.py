"""FLEET_MESH_ALLOW: mesh registrations must resolve to a listed node name.

A registration cannot come from a 100.64.x.y socket address on this machine, so the HTTP tests
run with FLEET_TRUST_PROXY=127.0.0.1 and name the peer in X-Forwarded-For, as a reverse proxy on
the same host would.
The identity lookup is a real executable named `tailscale` written onto PATH.
"""

from __future__ import annotations

import ipaddress

import pytest

from fleet_min.collector.access import mesh
from tests.support.collector import registration
from tests.support.fake_tailscale import install, whois

ANSWERS = {
    "100.64.0.5": whois("pi5.example.ts.net.", "pi5"),
    "fd7a:115c:a1e0::5": whois("pi5.example.ts.net.", "pi5"),
    "100.64.0.6": whois("laptop.example.ts.net.", "laptop"),
    # claims to be pi5 through the host name it reports about itself: not believed
    "100.64.0.7": whois("intruder.example.ts.net.", "intruder", hostname="pi5"),
    "100.127.0.9": whois("", "pi5", hostname="pi5"),  # no MagicDNS name: unidentified
    "100.64.0.10": "this is not json",
    "100.64.0.11": "hang",
    "100.64.0.12": "[" * 100_000 + "]" * 100_000,  # deeper than any parser should follow
    "100.64.0.13": "flood",
}


@pytest.fixture
def fake_tailscale(tmp_path, monkeypatch):
    for name, value in install(tmp_path, ANSWERS).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FLEET_MESH_WHOIS", raising=False)
    return tmp_path / "whois.log"


async def start(collector_factory, monkeypatch, allow, trust_proxy=True, whois=None):
    """A collector with these settings, given both as environment and as typed overrides (so
    the test keeps working when the settings move into fleet_min.config)."""
    values = {"FLEET_MESH_ALLOW": allow,
              "FLEET_TRUST_PROXY": "127.0.0.1" if trust_proxy else "0",
              "FLEET_MESH_WHOIS": whois}
    for name, value in values.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    names = tuple(n.strip() for n in (allow or "").split(",") if n.strip())
    return await collector_factory(mesh_allow=names,
                                   trust_proxy=("127.0.0.1/32",) if trust_proxy else (),
                                   mesh_whois=whois or "tailscale")


async def register_from(client, address, device="d"):
    headers = {"X-Forwarded-For": address} if address else {}
    return await client.post("/devices/register", json=registration(device), headers=headers)


# -- pure parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kind"), [
    ("100.64.0.1", "mesh"), ("100.127.255.254", "mesh"), ("100.63.255.255", "other"),
    ("100.128.0.1", "other"), ("fd7a:115c:a1e0::1", "mesh"), ("fd7a:115c:a1e1::1", "lan"),
    ("::ffff:100.64.1.2", "mesh"), ("127.0.0.1", "loopback"), ("::1", "loopback"),
    ("192.168.1.20", "lan"), ("10.0.0.3", "lan"), ("172.16.4.4", "lan"),
    ("fe80::1%eth0", "lan"), ("169.254.1.1", "lan"), ("8.8.8.8", "other"),
    ("not an address", "unknown"), ("", "unknown"),
])
def test_address_classification(text, kind):
    assert mesh.classify(mesh.parse_address(text)) == kind


LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)


def test_forwarded_for_is_only_read_behind_a_trusted_proxy():
    assert str(mesh.peer_address("127.0.0.1", "100.64.0.5", ())) == "127.0.0.1"
    assert str(mesh.peer_address("127.0.0.1", "100.64.0.5", LOOPBACK)) == "100.64.0.5"
    # the entry the proxy itself added is the last one; earlier ones are the client's say-so
    assert str(mesh.peer_address("127.0.0.1", "100.64.0.5, 192.168.1.9", LOOPBACK)
               ) == "192.168.1.9"
    assert mesh.peer_address("127.0.0.1", "junk", LOOPBACK) is None
    assert str(mesh.peer_address("127.0.0.1", None, LOOPBACK)) == "127.0.0.1"
    assert mesh.peer_address(None, None, ()) is None


def test_node_names_come_from_the_coordination_server_not_the_node():
    assert mesh.node_names(whois("pi5.example.ts.net.", "pi5")) == {"pi5.example.ts.net",
                                                                    "pi5"}
    assert mesh.node_names(whois("Pi5.Example.ts.net.")) == {"pi5.example.ts.net"}
    assert mesh.node_names(whois("", "pi5", hostname="pi5")) == set()
    assert mesh.node_names({"Node": {"Hostinfo": {"Hostname": "pi5"}}}) == set()
    assert mesh.node_names([]) == set() and mesh.node_names({"Node": "x"}) == set()


def test_mesh_ranges_are_the_ones_the_spec_names():
    assert ipaddress.ip_network("100.64.0.0/10") == mesh.MESH_V4
    assert ipaddress.ip_network("fd7a:115c:a1e0::/48") == mesh.MESH_V6


# -- over HTTP -----------------------------------------------------------------------------------


async def test_listed_mesh_node_registers(collector_factory, monkeypatch, fake_tailscale):
    client = await start(collector_factory, monkeypatch, "pi5, other-node")
    resp = await register_from(client, "100.64.0.5")
    assert resp.status == 200 and (await resp.json())["device_id"] == "d"
    resp = await register_from(client, "fd7a:115c:a1e0::5", device="d6")
    assert resp.status == 200
    assert fake_tailscale.read_text().splitlines() == ["whois --json 100.64.0.5",
                                                       "whois --json fd7a:115c:a1e0::5"]


async def test_full_magicdns_name_may_be_listed(collector_factory, monkeypatch, fake_tailscale):
    client = await start(collector_factory, monkeypatch, "PI5.example.ts.net.")
    assert (await register_from(client, "100.64.0.5")).status == 200


async def test_unlisted_and_unidentified_mesh_peers_get_403(collector_factory, monkeypatch,
                                                            fake_tailscale):
    client = await start(collector_factory, monkeypatch, "pi5")
    cases = {
        "100.64.0.6": "laptop is not in this collector's FLEET_MESH_ALLOW",
        "100.64.0.7": "intruder is not in",
        "100.127.0.9": "could not be identified (the identity lookup named no node)",
        "100.64.0.10": "did not answer JSON",
        "100.64.0.99": "no match for IP",
    }
    for address, words in cases.items():
        resp = await register_from(client, address, device="x" + address)
        assert resp.status == 403, address
        assert words in (await resp.json())["error"], address
    devices = await (await client.get("/api/devices")).json()
    assert devices["devices"] == []


async def test_loopback_and_lan_peers_are_admitted_without_a_lookup(
        collector_factory, monkeypatch, fake_tailscale):
    client = await start(collector_factory, monkeypatch, "pi5")
    assert (await register_from(client, None)).status == 200  # loopback socket
    assert (await register_from(client, "192.168.1.20", device="lan")).status == 200
    assert (await register_from(client, "fe80::1", device="ll")).status == 200
    assert fake_tailscale.read_text() == ""


async def test_unset_list_admits_everyone(collector_factory, monkeypatch, fake_tailscale):
    client = await start(collector_factory, monkeypatch, None)
    assert (await register_from(client, "100.64.0.6")).status == 200
    assert fake_tailscale.read_text() == ""


async def test_forwarded_for_is_ignored_unless_the_proxy_is_trusted(
        collector_factory, monkeypatch, fake_tailscale):
    client = await start(collector_factory, monkeypatch, "pi5", trust_proxy=False)
    # the header names an unlisted node, but the socket is loopback and the header is not
    # believed: admitted as loopback, no lookup
    assert (await register_from(client, "100.64.0.6")).status == 200
    assert fake_tailscale.read_text() == ""


async def test_lookups_are_cached(collector_factory, monkeypatch, fake_tailscale):
    client = await start(collector_factory, monkeypatch, "pi5")
    for _ in range(3):
        assert (await register_from(client, "100.64.0.5")).status == 200
        assert (await register_from(client, "100.64.0.6", device="e")).status == 403
    assert sorted(fake_tailscale.read_text().splitlines()) == [
        "whois --json 100.64.0.5", "whois --json 100.64.0.6"]


async def test_enqueue_and_reads_are_not_checked(collector_factory, monkeypatch, fake_tailscale):
    client = await start(collector_factory, monkeypatch, "pi5")
    resp = await client.get("/api/health", headers={"X-Forwarded-For": "100.64.0.6"})
    assert resp.status == 200
    resp = await client.post("/jobs", json={"schema": 1, "job_id": "j", "workload": "install",
                                            "executor": "host"},
                             headers={"X-Forwarded-For": "100.64.0.6"})
    assert resp.status == 201
    assert fake_tailscale.read_text() == ""


async def test_lookup_binary_is_configurable(collector_factory, monkeypatch, fake_tailscale,
                                             tmp_path):
    renamed = tmp_path / "bin" / "ts-identity"
    (tmp_path / "bin" / "tailscale").rename(renamed)
    client = await start(collector_factory, monkeypatch, "pi5", whois=str(renamed))
    assert (await register_from(client, "100.64.0.5")).status == 200


async def test_missing_lookup_binary_refuses_mesh_peers(collector_factory, monkeypatch,
                                                        fake_tailscale, tmp_path):
    client = await start(collector_factory, monkeypatch, "pi5",
                         whois=str(tmp_path / "no-such-binary"))
    resp = await register_from(client, "100.64.0.5")
    assert resp.status == 403 and "cannot run" in (await resp.json())["error"]
    assert (await register_from(client, "127.0.0.1", device="local")).status == 200


async def test_a_hanging_lookup_is_cut_off_and_refused(collector_factory, monkeypatch,
                                                       fake_tailscale):
    client = await start(collector_factory, monkeypatch, "pi5")
    resp = await register_from(client, "100.64.0.11")
    assert resp.status == 403 and "took over 3 s" in (await resp.json())["error"]
    # the collector kept answering meanwhile and afterwards
    assert (await client.get("/api/health")).status == 200


async def test_a_cached_answer_in_use_is_refreshed_before_it_runs_out(fake_tailscale):
    """Agent routes ask on every request: near the end of its life a cached answer is still
    served at once while a lookup in the background renews it, so no request waits for one."""
    clock = [1000.0]
    gate = mesh.MeshGate(mesh.MeshSettings(frozenset({"pi5"}), "tailscale"),
                         clock=lambda: clock[0])
    assert (await gate.lookup("100.64.0.5")).node == "pi5.example.ts.net"
    clock[0] += mesh.CACHE_S - mesh.REFRESH_AHEAD_S - 1  # not yet near the end: no lookup
    await gate.lookup("100.64.0.5")
    assert not gate._refreshing and gate.lookups == 1
    clock[0] += 2  # near the end: answered from the cache, renewed in the background
    assert (await gate.lookup("100.64.0.5")).node == "pi5.example.ts.net"
    refreshing = list(gate._refreshing)
    assert len(refreshing) == 1
    await refreshing[0]
    assert gate.lookups == 2
    clock[0] += mesh.CACHE_S - mesh.REFRESH_AHEAD_S - 1  # the renewed answer is still fresh
    await gate.lookup("100.64.0.5")
    assert gate.lookups == 2 and not gate._refreshing
    await gate.close()
    assert fake_tailscale.read_text().splitlines() == ["whois --json 100.64.0.5"] * 2


async def test_the_executor_routes_hold_to_the_executor_names_binding(
        collector_factory, monkeypatch, fake_tailscale):
    """An executor's registration, its locks and its live mirror, from the mesh, speak for the
    executor name the first node bound (by registering or polling); another node gets 403."""
    client = await start(collector_factory, monkeypatch, "pi5, laptop")
    pi5, laptop = {"X-Forwarded-For": "100.64.0.5"}, {"X-Forwarded-For": "100.64.0.6"}
    body = {"name": "mac", "capabilities": ["soak"]}
    assert (await client.post("/executors/register", json=body, headers=pi5)).status == 200
    resp = await client.post("/executors/register", json={"name": "mac", "capabilities": []},
                             headers=laptop)
    assert resp.status == 403 and "in use by another mesh node" in (await resp.json())["error"]
    resp = await client.post("/jobs", json={"schema": 1, "job_id": "soak", "workload": "soak",
                                            "executor": "host"})
    assert resp.status == 201
    resp = await client.get("/executor/next-job?name=mac", headers=pi5)
    assert (await resp.json())["job_id"] == "soak"
    lock = {"job_id": "soak", "device_ids": ["d1"]}
    assert (await client.post("/locks/acquire", json=lock, headers=laptop)).status == 403
    assert (await client.post("/locks/acquire", json=lock, headers=pi5)).status == 200
    frame = b"\xff\xd8\xff\xe0" + b"\0" * 16 + b"\xff\xd9"
    for headers, wanted in ((laptop, 403), (pi5, 204)):
        resp = await client.post("/api/jobs/soak/mirror?executor=mac", data=frame,
                                 headers={**headers, "Content-Type": "image/jpeg"})
        assert resp.status == wanted, await resp.text()
    listed = await (await client.get("/api/executors")).json()
    assert listed["executors"][0]["capabilities"] == ["soak"]  # the refused one changed nothing


async def test_a_lock_cannot_make_another_nodes_device_speak_for_an_executor(
        collector_factory, monkeypatch, fake_tailscale):
    """A lock makes the job's claimant speak for the locked device (its beacons and rows), so
    from the mesh it is refused on a device another node registered; and a lock taken before
    the device was registered does not let the executor's node write that device's record."""
    client = await start(collector_factory, monkeypatch, "pi5, laptop")
    laptop = {"X-Forwarded-For": "100.64.0.6"}  # pi5 (100.64.0.5) registers d1 and d2
    assert (await register_from(client, "100.64.0.5", "d1")).status == 200
    assert (await register_from(client, None, "lan-device")).status == 200  # no node
    assert (await client.post("/executors/register", json={"name": "e2", "capabilities": ["soak"]},
                              headers=laptop)).status == 200
    assert (await client.post("/jobs", json={"schema": 1, "job_id": "soak", "workload": "soak",
                                             "executor": "host"})).status == 201
    claimed = await client.get("/executor/next-job?name=e2", headers=laptop)
    assert (await claimed.json())["job_id"] == "soak"

    def lock(*devices):
        return client.post("/locks/acquire", headers=laptop, json={
            "job_id": "soak", "device_ids": list(devices), "executor": "e2"})

    resp = await lock("lan-device", "d1")
    assert resp.status == 403
    assert "registered from another mesh node" in (await resp.json())["error"]
    assert (await (await client.get("/api/locks")).json())["locks"] == []  # all or nothing
    assert (await (await lock("lan-device", "d2")).json())["granted"] == ["lan-device", "d2"]
    assert (await register_from(client, "100.64.0.5", "d2")).status == 200  # pi5's now
    beacon = {"schema": 1, "kind": "beacon", "device_id": "d2", "job_id": "soak",
              "beacon": {"battery_pct": 1, "charging": False}}
    resp = await client.post("/results", json=beacon, headers=laptop)
    assert resp.status == 403, await resp.text()
    row = {"schema": 1, "kind": "result", "job_id": "soak", "device_id": "d2", "iter": 1,
           "ok": True, "metrics": {}}
    resp = await client.post("/results", json=row, headers=laptop)
    assert resp.status == 403, await resp.text()
    device = await (await client.get("/api/devices/d2")).json()
    assert device["last_beacon"] is None
    rows = await (await client.get("/api/results?job=soak")).json()
    assert rows["results"] == []
    # The device locked while it had no node still speaks for the executor's job.
    beacon["device_id"] = "lan-device"
    assert (await (await client.post("/results", json=beacon, headers=laptop)).json())[
        "lease_renewed"] is True


@pytest.mark.parametrize(("address", "words"), [
    ("100.64.0.12", "did not answer JSON"),
    ("100.64.0.13", "answered more than 1 MiB"),
], ids=["deep-json", "endless-output"])
async def test_a_lookup_answering_deep_or_endless_output_is_refused_and_cached(
        collector_factory, monkeypatch, fake_tailscale, address, words, caplog):
    """Nesting 100,000 deep is refused like any answer that is not JSON, and output without end
    is cut at MAX_OUTPUT (the process stopped there, not read to its end); both are definite
    answers, cached like the others, so the next requests start no new lookup."""
    client = await start(collector_factory, monkeypatch, "pi5")
    for attempt in range(3):
        resp = await register_from(client, address, device=f"x{attempt}")
        assert resp.status == 403, await resp.text()
        assert words in (await resp.json())["error"]
    assert fake_tailscale.read_text().splitlines() == [f"whois --json {address}"]
    assert (await client.get("/api/health")).status == 200
    assert "did not end once stopped" not in caplog.text  # stopped, its pipes read to the end
