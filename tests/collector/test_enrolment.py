"""Enrolment over HTTP against real collectors: the addresses agents can reach it at, the devices
known, the newest phone runner build, the QR code, and the agent served from the package (fetched
with curl and started, as the one-line command does)."""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_min.collector.access import enrolment
from tests.support.collector import CollectorProcess, edit_rows, registration

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "agent" / "fleet_agent.py"


async def upload(api, data: bytes, **headers: str) -> str:
    resp = await api.post("/artifacts", data=data, headers={
        "content-type": "application/octet-stream",
        **{f"x-artifact-{k}": v for k, v in headers.items()}})
    assert resp.status == 201, await resp.text()
    return str((await resp.json())["sha256"])


async def test_enroll_lists_addresses_names_devices_and_the_runner_build(collector_factory):
    api = await collector_factory(bind=("127.0.0.1", "192.168.7.20", "100.101.102.103"),
                                  port=8788, allowed_hosts=("shelf.lan", "*.example.lan"))
    empty = await (await api.get("/api/enroll")).json()
    assert empty["runner_apk"] is None and empty["known_device_ids"] == []
    await api.post("/devices/register", json=registration("pixel-7", pools=["phones"]))
    await api.post("/devices/register", json=registration("pi-4", pools=["sbc"]))
    await upload(api, b"runner 1", app="fleet-runner-android", build="1", name="runner-1.apk")
    newest = await upload(api, b"runner 2", app="fleet-runner-android", build="2",
                          name="runner-2.apk")
    await upload(api, b"another app", app="shelf-app", build="9", name="shelf.apk")
    got = await (await api.get("/api/enroll")).json()
    assert got["port"] == 8788 and got["runner_app"] == "fleet-runner-android"
    assert [(b["url"], b["kind"], b["via"]) for b in got["bases"]] == [
        ("http://192.168.7.20:8788", "lan", "bind"),
        ("http://100.101.102.103:8788", "mesh", "bind"),
        ("http://shelf.lan:8788", "name", "allowed-hosts"),
        ("http://127.0.0.1:8788", "loopback", "bind")]
    assert got["bases"][0]["command"] == (
        "curl -fsSL http://192.168.7.20:8788/agent/fleet_agent.py -o fleet_agent.py && "
        "python3 fleet_agent.py --collector http://192.168.7.20:8788")
    apk = got["runner_apk"]
    assert apk["sha256"] == newest and apk["build"] == "2" and apk["filename"] == "runner-2.apk"
    assert apk["download"] == f"/artifacts/{newest}?filename=runner-2.apk"
    assert apk["size"] == len(b"runner 2")
    download = await api.get(apk["download"])
    assert await download.read() == b"runner 2"
    assert 'filename="runner-2.apk"' in download.headers["Content-Disposition"]
    assert sorted(got["known_device_ids"]) == ["pi-4", "pixel-7"]
    assert got["pools"] == ["phones", "sbc"]
    other = await (await api.get("/api/enroll?app=shelf-app")).json()
    assert other["runner_apk"]["name"] == "shelf.apk"
    assert (await api.get("/api/enroll?app=" + "x" * 201)).status == 400


