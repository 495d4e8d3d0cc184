"""The original collector's read shapes, accepted beside ours (docs/api.md, "Compatibility"):
the overview, devices and their beacon history, the result views by configuration and per run,
/api/system, alerts, artifacts, retention, the sweep, CI status reports, the topic cursor poll,
the legacy pages and the benchmark-regressed alert. Each test sends the bodies the original's
clients send, over HTTP to a real collector."""

from __future__ import annotations

import asyncio
import hashlib

from tests.support.collector import age_rows, beacon, job, registration, result_row

PIXEL = {"model": "Pixel 4a", "soc": "SD730G", "ram_mb": 5793, "os": "android-13"}


async def claim(client, device_id: str) -> dict:
    resp = await client.get(f"/devices/{device_id}/next-job")
    assert resp.status == 200, resp.status
    return await resp.json()


async def get(client, path: str) -> dict:
    resp = await client.get(path)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def run_benchmark(client, device_id: str, job_id: str, decode: float, **spec) -> None:
    """A benchmark the device claims and closes with a summary row (the original's shape)."""
    await client.post("/jobs", json=job(job_id, targets={"device_id": device_id}, **spec))
    assert (await claim(client, device_id))["job_id"] == job_id
    resp = await client.post("/results", json=result_row(
        job_id, device_id, final=True, ok=True,
        metrics={"decode_tok_s": decode, "prefill_tok_s": 61.2, "peak_mem_mb": 812,
                 "mem_method": "pss"}))
    assert resp.status == 200, await resp.text()


# -- overview and devices -------------------------------------------------------------------------


async def test_overview_counts_closed_jobs_schedules_and_flat_batteries(client):
    await client.post("/devices/register", json={"device_id": "pixel", "descriptor": PIXEL,
                                                 "pools": ["ml-capable"]})
    await client.post("/devices/register", json={"device_id": "flat", "descriptor": {}})
    await client.post("/devices/register", json={"device_id": "sim", "descriptor": {}})
    await client.post("/results", json=beacon("flat", battery_pct=7, charging=False,
                                              thermal="nominal"))
    await client.post("/results", json=beacon("sim", battery_pct=-1, charging=False))
    await run_benchmark(client, "pixel", "b1", 10.0)
    created = await client.post("/api/schedules", json={
        "id": "nightly", "cron": "0 3 * * *", "template": {
            "schema": 1, "workload": "benchmark", "executor": "device", "backend": "synthetic",
            "targets": {"device_id": "pixel"}}})
    assert created.status == 201, await created.text()

    overview = await get(client, "/api/overview?fresh=1")
    assert overview["queue"]["done_24h"] == 1 and overview["queue"]["done"] == 1
    assert overview["queue"]["failed_24h"] == 0
    assert overview["schedules"] == {"total": 1, "enabled": 0}
    assert overview["generated_at"].endswith("Z") and overview["generated_at"] == overview["now"]
    # A -1 (a simulator's "no battery") is not flat; 7% and not charging is.
    assert overview["devices"]["low_battery_devices"] == ["flat"]


async def test_device_rows_carry_the_beacon_and_the_network_they_came_from(client):
    await client.post("/devices/register", json={"device_id": "pixel", "descriptor": PIXEL})
    await client.post("/results", json=beacon("pixel", battery_pct=74, charging=True,
                                              thermal="nominal"))
    row = (await get(client, "/api/devices"))["devices"][0]
    assert row["beacon"] == row["last_beacon"] and row["beacon"]["thermal"] == "nominal"
    assert row["last_net"] == "loopback"  # the test client connects over 127.0.0.1


async def test_a_device_with_an_override_still_shows_the_pools_it_reported(client):
    await client.post("/devices/register", json={"device_id": "pixel", "descriptor": PIXEL,
                                                 "pools": ["ml-capable"]})
    resp = await client.patch("/api/devices/pixel", json={"pools": ["shelf-top"]})
    assert resp.status == 200
    detail = await get(client, "/api/devices/pixel")
    assert detail["pools"] == ["shelf-top"]
    assert detail["pools_reported"] == detail["reported_pools"] == ["ml-capable"]


async def test_device_detail_lists_its_jobs_and_benchmarks(client):
    await client.post("/devices/register", json={"device_id": "pixel", "descriptor": PIXEL})
    await client.post("/devices/register", json={"device_id": "other", "descriptor": PIXEL})
    await run_benchmark(client, "pixel", "mine", 10.0)
    await run_benchmark(client, "other", "theirs", 12.0)
    detail = await get(client, "/api/devices/pixel")
    assert [j["job_id"] for j in detail["jobs"]] == ["mine"]
    assert [(b["job_id"], b["metrics"]["decode_tok_s"]) for b in detail["benchmarks"]] == [
        ("mine", 10.0)]


