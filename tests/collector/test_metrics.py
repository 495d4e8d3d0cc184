"""GET /metrics on the collector: a real collector process with devices in every status, jobs in
every status, beacons, results, an artifact and a stream client, scraped and read back with
prometheus_client's parser; the cache that keeps a scrape storm to one read a second; and the
plan of the jobs count."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import aiohttp
import pytest

from fleet_min.collector.http.metrics import METRICS
from fleet_min.collector.insight import telemetry
from tests.support.collector import (
    CollectorProcess,
    age_rows,
    beacon,
    edit_rows,
    job,
    registration,
    result_row,
    wait_for_polls,
)
from tests.support.metrics import Scrape, check_reply, parse
from tests.support.stream import StreamReader


class Api:
    """A few JSON calls on a live collector, each checked for the status it must get."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http, self.base = http, base

    async def call(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        async with self.http.request(method, self.base + path, json=body) as resp:
            assert resp.status == status, (path, resp.status, await resp.text())
            return await resp.json(content_type=None) if resp.status != 204 else None

    async def poll(self, device: str) -> str:
        spec = await self.call("GET", f"/devices/{device}/next-job")
        return str(spec["job_id"])

    async def scrape(self) -> Scrape:
        async with self.http.get(self.base + "/metrics") as resp:
            return check_reply(resp.status, resp.headers, await resp.text())


async def _seed(api: Api, db_path: Any) -> None:
    for device in ("d1", "d2", "d3", "d4"):
        await api.call("POST", "/devices/register", registration(device))
    await api.call("POST", "/devices/register", registration("temp", ttl_s=60))
    pinned = {"d1": ["dn1", "fl1", "c1"], "d2": [], "d3": ["q1", "q2", "q3", "x1"]}
    for device, ids in pinned.items():
        for job_id in ids:
            await api.call("POST", "/jobs", job(job_id, targets={"device_id": device}), 201)
    await api.call("POST", "/jobs", job("w1", depends_on=["q1"]), 201)
    await api.call("POST", "/jobs", job("e1", targets={"device_id": "d2"},
                                        lease={"max_attempts": 2}), 201)
    await api.call("POST", "/jobs", job("e2", targets={"device_id": "d2"},
                                        lease={"max_attempts": 1}), 201)
    await api.call("POST", "/api/jobs/x1/cancel")
    # d1 runs two jobs to the end (one fails) and holds a third, claimed 100 s after it became
    # claimable.
    assert await api.poll("d1") == "dn1"
    await api.call("POST", "/results", result_row("dn1", "d1", final=True, ok=True))
    await api.call("POST", "/results", result_row("dn1", "d1", final=True, ok=True))  # repeat
    assert await api.poll("d1") == "fl1"
    await api.call("POST", "/results", result_row("fl1", "d1", final=True, ok=False,
                                                  error="boom"))
    age_rows(db_path, "UPDATE jobs SET updated_at = updated_at - 100 WHERE job_id = 'c1'")
    assert await api.poll("d1") == "c1"
    await api.call("POST", "/results", result_row("c1", "d1", iteration=0))
    # d2 lets a lease lapse twice: e2 fails on its only attempt, then e1 is requeued (and
    # claimed again). A device holds one claimed job at a time, so one lapses after the other.
    lapse = ("UPDATE jobs SET lease_deadline = lease_deadline - 100000 "
             "WHERE status = 'claimed' AND claimed_by = 'd2'")
    assert await api.poll("d2") == "e1"
    age_rows(db_path, "UPDATE jobs SET priority = 1 WHERE job_id = 'e2'")
    age_rows(db_path, lapse)
    await api.call("POST", "/jobs/sweep")  # e1 requeued (or the sweep loop got there first)
    assert await api.poll("d2") == "e2"
    age_rows(db_path, lapse)
    await api.call("POST", "/jobs/sweep")  # e2 failed
    assert await api.poll("d2") == "e1"


async def _beacons_and_ages(api: Api, db_path: Any) -> None:
    await api.call("POST", "/results", beacon("d1", battery_pct=80))
    await api.call("POST", "/results", beacon("d2", battery_pct=70))
    age_rows(db_path, "UPDATE devices SET last_beacon_at = last_beacon_at - 400 "
                      "WHERE device_id = 'd2'")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 600 WHERE device_id = 'd3'")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 3600 WHERE device_id = 'd4'")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 600 WHERE device_id = 'temp'")


