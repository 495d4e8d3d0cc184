"""Every transition of the spec's state table after the claim, driven over HTTP."""

from __future__ import annotations

import asyncio
import importlib.util
import json

from tests.support.collector import age_rows, beacon, job, registration, result_row

SHA_A = "a" * 64
SHA_B = "b" * 64


async def claim(client, device_id):
    resp = await client.get(f"/devices/{device_id}/next-job")
    return None if resp.status == 204 else await resp.json()


async def status_of(client, job_id):
    return (await (await client.get(f"/jobs/{job_id}")).json())


async def setup_claimed(client, job_id="j", device="d", **fields):
    await client.post("/devices/register", json=registration(device))
    await client.post("/jobs", json=job(job_id, **fields))
    got = await claim(client, device)
    assert got["job_id"] == job_id


# -- results -----------------------------------------------------------------------------------


async def test_final_ok_closes_done(client):
    await setup_claimed(client)
    for i in (1, 2):
        resp = await client.post("/results", json=result_row("j", "d", i, metrics={
            "decode_tok_s": 10.0 + i}))
        assert (await resp.json())["status"] == "claimed"
    resp = await client.post("/results", json=result_row("j", "d", 0, final=True, ok=True))
    assert (await resp.json())["status"] == "done"
    row = await status_of(client, "j")
    assert row["status"] == "done" and row["finished_at"]
    listing = await (await client.get("/api/results?job=j")).json()
    assert listing["total"] == 3 and listing["per_page"] == 50 and listing["pages"] == 1


async def test_final_not_ok_fails_with_the_error(client):
    await setup_claimed(client)
    await client.post("/results", json=result_row("j", "d", 0, final=True, ok=False,
                                                  error="the model file is missing"))
    row = await status_of(client, "j")
    assert row["status"] == "failed" and row["last_error"] == "the model file is missing"


async def test_rows_are_idempotent(client):
    await setup_claimed(client)
    first = await (await client.post("/results", json=result_row(
        "j", "d", 1, metrics={"x": 1}))).json()
    again = await (await client.post("/results", json=result_row(
        "j", "d", 1, metrics={"x": 2}))).json()
    assert first["duplicate"] is False and again["duplicate"] is True
    listing = await (await client.get("/api/results?job=j")).json()
    assert listing["total"] == 1 and listing["results"][0]["metrics"] == {"x": 1}


async def test_a_final_row_from_someone_else_does_not_close(client):
    await setup_claimed(client)
    await client.post("/devices/register", json=registration("intruder"))
    await client.post("/results", json=result_row("j", "intruder", 0, final=True, ok=True))
    assert (await status_of(client, "j"))["status"] == "claimed"


async def test_result_for_an_unknown_job_is_404(client):
    await client.post("/devices/register", json=registration("d"))
    resp = await client.post("/results", json=result_row("nope", "d", 0))
    assert resp.status == 404


async def test_an_array_of_rows_is_applied_in_order_in_one_request(client):
    await setup_claimed(client)
    rows = [result_row("j", "d", i, metrics={"decode_tok_s": float(i)}) for i in (1, 2, 3)]
    rows.append(result_row("j", "d", 2, metrics={"decode_tok_s": 99.0}))  # a repeat
    rows.append(result_row("j", "d", 0, final=True, ok=True))
    resp = await client.post("/results", json=rows)
    assert resp.status == 200
    body = await resp.json()
    assert body["ok"] is True
    assert [r["duplicate"] for r in body["results"]] == [False, False, False, True, False]
    assert [r["status"] for r in body["results"]] == ["claimed"] * 4 + ["done"]
    assert (await status_of(client, "j"))["status"] == "done"
    listing = await (await client.get("/api/results?job=j")).json()
    assert listing["total"] == 4
    by_iter = {r["iter"]: r["metrics"] for r in listing["results"]}
    assert by_iter[2] == {"decode_tok_s": 2.0}  # the repeat changed nothing


