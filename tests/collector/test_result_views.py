"""The shaped result views (/api/results/bench, /ui, /drain, /soak) through HTTP against a real
collector, with rows posted the way agents post them."""

from __future__ import annotations

import json

import pytest

from tests.support.collector import (
    age_rows,
    beacon,
    edit_rows,
    ended_before_a_device_listing,
    job,
    registration,
    result_row,
)

# -- helpers -----------------------------------------------------------------------------------


async def device_run(client, job_id, device, iterations, summary=None, ok=True, **spec):
    """Enqueue a device job pinned to `device`, claim it, post its rows and close it."""
    resp = await client.post("/jobs", json=job(job_id, targets={"device_id": device}, **spec))
    assert resp.status == 201, await resp.text()
    claimed = await client.get(f"/devices/{device}/next-job")
    assert claimed.status == 200 and (await claimed.json())["job_id"] == job_id
    for number, metrics in enumerate(iterations, 1):
        await client.post("/results", json=result_row(job_id, device, number, ok=True,
                                                      metrics=metrics))
    await client.post("/results", json=result_row(job_id, device, 0, final=True, ok=ok,
                                                  metrics=summary or {}))


async def host_run(client, job_id, workload, rows, ok=True, closing=None, **spec):
    """A host job claimed by executor `mac`; rows are (device, fields) posted in order, each
    naming the executor that files it under an attached device's id; the closing row, under the
    first row's device, carries `closing`'s fields."""
    resp = await client.post("/jobs", json=job(job_id, workload, "host", **spec))
    assert resp.status == 201, await resp.text()
    claimed = await client.get("/executor/next-job?name=mac")
    assert (await claimed.json())["job_id"] == job_id
    for number, (device, fields) in enumerate(rows, 1):
        await client.post("/results", json=result_row(job_id, device, number, executor="mac",
                                                      **fields))
    await client.post("/results", json=result_row(job_id, rows[0][0] if rows else "x", 0,
                                                  final=True, ok=ok, executor="mac",
                                                  **(closing or {})))


async def get(client, path):
    resp = await client.get(path)
    assert resp.status == 200, await resp.text()
    return await resp.json()


LLAMA = {"name": "llama-3.2-1b", "format": "gguf", "quant": "Q4_K_M"}


# -- bench -------------------------------------------------------------------------------------


async def test_bench_groups_by_device_and_model_with_iteration_samples(client):
    for name in ("pi", "phone"):
        await client.post("/devices/register", json=registration(name))
    await device_run(client, "b1", "pi", [{"decode_tok_s": 10, "prefill_tok_s": 100,
                                           "ttft_ms": 50}, {"decode_tok_s": 12}],
                     summary={"decode_tok_s": 11, "prefill_tok_s": 100})
    await device_run(client, "b2", "pi", [{"decode_tok_s": 14}])
    await device_run(client, "b3", "phone", [{"decode_tok_s": 30}])
    body = await get(client, "/api/results/bench")
    assert body["workload"] == "benchmark" and body["truncated"] is False
    rows = {(r["device_id"], r["model"]): r for r in body["rows"]}
    assert set(rows) == {("pi", "synthetic"), ("phone", "synthetic")}  # model falls to backend
    pi = rows[("pi", "synthetic")]
    # Iteration rows are the samples; b1's summary (11) is not counted a second time.
    assert pi["decode_tok_s"] == {"median": 12.0, "min": 10.0, "max": 14.0, "n": 3}
    assert pi["prefill_tok_s"] == {"median": 100.0, "min": 100.0, "max": 100.0, "n": 1}
    assert pi["ttft_ms"]["n"] == 1 and pi["peak_mem_mb"]["n"] == 0
    assert pi["runs"] == 2 and pi["backends"] == ["synthetic"] and pi["mem_method"] is None
    assert pi["last_at"].endswith("Z")