async def test_beacon_history_as_samples_survives_a_forgotten_device(client):
    await client.post("/devices/register", json={"device_id": "gone", "descriptor": {},
                                                 "pools": []})
    for pct in (50, 49):
        await client.post("/results", json=beacon("gone", battery_pct=pct, charging=False,
                                                  thermal="nominal"))
    history = await get(client, "/api/devices/gone/beacons?hours=24")
    assert [s["battery_pct"] for s in history["samples"]] == [50, 49]
    assert [s["ts"] for s in history["samples"]] == [b["at"] for b in history["beacons"]]

    assert (await client.delete("/api/devices/gone")).status == 200
    kept = await get(client, "/api/devices/gone/beacons")
    assert len(kept["samples"]) == 2
    assert (await client.get("/api/devices/never-was/beacons")).status == 404


# -- result views ---------------------------------------------------------------------------------


async def test_bench_view_groups_by_configuration(client):
    await client.post("/devices/register", json={"device_id": "pixel", "descriptor": PIXEL})
    spec = {"model": {"name": "smoke-model", "format": "gguf", "quant": "Q4_K_M",
                      "sha256": "0" * 64}, "backend": "llama.cpp",
            "params": {"prompt_tokens": 512, "gen_tokens": 128, "warmup_iters": 1,
                       "measure_iters": 2}, "targets": {"device_id": "pixel"}}
    await client.post("/jobs", json=job("bench", **spec))
    await claim(client, "pixel")
    for iteration in (1, 2):
        await client.post("/results", json=result_row("bench", "pixel", iteration, metrics={
            "decode_tok_s": 9.8 + iteration, "prefill_tok_s": 61.2, "ttft_ms": 8420,
            "peak_mem_mb": 812, "mem_method": "pss", "thermal": ["nominal"]}))
    await client.post("/results", json=result_row("bench", "pixel", final=True, ok=True, metrics={
        "decode_tok_s": 10.8, "prefill_tok_s": 61.2, "ttft_ms": 8420, "peak_mem_mb": 812,
        "mem_method": "pss", "thermal": ["nominal", "fair"]}))

    configs = (await get(client, "/api/results/bench"))["configs"]
    assert [c["config"] for c in configs] == ["smoke-model Q4_K_M · llama.cpp"]
    [device] = configs[0]["devices"]
    latest = device["latest"]
    assert device["device_id"] == "pixel" and latest["job_id"] == "bench"
    # The run's own summary, decode and prefill apart, with how memory was measured.
    assert latest["decode_tok_s"] == 10.8 and latest["prefill_tok_s"] == 61.2
    assert latest["mem_method"] == "pss"


async def test_ui_view_has_runs_devices_and_a_build_by_device_matrix(client):
    await client.post("/jobs", json=job("ui", workload="ui-test", executor="host",
                                        app={"name": "fleet-runner", "build": "exec-shape"},
                                        suite={"kind": "maestro",
                                               "flows": "fleetrunner/smoke.yaml"}))
    assert (await client.get("/executor/next-job?name=mac")).status == 200
    # The executor files each device's verdict (not final) and then its own host: summary.
    await client.post("/results", json=result_row(
        "ui", "pixel", executor="mac", ok=True, test={"passed": 3, "failed": 0,
                                                      "artifacts": []}))
    await client.post("/results", json=result_row("ui", "host:mac", final=True, ok=True))

    view = await get(client, "/api/results/ui")
    assert view["devices"] == ["pixel"]  # the host: summary is not a device
    [run] = view["runs"]
    assert (run["job_id"], run["device_id"], run["passed"], run["failed"], run["ok"]) == (
        "ui", "pixel", 3, 0, True)
    [row] = view["matrix"]
    assert row["build"] == "fleet-runner exec-shape"
    assert row["cells"] == [{"device": "pixel", "latest": run}]