async def test_an_array_with_a_bad_row_stores_nothing(client):
    await setup_claimed(client)
    good = result_row("j", "d", 1, metrics={"x": 1})
    cases = [
        ([good, result_row("j", "d", "two")], 400, "row 1: iter"),
        ([good, beacon("d", "j", battery_pct=50)], 400, "row 1: an array holds result rows"),
        ([good, result_row("nope", "d", 2)], 404, "row 1: no job 'nope'"),
        ([], 400, "the array of result rows is empty"),
        ([good] * 1001, 400, "at most 1000 result rows"),
        ([good, 7], 400, "row 1:"),
    ]
    for rows, status, words in cases:
        resp = await client.post("/results", json=rows)
        assert resp.status == status, (rows[:2], await resp.text())
        assert (await resp.json())["error"].startswith(words), words
    listing = await (await client.get("/api/results?job=j")).json()
    assert listing["total"] == 0
    assert (await status_of(client, "j"))["status"] == "claimed"
    resp = await client.post("/results", json="a string")
    assert resp.status == 400
    assert "an array of result rows" in (await resp.json())["error"]


async def test_results_listing_filters_and_pages(client):
    await setup_claimed(client, workload="benchmark")
    for i in range(1, 61):
        await client.post("/results", json=result_row("j", "d", i))
    page1 = await (await client.get("/api/results?job=j&page=1")).json()
    page2 = await (await client.get("/api/results?job=j&page=2")).json()
    assert (page1["total"], page1["pages"], len(page1["results"]), len(page2["results"])) == (
        60, 2, 50, 10)
    assert (await (await client.get("/api/results?device=other")).json())["total"] == 0
    assert (await (await client.get("/api/results?workload=benchmark")).json())["total"] == 60
    assert (await (await client.get("/api/results?from=2000-01-01T00:00:00Z")).json())[
        "total"] == 60
    assert (await (await client.get("/api/results?to=2000-01-01T00:00:00Z")).json())[
        "total"] == 0
    assert (await client.get("/api/results?from=yesterday")).status == 400
    assert (await client.get("/api/results?page=0")).status == 400


# -- beacons and leases ------------------------------------------------------------------------


async def test_beacon_renews_only_the_claimants_lease(client, db_path):
    await setup_claimed(client, lease={"ttl_s": 60})
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 50")
    before = (await status_of(client, "j"))["lease_deadline"]
    reply = await (await client.post("/results", json=beacon("d", "j", battery_pct=80))).json()
    assert reply == {"lease_renewed": True, "preempt": False}
    assert (await status_of(client, "j"))["lease_deadline"] > before
    await client.post("/devices/register", json=registration("other"))
    reply = await (await client.post("/results", json=beacon("other", "j"))).json()
    assert reply["lease_renewed"] is False
    history = await (await client.get("/api/devices/d/beacons")).json()
    assert history["beacons"][-1]["battery_pct"] == 80


async def test_beacon_from_an_unknown_device_is_404(client):
    resp = await client.post("/results", json=beacon("ghost"))
    assert resp.status == 404 and "register" in (await resp.json())["error"]


async def test_sweep_requeues_then_fails_on_the_final_attempt(client, db_path):
    await setup_claimed(client, lease={"ttl_s": 30, "max_attempts": 2})
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 100")
    swept = await (await client.post("/jobs/sweep")).json()
    assert swept == {"ok": True, "requeued": ["j"], "failed": []}
    row = await status_of(client, "j")
    assert row["status"] == "queued" and "lease expired" in row["last_error"]
    assert (await claim(client, "d"))["attempt"] == 2
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 100")
    swept = await (await client.post("/jobs/sweep")).json()
    assert swept["failed"] == ["j"]
    row = await status_of(client, "j")
    assert row["status"] == "failed" and "final attempt" in row["last_error"]


async def test_sweep_runs_on_its_own(collector_factory, db_path):
    client = await collector_factory(sweep_s=0.2)
    await setup_claimed(client, lease={"ttl_s": 30})
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 100")
    import asyncio
    for _ in range(50):
        if (await status_of(client, "j"))["status"] == "queued":
            break
        await asyncio.sleep(0.1)
    assert (await status_of(client, "j"))["status"] == "queued"


# -- release -----------------------------------------------------------------------------------