async def test_bench_never_mixes_memory_measured_differently(client):
    await client.post("/devices/register", json=registration("mac"))
    common = {"backend": "llama.cpp", "model": LLAMA}
    await device_run(client, "m1", "mac", [{"decode_tok_s": 40}],
                     summary={"peak_mem_mb": 900, "mem_method": "wait4-maxrss-darwin"}, **common)
    await device_run(client, "m2", "mac", [{"decode_tok_s": 42}],
                     summary={"peak_mem_mb": 950, "mem_method": "wait4-maxrss-darwin"}, **common)
    await device_run(client, "m3", "mac", [{"decode_tok_s": 41}],
                     summary={"peak_mem_mb": 600, "mem_method": "phys-footprint"}, **common)
    rows = (await get(client, "/api/results/bench"))["rows"]
    by_method = {r["mem_method"]: r for r in rows}
    assert set(by_method) == {"wait4-maxrss-darwin", "phys-footprint"}
    assert all(r["model"] == "llama-3.2-1b" and r["backends"] == ["llama.cpp"] for r in rows)
    maxrss = by_method["wait4-maxrss-darwin"]
    assert maxrss["peak_mem_mb"] == {"median": 925.0, "min": 900.0, "max": 950.0, "n": 2}
    assert maxrss["decode_tok_s"]["n"] == 2 and maxrss["runs"] == 2
    assert by_method["phys-footprint"]["peak_mem_mb"]["n"] == 1


async def test_bench_leaves_out_failed_and_handed_back_rows(client):
    await client.post("/devices/register", json=registration("d"))
    await device_run(client, "bad", "d", [], summary={"decode_tok_s": 999}, ok=False)
    await client.post("/jobs", json=job("pre", targets={"device_id": "d"}, preemptible=True))
    await client.get("/devices/d/next-job")
    await client.post("/results", json=result_row("pre", "d", 1, ok=False,
                                                  metrics={"decode_tok_s": 999}))
    await client.post("/results", json=result_row("pre", "d", 9999, final=True, ok=True,
                                                  preempted=True,
                                                  metrics={"decode_tok_s": 999}))
    rows = (await get(client, "/api/results/bench"))["rows"]
    assert rows == []


async def test_bench_filters(client):
    for name in ("a", "b"):
        await client.post("/devices/register", json=registration(name))
    await device_run(client, "fa", "a", [{"decode_tok_s": 1}])
    await device_run(client, "fb", "b", [{"decode_tok_s": 2}], model={"name": "tiny"})
    only_b = (await get(client, "/api/results/bench?device=b"))["rows"]
    assert [(r["device_id"], r["model"]) for r in only_b] == [("b", "tiny")]
    by_model = (await get(client, "/api/results/bench?model=synthetic"))["rows"]
    assert [r["device_id"] for r in by_model] == ["a"]
    future = (await get(client, "/api/results/bench?from=2999-01-01T00:00:00Z"))["rows"]
    assert future == []
    past = (await get(client, "/api/results/bench?to=2000-01-01"))["rows"]
    assert past == []
    resp = await client.get("/api/results/bench?from=yesterday")
    assert resp.status == 400 and "from" in (await resp.json())["error"]


# -- ui ----------------------------------------------------------------------------------------


async def test_ui_outcomes_per_job_and_flow(client):
    flows = [("emu-1", {"ok": True, "flow": "login"}),
             ("emu-1", {"ok": False, "flow": "checkout", "error": "button not found"}),
             ("emu-2", {"ok": True, "flow": "login"}),
             ("emu-2", {"ok": False, "flow": "checkout", "error": "timed out after 30 s"}),
             ("emu-2", {"ok": True})]
    await host_run(client, "ui1", "ui-test", flows, ok=False,
                   app={"name": "shop", "build": "7"},
                   suite={"kind": "flow_runner", "flows": "flows/"})
    body = await get(client, "/api/results/ui")
    assert body["total"] == 1 and body["per_page"] == 50 and body["workload"] == "ui-test"
    only = body["jobs"][0]
    assert only["job_id"] == "ui1" and only["status"] == "failed" and only["app"] == "shop"
    assert only["pass"] == 3 and only["fail"] == 2
    by_flow = {f["flow"]: f for f in only["flows"]}
    assert set(by_flow) == {"login", "checkout", "iter 5"}
    checkout = by_flow["checkout"]
    assert (checkout["runs"], checkout["pass"], checkout["fail"]) == (2, 0, 2)
    assert checkout["latest_error"] == "timed out after 30 s"
    assert checkout["devices"] == ["emu-1", "emu-2"]
    assert by_flow["login"]["latest_error"] is None and by_flow["login"]["pass"] == 2