async def _artifact(api: Api, data: bytes) -> None:
    for _ in range(2):  # the second upload of the same bytes keeps the stored copy
        async with api.http.post(api.base + "/artifacts", data=data) as resp:
            assert resp.status == 201, await resp.text()


def _check_jobs(scrape: Scrape) -> None:
    assert scrape.type_of("fleet_collector_jobs") == "gauge"
    expected = {"queued": 3, "waiting": 1, "claimed": 2, "done": 1, "failed": 2, "cancelled": 1}
    for status, count in expected.items():
        assert scrape.value("fleet_collector_jobs", status=status, workload="benchmark") == \
            count, status


def _check_claims_and_leases(scrape: Scrape) -> None:
    assert scrape.type_of("fleet_collector_claim_wait_seconds") == "histogram"
    # Six claims: dn1, fl1, c1, e1, e2 and e1 again; only c1 had waited 100 s.
    buckets = scrape.buckets("fleet_collector_claim_wait_seconds")
    assert buckets["+Inf"] == 6 and scrape.value("fleet_collector_claim_wait_seconds_count") == 6
    assert buckets["60.0"] == 5 and buckets["120.0"] == 6, buckets
    assert 100 <= scrape.value("fleet_collector_claim_wait_seconds_sum") < 200
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative
    assert scrape.type_of("fleet_collector_lease_expiries") == "counter"
    assert scrape.value("fleet_collector_lease_expiries_total", outcome="requeued") == 1
    assert scrape.value("fleet_collector_lease_expiries_total", outcome="failed") == 1


def _check_devices_and_beacons(scrape: Scrape) -> None:
    for status, count in {"online": 2, "stale": 1, "offline": 1}.items():
        assert scrape.value("fleet_collector_devices", status=status) == count, status
    assert scrape.type_of("fleet_collector_beacon_age_seconds") == "histogram"
    ages = scrape.buckets("fleet_collector_beacon_age_seconds")
    # d1 beaconed just now, d2 400 s ago; the others never did.
    assert ages["300.0"] == 1 and ages["600.0"] == 2 and ages["+Inf"] == 2, ages
    assert scrape.value("fleet_collector_beacon_age_seconds_count") == 2


def _check_ingest_and_store(scrape: Scrape, data: bytes) -> None:
    assert scrape.type_of("fleet_collector_results_ingested") == "counter"
    assert scrape.value("fleet_collector_results_ingested_total", kind="result") == 3
    assert scrape.value("fleet_collector_results_ingested_total", kind="beacon") == 2
    assert scrape.value("fleet_collector_artifacts") == 1
    assert scrape.value("fleet_collector_artifact_bytes") == len(data)
    assert scrape.value("fleet_collector_artifact_uploaded_bytes_total") == 2 * len(data)
    assert scrape.value("fleet_collector_stream_clients") == 1
    assert scrape.value("fleet_collector_waiting_polls") == 0
    assert scrape.value("fleet_collector_db_bytes") > 0
    assert scrape.value("fleet_collector_db_wal_bytes") >= 0
    for stage in ("waiting", "uncommitted"):
        assert scrape.value("fleet_collector_db_writer_queue", stage=stage) >= 0
    assert scrape.value("fleet_collector_db_transactions_total") >= \
        scrape.value("fleet_collector_db_commits_total") > 0
    assert abs(scrape.value("process_start_time_seconds") - time.time()) < 600
    assert scrape.value("process_resident_memory_bytes") > 1 << 20
    assert scrape.value("process_open_fds") > 3


@pytest.mark.slow
async def test_a_live_collector_reports_its_fleet(tmp_path):
    proc = CollectorProcess(tmp_path / "data").start()
    db_path = tmp_path / "data" / "fleet.sqlite3"
    data = b"artifact bytes " * 100
    try:
        async with aiohttp.ClientSession() as http:
            api = Api(http, proc.url)
            await _seed(api, db_path)
            await _beacons_and_ages(api, db_path)
            await _artifact(api, data)
            async with StreamReader(http, proc.url + "/api/stream"):
                scrape = await api.scrape()
    finally:
        proc.stop()
    _check_jobs(scrape)
    _check_claims_and_leases(scrape)
    _check_devices_and_beacons(scrape)
    _check_ingest_and_store(scrape, data)