async def test_release_hands_the_attempt_back(client):
    await setup_claimed(client)
    resp = await client.post("/jobs/j/release", json={"device_id": "d"})
    assert await resp.json() == {"ok": True, "job_id": "j", "status": "queued"}
    row = await status_of(client, "j")
    assert row["status"] == "queued" and row["attempts"] == 0 and row["claimed_by"] is None


async def test_release_refusals(client):
    await setup_claimed(client)
    resp = await client.post("/jobs/j/release", json={"device_id": "someone-else"})
    assert resp.status == 409
    await client.post("/results", json=result_row("j", "d", 1))
    resp = await client.post("/jobs/j/release", json={"device_id": "d"})
    assert resp.status == 409 and "result rows" in (await resp.json())["error"]
    assert (await client.post("/jobs/ghost/release", json={"device_id": "d"})).status == 404
    assert (await client.post("/jobs/j/release", json={})).status == 400


# -- preemption --------------------------------------------------------------------------------


async def test_preempt_only_for_strictly_higher_priority_to_the_same_claimant(client):
    await setup_claimed(client, "low", preemptible=True, priority=1)
    reply = await (await client.post("/results", json=beacon("d", "low"))).json()
    assert reply["preempt"] is False
    await client.post("/jobs", json=job("same", priority=1))
    reply = await (await client.post("/results", json=beacon("d", "low"))).json()
    assert reply["preempt"] is False
    await client.post("/devices/register", json=registration("other"))
    await client.post("/jobs", json=job("elsewhere", priority=9,
                                        targets={"device_id": "other"}))
    reply = await (await client.post("/results", json=beacon("d", "low"))).json()
    assert reply["preempt"] is False
    await client.post("/jobs", json=job("urgent", priority=5))
    reply = await (await client.post("/results", json=beacon("d", "low"))).json()
    assert reply == {"lease_renewed": True, "preempt": True}


async def test_non_preemptible_jobs_are_never_asked_to_stop(client):
    await setup_claimed(client, "steady", priority=0)
    await client.post("/jobs", json=job("urgent", priority=9))
    reply = await (await client.post("/results", json=beacon("d", "steady"))).json()
    assert reply["preempt"] is False


async def test_preempted_final_row_hands_the_job_back_resumable(client):
    await setup_claimed(client, "long", preemptible=True, targets={"exclusive": True})
    resp = await client.post("/results", json=result_row(
        "long", "d", 0, final=True, ok=False, preempted=True, artifacts=[SHA_A, SHA_B]))
    assert (await resp.json())["status"] == "queued"
    row = await status_of(client, "long")
    assert row["status"] == "queued" and row["attempts"] == 0 and row["last_error"] is None
    assert row["spec"]["params"]["resume_from"] == SHA_A
    again = await claim(client, "d")
    assert again["job_id"] == "long" and again["params"]["resume_from"] == SHA_A


# -- cancel, retry, priority -------------------------------------------------------------------


async def test_cancel_queued_claimed_and_waiting(client):
    await setup_claimed(client, "run")
    await client.post("/jobs", json=[job("q"), job("w", depends_on=["run"]),
                                     job("w2", depends_on=["w"])])
    reply = await (await client.post("/api/jobs/q/cancel")).json()
    assert reply == {"ok": True, "job_id": "q", "was": "queued", "cascaded": [],
                     "locks_released": 0}
    reply = await (await client.post("/api/jobs/run/cancel")).json()
    assert reply["was"] == "claimed" and set(reply["cascaded"]) == {"w", "w2"}
    row = await status_of(client, "w2")
    assert row["status"] == "failed" and "dependency" in row["last_error"]
    # The claimant's next beacon learns its lease is gone.
    reply = await (await client.post("/results", json=beacon("d", "run"))).json()
    assert reply["lease_renewed"] is False
    resp = await client.post("/api/jobs/run/cancel")
    assert resp.status == 409
    assert (await client.post("/api/jobs/ghost/cancel")).status == 404


