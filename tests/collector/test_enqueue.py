"""POST /jobs: single and array bodies, refusals, built-ins, dependencies at enqueue."""

from __future__ import annotations

import asyncio

import pytest

from fleet_min.collector.jobs import queue
from tests.support.collector import job, registration


async def test_single_spec_reply_and_job_row(client):
    resp = await client.post("/jobs", json=job("j1", priority=3))
    assert resp.status == 201
    assert await resp.json() == {"ok": True, "job_id": "j1", "status": "queued"}
    row = await (await client.get("/jobs/j1")).json()
    for key in ("job_id", "workload", "executor", "status", "priority", "claimed_by", "attempts",
                "lease_deadline", "last_error", "parent_job_id", "template_id", "created_at",
                "updated_at", "spec"):
        assert key in row
    assert row["status"] == "queued" and row["priority"] == 3 and row["attempts"] == 0
    assert row["spec"]["job_id"] == "j1"
    assert row["created_at"].endswith("Z")


async def test_duplicate_job_id_is_409_and_changes_nothing(client):
    await client.post("/jobs", json=job("dup", priority=1))
    resp = await client.post("/jobs", json=job("dup", priority=9))
    assert resp.status == 409 and "already exists" in (await resp.json())["error"]
    assert (await (await client.get("/jobs/dup")).json())["priority"] == 1


async def test_a_taken_id_is_refused_by_the_insert_without_undoing_the_batch(client):
    """The id is checked by the INSERT itself: a lone spec whose id is taken writes nothing,
    so the writer has nothing to roll back and replay (its replays stay as they were)."""
    await client.post("/jobs", json=job("taken"))
    replays = (await (await client.get("/api/health")).json())["writer"]["replays"]
    resp = await client.post("/jobs", json=job("taken", priority=5))
    assert resp.status == 409 and (await resp.json())["error"] == "job_id 'taken' already exists"
    assert (await (await client.get("/api/health")).json())["writer"]["replays"] == replays
    assert (await (await client.get("/jobs/taken")).json())["priority"] == 0


async def test_a_fan_out_child_whose_id_is_taken_is_409_and_stores_nothing(client):
    for device in ("pixel", "galaxy"):
        await client.post("/devices/register", json=registration(device))
    await client.post("/jobs", json=job("sweep--pixel"))
    resp = await client.post("/jobs", json=job("sweep", fanout=True))
    assert resp.status == 409
    assert (await resp.json())["error"] == "job_id 'sweep--pixel' already exists"
    for gone in ("sweep", "sweep--galaxy"):
        assert (await client.get(f"/jobs/{gone}")).status == 404


async def test_array_is_atomic(client):
    resp = await client.post("/jobs", json=[job("a1"), job("a2", depends_on=["a1"])])
    assert resp.status == 201
    assert await resp.json() == {"ok": True, "jobs": [{"job_id": "a1", "status": "queued"},
                                                      {"job_id": "a2", "status": "waiting"}]}
    # One bad member refuses the whole array: nothing stored.
    resp = await client.post("/jobs", json=[job("b1"), job("a1")])
    assert resp.status == 409
    assert (await client.get("/jobs/b1")).status == 404
    resp = await client.post("/jobs", json=[job("c1"), job("c2", workload="teleport")])
    assert resp.status == 422
    assert (await client.get("/jobs/c1")).status == 404


async def test_unknown_workload_is_422_naming_the_capability(client):
    resp = await client.post("/jobs", json=job("x", workload="batch"))
    assert resp.status == 422
    assert "batch" in (await resp.json())["error"]
    await client.post("/devices/register", json=registration("d", capabilities=["batch"]))
    assert (await client.post("/jobs", json=job("x", workload="batch"))).status == 201