async def test_drain_runs_read_the_named_field_and_flag_legacy_rows(client):
    for job_id, metrics in (
            ("named", {"battery_start_pct": 90, "battery_end_pct": 60, "drain_pct_per_h": 15}),
            ("legacy", {"battery_start_pct": 90, "battery_end_pct": 60, "decode_tok_s": 15})):
        await client.post("/jobs", json=job(job_id, workload="drain", executor="host",
                                            params={"app_id": "com.taylab.fleetrunner"}))
        assert (await client.get("/executor/next-job?name=mac")).status == 200
        resp = await client.post("/results", json=result_row(
            job_id, "pixel", executor="mac", ok=True, metrics=metrics))
        assert resp.status == 200, await resp.text()
        await client.post("/results", json=result_row(job_id, "host:mac", final=True, ok=True))
    runs = {r["job_id"]: r for r in (await get(client, "/api/results/drain"))["runs"]}
    named, legacy = runs["named"]["devices"][0], runs["legacy"]["devices"][0]
    assert (named["pct_per_h"], named["pct_per_h_inferred"]) == (15, False)
    assert (legacy["pct_per_h"], legacy["pct_per_h_inferred"]) == (15, True)
    assert named["device_id"] == "pixel" and named["battery_start_pct"] == 90


async def test_soak_and_vision_views_list_runs(client):
    await client.post("/devices/register", json=registration("d1"))
    await client.post("/jobs", json=job("soak1", workload="soak"))
    await claim(client, "d1")
    await client.post("/results", json=result_row("soak1", "d1", 1, metrics={"mem_mb": 100}))
    soak = await get(client, "/api/results/soak")
    assert [(r["job_id"], r["devices"][0]["rows"]) for r in soak["runs"]] == [("soak1", 1)]
    assert soak["runs"][0]["truncated"] is False
    assert soak["series"]  # our shape stays beside it
    vision = await get(client, "/api/results/vision")
    assert vision == {"workload": "vision", "runs": []}


async def test_a_vision_run_of_many_devices_counts_each_and_lists_the_first_thousand(client):
    """A host executor may file rows under any device_id: 10,000 devices of one job made the
    view count each device's rows against every row (10.5 s with the loop held). Counts come
    from SQLite; a run lists its first 1,000 devices in device order and says it was cut."""
    await client.post("/executors/register", json={"name": "mac", "capabilities": ["vision"]})
    await client.post("/jobs", json=job("v1", workload="vision", executor="host"))
    assert (await client.get("/executor/next-job?name=mac")).status == 200
    names = [f"d{i:04d}" for i in range(1_200)]
    for start in range(0, len(names), 600):
        rows = [result_row("v1", name, 1, executor="mac", ok=True, metrics={"n": 1})
                for name in names[start:start + 600]]
        assert (await client.post("/results", json=rows)).status == 200
    again = [result_row("v1", "d0005", i, executor="mac", ok=i < 3, metrics={"n": i})
             for i in (2, 3)] + [result_row("v1", "host:mac", 0, executor="mac", final=True)]
    assert (await client.post("/results", json=again)).status == 200
    (run,) = (await get(client, "/api/results/vision"))["runs"]
    assert run["truncated"] is True
    assert [d["device_id"] for d in run["devices"]] == names[:1_000]
    assert [d["rows"] for d in run["devices"]] == [3 if n == "d0005" else 1 for n in names[:1_000]]
    newest = run["devices"][5]
    assert (newest["ok"], newest["metrics"]) == (False, {"n": 3})


# -- system, retention and the sweep --------------------------------------------------------------


async def test_system_reports_db_counts_artifact_files_and_ci(client):
    await client.post("/jobs", json=job("j1"))
    await client.post("/artifacts", data=b"bytes", headers={
        "content-type": "application/octet-stream"})
    system = await get(client, "/api/system")
    assert system["db"]["counts"]["jobs"] == 1 and system["db"]["counts"] == system["tables"]
    assert system["artifacts"]["files"] == 1 == system["artifacts"]["count"]
    assert system["ci"] == {"armed": False}


async def test_retention_takes_windows_in_days_and_dry_runs_by_default(client, db_path):
    await client.post("/devices/register", json=registration("d1"))
    for _ in range(2):
        await client.post("/results", json=beacon("d1", battery_pct=80))
    age_rows(db_path, "UPDATE beacons SET at = at - 10 * 86400 WHERE id = 1")

    dry = await client.post("/api/system/retention", json={"beacon_days": 3650,
                                                          "event_days": 3650})
    body = await dry.json()
    assert dry.status == 200 and body["dry_run"] is True
    assert body["would_delete"] == {"beacons": 0, "events": 0, "alerts": 0}
    week = await (await client.post("/api/system/retention", json={"beacon_days": 7})).json()
    assert week["would_delete"]["beacons"] == 1
    assert len((await get(client, "/api/devices/d1/beacons"))["beacons"]) == 2  # a dry run

    applied = await (await client.post("/api/system/retention",
                                       json={"beacon_days": 7, "apply": True})).json()
    assert applied["dry_run"] is False and applied["tables"]["beacons"]["deleted"] == 1
    for bad in ({"beacon_days": 0}, {"beacon_days": "7"}, {"beacons_days": 7}):
        resp = await client.post("/api/system/retention", json=bad)
        assert resp.status == 400 and "error" in await resp.json()


