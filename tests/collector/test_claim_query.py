"""The claim query itself: the order it offers candidates in, across its branches (jobs pinned to
the claimant and unpinned ones) and across pages, and the plan SQLite runs it with. Jobs are
enqueued through a real collector; the query is then run on its SQLite file."""

from __future__ import annotations

import sqlite3

from fleet_min.collector import queue
from tests.support.collector import job, registration


def _candidates(db_path, claimant, workloads, min_priority=None):
    conn = sqlite3.connect(db_path)
    conn.row_factory = sqlite3.Row
    statements: list[str] = []
    conn.set_trace_callback(statements.append)  # with the bound values filled in
    try:
        rows = [row["job_id"] for row in queue._candidates(conn, claimant, workloads,
                                                           min_priority)]
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
    claimant = queue.Claimant("device", "d")
    for workloads in (None, ["benchmark"]):
        rows, plans = _candidates(db_path, claimant, workloads)
        assert rows == expected
        assert len(plans) == 3  # three pages, each found by the cursor of the last
        for plan in plans:
            # Both branches read the claim index in its own order and are merged: no sort.
            assert "MERGE (UNION ALL)" in plan and "TEMP B-TREE" not in plan, plan
            assert plan.count("USING INDEX jobs_claim_") == 2, plan


async def test_candidates_honour_the_priority_floor(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    expected = await _enqueue_mixed(client, 12)
    rows, plans = _candidates(db_path, queue.Claimant("device", "d"), ["benchmark"],
                              min_priority=1)
    assert rows == [j for j in expected if int(j[1:]) % 3 >= 1]
    assert all("TEMP B-TREE" not in plan for plan in plans)
