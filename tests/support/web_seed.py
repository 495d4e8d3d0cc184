"""Real data for the browser tests: devices, beacons, jobs in every status, results, schedules,
artifacts, alerts and topics, all put into a live collector through its own HTTP API."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tests.support.collector import HttpClient, beacon, job, registration, result_row
from tests.support.images import png_bytes, with_stripe


@dataclass
class Seeded:
    """Ids the tests look for on the pages."""

    devices: list[str] = field(default_factory=list)
    jobs: dict[str, str] = field(default_factory=dict)  # role -> job id
    artifact: str = ""
    schedule: str = ""


APP_BUILD = b"app build 41 " * 100  # the pinned release build's bytes


def ok(reply: tuple[int, Any], *codes: int) -> Any:
    status, body = reply
    assert status in (codes or (200, 201)), (status, body)
    return body


def upload(base: str, data: bytes, **headers: str) -> str:
    req = urllib.request.Request(base + "/artifacts", data=data, method="POST", headers={
        "Content-Type": "application/octet-stream", **headers})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(json.loads(resp.read())["sha256"])


def claim(c: HttpClient, device_id: str) -> dict[str, Any]:
    status, spec = c.get(f"/devices/{device_id}/next-job", timeout=10)
    assert status == 200, (status, spec)
    return dict(spec)


def devices(c: HttpClient, s: Seeded) -> None:
    phone = registration("pixel-7", descriptor={
        "platform": "android", "kind": "phone", "model": "Pixel 7", "soc": "Tensor G2",
        "ram_mb": 8192, "os": "Android 14", "arch": "arm64"},
        pools=["phones", "nightly"], capabilities=["benchmark", "self-check", "pipeline"])
    pi = registration("pi5", pools=["sbc"], capabilities=["benchmark", "self-check", "shell"])
    tablet = registration("ipad-air", descriptor={
        "platform": "ios", "kind": "tablet", "model": "iPad Air", "ram_mb": 8192,
        "os": "iPadOS 17"}, pools=["tablets"], capabilities=["benchmark"])
    for body in (phone, pi, tablet):
        ok(c.post("/devices/register", body))
        s.devices.append(body["device_id"])
    ok(c.request("PATCH", "/api/devices/pixel-7",
                  {"name": "Pixel on the shelf", "notes": "left USB hub, port 2"}))
    for pct, thermal in ((92, "nominal"), (88, "nominal"), (81, "fair"), (77, "fair")):
        ok(c.post("/results", beacon("pixel-7", battery_pct=pct, charging=False,
                                     thermal=thermal, mem_mb=5200)))
    # The constraint fields under the names the agents in the field send (decisions.md).
    for load in (0.4, 0.7):
        ok(c.post("/results", beacon("pi5", thermal="nominal", mem_mb=2100, load_1m=load,
                                     on_ac=True, idle_s=None)))
    ok(c.post("/results", beacon("ipad-air", battery_pct=9, charging=False, thermal="serious")))


def bench_done(c: HttpClient, s: Seeded) -> None:
    spec = job("bench-pi", params={"prompt_tokens": 4, "gen_tokens": 2, "warmup_iters": 0,
                                   "measure_iters": 3}, targets={"device_id": "pi5"})
    ok(c.post("/jobs", spec))
    claim(c, "pi5")
    for i, (p, d) in enumerate(((410.0, 120.0), (402.5, 118.0), (415.2, 121.5)), start=1):
        ok(c.post("/results", result_row("bench-pi", "pi5", i, ok=True, final=False, metrics={
            "prefill_tok_s": p, "decode_tok_s": d, "ttft_ms": 12.5 + i})))
    ok(c.post("/results", result_row("bench-pi", "pi5", 0, ok=True, final=True, metrics={
        "prefill_tok_s": 410.0, "decode_tok_s": 120.0, "ttft_ms": 13.5,
        "synthetic_digest": "ab" * 32, "synthetic_rounds": 6000}, device={"model": "Pi 5"})))
    s.jobs["done"] = "bench-pi"


def running_and_failed(c: HttpClient, s: Seeded) -> None:
    ok(c.post("/jobs", job("bench-phone", params={"prompt_tokens": 64, "gen_tokens": 16,
                                                  "measure_iters": 5},
                           targets={"device_id": "pixel-7"}, lease={"ttl_s": 900})))
    claim(c, "pixel-7")
    ok(c.post("/results", result_row("bench-phone", "pixel-7", 1, ok=True, final=False,
                                     metrics={"prefill_tok_s": 95.0, "decode_tok_s": 31.0})))
    ok(c.post("/results", beacon("pixel-7", "bench-phone", battery_pct=75, charging=False,
                                 thermal="fair")))
    s.jobs["running"] = "bench-phone"
    # ipad-air did not declare self-check, so this one stays queued (pi5 declared it).
    ok(c.post("/jobs", job("selfcheck-ipad", workload="self-check",
                           targets={"device_id": "ipad-air"})))
    ok(c.post("/jobs", job("selfcheck-pi", workload="self-check",
                           targets={"device_id": "pi5"})))
    claim(c, "pi5")
    ok(c.post("/results", result_row("selfcheck-pi", "pi5", 0, ok=False, final=True,
                                     error="the state directory is not writable (<b>x</b>)")))
    s.jobs["failed"] = "selfcheck-pi"


def queued_and_waiting(c: HttpClient, s: Seeded) -> None:
    chain = [job("chain-make", workload="self-check", targets={"pool": "nightly"}),
             job("chain-bench", depends_on=["chain-make"],
                 params={"prompt_tokens": 8, "gen_tokens": 4}, priority=5)]
    ok(c.post("/jobs", chain))
    s.jobs["queued"] = "chain-make"
    s.jobs["waiting"] = "chain-bench"
    ok(c.post("/jobs", job("fan-bench", fanout=True, targets={"match": "ram_mb >= 4096"},
                           params={"prompt_tokens": 8, "gen_tokens": 4})))
    s.jobs["fanout"] = "fan-bench"
    ok(c.post("/jobs", job("to-cancel", targets={"device_id": "ipad-air"},
                           params={"prompt_tokens": 8, "gen_tokens": 4})))
    s.jobs["cancel"] = "to-cancel"


def ui_test(c: HttpClient, s: Seeded) -> None:
    ok(c.post("/executors/register", {
        "name": "mac-mini", "slots": 2, "agent": "fleet_agent 0.9.0",
        "capabilities": ["cold-start", "install", "ui-test:flow_runner", "web-audit",
                         "web-test"]}))
    ok(c.post("/jobs", job("ui-login", workload="ui-test", executor="host",
                           app={"name": "shelf-app", "build": "41", "sha256": s.artifact},
                           suite={"kind": "flow_runner", "flows": "flows/*.yaml"})))
    status, spec = c.get("/executor/next-job?name=mac-mini", timeout=10)
    assert status == 200, (status, spec)
    for i, (flow, passed) in enumerate((("login", True), ("checkout", False)), start=1):
        row = result_row("ui-login", "pixel-7", i, ok=passed, final=False, flow=flow,
                         executor="mac-mini")
        if not passed:
            row["error"] = "checkout button was not visible after 10 s"
        ok(c.post("/results", row))
    ok(c.post("/results", result_row("ui-login", "pixel-7", 0, ok=False, final=True,
                                     error="1 of 2 flows failed", executor="mac-mini")))
    s.jobs["ui"] = "ui-login"


def artifacts_and_schedules(c: HttpClient, s: Seeded) -> None:
    s.artifact = upload(c.base, APP_BUILD, **{
        "x-artifact-name": "shelf-app-41.apk", "x-artifact-app": "shelf-app",
        "x-artifact-build": "41", "x-artifact-platform": "android"})
    upload(c.base, b"orphan report", **{"x-artifact-name": "old-report.html"})
    ok(c.post(f"/api/artifacts/{s.artifact}/pin", {"reason": "golden run for release 4.1"}))
    ok(c.post("/api/schedules", {"id": "nightly-bench", "cron": "0 3 * * *", "template": {
        "schema": 1, "workload": "benchmark", "executor": "device", "backend": "synthetic",
        "params": {"prompt_tokens": 16, "gen_tokens": 8}, "targets": {"pool": "sbc"}}}))
    ok(c.request("PATCH", "/api/schedules/nightly-bench", {"enabled": True}))
    ok(c.post("/api/schedules", {"id": "weekly-selfcheck", "cron": "@weekly", "template": {
        "schema": 1, "workload": "self-check", "executor": "device"}}))
    ok(c.post("/api/schedules/nightly-bench/run"))
    s.schedule = "nightly-bench"
    ok(c.post("/api/templates", {"id": "sbc-bench", "name": "SBC benchmark", "spec": {
        "schema": 1, "workload": "benchmark", "executor": "device", "backend": "synthetic",
        "params": {"prompt_tokens": 16, "gen_tokens": 8}, "targets": {"pool": "sbc"}}}))
    ok(c.post("/api/templates", {"id": "weekly-selfcheck", "name": None, "spec": {
        "schema": 1, "workload": "self-check", "executor": "device"}}))


def alerts_and_topics(c: HttpClient) -> None:
    ok(c.post("/api/alerts/tick"))
    ok(c.post("/api/events/camera-frames?source=pixel-7", {"frame": 1, "objects": ["cat"]}))
    ok(c.post("/api/events/camera-frames?source=pixel-7", {"frame": 2, "objects": []}))
    ok(c.post("/api/events/build-log", {"line": "<script>alert(1)</script> compiled"}))


def seed(c: HttpClient) -> Seeded:
    s = Seeded()
    devices(c, s)
    bench_done(c, s)
    running_and_failed(c, s)
    queued_and_waiting(c, s)
    artifacts_and_schedules(c, s)
    ui_test(c, s)
    alerts_and_topics(c)
    return s


# -- a busier shelf: what a page looks like after weeks of use ----------------------------------

SHELF = (  # device id, name, platform, kind, model, os, ram MB, pools
    ("galaxy-s23", "Galaxy S23 Ultra (left shelf, USB hub port 4)", "android", "phone",
     "Samsung Galaxy S23 Ultra", "Android 14 (One UI 6.1)", 12288, ["phones", "flagship"]),
    ("pixel-8-pro", "Pixel 8 Pro", "android", "phone", "Pixel 8 Pro", "Android 15", 12288,
     ["phones", "flagship"]),
    ("oneplus-12", None, "android", "phone", "OnePlus 12", "Android 14", 16384, ["phones"]),
    ("moto-g54", "Moto G54 (budget reference)", "android", "phone", "moto g54 5G", "Android 13",
     4096, ["phones", "budget"]),
    ("rpi5-kitchen", "Raspberry Pi 5 in the kitchen", "linux", "sbc", "Raspberry Pi 5 Model B",
     "Debian 12 (bookworm)", 8192, ["boards"]),
    ("orangepi-5-plus", None, "linux", "sbc", "Orange Pi 5 Plus (RK3588)", "Ubuntu 22.04", 16384,
     ["boards", "npu"]),
    ("jetson-orin-nano", "Jetson Orin Nano devkit", "linux", "sbc",
     "NVIDIA Jetson Orin Nano 8GB", "JetPack 6.0", 8192, ["boards", "gpu"]),
    ("macbook-air-m2", "MacBook Air M2 (Ana's)", "macos", "laptop", "MacBook Air (M2, 2022)",
     "macOS 14.5", 16384, ["laptops"]),
    ("thinkpad-x1-carbon-gen11", None, "linux", "laptop", "ThinkPad X1 Carbon Gen 11",
     "Fedora 40", 32768, ["laptops"]),
    ("nvidia-shield-tv", "Shield TV in the living room", "android", "tv", "NVIDIA SHIELD TV Pro",
     "Android TV 11", 3072, ["tvs"]),
)
MODELS = ("phi-3-mini-4k-instruct-q4_k_m", "llama-3.2-1b-instruct", "qwen2.5-0.5b-instruct",
          "gemma-2-2b-it")
FAILURES = (
    "adb: device 'R5CT30XYZ9K' not found; is USB debugging still authorised on the phone?",
    "llama.cpp exited with status 137 after 212 s (killed: out of memory while loading the "
    "model weights)",
    "thermal state reached 'critical' during decode; the run was stopped to protect the device",
    "the model file checksum did not match: expected 9f2c4e…, got 31ab07…",
)


def shelf_devices(c: HttpClient, s: Seeded) -> None:
    for device_id, name, platform, kind, model, os_name, ram, pools in SHELF:
        ok(c.post("/devices/register", registration(device_id, descriptor={
            "platform": platform, "kind": kind, "model": model, "os": os_name, "ram_mb": ram},
            pools=pools, capabilities=["benchmark", "self-check"])))
        if name:
            ok(c.request("PATCH", f"/api/devices/{device_id}", {"name": name}))
        for pct in (96, 90, 83):
            ok(c.post("/results", beacon(device_id, battery_pct=pct, charging=pct > 90,
                                         thermal="nominal", mem_mb=ram // 3, load=1.2)))
        s.devices.append(device_id)
    # An emulator the executor mac-mini drives, as it registers it: nothing polls for it.
    ok(c.post("/devices/register", registration("emulator-5554", capabilities=[], descriptor={
        "platform": "android", "kind": "phone", "model": "sdk_gphone64_x86_64",
        "os": "Android 14", "serial": "emulator-5554", "attached_to": "mac-mini",
        "simulator": False, "emulator": True})))
    ok(c.post("/executors/register", {"name": "linux-builder-with-a-long-name-01",
                                      "capabilities": ["build:gradle", "web-shots"]}))


def shelf_bench(c: HttpClient, n: int, device_id: str, model: str, failed: bool) -> str:
    job_id = f"bench-{model}-{device_id}-{n:03d}"
    ok(c.post("/jobs", job(job_id, backend="llama.cpp", model={"name": model, "quant": "q4_k_m"},
                           params={"prompt_tokens": 512, "gen_tokens": 128, "measure_iters": 3},
                           targets={"device_id": device_id},
                           constraints={"min_battery_pct": 20}, lease={"ttl_s": 3600})))
    assert claim(c, device_id)["job_id"] == job_id
    scale = 1 + (n % 7) / 3
    for i in range(1, 4):
        ok(c.post("/results", result_row(job_id, device_id, i, ok=True, final=False, metrics={
            "prefill_tok_s": round(90 * scale + i, 2), "decode_tok_s": round(11 * scale + i / 3, 2),
            "ttft_ms": round(640 / scale + i, 1), "peak_mem_mb": 1800 + 40 * i})))
    final = result_row(job_id, device_id, 0, ok=not failed, final=True, metrics={
        "decode_tok_s": round(11 * scale, 2), "mem_method": "VmHWM"})
    if failed:
        final["error"] = FAILURES[(n // 4) % len(FAILURES)]
    ok(c.post("/results", final))
    return job_id


def shelf_jobs(c: HttpClient, s: Seeded) -> None:
    """Dozens of jobs in every status on the shelf's devices, benchmarks of four models."""
    ids = [d[0] for d in SHELF]
    for n in range(32):  # done and failed
        shelf_bench(c, n, ids[n % len(ids)], MODELS[n % len(MODELS)], failed=n % 4 == 3)
    for n, device_id in enumerate(ids[:6]):  # claimed, running
        job_id = f"selfcheck-running-{device_id}-{n:03d}"
        ok(c.post("/jobs", job(job_id, workload="self-check", targets={"device_id": device_id},
                               lease={"ttl_s": 7200})))
        assert claim(c, device_id)["job_id"] == job_id
        ok(c.post("/results", beacon(device_id, job_id, battery_pct=80, thermal="fair")))
    for n in range(12):  # cancelled
        job_id = f"bench-cancelled-{n:03d}"
        ok(c.post("/jobs", job(job_id, targets={"device_id": ids[n % len(ids)]},
                               params={"prompt_tokens": 8, "gen_tokens": 4})))
        ok(c.post(f"/api/jobs/{job_id}/cancel"))
    for n in range(12):  # queued, then waiting on them
        device_id = ids[n % len(ids)]
        first = f"nightly-selfcheck-{device_id}-{n:03d}"
        ok(c.post("/jobs", [
            job(first, workload="self-check", targets={"device_id": device_id}, priority=n - 6),
            job(f"nightly-bench-after-selfcheck-{device_id}-{n:03d}", depends_on=[first],
                model={"name": MODELS[n % len(MODELS)]}, backend="llama.cpp",
                targets={"device_id": device_id})]))