async def test_the_sweep_runs_through_the_guarded_route(collector_factory, monkeypatch):
    monkeypatch.setenv("FLEET_DASH_TOKEN", "t" * 32)
    client = await collector_factory()
    assert (await client.post("/api/system/sweep", json={})).status == 401
    resp = await client.post("/api/system/sweep", json={}, headers={"X-Fleet-Token": "t" * 32})
    body = await resp.json()
    assert resp.status == 200 and body["requeued"] == [] and body["failed"] == []


# -- alerts ---------------------------------------------------------------------------------------


async def test_alerts_list_webhook_and_thresholds(client):
    listing = await get(client, "/api/alerts")
    assert listing["webhook"] is False
    assert listing["thresholds"]["scheduleLateS"] == 300
    assert listing["thresholds"]["batteryPct"] == 15


async def test_alert_status_names_acked_and_snoozed_and_filters_by_them(client):
    for device_id in ("batt", "hot"):
        await client.post("/devices/register", json={"device_id": device_id,
                                                     "descriptor": {"model": "AlertTest"},
                                                     "pools": []})
    await client.post("/results", json=beacon("batt", battery_pct=6, charging=False,
                                              thermal="nominal"))
    await client.post("/results", json=beacon("hot", battery_pct=90, thermal="critical"))
    await client.post("/api/alerts/tick", json={})
    alerts = {a["subject"]: a for a in (await get(client, "/api/alerts"))["alerts"]}
    batt, hot = alerts["batt"]["id"], alerts["hot"]["id"]
    assert alerts["batt"]["status"] == "open"

    acked = await (await client.post(f"/api/alerts/{batt}/ack", json={})).json()
    assert acked["status"] == "acked" and acked["state"] == "open"  # ours keeps its meaning
    snoozed = await (await client.post(f"/api/alerts/{hot}/snooze",
                                       json={"minutes": 30})).json()
    assert snoozed["status"] == "snoozed"

    def ids(listing: dict) -> set[int]:
        return {a["id"] for a in listing["alerts"]}

    assert ids(await get(client, "/api/alerts?state=acked")) == {batt}
    assert ids(await get(client, "/api/alerts?state=snoozed")) == {hot}
    assert ids(await get(client, "/api/alerts?state=open")) == {batt, hot}  # ours: muted too
    assert ids(await get(client, "/api/alerts?state=open,resolved")) == set()

    await client.post("/results", json=beacon("batt", battery_pct=90, charging=True,
                                              thermal="nominal"))
    await client.post("/api/alerts/tick", json={})
    every = await get(client, "/api/alerts?state=open,acked,snoozed,resolved")
    resolved = next(a for a in every["alerts"] if a["id"] == batt)
    assert resolved["state"] == resolved["status"] == "resolved"
    assert resolved["first_seen"] and resolved["resolved_at"]
    assert (await client.get("/api/alerts?state=acked,bogus")).status == 400


async def test_a_benchmark_under_its_own_median_raises_an_alert(client):
    await client.post("/devices/register", json={
        "device_id": "reg", "descriptor": {"model": "Regressor", "os": "android-14",
                                           "ram_mb": 8000},
        "pools": [], "capabilities": ["benchmark"]})
    model = {"name": "qwen-test", "format": "gguf", "quant": "Q4_K_M", "sha256": "b" * 64}
    for i in range(5):
        await run_benchmark(client, "reg", f"reg-{i}", 100, model=model)
    quiet = await (await client.post("/api/alerts/tick")).json()
    assert quiet["opened"] == []
    await run_benchmark(client, "reg", "reg-5", 66, model=model)
    await client.post("/api/alerts/tick")
    [alert] = [a for a in (await get(client, "/api/alerts"))["alerts"]
               if a["rule"] == "benchmark-regressed"]
    assert alert["subject"] == "reg qwen-test Q4_K_M · synthetic"
    assert "34% under the median 100" in alert["detail"]
    # A run back at its usual speed resolves it.
    await run_benchmark(client, "reg", "reg-6", 99, model=model)
    await client.post("/api/alerts/tick")
    assert not [a for a in (await get(client, "/api/alerts?state=open"))["alerts"]
                if a["rule"] == "benchmark-regressed"]


# -- artifacts ------------------------------------------------------------------------------------