async def test_enroll_bounds_the_devices_and_pools_it_lists(client, db_path):
    """The page needs neither list whole: every device's id and pools made one answer 163 MB
    (25,000 devices of 64 pools). The ids are the devices seen most recently, with the count of
    all; the pools are distinct, at most POOLS_SHOWN, and say when more exist; whether an id is
    taken is one lookup."""
    await client.post("/devices/register", json=registration("pixel-7", pools=["phones", "lab"]))
    await client.post("/devices/register", json=registration("pi-4", pools=["sbc", "lab"]))
    await client.post("/devices/register", json=registration("odd", pools=["hidden"]))
    edit_rows(db_path, "UPDATE devices SET pools_override = '[\"desk\", 7]' "
                       "WHERE device_id = 'pi-4'")
    edit_rows(db_path, "UPDATE devices SET pools = '{\"not\": \"a list\"}' "
                       "WHERE device_id = 'odd'")
    small = await (await client.get("/api/enroll")).json()
    assert sorted(small["known_device_ids"]) == ["odd", "pi-4", "pixel-7"]
    assert small["known_devices"] == 3
    assert (small["pools"], small["pools_truncated"]) == (["desk", "lab", "phones"], False)
    assert "device_id_taken" not in small
    for asked, taken in (("pi-4", True), ("pi-5", False)):
        got = await (await client.get(f"/api/enroll?device_id={asked}")).json()
        assert got["device_id_taken"] is taken, asked
    assert "device_id_taken" not in await (await client.get("/api/enroll?device_id=")).json()
    assert (await client.get("/api/enroll?device_id=" + "x" * 201)).status == 400

    # Many more devices, each in pools of its own, as a registry filled by open registrations
    # may hold them (written straight into the file; last seen long ago).
    bulk = enrolment.KNOWN_IDS + 200
    edit_rows(db_path, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
                       "WHERE i < ?) INSERT INTO devices (device_id, pools, first_seen, "
                       "last_seen, registered_at) SELECT printf('bulk-%05d', i), "
                       "json_array(printf('pool-%05d-a', i), printf('pool-%05d-b', i)), "
                       "0, i, 0 FROM n", (bulk,))
    resp = await client.get("/api/enroll?device_id=bulk-00001")
    body = await resp.read()
    got = await resp.json()
    assert got["known_devices"] == bulk + 3 and got["device_id_taken"] is True
    ids = got["known_device_ids"]
    assert len(ids) == enrolment.KNOWN_IDS
    assert sorted(ids[:3]) == ["odd", "pi-4", "pixel-7"]  # seen most recently: listed first
    assert ids[3:6] == [f"bulk-{bulk - k:05d}" for k in range(3)]
    pools = got["pools"]
    assert len(pools) == enrolment.POOLS_SHOWN and got["pools_truncated"] is True
    assert pools == sorted(set(pools))
    assert len(body) < 100_000, len(body)


async def test_a_runner_build_named_as_the_original_names_it_is_offered(collector_factory):
    """The original's runner builds arrive with no app header, named fleet-runner-<build>.apk."""
    api = await collector_factory()
    sha = await upload(api, b"runner from the original", name="fleet-runner-42.apk")
    await upload(api, b"some other apk", name="shelf.apk")
    apk = (await (await api.get("/api/enroll")).json())["runner_apk"]
    assert apk["sha256"] == sha and apk["name"] == "fleet-runner-42.apk"
    assert apk["download"].endswith("?filename=fleet-runner-42.apk")


def test_every_interface_address_listed_for_0_0_0_0_is_this_machines():
    bases = enrolment.bound_bases(["0.0.0.0"])
    assert bases[-1] == enrolment.Base("127.0.0.1", "loopback", "lo")
    for base in bases:
        ipaddress.IPv4Address(base.address)
        # Only an address of this machine can be bound.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((base.address, 0))


def test_an_ipv6_bind_is_bracketed_and_the_mdns_name_follows():
    bases = enrolment.bound_bases(["fd7a:115c:a1e0::5"]) + enrolment.name_bases(
        ["*", "localhost", "pi.lan"], "fleet-abc.local")
    described = enrolment.describe(bases, 8788)
    assert [d["url"] for d in described] == [
        "http://[fd7a:115c:a1e0::5]:8788", "http://pi.lan:8788", "http://fleet-abc.local:8788"]


async def test_the_qr_code_is_an_svg_and_bad_text_is_400(client):
    resp = await client.get("/api/enroll/qr", params={"text": "http://192.168.7.20:8788"})
    assert resp.status == 200 and resp.content_type == "image/svg+xml"
    svg = await resp.text()
    assert svg.startswith("<svg") and 'class="qr"' in svg and "<path" in svg
    # Quiet zone of 4 modules around a version-2 code (25 modules): 33 units square.
    assert 'viewBox="0 0 33 33"' in svg
    assert (await client.get("/api/enroll/qr")).status == 400
    too_long = await client.get("/api/enroll/qr", params={"text": "x" * 513})
    assert too_long.status == 400 and "512" in (await too_long.json())["error"]


async def test_the_agent_is_served_from_the_package(client):
    resp = await client.get("/agent/fleet_agent.py")
    assert resp.status == 200 and resp.content_type == "text/x-python"
    assert await resp.read() == AGENT.read_bytes()