def shelf_artifacts(c: HttpClient) -> None:
    for n in range(8):
        upload(c.base, f"nightly build {n} ".encode() * 400, **{
            "x-artifact-name": f"shelf-app-release-candidate-4.{n}.0-arm64-v8a-signed.apk",
            "x-artifact-app": "shelf-app", "x-artifact-build": f"4.{n}.0-rc{n}",
            "x-artifact-platform": "android"})


SHOTS_URL = "http://shop.example/pricing"


def shots_run(c: HttpClient, job_id: str, shots: dict[str, bytes | None]) -> dict[str, str]:
    """A web-shots job as a host executor runs it: a row per profile with its PNG."""
    ok(c.post("/jobs", job(job_id, workload="web-shots", executor="host",
                           targets={"url": SHOTS_URL, "executor": "shots-host"},
                           params={"browser": ["chromium", "android-device"]})))
    status, spec = c.get("/executor/next-job?name=shots-host", timeout=10)
    assert status == 200 and spec["job_id"] == job_id, (status, spec)
    hashes = {}
    for number, (profile, image) in enumerate(shots.items(), 1):
        browser, _, serial = profile.partition("@")
        sha = upload(c.base, image, **{"x-artifact-name": f"shot-{job_id}-{number}.png"}) \
            if image is not None else None
        if sha:
            hashes[profile] = sha
        ok(c.post("/results", result_row(
            job_id, "shots-host", number, ok=sha is not None, executor="shots-host",
            browser=browser, serial=serial or None, artifacts=[sha] if sha else [],
            error=None if sha else "no Android device is attached for the android-device "
                                   "profile")))
    ok(c.post("/results", result_row(job_id, "shots-host", 0, final=True, ok=True,
                                     executor="shots-host")))
    return hashes