async def test_ui_device_filter_counts_that_device_only_and_pages(client):
    await host_run(client, "u1", "ui-test", [("emu-1", {"ok": True, "flow": "f"}),
                                             ("emu-2", {"ok": False, "flow": "f"})])
    await host_run(client, "u2", "ui-test", [("emu-2", {"ok": True, "flow": "f"})])
    body = await get(client, "/api/results/ui?device=emu-1")
    assert [j["job_id"] for j in body["jobs"]] == ["u1"]
    assert body["jobs"][0]["flows"][0]["runs"] == 1 and body["jobs"][0]["fail"] == 0
    both = await get(client, "/api/results/ui")
    assert [j["job_id"] for j in both["jobs"]] == ["u2", "u1"]  # newest first
    assert (await get(client, "/api/results/ui?page=2"))["jobs"] == []
    assert (await client.get("/api/results/ui?page=0")).status == 400


async def test_a_ui_job_of_many_rows_is_read_from_its_newest_5000(client):
    """A host executor may file rows under any device id: 20,000 rows of one ui-test job, each
    a device of its own, made one page 8 MB and held the event loop 3.1 s (a flow's device list
    searched for each row). A job's flows and runs are read from its newest 5,000 rows, and the
    job says so."""
    await host_run(client, "small", "ui-test", [("emu-1", {"ok": True, "flow": "login"})])
    await client.post("/jobs", json=job("big", "ui-test", "host"))
    assert (await (await client.get("/executor/next-job?name=mac")).json())["job_id"] == "big"
    names = [f"d{i:04d}" for i in range(5_200)]
    for start in range(0, len(names), 1_000):
        rows = [result_row("big", name, 1, executor="mac", ok=name != "d5199", flow="login",
                           error=None if name != "d5199" else "no button",
                           test={"passed": 1, "failed": 0}) for name in names[start:start + 1_000]]
        assert (await client.post("/results", json=rows)).status == 200
    body = await get(client, "/api/results/ui")
    big, small = body["jobs"]
    assert (big["job_id"], big["truncated"], small["truncated"]) == ("big", True, False)
    (login,) = big["flows"]
    assert (login["runs"], login["pass"], login["fail"]) == (5_000, 4_999, 1)
    assert login["devices"] == names[200:] and login["attempts"] == [1]
    assert login["latest_error"] == "no button"
    assert len(body["runs"]) == 5_001 and len(body["devices"]) == 5_001
    assert {r["passed"] for r in body["runs"] if r["job_id"] == "big"} == {1}


# -- drain -------------------------------------------------------------------------------------


async def beacons_at(client, db_path, device, points):
    """Post beacons, then move each to `minutes_ago` in the real file: (minutes_ago, pct, chg)."""
    for minutes_ago, pct, charging in points:
        await client.post("/results", json=beacon(device, battery_pct=pct, charging=charging))
        age_rows(db_path, "UPDATE beacons SET at = at - ? WHERE id = (SELECT MAX(id) FROM "
                 "beacons)", (minutes_ago * 60,))


async def test_drain_rate_skips_gaps_and_charging(client, db_path):
    await client.post("/devices/register", json=registration("phone"))
    # 60 -> 58 over 4 minutes (30 %/h), a 20-minute gap (skipped), 50 -> 49 over 2 minutes
    # (30 %/h), then 2 minutes charging (left out).
    await beacons_at(client, db_path, "phone", [
        (40, 60, False), (38, 59, False), (36, 58, False),
        (16, 50, False), (14, 49, False), (12, 55, True)])
    body = await get(client, "/api/results/drain?device=phone&hours=2")
    assert body["metric"] == "drain_pct_per_h" and body["hours"] == 2
    assert body["max_gap_s"] == 300
    (phone,) = body["devices"]
    assert phone["device_id"] == "phone" and phone["samples"] == 6
    assert round(phone["drain_pct_per_h"], 1) == 30.0
    assert round(phone["covered_s"]) == 360 and phone["gaps_skipped"] == 1
    assert round(phone["charging_s"]) == 120
    covered = [h for h in phone["series"] if h["covered_s"] > 0]
    # Each figure is rounded to 0.1 s on its own, so the hours may differ from the total by that.
    assert abs(sum(h["covered_s"] for h in covered) - phone["covered_s"]) <= 0.1 * len(covered)
    assert all(round(h["drain_pct_per_h"], 1) == 30.0 for h in covered)
    assert all(h["drain_pct_per_h"] is None for h in phone["series"] if h["covered_s"] == 0)