async def test_cancel_a_waiting_job_fails_its_own_waiters(client):
    await client.post("/jobs", json=[job("a"), job("b", depends_on=["a"]),
                                     job("c", depends_on=["b"])])
    reply = await (await client.post("/api/jobs/b/cancel")).json()
    assert reply["was"] == "waiting" and reply["cascaded"] == ["c"]
    assert (await status_of(client, "c"))["last_error"] == (
        "dependency 'b' was cancelled: cancelled by an operator")
    assert (await status_of(client, "a"))["status"] == "queued"


async def test_retry_clones_with_the_next_free_suffix(client):
    await setup_claimed(client, "flaky")
    await client.post("/results", json=result_row("flaky", "d", 0, final=True, ok=False,
                                                  error="boom"))
    reply = await (await client.post("/api/jobs/flaky/retry")).json()
    assert reply["job_id"] == "flaky-r2" and reply["status"] == "queued"
    reply = await (await client.post("/api/jobs/flaky/retry")).json()
    assert reply["job_id"] == "flaky-r3"
    assert (await client.post("/api/jobs/flaky-r2/retry")).status == 409  # still queued
    await client.post("/api/jobs/flaky-r2/cancel")
    reply = await (await client.post("/api/jobs/flaky-r2/retry")).json()
    assert reply["job_id"] == "flaky-r4"


async def test_a_retry_whose_id_would_pass_200_characters_is_refused(client):
    """A retry's id (<job_id>-r<n>) follows the job-id rule, or no agent could report for it."""
    longest, fits = "L" * 200, "F" * 197
    await client.post("/jobs", json=[job(longest), job(fits)])
    for job_id in (longest, fits):
        assert (await client.post(f"/api/jobs/{job_id}/cancel")).status == 200
    resp = await client.post(f"/api/jobs/{longest}/retry")
    assert resp.status == 409
    assert (await resp.json())["error"] == (
        f"job {longest} cannot be retried: its clone's id {'L' * 40}... would be 203 "
        "characters, more than the 200 a job id may have; enqueue a copy of its spec under a "
        "shorter job_id instead")
    listing = await (await client.get("/api/jobs")).json()
    assert sorted(j["job_id"] for j in listing["jobs"]) == [fits, longest]  # no clone
    assert (await status_of(client, longest))["status"] == "cancelled"
    reply = await (await client.post(f"/api/jobs/{fits}/retry")).json()
    assert reply["job_id"] == f"{fits}-r2" and len(reply["job_id"]) == 200


async def test_priority_change(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[job("a"), job("b")])
    resp = await client.patch("/api/jobs/b", json={"priority": 7})
    assert (await resp.json())["priority"] == 7
    assert (await claim(client, "d"))["job_id"] == "b"
    assert (await client.patch("/api/jobs/b", json={"priority": "x"})).status == 400
    assert (await client.patch("/api/jobs/b", json={"status": "done"})).status == 400
    assert (await client.patch("/api/jobs/ghost", json={"priority": 1})).status == 404


# -- dependencies ------------------------------------------------------------------------------


async def test_waiting_is_invisible_then_promoted_with_templates(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[
        job("make", priority=0),
        job("use", workload="batch", depends_on=["make"], priority=9, params={
            "input_sha256": "${jobs.make.artifact}", "max_items": "${jobs.make.metrics.n}",
            "note": "from ${jobs.make.metrics.n} items of ${jobs.make.artifact}"})])
    assert (await status_of(client, "use"))["status"] == "waiting"
    got = await claim(client, "d")
    assert got["job_id"] == "make"  # the waiter's higher priority does not matter
    assert await claim(client, "d") is None
    await client.post("/results", json=result_row("make", "d", 1, metrics={"n": 3}))
    await client.post("/results", json=result_row("make", "d", 0, final=True, ok=True,
                                                  artifacts=[SHA_A], metrics={"n": 42}))
    row = await status_of(client, "use")
    assert row["status"] == "queued"
    params = row["spec"]["params"]
    assert params["input_sha256"] == SHA_A
    assert params["max_items"] == 42  # a whole-string reference keeps its type
    assert params["note"] == f"from 42 items of {SHA_A}"


async def test_unresolvable_reference_fails_the_waiter(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[job("make"), job("use", depends_on=["make"], params={
        "input_sha256": "${jobs.make.artifact}"})])
    await claim(client, "d")
    await client.post("/results", json=result_row("make", "d", 0, final=True, ok=True))
    row = await status_of(client, "use")
    assert row["status"] == "failed" and "cannot be resolved" in row["last_error"]