def shelf_visual(c: HttpClient) -> None:
    """Two runs of a web-shots suite: the first accepted as the baselines, the second with one
    profile diverged, one matching, one that failed to capture and one new."""
    first = shots_run(c, "shots-pricing-1", {"chromium": png_bytes(320, 200),
                                             "android-device@R5CT30XYZ9K": png_bytes(108, 240),
                                             "android-device@emulator-5554": png_bytes(108, 240)})
    for profile, sha in first.items():
        ok(c.post("/api/visual/baselines/accept", {
            "suite": "shop.example", "page": "/pricing", "profile": profile, "sha256": sha,
            "job_id": "shots-pricing-1"}), 201)
    shots_run(c, "shots-pricing-2", {"chromium": png_bytes(320, 200, with_stripe(24)),
                                     "android-device@R5CT30XYZ9K": png_bytes(108, 240),
                                     "android-device@emulator-5554": None,
                                     "webkit": png_bytes(320, 200)})


def seed_shelf(c: HttpClient) -> Seeded:
    """Everything `seed` puts in, and a busier shelf on top: a dozen devices with long names,
    dozens of jobs in every status, benchmarks of four models, failures with long sentences
    and release builds. For pages that must read well with realistic amounts of data."""
    s = seed(c)
    shelf_devices(c, s)
    shelf_jobs(c, s)
    shelf_artifacts(c)
    shelf_visual(c)
    ok(c.post("/api/alerts/tick"))
    return s
