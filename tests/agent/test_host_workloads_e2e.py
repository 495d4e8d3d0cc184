"""End-to-end: the host workloads enqueued over HTTP on a real collector process and run by a
real host executor process. Android devices and simulators are fake adb, xcrun and flow-runner
executables on its PATH, the archive tools are fakes too, web-audit drives this machine's own
Chromium, web-unfurl reads a local web site, and digest reads the collector back."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import zipfile

import pytest

from tests.support.agent import (
    FAKE_ADB,
    FAKE_BUNDLETOOL,
    FAKE_CHROMIUM,
    FAKE_FLOW_RUNNER,
    FAKE_XCRUN,
    http_bytes,
    make_tool,
    python38,
    wait_for,
)

pytestmark = pytest.mark.slow

PAGE = (b'<!doctype html><html lang="en"><head><title>Sale</title>'
        b'<meta property="og:title" content="Spring sale">'
        b'<meta property="og:image" content="/card.png"></head>'
        b'<body><img src="/card.png"><input name="q"></body></html>')
PNG = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
                    "0000000d49444154789c6360f8cf00000301010018dd8db40000000049454e44ae"
                    "426082")  # one transparent pixel


def host_job(job_id: str, workload: str, **fields) -> dict:
    return {"schema": 1, "job_id": job_id, "workload": workload, "executor": "host", **fields}


def fake_tools(tmp_path, names: dict) -> dict:
    """The fakes in a folder, found the way the real tools are: on PATH (nothing else is)."""
    bin_dir, state = tmp_path / "fake-bin", tmp_path / "devices"
    state.mkdir(parents=True, exist_ok=True)
    for name, body in names.items():
        make_tool(bin_dir, name, body)
    # ps is what a simulator soak reads memory with; the host's own, not a fake
    return {"FAKE_ADB_DIR": str(state), "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
            "FAKE_CRASH_AT": "R5CT1234ABC:3"}


def aab() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("BundleConfig.pb", "cfg")
        bundle.writestr("base/manifest/AndroidManifest.xml", "<manifest/>")
    return buffer.getvalue()


def final_row(collector, job_id: str) -> dict:
    row = next(r for r in collector.results(job_id) if r["final"])
    return row.get("payload") or row


def wait_all(collector, jobs: list[dict], timeout: float = 120) -> dict:
    return {spec["job_id"]: collector.wait_status(spec["job_id"], ("done", "failed"), timeout)
            for spec in jobs}


def start_executor(procs, collector, tmp_path, website) -> tuple:
    site = website({"/": (301, b"", {"location": "/sale"}),
                    "/sale": (200, PAGE, {"content-type": "text/html"}),
                    "/card.png": (200, PNG, {"content-type": "image/png"})})
    env = fake_tools(tmp_path, {"adb": FAKE_ADB, "xcrun": FAKE_XCRUN,
                                "fleet-flow-runner": FAKE_FLOW_RUNNER,
                                "bundletool": FAKE_BUNDLETOOL})
    state = tmp_path / "state-host"  # the executor's --state-dir (AgentProc's naming)
    (state / "credentials").mkdir(parents=True)
    keystore = tmp_path / "upload.jks"
    keystore.write_bytes(b"keystore")
    item = state / "credentials" / "play-upload.json"
    item.write_text(json.dumps({"apps": ["shop"], "keystore": str(keystore),
                                "keystore_password": "s3cret", "key_alias": "upload"}))
    item.chmod(0o600)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    extra = ["--chromium", browser] if browser else []
    # on the oldest Python the agent supports, when this machine has it
    agent = procs.agent([collector], "host", "--executor", "host", "--name", "lab-mac",
                        "--allow-private-urls", *extra, env=env,
                        python=python38() or sys.executable)
    return agent, site, browser


def test_the_host_workloads_through_a_real_collector(procs, tmp_path, website):
    collector = procs.collector()
    agent, site, browser = start_executor(procs, collector, tmp_path, website)
    shop = {"name": "shop", "platform": "android"}
    source = collector.upload(aab(), "shop.aab")
    jobs = [
        host_job("soak", "app-soak", app=shop, targets={"device_id": "R5CT1234ABC"},
                 params={"app_id": "com.example.shop", "duration_s": 5, "interval_s": 1}),
        host_job("a11y", "a11y-audit", targets={"device_id": "emulator-5554"},
                 params={"app_id": "com.example.shop", "variants": ["default", "largest"],
                         "settle_s": 0}),
        host_job("shots", "locale-shots", targets={"device_id": "R5CT1234ABC"},
                 params={"app_id": "com.example.shop", "locales": ["de-DE", "ja-JP"],
                         "settle_s": 0}),
        host_job("drain", "drain", targets={"device_id": "emulator-5554"},
                 params={"duration_s": 2, "interval_s": 1, "track": "level"}),
        host_job("unfurl", "web-unfurl", targets={"url": site.url + "/"}),
        host_job("archive", "archive", params={"source": source, "app": "shop",
                                               "account": "play-upload", "build": "2.0.1"}),
        host_job("ui-1", "ui-test", app=shop, targets={"device_id": "R5CT1234ABC"},
                 suite={"kind": "flow_runner", "flows": "flows/"}),
        host_job("ui-2", "ui-test", app=shop, targets={"device_id": "R5CT1234ABC"},
                 suite={"kind": "flow_runner", "flows": "flows/"}),
        host_job("cold", "cold-start", app=shop, targets={"device_id": "R5CT1234ABC"},
                 params={"app_id": "com.example.shop", "launches": 3}),
    ]
    if browser:
        jobs.append(host_job("audit", "web-audit", targets={"url": site.url + "/sale"},
                             params={"settle_s": 0}))
    for spec in jobs:
        collector.enqueue(spec)
    status = wait_all(collector, jobs)
    # the digest below counts this one as done: say why here if it was not
    assert status["cold"]["status"] == "done", status["cold"].get("last_error")

    # app-soak: a row a pass with memory, the crash on the third launch fails it, by name
    assert status["soak"]["status"] == "failed"
    assert status["soak"]["last_error"].startswith(
        "the app crashed on pass 3 of 5 on R5CT1234ABC: FATAL EXCEPTION: main")
    _, view = collector.get("/api/results/soak?job=soak")
    (series,) = view["series"]
    assert series["device_id"] == "R5CT1234ABC" and series["mem_method"] == "dumpsys-meminfo-pss"
    assert [p["errors"] for p in series["points"]] == [0, 0, 1]
    assert series["mem_growth_mb"] > 0

    # a11y-audit: the small unlabeled button under both fonts, the font scale put back
    assert status["a11y"]["status"] == "failed"
    assert status["a11y"]["last_error"] == ("2 touch targets under 48 dp/pt and 2 unlabeled "
                                            "controls")
    rows = [r for r in collector.results("a11y") if not r["final"]]
    assert sorted(r["variant"] for r in rows) == ["default", "largest"]
    assert all(r["device_id"] == "emulator-5554" and r["executor"] == "lab-mac" for r in rows)
    emulator = tmp_path / "devices" / "emulator-5554.json"
    assert "font_scale" not in json.loads(emulator.read_text())

    # locale-shots: a screenshot a locale, the app's language given back
    assert status["shots"]["status"] == "done", status["shots"]
    shots = final_row(collector, "shots")["artifacts"]
    assert [json.loads(http_bytes(f"{collector.url}/artifacts/{sha}")[8:])[1]
            for sha in shots] == ["de-DE", "ja-JP"]

    # drain: samples off the charger, drain_pct_per_h in the summary, the charger given back
    assert status["drain"]["status"] == "done", status["drain"]
    summary = final_row(collector, "drain")
    assert summary["metrics"]["drain_pct_per_h"] > 0 and summary["metrics"]["samples"] == 3
    assert json.loads(emulator.read_text())["unplugged"] is False

    # web-unfurl: the redirect, the card, the image reached
    assert status["unfurl"]["status"] == "done", status["unfurl"]
    unfurl = final_row(collector, "unfurl")
    assert [h["status"] for h in unfurl["chain"]] == [301, 200]
    assert unfurl["card"]["title"] == "Spring sale" and unfurl["image"]["ok"] is True

    # archive: signed with the executor's own credential, published as shop 2.0.1
    assert status["archive"]["status"] == "done", status["archive"]
    _, listed = collector.get("/api/artifacts?app=shop&platform=android")
    assert [a.get("build") for a in listed["artifacts"]] == ["2.0.1"]
    assert "s3cret" not in json.dumps(collector.results("archive"))

    if browser:  # web-audit in the real Chromium: the image without alt, the unlabeled field
        assert status["audit"]["status"] == "failed"
        assert "1 image without a text alternative, 1 unlabeled form field" in \
            status["audit"]["last_error"]

    # digest: the app's results read back, flaky checkout found, Markdown and HTML kept
    collector.enqueue(host_job("digest", "digest", params={"app": "shop", "days": 1}))
    assert collector.wait_status("digest", ("done", "failed"), 60)["status"] == "done"
    digest = final_row(collector, "digest")
    assert digest["digest"]["flaky"] == ["checkout"]
    rates = {w["workload"]: w for w in digest["digest"]["workloads"]}
    assert (rates["ui-test"]["done"], rates["ui-test"]["failed"]) == (1, 1)
    assert rates["app-soak"]["failed"] == 1 and rates["cold-start"]["done"] == 1
    assert [c["state"] for c in digest["digest"]["cold_start"]] == ["cold"]
    assert digest["digest"]["soak"][0]["errors"] == 1
    markdown, page = (http_bytes(f"{collector.url}/artifacts/{sha}").decode()
                      for sha in digest["artifacts"])
    assert markdown.startswith("# shop: the last day") and "| checkout | 2 | 1 | 1 |" in \
        markdown
    assert page.startswith("<!doctype html>") and "<td>checkout</td>" in page

    # the attached devices are on the shelf, registered by the executor with no capabilities
    for serial in ("R5CT1234ABC", "emulator-5554", "5A1B-SIM"):
        status_code, device = collector.get(f"/api/devices/{serial}")
        assert status_code == 200, device
        assert device["descriptor"]["attached_to"] == "lab-mac"
        assert device["capabilities"] == []
    # the executor registered what it declares, and is listed with its attached devices
    status_code, listed = collector.get("/api/executors")
    assert status_code == 200, listed
    (lab,) = [e for e in listed["executors"] if e["name"] == "lab-mac"]
    assert "cold-start" in lab["capabilities"] and lab["agent"].startswith("fleet_agent ")
    assert {d["device_id"] for d in lab["attached"]} == {"R5CT1234ABC", "emulator-5554",
                                                          "5A1B-SIM"}
    assert "does not take executor registrations" not in agent.log()


def test_each_executor_is_offered_only_what_it_declared(procs, tmp_path):
    collector = procs.collector()
    phones = fake_tools(tmp_path / "phones", {"adb": FAKE_ADB})
    # only its fake adb: a browser installed on this machine would make it declare web-test
    phones["PATH"] = str(tmp_path / "phones" / "fake-bin")
    web = fake_tools(tmp_path / "web", {"chromium": FAKE_CHROMIUM})
    procs.agent([collector], "phones", "--executor", "host", "--name", "phones", env=phones)
    cold = {"app_id": "com.example.shop", "launches": 1}
    collector.enqueue(host_job("cold-1", "cold-start", targets={"device_id": "R5CT1234ABC"},
                               params=cold))
    collector.wait_status("cold-1", ("done",), 30)  # the phone executor is polling
    # queued first, so an executor offered every host job takes it before cold-2
    collector.enqueue(host_job("page", "web-test", targets={"url": "http://shop.test/"}))
    collector.enqueue(host_job("cold-2", "cold-start", targets={"device_id": "R5CT1234ABC"},
                               params=cold))
    collector.wait_status("cold-2", ("done",), 30)
    assert collector.job("page")["status"] == "queued"  # never offered to "phones"
    procs.agent([collector], "web", "--executor", "host", "--name", "web", env=web)
    page = collector.wait_status("page", ("done", "failed"), 30)
    assert page["status"] == "done" and page["claimed_by"] == "web"


def test_a_job_for_a_phone_goes_to_the_executor_it_is_plugged_into(procs, tmp_path):
    collector = procs.collector()
    for name, serial in (("lab-a", "emulator-5554"), ("lab-b", "R5CT1234ABC")):
        env = fake_tools(tmp_path / name, {"adb": FAKE_ADB})
        env.update(PATH=str(tmp_path / name / "fake-bin"), FAKE_ADB_ONLY=serial)
        procs.agent([collector], name, "--executor", "host", "--name", name,
                                  env=env)
    for name, serial in (("lab-a", "emulator-5554"), ("lab-b", "R5CT1234ABC")):
        # each executor's presence round registers its phone as attached to it
        wait_for(lambda serial=serial: collector.get(f"/api/devices/{serial}")[0] == 200,
                 30, what=f"{serial} registered by its executor")
        assert collector.get(f"/api/devices/{serial}")[1]["descriptor"]["attached_to"] == name
    cold = {"app_id": "com.example.shop", "launches": 1}
    jobs = [host_job(f"cold-{serial}-{n}", "cold-start", targets={"device_id": serial},
                     params=cold) for n in range(3)
            for serial in ("emulator-5554", "R5CT1234ABC")]
    for spec in jobs:
        collector.enqueue(spec)
    status = wait_all(collector, jobs, timeout=90)
    for spec in jobs:
        serial = spec["targets"]["device_id"]
        row = status[spec["job_id"]]
        assert row["status"] == "done", row
        assert row["claimed_by"] == ("lab-a" if serial == "emulator-5554" else "lab-b"), row