@pytest.mark.skipif(shutil.which("curl") is None, reason="the one-line command needs curl")
def test_the_one_line_command_fetches_and_starts_the_agent(tmp_path):
    proc = CollectorProcess(tmp_path / "data").start()
    try:
        base = f"http://127.0.0.1:{proc.port}"
        fetched = subprocess.run(["curl", "-fsSL", f"{base}/agent/fleet_agent.py", "-o",
                                  str(tmp_path / "fleet_agent.py")], timeout=30)
        assert fetched.returncode == 0
        assert (tmp_path / "fleet_agent.py").read_bytes() == AGENT.read_bytes()
        started = subprocess.run([sys.executable, str(tmp_path / "fleet_agent.py"), "--help"],
                                 capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert started.returncode == 0 and "--collector" in started.stdout
    finally:
        assert proc.stop() == 0


async def test_a_pinned_runner_build_is_offered_before_any_newer_upload(collector_factory):
    """Uploads are open, so the newest build of the runner may be anyone's: a build pinned
    (approved) by the operator wins over newer uploads, and an unpinned one says it is not."""
    api = await collector_factory()
    approved = await upload(api, b"runner 1 as built by us", app="fleet-runner-android",
                            build="1", name="runner-1.apk")
    planted = await upload(api, b"runner 9.9.9 from the network", app="fleet-runner-android",
                           build="9.9.9", name="fleet-runner-9.9.9.apk")
    got = await (await api.get("/api/enroll")).json()
    assert got["runner_apk"]["sha256"] == planted and got["runner_apk"]["approved"] is False
    assert got["runner_pinned_only"] is False
    resp = await api.post(f"/api/artifacts/{approved}/pin", json={"reason": "runner release"})
    assert resp.status == 200, await resp.text()
    await upload(api, b"runner 10 from the network", app="fleet-runner-android", build="10")
    apk = (await (await api.get("/api/enroll")).json())["runner_apk"]
    assert apk["sha256"] == approved and apk["approved"] is True


async def test_a_pinned_build_cannot_be_restamped_by_uploading_its_bytes_again(
        collector_factory, monkeypatch):
    """Uploads are open and re-publishing stored bytes replaced their name, app and build and
    moved them to newest: anyone could make an approved old build the one enrolment offers as
    the newest (a downgrade), or take it out of the offer by giving it another app."""
    monkeypatch.setenv("FLEET_DASH_TOKEN", "operator-secret")
    api = await collector_factory(dash_token="operator-secret")
    token = {"X-Fleet-Token": "operator-secret"}
    old_bytes = b"runner 1.3 as built by us"
    old = await upload(api, old_bytes, app="fleet-runner-android", build="1.3",
                       name="fleet-runner-1.3.apk")
    assert (await api.post(f"/api/artifacts/{old}/pin", json={"reason": "1.3"},
                           headers=token)).status == 200
    new = await upload(api, b"runner 1.4 as built by us", app="fleet-runner-android",
                       build="1.4", name="fleet-runner-1.4.apk")
    assert (await api.post(f"/api/artifacts/{new}/pin", json={"reason": "1.4"},
                           headers=token)).status == 200
    for stamp in ({"app": "fleet-runner-android", "build": "1.4.1",
                   "name": "fleet-runner-1.4.1.apk"}, {"app": "something-else"}):
        assert await upload(api, old_bytes, **stamp) == old  # stored, as before
        apk = (await (await api.get("/api/enroll")).json())["runner_apk"]
        assert (apk["sha256"], apk["build"], apk["approved"]) == (new, "1.4", True)
    kept = await (await api.get(f"/api/artifacts/{old}")).json()
    assert (kept["name"], kept["app"], kept["build"]) == (
        "fleet-runner-1.3.apk", "fleet-runner-android", "1.3")


async def test_with_a_dashboard_token_only_a_pinned_runner_build_is_offered(collector_factory,
                                                                             monkeypatch):
    """With FLEET_DASH_TOKEN set, pinning needs the operator's token while uploading does
    not: an upload alone never reaches the Add-a-device page."""
    monkeypatch.setenv("FLEET_DASH_TOKEN", "operator-secret")
    api = await collector_factory(dash_token="operator-secret")
    planted = await upload(api, b"runner from the network", app="fleet-runner-android",
                           build="9.9.9", name="fleet-runner-9.9.9.apk")
    got = await (await api.get("/api/enroll")).json()
    assert got["runner_apk"] is None and got["runner_pinned_only"] is True
    assert (await api.post(f"/api/artifacts/{planted}/pin", json={"reason": "x"})).status == 401
    ours = await upload(api, b"runner as built by us", app="fleet-runner-android", build="2")
    resp = await api.post(f"/api/artifacts/{ours}/pin", json={"reason": "runner release"},
                          headers={"X-Fleet-Token": "operator-secret"})
    assert resp.status == 200, await resp.text()
    apk = (await (await api.get("/api/enroll")).json())["runner_apk"]
    assert apk["sha256"] == ours and apk["approved"] is True