async def test_drain_never_extrapolates_a_lone_reading(client, db_path):
    await client.post("/devices/register", json=registration("tv"))
    await beacons_at(client, db_path, "tv", [(30, 80, False), (10, 70, False)])  # 20 min apart
    (tv,) = (await get(client, "/api/results/drain?device=tv"))["devices"]
    assert tv["drain_pct_per_h"] is None and tv["covered_s"] == 0 and tv["gaps_skipped"] == 1


async def test_drain_window_and_bad_hours(client, db_path):
    await client.post("/devices/register", json=registration("old"))
    await beacons_at(client, db_path, "old", [(300, 90, False), (298, 89, False)])
    assert (await get(client, "/api/results/drain?hours=1"))["devices"] == []
    assert len((await get(client, "/api/results/drain?hours=6"))["devices"]) == 1
    for bad in ("0", "169", "x"):
        assert (await client.get(f"/api/results/drain?hours={bad}")).status == 400


# -- soak --------------------------------------------------------------------------------------


async def test_soak_series_per_device_with_memory_and_errors(client):
    samples = [("tab", {"ok": True, "metrics": {"mem_mb": 100, "mem_method": "pss"}}),
               ("tab", {"ok": True, "metrics": {"mem_mb": 130, "mem_method": "pss",
                                                "errors": 2}}),
               ("tab", {"ok": False, "error": "app crashed",
                        "metrics": {"mem_mb": 90, "mem_method": "pss"}}),
               ("tab", {"ok": True, "metrics": {"peak_mem_mb": 400,
                                                "mem_method": "rss"}})]
    await host_run(client, "s1", "app-soak", samples)
    body = await get(client, "/api/results/soak")
    assert body["workloads"] == ["app-soak", "soak"] and body["truncated"] is False
    series = {(s["device_id"], s["mem_method"]): s for s in body["series"]}
    assert set(series) == {("tab", "pss"), ("tab", "rss")}
    pss = series[("tab", "pss")]
    assert [p["mem_mb"] for p in pss["points"]] == [100, 130, 90]
    assert [p["errors"] for p in pss["points"]] == [0, 2, 1]
    assert pss["errors"] == 3 and pss["mem_growth_mb"] == -10
    assert (pss["mem_min_mb"], pss["mem_max_mb"]) == (90, 130)
    assert pss["points"][2]["error"] == "app crashed" and pss["points"][0]["at"].endswith("Z")
    assert series[("tab", "rss")]["points"][0]["mem_mb"] == 400


async def test_soak_filters_and_limit(client):
    await host_run(client, "s2", "soak", [("a", {"ok": True, "metrics": {"mem_mb": i}})
                                          for i in range(5)])
    await host_run(client, "s3", "app-soak", [("b", {"ok": True, "metrics": {"mem_mb": 1}})])
    soak_only = await get(client, "/api/results/soak?workload=soak")
    assert [s["device_id"] for s in soak_only["series"]] == ["a"]
    newest = await get(client, "/api/results/soak?device=a&limit=2")
    assert newest["truncated"] is True
    assert [p["mem_mb"] for p in newest["series"][0]["points"]] == [3, 4]
    assert (await get(client, "/api/results/soak?job=s3"))["series"][0]["device_id"] == "b"
    assert (await client.get("/api/results/soak?workload=benchmark")).status == 400
    assert (await client.get("/api/results/soak?limit=0")).status == 400


# -- numbers past a float's range --------------------------------------------------------------

# A number no float holds is refused at the door now (more than 308 digits), but a database
# from before kept such numbers with every digit, and the views still read it: the rows are
# posted with a stand-in that is then written over in the database file.
HUGE = 987_654_321_987_654  # the stand-in, written over with HUGE_DIGITS below
HUGE_DIGITS = "1" + "0" * 400  # valid JSON, held by no float
NEAR_TOP = 1.7e308  # a finite double; two of them add up to infinity