async def test_references_past_the_body_limit_fail_the_waiter_and_the_dependency_closes(client):
    """40 references to a 30 kB metric would make a 1.2 MB spec, more than a request body may
    carry (1 MiB): the waiter fails with a sentence, as for a missing value, keeping its spec as
    sent, and the dependency's final row closes it as usual. 30 of them (900 kB) still fit."""
    ref = "${jobs.make.metrics.blob}"
    await client.post("/devices/register", json=registration("d"))
    resp = await client.post("/jobs", json=[
        job("make"),
        job("whole", depends_on=["make"], params={"p": [ref] * 40}),
        job("embedded", depends_on=["make"], params={"p": f"<{ref}>" * 40}),
        job("fits", depends_on=["make"], params={"p": [ref] * 30})])
    assert resp.status == 201, await resp.text()
    await claim(client, "d")
    resp = await client.post("/results", json=result_row(
        "make", "d", 0, final=True, ok=True, metrics={"blob": "x" * 30_000}))
    assert resp.status == 200, await resp.text()
    reply = await resp.json()
    assert reply["status"] == "done" and reply["promoted"] == ["fits"]
    assert sorted(reply["failed"]) == ["embedded", "whole"]
    assert (await status_of(client, "make"))["status"] == "done"
    for name, sent in (("whole", [ref] * 40), ("embedded", f"<{ref}>" * 40)):
        row = await status_of(client, name)
        assert row["status"] == "failed" and row["spec"]["params"]["p"] == sent
        assert row["last_error"] == (
            f"template reference {ref} cannot be resolved: with it (reference 35 of the spec) "
            "the spec would pass 1048576 bytes, the most a request body may carry; refer to a "
            "smaller value (an artifact's hash, say) or to it fewer times")
    fits = await status_of(client, "fits")
    assert fits["status"] == "queued" and fits["spec"]["params"]["p"] == ["x" * 30_000] * 30
    # A dependency already done is read at enqueue: the same refusal, stored as a failed job.
    resp = await client.post("/jobs", json=job("late", depends_on=["make"],
                                               params={"p": [ref] * 40}))
    assert resp.status == 201 and (await resp.json())["status"] == "failed"
    assert "the spec would pass 1048576 bytes" in (await status_of(client, "late"))["last_error"]


async def test_the_waiters_one_final_row_promotes_may_add_16_mib_together(client):
    """20 waiters that each grow by 900 kB fit under 1 MiB one by one, but one final row may
    add 16 MiB over all of them: the first 18 (in the order they were enqueued) are promoted,
    the others fail with a sentence, and the dependency closes as usual."""
    ref = "${jobs.make.metrics.blob}"
    waiters = [job(f"w{i:02d}", depends_on=["make"], params={"p": [ref] * 30})
               for i in range(20)]
    await client.post("/devices/register", json=registration("d"))
    assert (await client.post("/jobs", json=[job("make"), *waiters])).status == 201
    await claim(client, "d")
    resp = await client.post("/results", json=result_row(
        "make", "d", 0, final=True, ok=True, metrics={"blob": "x" * 30_000}))
    reply = await resp.json()
    assert resp.status == 200 and reply["status"] == "done"
    assert reply["promoted"] == [f"w{i:02d}" for i in range(18)]
    assert sorted(reply["failed"]) == ["w18", "w19"]
    row = await status_of(client, "w19")
    assert row["spec"]["params"]["p"] == [ref] * 30
    assert row["last_error"] == (
        f"template reference {ref} cannot be resolved: with the jobs rewritten before it in "
        "the same promotion or request, the references would add more than 16777216 bytes; "
        "refer to smaller values (an artifact's hash, say) or from fewer jobs")


