"""The host executor against a real collector, driving fake `adb`, suite tool and Chromium
executables that behave like the real tools (argv, output format, exit codes)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import pytest

from tests.support.agent import (
    FAKE_ADB,
    FAKE_CHROMIUM,
    FAKE_FLOW_RUNNER,
    FAKE_XCRUN,
    PNG,
    http_bytes,
    http_json,
    make_tool,
)

pytestmark = pytest.mark.slow

def host_job(job_id: str, workload: str, **fields) -> dict:
    return {"schema": 1, "job_id": job_id, "workload": workload, "executor": "host", **fields}


@pytest.fixture
def fakes(tmp_path):
    bin_dir = tmp_path / "fake-bin"
    state = tmp_path / "adb-state"
    state.mkdir()
    return {"adb": make_tool(bin_dir, "adb", FAKE_ADB),
            "xcrun": make_tool(bin_dir, "xcrun", FAKE_XCRUN),
            "runner": make_tool(bin_dir, "fleet-flow-runner", FAKE_FLOW_RUNNER),
            "chromium": make_tool(bin_dir, "chromium", FAKE_CHROMIUM),
            "state": state}


def on_path(fakes: dict) -> dict:
    """The fakes found the way the real tools are: first on PATH."""
    return {"FAKE_ADB_DIR": str(fakes["state"]),
            "PATH": f"{fakes['adb'].parent}{os.pathsep}{os.environ['PATH']}"}


def app_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("Payload/Shop.app/Info.plist", "<plist/>")
        bundle.writestr("Payload/Shop.app/Shop", "binary")
    return buffer.getvalue()


def calls(state: Path) -> list[list[str]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


def test_host_executor_drives_attached_devices(procs, fakes):
    collector = procs.collector()
    apk = b"PK\x03\x04 fake apk bytes"
    apk_sha = collector.upload(apk, "app.apk")
    ios_sha = collector.upload(app_zip(), "Shop.zip")
    jobs = [
        host_job("inst", "install", app={"name": "shop", "build": "42", "sha256": apk_sha,
                                         "platform": "android"}),
        host_job("cold", "cold-start", targets={"device_id": "R5CT1234ABC"},
                 params={"app_id": "com.example.shop", "launches": 5, "states": ["cold", "hot"]}),
        host_job("ui", "ui-test", targets={"device_id": "emulator-5554"},
                 app={"name": "shop", "platform": "android"},
                 suite={"kind": "flow_runner", "flows": "flows/"}),
        host_job("shots", "web-shots", targets={"url": "http://shop.test/"},
                 params={"browser": ["chromium", "android-device"], "settle_s": 0}),
        host_job("page", "web-test", targets={"url": "http://shop.test/"},
                 params={"browser": "chromium", "expect_text": "Hello shelf"}),
        host_job("inst-ios", "install", app={"name": "shop", "build": "42", "sha256": ios_sha,
                                             "platform": "ios"}),
        host_job("no-tv", "install", app={"name": "shop", "build": "42", "sha256": apk_sha,
                                          "platform": "tvos"}),
        host_job("gone", "cold-start", targets={"device_id": "R9-missing"},
                 params={"app_id": "com.example.shop"}),
        host_job("no-tool", "archive", params={"source": "a" * 64, "app": "shop",
                                               "account": "play"}),
    ]
    for spec in jobs:
        collector.enqueue(spec)
    procs.agent([collector], "host", "--executor", "host", "--name", "bench-host",
                env=on_path(fakes))
    final = {spec["job_id"]: collector.wait_status(spec["job_id"], ("done", "failed"), 40)
             for spec in jobs if spec["job_id"] != "no-tool"}

    # install: downloaded by hash, verified, installed on both attached Android devices
    assert final["inst"]["status"] == "done", final["inst"]
    installed = [json.loads(x) for x in
                 (fakes["state"] / "installed.jsonl").read_text().splitlines()]
    assert sorted((serial, sha) for serial, sha, _ in installed) == [
        ("R5CT1234ABC", apk_sha), ("emulator-5554", apk_sha)]
    assert all(path.endswith(".apk") for _, _, path in installed)
    rows = collector.results("inst")
    assert {r["device_id"] for r in rows if r["iter"] > 0} == {"R5CT1234ABC", "emulator-5554"}
    # filed under the attached devices' ids, each row names the executor that holds the job
    assert {r["executor"] for r in rows} == {"bench-host"}

    # cold-start: p50/p95 per launch state from `am start -W` TotalTime
    assert final["cold"]["status"] == "done", final["cold"]
    rows = {r.get("state"): r for r in collector.results("cold") if r["iter"] > 0}
    assert rows["cold"]["metrics"]["p50_ms"] == 820 and rows["cold"]["metrics"]["p95_ms"] == 840
    assert rows["hot"]["metrics"]["p50_ms"] == 170 and rows["hot"]["metrics"]["launches"] == 5
    assert all(r["device_id"] == "R5CT1234ABC" for r in rows.values())
    adb_calls = calls(fakes["state"])
    assert ["-s", "R5CT1234ABC", "shell", "am", "force-stop", "com.example.shop"] in adb_calls

    # ui-test: one row per flow, the report kept as an artifact, the verdict names the failure
    assert final["ui"]["status"] == "failed"
    assert final["ui"]["last_error"] == "1 of 3 flows failed: checkout"
    ui_rows = collector.results("ui")
    flows = {r["flow"]: r for r in ui_rows if r["iter"] > 0}
    assert sorted(flows) == ["checkout", "login", "logout"]
    assert flows["checkout"]["error"] == "Pay button not found" and flows["login"]["ok"]
    report_sha = next(r for r in ui_rows if r["final"])["artifacts"][0]
    status, report = http_json("GET", f"{collector.url}/artifacts/{report_sha}")
    assert status == 200 and report["device"] == "emulator-5554"

    # web-shots: Chromium plus one shot per attached Android device
    assert final["shots"]["status"] == "done", final["shots"]
    shot_rows = [r for r in collector.results("shots") if r["iter"] > 0]
    assert sorted(r["browser"] for r in shot_rows) == ["android-device", "android-device",
                                                       "chromium"]
    for row in shot_rows:
        assert http_bytes(f"{collector.url}/artifacts/{row['artifacts'][0]}").startswith(PNG[:8])
    assert final["page"]["status"] == "done", final["page"]

    # clean failures, each with a sentence
    assert final["inst-ios"]["status"] == "done", final["inst-ios"]
    simctl = [json.loads(x) for x in (fakes["state"] / "xcrun.jsonl").read_text().splitlines()]
    install = next(c for c in simctl if c[:2] == ["simctl", "install"])
    assert install[2] == "5A1B-SIM" and install[3].endswith("Shop.app")
    assert final["no-tv"]["status"] == "failed"
    assert final["no-tv"]["last_error"] == "no tvos targets are attached to this executor"
    assert final["gone"]["last_error"] == "device R9-missing is not attached to this executor"
    # no bundletool, xcodebuild or apksigner here: archive is not declared, so the collector
    # never offers it (everything else was offered and ran meanwhile)
    assert collector.job("no-tool")["status"] == "queued"
    _, listed = collector.get("/api/executors")
    (bench,) = listed["executors"]
    assert "archive" not in bench["capabilities"] and "install" in bench["capabilities"]


def test_a_host_build_with_the_wrong_hash_is_not_installed(procs, fakes):
    collector = procs.collector()
    apk = b"PK\x03\x04 original"
    sha = collector.upload(apk, "app.apk")
    stored = [p for p in collector.data.rglob("*") if p.is_file() and p.read_bytes() == apk]
    assert len(stored) == 1
    stored[0].write_bytes(b"PK\x03\x04 swapped!")
    collector.enqueue(host_job("bad-apk", "install", targets={"executor": "bench-host-2"},
                               app={"name": "shop", "build": "1", "sha256": sha,
                                    "platform": "android"}))
    # A second executor with no phone attached gets a job pinned to it.
    collector.enqueue(host_job("no-phone", "cold-start",
                               targets={"device_kind": "android", "executor": "empty-host"},
                               params={"app_id": "com.example.shop"}))
    procs.agent([collector], "host2", "--executor", "host", "--name", "bench-host-2",
                "--adb", str(fakes["adb"]), env={"FAKE_ADB_DIR": str(fakes["state"])})
    procs.agent([collector], "host3", "--executor", "host", "--name", "empty-host",
                "--adb", str(fakes["adb"]), env={"FAKE_ADB_DIR": str(fakes["state"]),
                                                 "FAKE_ADB_EMPTY": "1"})
    job = collector.wait_status("bad-apk", ("done", "failed"), 30)
    assert job["status"] == "failed" and "altered or corrupted" in job["last_error"]
    assert not (fakes["state"] / "installed.jsonl").exists()
    assert hashlib.sha256(stored[0].read_bytes()).hexdigest() != sha
    job = collector.wait_status("no-phone", ("done", "failed"), 30)
    assert job["last_error"] == "no android targets are attached to this executor"