@pytest.mark.parametrize("executor", ["device", "host"])
async def test_a_declarer_past_the_claimants_a_transaction_reads_is_found(client, executor):
    """The check that a registered claimant declares a job's workload reads at most
    queue.CHECK_IN_TRANSACTION of them inside the transaction; past them the registry is read
    on a worker thread and the enqueue run again. The answers are those of a whole read: a
    job of a workload only a claimant registered after them declares is stored (then again,
    through the claimant remembered), and refused once that claimant is gone or declares
    something else."""
    workload = f"rare-{executor}"
    crowd = queue.CHECK_IN_TRANSACTION + 8
    for i in range(crowd):
        if executor == "device":
            body = registration(f"crowd-{i}", capabilities=["other"])
        else:
            body = {"name": f"crowd-{i}", "capabilities": ["other"]}
        path = "/devices/register" if executor == "device" else "/executors/register"
        assert (await client.post(path, json=body)).status == 200
    late = (registration("late", capabilities=[workload]) if executor == "device"
            else {"name": "late", "capabilities": [workload]})
    assert (await client.post(path, json=late)).status == 200
    for job_id in ("found", "found-again"):
        resp = await client.post("/jobs", json=job(job_id, workload=workload, executor=executor))
        assert resp.status == 201, await resp.text()
    resp = await client.post("/jobs", json=[job("batch-ok", workload=workload, executor=executor),
                                            job("batch-no", workload="nobody", executor=executor)])
    assert resp.status == 422 and "'nobody'" in (await resp.json())["error"]
    assert (await client.get("/jobs/batch-ok")).status == 404
    late["capabilities"] = ["something-else"]
    assert (await client.post(path, json=late)).status == 200
    resp = await client.post("/jobs", json=job("not-found", workload=workload, executor=executor))
    assert resp.status == 422, await resp.text()
    assert f"{workload!r}" in (await resp.json())["error"]


async def test_a_device_without_an_opinion_counts_as_declaring(client):
    await client.post("/devices/register", json=registration("legacy"))
    assert (await client.post("/jobs", json=job("x", workload="vision-eval"))).status == 201


@pytest.mark.parametrize("workload", ["install", "ui-test", "cold-start", "app-soak",
                                      "a11y-audit", "locale-shots", "web-test", "web-shots",
                                      "web-audit", "web-unfurl", "drain", "archive", "digest",
                                      "soak"])
async def test_host_workloads_are_built_in(client, workload):
    resp = await client.post("/jobs", json=job(f"h-{workload}", workload=workload,
                                               executor="host"))
    assert resp.status == 201, await resp.text()


async def test_synthetic_benchmark_is_built_in_but_other_backends_are_not(client):
    assert (await client.post("/jobs", json=job("s1"))).status == 201
    assert (await client.post("/jobs", json=job("s2", backend="llama.cpp"))).status == 422
    assert (await client.post("/jobs", json=job("s3", workload="shell"))).status == 422


@pytest.mark.parametrize("body, fragment", [
    ({"schema": 1, "workload": "benchmark", "executor": "device"}, "job_id"),
    ({**job("x"), "executor": "phone"}, "executor"),
    ({**job("x"), "lease": {"ttl_s": 0}}, "lease.ttl_s"),
    ({**job("x"), "priority": "high"}, "priority"),
    ({**job("x"), "schema": 2}, "schema"),
    ({**job("x"), "targets": {"match": "ram_mb >= "}}, "targets.match"),
    ({**job("x"), "targets": {"match": "model ~ '(a+)+$'"}}, "targets.match"),
    ({**job("x"), "depends_on": ["ghost"]}, "ghost"),
    ({**job("x"), "depends_on": ["x"]}, "itself"),
    ({**job("x"), "params": {"input_sha256": "${jobs.other.artifact}"}}, "depends_on"),
    ({**job("x"), "params": {"api_token": "abc"}}, "secret"),
    ({**job("x"), "model": {"name": "m", "auth": {"password": "hunter2"}}}, "secret"),
])
async def test_malformed_specs_are_400_and_change_nothing(client, body, fragment):
    resp = await client.post("/jobs", json=body)
    assert resp.status == 400, await resp.text()
    assert fragment in (await resp.json())["error"]
    listing = await (await client.get("/api/jobs")).json()
    assert listing["total"] == 0


async def test_token_counts_are_not_mistaken_for_secrets(client):
    resp = await client.post("/jobs", json=job("ok", params={
        "prompt_tokens": 8, "gen_tokens": 8, "warmup_iters": 0, "measure_iters": 1}))
    assert resp.status == 201