async def test_the_legacy_job_page_lists_the_artifacts_a_job_made(client):
    """The job detail lists artifacts as records (hash, role, name); the legacy page read them
    as hashes and answered 500 for every job whose row listed one."""
    await setup_claimed(client, "made")
    resp = await client.post("/results", json=result_row("made", "d", 0, final=True, ok=True,
                                                         artifacts=[SHA_A]))
    assert resp.status == 200, await resp.text()
    resp = await client.get("/dash/legacy/jobs/made")
    assert resp.status == 200, await resp.text()
    page = await resp.text()
    assert f'href="/artifacts/{SHA_A}"' in page and "output" in page


async def test_the_detail_lists_dependencies_in_the_specs_order_with_their_status(client):
    await client.post("/jobs", json=[job("z"), job("a"), job("w", depends_on=["z", "a"])])
    waiter = await (await client.get("/api/jobs/w")).json()
    assert waiter["depends_on"] == ["z", "a"]  # ids, as the spec lists them
    assert waiter["dependencies"] == [{"job_id": "z", "status": "queued"},
                                      {"job_id": "a", "status": "queued"}]
    assert waiter["dependents"] == []
    first = await (await client.get("/api/jobs/z")).json()
    assert first["depends_on"] == [] and first["dependencies"] == []
    assert first["dependents"] == [{"job_id": "w", "status": "waiting"}]
    page = await (await client.get("/dash/legacy/jobs/w")).text()  # the legacy page reads them
    assert page.count("depends on") == 2 and "/dash/legacy/jobs/z" in page


async def test_a_diamond_names_each_waiter_once_through_the_root_when_it_can(client):
    await client.post("/jobs", json=[job("a"), job("c", depends_on=["a"]),
                                     job("b", depends_on=["a"]),
                                     job("join", depends_on=["c", "b"]),
                                     job("both", depends_on=["c", "a"])])
    reply = await (await client.post("/api/jobs/a/cancel")).json()
    assert sorted(reply["cascaded"]) == ["b", "both", "c", "join"]
    root = "dependency 'a' was cancelled: cancelled by an operator"
    assert (await status_of(client, "both"))["last_error"] == root
    assert (await status_of(client, "join"))["last_error"] == f"dependency 'b' failed: {root}"


async def test_failed_dependency_fails_the_whole_chain(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[job("a"), job("b", depends_on=["a"]),
                                     job("c", depends_on=["b"]), job("side")])
    await claim(client, "d")
    await client.post("/results", json=result_row("a", "d", 0, final=True, ok=False,
                                                  error="disk full"))
    b, c = await status_of(client, "b"), await status_of(client, "c")
    # Each names the job it waited on and the one where the failure started: the text does
    # not grow along the chain.
    assert b["status"] == "failed" and b["last_error"] == "dependency 'a' failed: disk full"
    assert c["status"] == "failed" and c["last_error"] == (
        "dependency 'b' failed: dependency 'a' failed: disk full")
    assert (await status_of(client, "side"))["status"] == "queued"


async def test_dependency_already_done_or_failed_at_enqueue(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[job("ok1"), job("bad")])
    await claim(client, "d")
    await client.post("/results", json=result_row("ok1", "d", 0, final=True, ok=True,
                                                  metrics={"v": 1}))
    await claim(client, "d")
    await client.post("/results", json=result_row("bad", "d", 0, final=True, ok=False,
                                                  error="nope"))
    reply = await (await client.post("/jobs", json=job("after-ok", depends_on=["ok1"], params={
        "max_items": "${jobs.ok1.metrics.v}"}))).json()
    assert reply["status"] == "queued"
    assert (await status_of(client, "after-ok"))["spec"]["params"]["max_items"] == 1
    reply = await (await client.post("/jobs", json=job("after-bad", depends_on=["bad"]))).json()
    assert reply["status"] == "failed"


# -- fan-out -----------------------------------------------------------------------------------


