"""The claim query itself: the order it offers candidates in, across its branches (jobs pinned to
the claimant and unpinned ones), the plan SQLite runs it with, and its cost in the number of
candidates read. Jobs are
enqueued through a real collector; the query is then run on its SQLite file."""

from __future__ import annotations

import sqlite3

from fleet_min.collector.jobs import claims, rules
from tests.support.collector import job, registration
from tests.support.sqlite_steps import counted_steps


def _candidates(db_path, claimant, workloads, min_priority=None, pairs=None):
    conn = sqlite3.connect(db_path)
    conn.row_factory = sqlite3.Row
    statements: list[str] = []
    conn.set_trace_callback(statements.append)  # with the bound values filled in
    try:
        rows = [row["job_id"] for row in claims._candidates(conn, claimant, workloads,
                                                           min_priority, pairs)]
        plans = [" | ".join(r[3] for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
                 for sql in statements if sql.startswith("SELECT")]
    finally:
        conn.close()
    return rows, plans


async def _enqueue_mixed(client, count):
    """Pinned and unpinned jobs with interleaved priorities: the order to expect."""
    expected = []
    for n in range(count):
        priority = n % 3
        pinned = n % 2 == 0
        spec = job(f"j{n:03d}", priority=priority,
                   **({"targets": {"device_id": "d"}} if pinned else {}))
        resp = await client.post("/jobs", json=spec)
        assert resp.status == 201, await resp.text()
        expected.append((-priority, n, f"j{n:03d}"))
    # Someone else's pinned job is never a candidate for d.
    assert (await client.post("/jobs", json=job("other", targets={"device_id": "e"}))).status \
        == 201
    return [job_id for _, _, job_id in sorted(expected)]


async def test_candidates_come_in_claim_order_across_branches_and_pages(client, db_path):
    for device in ("d", "e"):
        await client.post("/devices/register", json=registration(device))
    expected = await _enqueue_mixed(client, 150)  # more than two pages of 64
    claimant = claims.Claimant("device", "d")
    for workloads in (None, ["benchmark"]):
        rows, plans = _candidates(db_path, claimant, workloads)
        assert rows == expected
        assert len(plans) == 1  # one statement, stepped as far as it is read
        for plan in plans:
            # Both branches read the claim index in its own order and are merged: no sort.
            assert "MERGE (UNION ALL)" in plan and "TEMP B-TREE" not in plan, plan
            assert plan.count("USING INDEX jobs_claim_") == 2, plan


async def test_candidates_honour_the_priority_floor(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    expected = await _enqueue_mixed(client, 12)
    rows, plans = _candidates(db_path, claims.Claimant("device", "d"), ["benchmark"],
                              min_priority=1)
    assert rows == [j for j in expected if int(j[1:]) % 3 >= 1]
    assert all("TEMP B-TREE" not in plan for plan in plans)


async def test_a_claimant_declaring_only_pairings_reads_only_their_jobs(client, db_path):
    """benchmark:jssha is never shown the queue's webcrypto benchmarks, nor build:gradle the
    xcode builds: one short range of jobs_claim_variant per (pin, pairing), merged, no sort."""
    await client.post("/devices/register", json=registration(
        "other", capabilities=["benchmark:webcrypto", "build:xcode"]))
    await client.post("/devices/register", json=registration(
        "d", capabilities=["benchmark:jssha", "build:gradle", "self-check"]))
    specs = [job(f"w{n}", backend="webcrypto") for n in range(70)]
    specs += [job(f"x{n}", workload="build", params={"kind": "xcode"}) for n in range(70)]
    specs += [job("mine-1", backend="jssha", priority=1),
              job("mine-2", workload="build", params={"kind": "gradle"}),
              job("mine-3", workload="self-check", targets={"device_id": "d"})]
    assert (await client.post("/jobs", json=specs)).status == 201
    routes = rules.declared_routes(["benchmark:jssha", "build:gradle", "self-check"])
    assert routes == (["self-check"], [("benchmark", "jssha"), ("build", "gradle")])
    rows, plans = _candidates(db_path, claims.Claimant("device", "d"), routes[0],
                              pairs=routes[1])
    assert rows == ["mine-1", "mine-2", "mine-3"]
    [plan] = plans
    assert "MERGE (UNION ALL)" in plan and "TEMP B-TREE" not in plan, plan
    assert plan.count("USING INDEX jobs_claim_variant") == 4, plan
    assert plan.count("USING INDEX jobs_claim_workload") == 2, plan


async def test_reading_candidates_costs_in_line_with_how_many(client, db_path):
    """Pages found each by a cursor of the last made SQLite walk the priority's range from its
    start for every page: reading 11,000 candidates a device could never take cost a poll
    150 ms, growing with their square. Reading four times the candidates is now about four
    times the work (SQLite's virtual-machine steps, which do not depend on this machine)."""
    await client.post("/devices/register", json=registration("d"))
    for start in range(0, 2400, 600):
        resp = await client.post("/jobs", json=[job(f"n{n}", targets={"device_id": "d"})
                                                for n in range(start, start + 600)])
        assert resp.status == 201, await resp.text()

    def steps(count: int) -> int:
        conn = sqlite3.connect(db_path)
        conn.row_factory = sqlite3.Row
        try:
            with counted_steps(conn, every=10) as taken:
                read = claims._candidates(conn, claims.Claimant("device", "d"), None, None)
                assert len([row for _, row in zip(range(count), read, strict=False)]) == count
                read.close()
        finally:
            conn.close()
        return taken[0]

    small, large = steps(600), steps(2400)
    assert large / small < 6, (small, large)  # 3.9 here; 10.3 with the paged cursor