async def test_gc_candidates_count_and_unpinning_through_the_pin_route(client):
    data = b"pin-me"
    sha = hashlib.sha256(data).hexdigest()
    await client.post("/artifacts", data=data, headers={
        "content-type": "application/octet-stream", "x-artifact-name": "pin.bin"})
    gc = await get(client, "/api/artifacts/gc-candidates?days=0")
    assert gc["count"] == 1 and [c["sha256"] for c in gc["candidates"]] == [sha]

    pinned = await client.post(f"/api/artifacts/{sha}/pin", json={"pinned": True,
                                                                  "reason": "smoke"})
    assert (await pinned.json())["pinned"] is True
    assert (await client.delete(f"/api/artifacts/{sha}")).status == 409
    assert (await get(client, "/api/artifacts/gc-candidates?days=0"))["count"] == 0
    unpinned = await client.post(f"/api/artifacts/{sha}/pin", json={"pinned": False})
    assert unpinned.status == 200 and (await unpinned.json())["pinned"] is False
    assert (await client.delete(f"/api/artifacts/{sha}")).status == 200
    bad = await client.post(f"/api/artifacts/{sha}/pin", json={"pinned": "no"})
    assert bad.status in (400, 404)


async def test_gc_candidates_never_offer_what_a_closed_job_named(client):
    model = b"fake-gguf-model" * 1000
    sha = hashlib.sha256(model).hexdigest()
    await client.post("/artifacts", data=model, headers={
        "content-type": "application/octet-stream", "x-artifact-name": "smoke.gguf"})
    await client.post("/devices/register", json=registration("d1"))
    await run_benchmark(client, "d1", "bench", 10.0,
                        model={"name": "smoke-model", "format": "gguf", "quant": "Q4_K_M",
                               "sha256": sha})
    gc = await get(client, "/api/artifacts/gc-candidates?days=0")
    # Ours lets a closed job's input go; the original's list keeps it.
    assert [a["sha256"] for a in gc["artifacts"]] == [sha]
    assert gc["candidates"] == [] and gc["count"] == 0


# -- CI status reports and the topic cursor poll -------------------------------------------------


async def test_status_reports_list_dry_runs(client):
    # Commit statuses are a host job's (the spec's rule): the executor closes it failed.
    await client.post("/jobs", json=job("ci", workload="install", executor="host",
                                        app={"name": "x", "build": "1", "sha256": "a" * 64},
                                        report_to={"github_status": "acme/app@deadbeef"}))
    assert (await client.get("/executor/next-job?name=mac")).status == 200
    await client.post("/results", json=result_row("ci", "host:mac", final=True, ok=False))
    for _ in range(200):  # the reporter records after the commit, off the request
        reports = await get(client, "/status-reports")
        if any(r["state"] == "failure" for r in reports):
            break
        await asyncio.sleep(0.05)
    row = next(r for r in reports if r["job_id"] == "ci" and r["state"] == "failure")
    assert row["posted"] == 0 and "dry run" in row["detail"]
    assert row["target"] == "acme/app@deadbeef"


async def test_the_cursor_poll_hands_out_one_event_at_a_time(client):
    first = await (await client.post("/events/smoke-topic", json={"prompt": "first"})).json()
    second = await (await client.post("/events/smoke-topic", json={"prompt": "second"})).json()
    assert second["id"] > first["id"] and first["id"] == first["seq"]
    one = await get(client, "/events/smoke-topic/poll?after=0")
    assert one["payload"] == {"prompt": "first"} and one["id"] == first["id"]
    two = await get(client, f"/events/smoke-topic/poll?after={one['id']}")
    assert two["payload"] == {"prompt": "second"}
    none = await client.get(f"/events/smoke-topic/poll?after={two['id']}&wait_s=0")
    assert none.status == 204


# -- the legacy pages -----------------------------------------------------------------------------


async def test_legacy_overview_shows_jobs_benchmarks_and_gave_up(client):
    await client.post("/devices/register", json={"device_id": "pixel", "descriptor": PIXEL})
    await run_benchmark(client, "pixel", "bench-job", 10.8)
    await client.post("/jobs", json=job("lease-job", targets={"device_id": "pixel"},
                                        lease={"ttl_s": 4, "max_attempts": 1}))
    await claim(client, "pixel")
    await client.post("/results", json=result_row("lease-job", "pixel", final=True, ok=False))

    html = await (await client.get("/dash/legacy")).text()
    assert "bench-job" in html and "lease-job" in html
    assert "10.8 tok/s" in html and "gave up after 1/1 attempts" in html
    assert 'href="/dash/legacy/bench"' in html
    bench = await (await client.get("/dash/legacy/bench")).text()
    assert "Fleet Benchmarks" in bench and 'href="/dash/legacy"' in bench
    assert "synthetic" in bench and "10.8 tok/s" in bench