def store_huge(db_path):
    edit_rows(db_path, "UPDATE results SET metrics = replace(metrics, ?1, ?2), "
                       "extra = replace(extra, ?1, ?2)", (str(HUGE), HUGE_DIGITS))


def strict_json(text):
    """JSON as a browser's JSON.parse reads it: NaN and Infinity are not JSON."""
    def refuse(word):
        raise AssertionError(f"{word} in a JSON body")
    return json.loads(text, parse_constant=refuse)


async def test_numbers_past_a_floats_range_leave_every_view_answering(client, db_path):
    """One device's 400-digit metrics must not take the views down for everyone: each answers
    with JSON, the number that no float holds counts as no figure, and a median of values
    near the top of the range stays finite."""
    await client.post("/devices/register", json=registration("pi"))
    await device_run(client, "big", "pi",
                     [{"decode_tok_s": HUGE, "ttft_ms": NEAR_TOP},
                      {"decode_tok_s": 10, "ttft_ms": NEAR_TOP}],
                     summary={"decode_tok_s": HUGE, "prefill_tok_s": HUGE})
    drained = {"metrics": {"drain_pct_per_h": HUGE, "battery_start_pct": HUGE,
                           "battery_end_pct": 40}}
    await host_run(client, "drain-big", "drain", [("phone", {"ok": True, **drained})],
                   closing=drained)
    await host_run(client, "soak-big", "soak", [
        ("tab", {"ok": True, "metrics": {"mem_mb": HUGE, "peak_mem_mb": HUGE}}),
        ("tab", {"ok": True, "metrics": {"mem_mb": 120}})])
    tested = {"test": {"passed": HUGE, "failed": 1}}
    await host_run(client, "ui-big", "ui-test", [("emu", {"ok": True, "flow": "login", **tested})],
                   closing=tested)
    store_huge(db_path)
    bodies = {}
    for path in ("/api/results/bench", "/api/results/drain", "/api/results/soak",
                 "/api/results/ui", "/dash/legacy", "/dash/legacy/bench", "/dash/legacy/results"):
        resp = await client.get(path)
        assert resp.status == 200, (path, await resp.text())
        if resp.content_type == "application/json":
            bodies[path] = strict_json(await resp.text())
    (pi,) = bodies["/api/results/bench"]["rows"]
    assert pi["decode_tok_s"] == {"median": 10.0, "min": 10.0, "max": 10.0, "n": 1}
    assert pi["ttft_ms"] == {"median": NEAR_TOP, "min": NEAR_TOP, "max": NEAR_TOP, "n": 2}
    (config,) = bodies["/api/results/bench"]["configs"]
    latest = config["devices"][0]["latest"]
    # The summary's decode figure is no number, so the iterations' median stands in.
    assert (latest["decode_tok_s"], latest["prefill_tok_s"]) == (10.0, None)
    (drain,) = bodies["/api/results/drain"]["runs"]
    assert drain["devices"][0]["pct_per_h"] is None
    assert drain["devices"][0]["battery_start_pct"] is None
    assert drain["devices"][0]["battery_end_pct"] == 40
    (tab,) = bodies["/api/results/soak"]["series"]
    assert [p["mem_mb"] for p in tab["points"]] == [None, 120]  # a point with no figure
    (ui,) = bodies["/api/results/ui"]["runs"]
    assert (ui["passed"], ui["failed"]) == (None, 1)


# -- reads bounded however large the rows --------------------------------------------------------

# A row's metrics are open: a device (or a host executor, under any device id) may fill the body
# limit with them. The views read the figures they show, and soak and vision carry metrics cut
# down, so neither the answer nor what the collector builds grows with the rows' size.
PAD = "x" * 900_000
BIG_ROWS = 12  # 12 rows of 900 KB: 10.8 MB that no answer or read may carry whole


async def peak_of(client, path):
    """The answer of GET `path` and the most memory Python held meanwhile (every thread: the
    reader's rows are built in aiosqlite's)."""
    import tracemalloc

    tracemalloc.start()
    try:
        resp = await client.get(path)
        text = await resp.text()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert resp.status == 200, text[:300]
    return strict_json(text), len(text), peak