async def test_a_scrape_storm_reads_the_database_once_until_the_figures_are_stale(client):
    cache = client.server.app[METRICS].cache
    cache.fresh_s = 3600.0
    await client.post("/jobs", json=job("a"))
    replies = await asyncio.gather(*(client.get("/metrics") for _ in range(30)))
    texts = [await reply.text() for reply in replies]
    assert all(reply.status == 200 for reply in replies)
    assert cache.reads == 1
    assert all(parse(text).value("fleet_collector_jobs", status="queued",
                                 workload="benchmark") == 1 for text in texts)
    await client.post("/jobs", json=job("b"))
    cached = parse(await (await client.get("/metrics")).text())
    assert cached.value("fleet_collector_jobs", status="queued", workload="benchmark") == 1
    cache.fresh_s = 0.0  # stale at once: every scrape reads again
    fresh = parse(await (await client.get("/metrics")).text())
    assert fresh.value("fleet_collector_jobs", status="queued", workload="benchmark") == 2
    assert cache.reads == 2


async def test_a_claim_rolled_back_is_not_counted(client, db_path):
    """A claim made inside the enqueue's transaction for a waiting poll, which fails and is
    rolled back to its savepoint (here: a stored spec that is not JSON), leaves no claim wait
    behind: only committed claims are observed."""
    await client.post("/devices/register", json=registration("d"))
    poll = asyncio.ensure_future(client.get("/devices/d/next-job"))
    await wait_for_polls(client, 1)
    edit_rows(db_path, "INSERT INTO jobs (job_id, workload, executor, status, priority, pin, "
                       "max_attempts, ttl_s, spec, created_at, updated_at) VALUES ('bad', "
                       "'benchmark', 'device', 'queued', 10, 'd', 3, 600, '{not json', 0, 0)")
    assert (await client.post("/jobs", json=job("good", targets={"device_id": "d"}))).status \
        == 201
    # Every claim for d trips over the bad row (the dispatcher's own pass too), so the poll
    # never gets a job; it is left waiting and dropped below.
    scrape = parse(await (await client.get("/metrics")).text())
    poll.cancel()
    assert scrape.value("fleet_collector_claim_wait_seconds_count") == 0
    assert scrape.value("fleet_collector_jobs", status="queued", workload="benchmark") == 2


async def test_a_poll_that_finds_nothing_is_counted_without_a_commit(client):
    """Its look wrote nothing, so it was answered with no COMMIT to wait for."""
    await client.post("/devices/register", json=registration("d"))
    before = parse(await (await client.get("/metrics")).text())
    poll = asyncio.ensure_future(client.get("/devices/d/next-job"))
    await wait_for_polls(client, 1)
    after = parse(await (await client.get("/metrics")).text())
    poll.cancel()
    assert after.value("fleet_collector_db_unwritten_transactions_total") == \
        before.value("fleet_collector_db_unwritten_transactions_total") + 1
    assert after.value("fleet_collector_db_commits_total") == \
        before.value("fleet_collector_db_commits_total")


async def test_the_jobs_count_reads_only_its_covering_index(client, db_path):
    await client.post("/jobs", json=job("a"))
    conn = sqlite3.connect(db_path)
    try:
        plan = " | ".join(row[3] for row in conn.execute(
            f"EXPLAIN QUERY PLAN {telemetry.JOBS_BY_STATUS}"))
        program = conn.execute(f"EXPLAIN {telemetry.JOBS_BY_STATUS}").fetchall()
        table_root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'"
                                  ).fetchone()[0]
    finally:
        conn.close()
    # The index holds both columns in the GROUP BY's order: no sort, ...
    assert plan == "SCAN jobs USING INDEX jobs_status_workload", plan
    # ... and no row of the table is read: SQLite names the plan "USING INDEX" only because
    # is_group (the partial index's own condition) is not a column of it; the seek into the
    # table it prepares is deferred, and never made, as no column of the table is read.
    tables = {op[2] for op in program if op[1] == "OpenRead" and op[3] == table_root}
    assert tables and not [op for op in program if op[1] == "Column" and op[2] in tables]


def test_device_figures_follow_the_spec_thresholds():
    now = 10_000.0
    rows = [{"last_seen": now - 10, "last_beacon_at": now - 10, "ttl_s": None},
            {"last_seen": now - 179.9, "last_beacon_at": None, "ttl_s": None},
            {"last_seen": now - 180, "last_beacon_at": now - 5000, "ttl_s": None},
            {"last_seen": now - 900, "last_beacon_at": None, "ttl_s": None},
            {"last_seen": now - 100, "last_beacon_at": now - 100, "ttl_s": 60},  # left
            {"last_seen": now + 5, "last_beacon_at": now + 5, "ttl_s": None}]  # clock skew
    by_status, ages = telemetry.device_figures(rows, now)
    assert by_status == {"online": 3, "stale": 1, "offline": 1}
    assert ages == [10.0, 5000.0, 0.0]