async def test_dependency_cycle_in_an_array_is_400(client):
    resp = await client.post("/jobs", json=[job("p", depends_on=["q"]),
                                            job("q", depends_on=["p"])])
    assert resp.status == 400 and "cycle" in (await resp.json())["error"]


async def test_template_reference_where_a_typed_value_is_expected(client):
    resp = await client.post("/jobs", json=[
        job("prep", workload="self-check"),
        job("use", workload="self-check", depends_on=["prep"],
            params={"max_items": "${jobs.prep.metrics.n}"})])
    # self-check is not built in and nobody declared it.
    assert resp.status == 422
    await client.post("/devices/register", json=registration("d"))
    resp = await client.post("/jobs", json=[
        job("prep", workload="self-check"),
        job("use", workload="batch", depends_on=["prep"],
            params={"max_items": "${jobs.prep.metrics.n}"})])
    assert resp.status == 201, await resp.text()


async def test_latest_app_needs_a_published_build(client):
    resp = await client.post("/jobs", json=job("i", workload="install", executor="host",
                                               app={"name": "shelf", "sha256": "latest"}))
    assert resp.status == 400 and "published" in (await resp.json())["error"]


async def test_lease_defaults(client):
    await client.post("/jobs", json=job("short"))
    await client.post("/jobs", json=job("long", workload="drain", executor="host"))
    await client.post("/jobs", json=job("own", lease={"ttl_s": 30, "max_attempts": 5}))
    rows = {j["job_id"]: j for j in (await (await client.get("/api/jobs")).json())["jobs"]}
    assert (rows["short"]["lease_ttl_s"], rows["short"]["max_attempts"]) == (600, 3)
    assert rows["long"]["lease_ttl_s"] == 14400
    assert (rows["own"]["lease_ttl_s"], rows["own"]["max_attempts"]) == (30, 5)


async def test_a_large_body_under_the_limit_is_read_whole(client):
    """A body that arrives in several pieces (hundreds of KiB) is read to its end, not cut."""
    resp = await client.post("/jobs", json=job("big", params={"pad": "x" * 800_000}))
    assert resp.status == 201, await resp.text()
    assert len((await (await client.get("/jobs/big")).json())["spec"]["params"]["pad"]) == 800_000


async def test_a_request_may_create_at_most_10000_jobs_and_64_mib_of_fan_out_children(client):
    """1,000 specs is the batch limit, but each fan-out spec makes a job per device: the jobs
    the request would create are counted (parents and children), and the bytes of its
    children's specs, and past 10,000 jobs or 64 MiB the whole request is refused before the
    fan-out that passes it writes a child."""
    registered = await asyncio.gather(*(client.post("/devices/register", json=registration(
        f"dev{i:03d}")) for i in range(100)))
    assert {resp.status for resp in registered} == {200}
    fanouts = [job(f"fan{i}", fanout=True) for i in range(100)]  # 100 + 100 x 100 = 10,100
    resp = await client.post("/jobs", json=fanouts)
    assert resp.status == 422, (await resp.text())[:300]
    error = (await resp.json())["error"]
    assert error.startswith("this request would create at least 10100 jobs, more than the "
                            "10000 one request may create (fan-out fan99 alone reaches 100 "
                            "targets)"), error
    assert (await client.get("/jobs/fan0")).status == 404
    assert (await client.get("/jobs/fan0--dev000")).status == 404
    assert (await (await client.get("/api/jobs")).json())["total"] == 0
    # The same request less one fan-out, 9,999 jobs, is under the limit and stored whole.
    resp = await client.post("/jobs", json=fanouts[:99])
    assert resp.status == 201, await resp.text()
    assert (await (await client.get("/api/jobs?per_page=1")).json())["total"] == 9999
    # Each child copies its parent's spec: 100 copies of 700 kB would be 70 MB of one request.
    resp = await client.post("/jobs", json=job("wide", fanout=True, params={"pad": "y" * 700_000}))
    assert resp.status == 422
    assert (await resp.json())["error"].startswith(
        "this request's fan-out children would hold at least 70012700 bytes of spec, more than "
        "the 67108864 one request may store (fan-out wide alone: 100 copies of a 700127-byte "
        "spec)")
    assert (await client.get("/jobs/wide")).status == 404