async def test_bench_reads_only_the_figures_of_rows_near_the_body_limit(client):
    """1,000 rows of 900 KB held the loop 3.2 s and 1.8 GB: every row's metrics were read and
    parsed whole. SQLite reads the four figures and mem_method, and those are still right."""
    await client.post("/devices/register", json=registration("pi"))
    iterations = [{"decode_tok_s": 10 + i, "mem_method": "pss", "pad": PAD}
                  for i in range(BIG_ROWS - 1)]
    await device_run(client, "fat", "pi", iterations,
                     summary={"decode_tok_s": 99, "peak_mem_mb": 700, "pad": PAD})
    body, size, peak = await peak_of(client, "/api/results/bench")
    (row,) = body["rows"]
    assert row["decode_tok_s"] == {"median": 15.0, "min": 10.0, "max": 20.0, "n": 11}
    assert row["peak_mem_mb"] == {"median": 700.0, "min": 700.0, "max": 700.0, "n": 1}
    assert row["ttft_ms"]["n"] == 0
    assert row["mem_method"] == "pss" and row["runs"] == 1
    latest = body["configs"][0]["devices"][0]["latest"]
    assert (latest["decode_tok_s"], latest["peak_mem_mb"]) == (99, 700)  # the summary's
    assert size < 2_000 and peak < 3 << 20, (size, peak)


async def test_soak_and_vision_runs_carry_big_metrics_cut_down(client, db_path):
    """1,000 rows of 900 KB made a vision (or soak) answer of 922 MB and held 3.6 GB: each
    device's newest row's metrics went out whole. Past 2,048 characters they are cut down by
    SQLite to their short fields (`trimmed` says so); small metrics go out whole."""
    figures = {"top1_pct": 91.5, "images_per_s": 3.25, "ok_items": 40, "partial": False,
               "mem_method": "pss", "mem_mb": 120, "note": None, "shape": [1, 2]}
    fat = {**figures, "pad": PAD, "k" * 5_000: 1, "huge": HUGE}
    rows = [(f"cam{i:02d}", {"ok": True, "metrics": fat}) for i in range(BIG_ROWS - 1)]
    rows.append(("slim", {"ok": True, "metrics": {"top1_pct": 80.0, "shape": {"w": 2}}}))
    await client.post("/executors/register", json={"name": "mac",
                                                   "capabilities": ["vision", "soak"]})
    for workload in ("vision", "soak"):
        # The closing row is the executor's own `host:` row, which is not a device.
        await host_run(client, f"{workload}-1", workload, [("host:mac", {}), *rows])
    store_huge(db_path)  # a number no double holds: never written out as `Inf`
    for path in ("/api/results/vision", "/api/results/soak"):
        body, size, peak = await peak_of(client, path)
        (run,) = body["runs"]
        by_device = {d["device_id"]: d for d in run["devices"]}
        assert len(by_device) == BIG_ROWS and run["truncated"] is False
        for name in (f"cam{i:02d}" for i in range(BIG_ROWS - 1)):
            assert by_device[name]["metrics"] == figures and by_device[name]["rows"] == 1
            assert by_device[name]["trimmed"] == ["metrics"]
        slim = by_device["slim"]
        assert slim["metrics"] == {"top1_pct": 80.0, "shape": {"w": 2}} and slim["trimmed"] == []
        whole = await get(client, f"/api/results/{by_device['cam00']['result_id']}")
        assert whole["metrics"]["pad"] == PAD  # the row whole, where `trimmed` sends a reader
        assert size < 30_000 and peak < 3 << 20, (path, size, peak)
    # Soak's own series read their figures the same way: a point per row, per device.
    series = {(s["device_id"], s["mem_method"]): s["points"] for s in body["series"]}
    assert [series[(f"cam{i:02d}", "pss")][0]["mem_mb"] for i in range(BIG_ROWS - 1)] == [
        120] * (BIG_ROWS - 1)