async def test_fanout_true_one_pinned_child_per_capable_matching_device(client):
    for name, caps in (("a", None), ("b", ["benchmark"]), ("c", ["self-check"])):
        body = registration(name)
        if caps is not None:
            body["capabilities"] = caps
        await client.post("/devices/register", json=body)
    preview = await (await client.post("/api/jobs/preview-targets", json={
        "workload": "benchmark", "backend": "synthetic", "executor": "device"})).json()
    reply = await (await client.post("/jobs", json=job("fan", fanout=True))).json()
    assert sorted(reply["fanout"]) == ["fan--a", "fan--b"]
    assert preview["count"] == 2
    assert sorted(d["device_id"] for d in preview["devices"]) == ["a", "b"]
    child = await status_of(client, "fan--a")
    assert child["parent_job_id"] == "fan" and child["spec"]["targets"]["device_id"] == "a"
    assert (await claim(client, "b"))["job_id"] == "fan--b"
    assert await claim(client, "b") is None
    for name in ("a", "b"):
        if name == "a":
            await claim(client, "a")
        await client.post("/results", json=result_row(f"fan--{name}", name, 0, final=True,
                                                      ok=True))
    assert (await status_of(client, "fan"))["status"] == "done"
    detail = await (await client.get("/api/jobs/fan")).json()
    assert sorted(c["job_id"] for c in detail["children"]) == ["fan--a", "fan--b"]


async def test_fanout_distinct_picks_the_newest_device_per_value(client, db_path):
    for name, model in (("old-pixel", "Pixel 8"), ("new-pixel", "Pixel 8"), ("moto", "Moto G")):
        await client.post("/devices/register", json=registration(
            name, descriptor={"platform": "android", "model": model}))
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 100 "
                      "WHERE device_id = 'old-pixel'")
    reply = await (await client.post("/jobs", json=job(
        "per-model", fanout={"distinct": "model"}))).json()
    assert sorted(reply["fanout"]) == ["per-model--moto", "per-model--new-pixel"]
    preview = await (await client.post("/api/jobs/preview-targets", json={
        "workload": "benchmark", "backend": "synthetic", "fanout": {"distinct": "model"}})).json()
    assert preview["count"] == 2


async def test_fanout_with_no_devices_is_refused(client):
    resp = await client.post("/jobs", json=job("fan", fanout=True))
    assert resp.status == 422


async def test_a_device_fan_out_whose_child_id_would_pass_200_characters_is_refused(client):
    """A child is <job_id>--<device_id>; past the job-id rule's 200 characters no beacon or
    row could name it, so the fan-out is refused whole, naming the length and the fix."""
    device = "D" * 150
    await client.post("/devices/register", json=registration(device))
    await client.post("/devices/register", json=registration("short"))
    resp = await client.post("/jobs", json=job("P" * 49, fanout=True))
    assert resp.status == 400
    assert (await resp.json())["error"] == (
        f"job {'P' * 49}: the fan-out child id {('P' * 49 + '--' + device)[:60]}... would be "
        "201 characters, more than the 200 a job id may have (<job_id>--<device_id>, device "
        "ids up to 150 characters); use a job_id of at most 48 characters")
    assert (await (await client.get("/api/jobs")).json())["total"] == 0
    reply = await (await client.post("/jobs", json=job("P" * 48, fanout=True))).json()
    assert sorted(map(len, reply["fanout"])) == [55, 200]
    child = f"{'P' * 48}--{device}"
    assert (await claim(client, device))["job_id"] == child
    resp = await client.post("/results", json=result_row(child, device, 0, final=True, ok=True))
    assert (await resp.json())["status"] == "done"
    # A device id of 198 characters or more leaves no room for any job_id: leave it out.
    await client.post("/devices/register", json=registration("E" * 200))
    resp = await client.post("/jobs", json=job("x", fanout=True))
    assert resp.status == 400
    assert (await resp.json())["error"].endswith(
        f"leave device {'E' * 40}... out with targets (a pool or a match expression)")


async def test_failed_child_fails_the_parent(client):
    await client.post("/devices/register", json=registration("a"))
    await client.post("/devices/register", json=registration("b"))
    await client.post("/jobs", json=job("fan", fanout=True))
    for name, ok in (("a", True), ("b", False)):
        await claim(client, name)
        await client.post("/results", json=result_row(f"fan--{name}", name, 0, final=True,
                                                      ok=ok, error=None if ok else "oops"))
    parent = await status_of(client, "fan")
    assert parent["status"] == "failed" and "1 of 2" in parent["last_error"]


# -- read API ----------------------------------------------------------------------------------