def test_job_samples_give_every_status_of_every_workload():
    samples = telemetry.job_samples({("queued", "benchmark"): 2, ("done", "install"): 1})
    assert len(samples) == 12
    assert (("queued", "benchmark"), 2) in samples and (("done", "benchmark"), 0) in samples
    assert (("done", "install"), 1) in samples and (("queued", "install"), 0) in samples


async def test_workloads_past_the_labelled_ones_are_summed_as_other(client, db_path):
    """Workload names are an open set: one label each made a scrape 22 MB at 25,600 names,
    growing with every new one. The spec's workloads and the OTHER_LABELLED most used others
    keep their label; the rest, and a workload named "other", are summed as workload="other"."""
    assert (await client.post("/jobs", json=job("spec-one"))).status == 201  # benchmark
    # 120 workloads of the clients' own, as open enqueues leave them: the first 50 with three
    # jobs each (two queued, one done), the other 70 with one queued; one more named "other".
    edit_rows(db_path, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
                       "WHERE i < 120), k(j) AS (VALUES (1), (2), (3)) INSERT INTO jobs (job_id, "
                       "workload, executor, status, max_attempts, ttl_s, spec, created_at, "
                       "updated_at) SELECT printf('j-%03d-%d', i, j), printf('w-%03d', i), "
                       "'device', CASE j WHEN 3 THEN 'done' ELSE 'queued' END, 3, 600, '{}', "
                       "0, 0 FROM n, k WHERE i <= 50 OR j = 1")
    edit_rows(db_path, "INSERT INTO jobs (job_id, workload, executor, status, max_attempts, "
                       "ttl_s, spec, created_at, updated_at) VALUES ('named-other', 'other', "
                       "'device', 'queued', 3, 600, '{}', 0, 0)")
    scrape = parse(await (await client.get("/metrics")).text())
    series = scrape.series("fleet_collector_jobs")
    labels = {dict(key)["workload"] for key in series}
    mine = {f"w-{i:03d}" for i in range(1, 51)}
    assert labels == {"benchmark", "other", *mine}
    assert len(series) == (len(labels)) * 6  # every status of each, zeros included
    assert len(labels) <= len(telemetry.SPEC_WORKLOADS) + telemetry.OTHER_LABELLED + 1
    assert scrape.value("fleet_collector_jobs", status="queued", workload="other") == 71
    assert scrape.value("fleet_collector_jobs", status="done", workload="other") == 0
    assert scrape.value("fleet_collector_jobs", status="queued", workload="w-007") == 2
    assert scrape.value("fleet_collector_jobs", status="done", workload="w-050") == 1
    assert scrape.value("fleet_collector_jobs", status="queued", workload="benchmark") == 1
    queued = sum(v for key, v in series.items() if ("status", "queued") in key)
    assert queued == 1 + 50 * 2 + 70 + 1  # nothing lost in the folding


def test_fold_workloads_keeps_the_spec_and_the_most_used_and_sums_the_rest():
    counts = {("queued", "benchmark"): 1, ("queued", "a"): 5, ("done", "b"): 3,
              ("queued", "b"): 2, ("queued", "c"): 5, ("failed", "d"): 1, ("queued", "other"): 9}
    folded = telemetry.fold_workloads(counts, frozenset({"benchmark"}), others=2)
    # b (5) and a (5) tie with c (5): a and b come first by name
    assert folded == {("queued", "benchmark"): 1, ("queued", "a"): 5, ("done", "b"): 3,
                      ("queued", "b"): 2, ("queued", "other"): 14, ("failed", "other"): 1}
    assert sum(folded.values()) == sum(counts.values())
    assert telemetry.fold_workloads({}, frozenset(), others=2) == {}


def test_the_spec_workloads_are_those_the_validator_knows_and_llm_eval():
    from fleet_min import validate

    named = set(validate._WORKLOAD_PARAMS) | set(validate._NAMED_PARAMS)
    assert set(telemetry.SPEC_WORKLOADS) == named | {"llm-eval"}