async def test_drain_runs_read_their_figures_of_rows_near_the_body_limit(client):
    fat = {"drain_pct_per_h": 12.5, "battery_start_pct": 90, "battery_end_pct": 65,
           "pad": PAD}
    legacy = {"decode_tok_s": 7, "pad": PAD}
    rows = [(f"ph{i:02d}", {"ok": True, "metrics": fat}) for i in range(BIG_ROWS - 1)]
    rows.append(("old", {"ok": True, "metrics": legacy}))
    await host_run(client, "drain-1", "drain", [("host:mac", {}), *rows])
    body, size, peak = await peak_of(client, "/api/results/drain")
    (run,) = body["runs"]
    by_device = {d["device_id"]: d for d in run["devices"]}
    assert by_device["ph00"]["pct_per_h"] == 12.5
    assert by_device["ph00"]["pct_per_h_inferred"] is False
    assert (by_device["ph00"]["battery_start_pct"], by_device["ph00"]["battery_end_pct"]) == (
        90, 65)
    assert (by_device["old"]["pct_per_h"], by_device["old"]["pct_per_h_inferred"]) == (7, True)
    assert by_device["old"]["battery_start_pct"] is None
    assert size < 10_000 and peak < 3 << 20, (size, peak)


# Beacons written straight into the file, as many as a test needs: (device, count, step_s, pct
# at the newest, pct lost per step), the newest 10 s ago.
def store_beacons(db_path, device, count, step_s, pct=50.0, drop=0.0):
    edit_rows(db_path, """
        WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?2)
        INSERT INTO beacons (device_id, at, body)
        SELECT ?1, (julianday('now') - 2440587.5) * 86400.0 - 10 - i * ?3,
               json_object('battery_pct', ?4 + i * ?5) FROM n""",
              (device, count, step_s, pct, drop))


async def test_drain_lists_a_bounded_number_of_devices_and_says_so(client, db_path):
    """25,000 devices of two beacons made a week's answer 333 MB (an entry per hour per
    device) with the loop held 6.9 s. An answer lists the first 200 devices with a sample, in
    device order, and counts them all; `device` reaches any of them."""
    for i in range(250):
        store_beacons(db_path, f"d{i:03d}", 3, 60, drop=0.5)  # 30 %/h
    store_beacons(db_path, "zz-no-reading", 3, 60)
    edit_rows(db_path, "UPDATE beacons SET body = '{\"battery_pct\": true}' "
                       "WHERE device_id = 'zz-no-reading'")
    body, size, _peak = await peak_of(client, "/api/results/drain?hours=168")
    assert (body["devices_total"], body["cut"], len(body["devices"])) == (250, True, 200)
    assert [d["device_id"] for d in body["devices"]] == [f"d{i:03d}" for i in range(200)]
    assert {d["drain_pct_per_h"] for d in body["devices"]} == {30.0}
    assert {d["samples"] for d in body["devices"]} == {3}
    assert all(len(d["series"]) == 169 for d in body["devices"])
    assert size < 4_000_000, size
    last = await get(client, "/api/results/drain?device=d249")
    assert (last["devices_total"], last["cut"]) == (1, False)
    assert last["devices"][0]["drain_pct_per_h"] == 30.0


async def test_drain_reads_a_bounded_number_of_beacons_and_says_so(client, db_path):
    """Beacons are not capped per device: an answer reads at most 500,000, taking devices in
    order while theirs fit, so no device is listed with part of its window."""
    store_beacons(db_path, "a", 300_000, 1)
    store_beacons(db_path, "b", 250_000, 1)
    both = await get(client, "/api/results/drain?hours=168")
    assert (both["devices_total"], both["cut"]) == (2, True)
    (a,) = both["devices"]
    assert (a["device_id"], a["samples"], a["drain_pct_per_h"]) == ("a", 300_000, 0.0)
    only_b = await get(client, "/api/results/drain?hours=168&device=b")
    assert (only_b["devices_total"], only_b["cut"]) == (1, False)
    assert only_b["devices"][0]["samples"] == 250_000


@pytest.mark.slow
async def test_many_drain_reports_at_once_leave_the_other_reads_their_threads(client, db_path):
    """A drain report reads up to 500,000 beacons on a worker thread. Asked for many at once,
    they took every worker thread and a device listing waited for the first of them to end; at
    most two run at once now and the rest queue behind each other."""
    await client.post("/devices/register", json=registration("d"))
    for i in range(100):
        store_beacons(db_path, f"b{i:03d}", 1000, 60, drop=0.01)

    ended = await ended_before_a_device_listing(client, ["/api/results/drain?hours=168"] * 7)
    assert ended == 0, f"the device listing waited for {ended} drain reports to end"