async def test_jobs_listing_filters(client):
    await client.post("/devices/register", json=registration("d", pools=["lab"]))
    await client.post("/jobs", json=[job("alpha"), job("beta", targets={"pool": "lab"}),
                                     job("gamma", workload="install", executor="host")])
    await claim(client, "d")
    listing = await (await client.get("/api/jobs")).json()
    assert listing["total"] == 3 and listing["per_page"] == 50
    assert [j["job_id"] for j in (await (await client.get(
        "/api/jobs?status=claimed")).json())["jobs"]] == ["alpha"]
    assert [j["job_id"] for j in (await (await client.get(
        "/api/jobs?executor=host")).json())["jobs"]] == ["gamma"]
    assert [j["job_id"] for j in (await (await client.get(
        "/api/jobs?pool=lab")).json())["jobs"]] == ["beta"]
    assert [j["job_id"] for j in (await (await client.get(
        "/api/jobs?device=d")).json())["jobs"]] == ["alpha"]
    assert [j["job_id"] for j in (await (await client.get(
        "/api/jobs?q=amm")).json())["jobs"]] == ["gamma"]
    assert (await (await client.get("/api/jobs?workload=install")).json())["total"] == 1
    assert (await client.get("/api/jobs?status=bogus")).status == 400


async def test_overview_counts_waiting_and_running(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[job("a"), job("b", depends_on=["a"])])
    await claim(client, "d")
    await client.post("/results", json=result_row("a", "d", 1))
    overview = await (await client.get("/api/overview")).json()
    assert overview["queue"]["claimed"] == 1 and overview["queue"]["waiting"] == 1
    assert overview["running"][0]["job_id"] == "a"
    assert overview["running"][0]["progress"]["rows"] == 1


async def test_health_fields(client):
    health = await (await client.get("/api/health")).json()
    for key in ("ok", "collector", "name", "instance", "started_at", "uptime_s", "now", "node",
                "pid", "stream_clients", "guard", "speedups"):
        assert key in health
    assert health["now"].endswith("Z")
    # What the fast extra gives this process, as it is: orjson when importable; uvloop only
    # when the loop is uvloop's (the test runner's loop is asyncio's own).
    loop_is_uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    assert health["speedups"] == (["uvloop"] if loop_is_uvloop else []) + (
        ["orjson"] if importlib.util.find_spec("orjson") else [])


async def test_unknown_api_path_is_json_404(client):
    resp = await client.get("/api/nothing/here")
    assert resp.status == 404 and "error" in await resp.json()


async def test_bodies_over_the_limit_are_413(collector_factory):
    client = await collector_factory(max_json_bytes=1024)
    resp = await client.post("/jobs", data=json.dumps(job("big", params={"x": "y" * 4000})),
                             headers={"Content-Type": "application/json"})
    assert resp.status == 413 and "limit" in (await resp.json())["error"]


async def test_a_new_attempt_supersedes_rows_of_a_handed_back_one(client):
    """Preempted, then claimed again by the same device: the new summary (iter 0 again) is not
    a duplicate; it closes the job."""
    await setup_claimed(client, "again", preemptible=True)
    await client.post("/results", json=result_row("again", "d", 1, metrics={"n": 1}))
    await client.post("/results", json=result_row("again", "d", 0, final=True, ok=False,
                                                  preempted=True, artifacts=[SHA_A]))
    assert (await claim(client, "d"))["job_id"] == "again"
    await client.post("/results", json=result_row("again", "d", 1, metrics={"n": 2}))
    reply = await (await client.post("/results", json=result_row(
        "again", "d", 0, final=True, ok=True, metrics={"n": 2}))).json()
    assert reply["duplicate"] is False and reply["status"] == "done"
    rows = (await (await client.get("/api/results?job=again")).json())["results"]
    assert sorted((r["iter"], r["metrics"].get("n")) for r in rows) == [(0, 2), (1, 2)]
    # Within one attempt a re-post is still a duplicate that changes nothing.
    again = await (await client.post("/results", json=result_row(
        "again", "d", 0, final=True, ok=False))).json()
    assert again["duplicate"] is True and again["status"] == "done"
