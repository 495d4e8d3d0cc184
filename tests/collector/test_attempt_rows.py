"""A late row never strands a job: result rows belong to the attempt that made them.

A claimed job carries its attempt number and the agent echoes it in every row and beacon, so a
row spooled during an outage and delivered after the job was claimed again is recorded against
the attempt that made it: it changes no status, takes no key the next attempt reports under, and
is shown with its attempt. The lapses that matter for timing (a lease that runs out, the sweep
that requeues it) happen in real collector processes on their own sweep timer; the rest is
driven through the in-process client.
"""

from __future__ import annotations

import sqlite3
import time

from fleet_min.collector.jobs import claims, queue, results
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate
from tests.support.collector import (
    age_rows,
    beacon,
    job,
    registration,
    result_row,
    running_collector,
)

SHA_A = "a" * 64
SHA_B = "b" * 64
SERIAL = "R5CT1234ABC"  # an attached Android device the host executors file rows under


def host_row(job_id, executor, iteration, **fields):
    """A host executor's row about its attached device, as the agent in host mode makes it."""
    return result_row(job_id, SERIAL, iteration, executor=executor, **fields)


def lapse_in_process(proc, job_id, timeout=20.0):
    """Run the lease of a claimed job out and let the collector's own sweep (every second in
    these processes) requeue it."""
    age_rows(proc.data_dir / "fleet.sqlite3",
             "UPDATE jobs SET lease_deadline = lease_deadline - 10000 WHERE job_id = ?",
             (job_id,))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.client.get(f"/jobs/{job_id}")[1]["status"] == "queued":
            return
        time.sleep(0.05)
    raise AssertionError(f"the sweep never requeued {job_id} within {timeout} s")


def claim_host(proc, name, job_id):
    status, spec = proc.client.get(f"/executor/next-job?name={name}")
    assert status == 200 and spec["job_id"] == job_id, (status, spec)
    return spec["attempt"]


def detail_rows(detail):
    return [(r["attempt"], r["device_id"], r["iter"], r["final"], r["ok"])
            for r in detail["results"]]


def attempts_of(detail):
    return [(a["attempt"], a["claimed_by"], a["outcome"]) for a in detail["attempts"]]


# -- 1 and 2: host jobs, real collector processes -------------------------------------------------


def test_a_host_attempts_late_final_row_is_its_own_and_the_next_attempt_closes_the_job(
        tmp_path):
    with running_collector(tmp_path / "data") as proc:
        c = proc.client
        assert c.post("/jobs", job("h", "install", "host"))[0] == 201
        assert claim_host(proc, "mac-a", "h") == 1
        assert c.post("/results", host_row("h", "mac-a", 1, ok=True, attempt=1))[0] == 200
        lapse_in_process(proc, "h")
        assert claim_host(proc, "mac-a", "h") == 2
        # attempt 1's final row, spooled while the executor was cut off, arrives now
        status, late = c.post("/results", host_row("h", "mac-a", 0, final=True, ok=False,
                                                   error="the device went away", attempt=1))
        assert status == 200, late
        assert late == {"ok": True, "duplicate": False, "job_id": "h", "status": "claimed",
                        "attempt": 1}
        # attempt 2 reports the same device and iterations, and its final row closes the job
        status, row = c.post("/results", host_row("h", "mac-a", 1, ok=True, attempt=2))
        assert (status, row["duplicate"], row["attempt"]) == (200, False, 2)
        status, closing = c.post("/results", host_row("h", "mac-a", 0, final=True, ok=True,
                                                      attempt=2))
        assert (status, closing["duplicate"], closing["status"]) == (200, False, "done")
        detail = c.get("/api/jobs/h")[1]
        assert detail["status"] == "done" and detail["last_error"] is None
        assert detail_rows(detail) == [(1, SERIAL, 0, True, False), (1, SERIAL, 1, False, True),
                                       (2, SERIAL, 0, True, True), (2, SERIAL, 1, False, True)]
        assert attempts_of(detail) == [(1, "mac-a", "expired"), (2, "mac-a", "done")]
        listed = c.get("/api/results?job=h")[1]["results"]
        assert sorted(r["attempt"] for r in listed) == [1, 1, 2, 2]


def test_the_old_holders_late_row_is_recorded_against_its_attempt_while_another_holds_the_job(
        tmp_path):
    with running_collector(tmp_path / "data") as proc:
        c = proc.client
        assert c.post("/jobs", job("h", "install", "host"))[0] == 201
        assert claim_host(proc, "mac-a", "h") == 1
        lapse_in_process(proc, "h")
        assert claim_host(proc, "mac-b", "h") == 2
        status, late = c.post("/results", host_row("h", "mac-a", 0, final=True, ok=False,
                                                   error="cut off", attempt=1))
        assert status == 200, late
        assert (late["status"], late["attempt"], late["duplicate"]) == ("claimed", 1, False)
        # an agent from before the field: taken as the sender's last attempt
        status, old = c.post("/results", host_row("h", "mac-a", 1, ok=True))
        assert (status, old["attempt"]) == (200, 1)
        # the old holder cannot speak for the attempt it does not hold
        status, refused = c.post("/results", host_row("h", "mac-a", 2, ok=True, attempt=2))
        assert status == 409 and "did not hold attempt 2" in refused["error"]
        job_row = c.get("/jobs/h")[1]
        assert (job_row["status"], job_row["claimed_by"]) == ("claimed", "mac-b")
        status, closing = c.post("/results", host_row("h", "mac-b", 0, final=True, ok=True,
                                                      attempt=2))
        assert closing["status"] == "done"
        detail = c.get("/api/jobs/h")[1]
        assert [(r["attempt"], r["executor"], r["iter"], r["ok"]) for r in detail["results"]] == [
            (1, "mac-a", 0, False), (1, "mac-a", 1, True), (2, "mac-b", 0, True)]
        assert attempts_of(detail) == [(1, "mac-a", "expired"), (2, "mac-b", "done")]


# -- 3: device jobs -------------------------------------------------------------------------------


async def claim(client, device_id):
    resp = await client.get(f"/devices/{device_id}/next-job")
    assert resp.status == 200, resp.status
    return await resp.json()


async def lapse(client, db_path, job_id):
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 10000 "
             "WHERE job_id = ?", (job_id,))
    assert job_id in (await (await client.post("/jobs/sweep")).json())["requeued"]


async def post(client, body):
    resp = await client.post("/results", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def detail(client, job_id):
    return await (await client.get(f"/api/jobs/{job_id}")).json()


async def test_a_device_reclaiming_after_a_lapse_reports_anew_and_closes_the_job(
        client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j"))
    assert (await claim(client, "d"))["attempt"] == 1
    for number in (1, 2):
        await post(client, result_row("j", "d", number, ok=True, metrics={"n": number},
                                      attempt=1))
    await lapse(client, db_path, "j")
    assert (await claim(client, "d"))["attempt"] == 2
    late = await post(client, result_row("j", "d", 0, final=True, ok=False,
                                         error="stopped: the lease was not renewed", attempt=1))
    assert (late["duplicate"], late["status"], late["attempt"]) == (False, "claimed", 1)
    for number in (1, 2):
        row = await post(client, result_row("j", "d", number, ok=True,
                                            metrics={"n": 10 + number}, attempt=2))
        assert (row["duplicate"], row["attempt"]) == (False, 2)
    closing = await post(client, result_row("j", "d", 0, final=True, ok=True, attempt=2))
    assert (closing["duplicate"], closing["status"]) == (False, "done")
    shown = await detail(client, "j")
    assert shown["status"] == "done" and shown["last_error"] is None
    assert [(r["attempt"], r["iter"], r["ok"], r["metrics"].get("n")) for r in shown["results"]
            ] == [(1, 0, False, None), (1, 1, True, 1), (1, 2, True, 2),
                  (2, 0, True, None), (2, 1, True, 11), (2, 2, True, 12)]
    assert [a["outcome"] for a in shown["attempts"]] == ["expired", "done"]


async def test_a_row_without_an_attempt_from_the_current_holder_is_the_current_attempts(
        client, db_path):
    """Agents in the field send no attempt: the holder's row goes to the attempt it holds."""
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j"))
    await claim(client, "d")
    await lapse(client, db_path, "j")
    assert (await claim(client, "d"))["attempt"] == 2
    row = await post(client, result_row("j", "d", 1, ok=True))
    assert (row["attempt"], row["duplicate"]) == (2, False)
    closing = await post(client, result_row("j", "d", 0, final=True, ok=True))
    assert (closing["attempt"], closing["status"]) == (2, "done")
    # after the close, the last holder's rows without the field still land on its last attempt
    late = await post(client, result_row("j", "d", 7, ok=True))
    assert (late["attempt"], late["status"]) == (2, "done")


# -- 4: repeats -----------------------------------------------------------------------------------


async def test_an_exact_repeat_of_a_stored_row_stays_a_duplicate_in_every_attempt(
        client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j"))
    await claim(client, "d")
    first = result_row("j", "d", 1, ok=True, metrics={"n": 1}, attempt=1)
    assert (await post(client, first))["duplicate"] is False
    again = await post(client, first)
    assert (again["duplicate"], again["attempt"]) == (True, 1)
    await lapse(client, db_path, "j")
    await client.post("/devices/register", json=registration("e"))
    assert (await claim(client, "e"))["attempt"] == 2
    late = result_row("j", "d", 0, final=True, ok=False, error="cut off", attempt=1)
    assert (await post(client, late))["duplicate"] is False
    # the spool re-posts both, in one array and with its keys in another order: nothing changes
    resp = await client.post("/results", json=[first, dict(reversed(list(late.items())))])
    assert resp.status == 200
    assert [r["duplicate"] for r in (await resp.json())["results"]] == [True, True]
    # the same iteration from attempt 2 is no repeat of attempt 1's
    own = await post(client, result_row("j", "e", 1, ok=True, metrics={"n": 1}, attempt=2))
    assert own["duplicate"] is False
    assert len((await detail(client, "j"))["results"]) == 3
    assert (await (await client.get("/jobs/j")).json())["status"] == "claimed"


async def test_a_final_row_under_a_progress_rows_key_is_refused_not_dropped(client):
    """An agent that sends no `iter` posts every row as iteration 0: its final row would take
    the key of its first progress row and, answered as a repeat, be dropped unseen while the
    job stayed claimed. It is refused instead, saying why; a final row of its own closes it."""
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j"))
    await claim(client, "d")
    progress = {k: v for k, v in result_row("j", "d", metrics={"progress": 50}).items()
                if k != "iter"}
    assert (await post(client, progress))["duplicate"] is False
    final = {**progress, "final": True, "ok": False, "error": "it broke", "metrics": {}}
    resp = await client.post("/results", json=final)
    assert resp.status == 409
    error = (await resp.json())["error"]
    assert "iteration 0 of attempt 1 from d already holds a row that is not final" in error
    assert "a row without iter is iteration 0" in error
    assert (await (await client.get("/jobs/j")).json())["status"] == "claimed"
    # the progress row is still the repeat it was, and a final row of its own closes the job
    assert (await post(client, progress))["duplicate"] is True
    closed = await post(client, {**final, "iter": 1})
    assert closed["status"] == "failed"
    # once stored, the final row's own repeat is a duplicate, not a refusal
    assert (await post(client, {**final, "iter": 1}))["duplicate"] is True


# -- 5: hand-backs keep their number ----------------------------------------------------------


async def test_a_handed_back_attempts_rows_are_replaced_by_the_claim_that_takes_it_again(client):
    """A preemption hands the attempt back: the next claim reports under the same number, and
    its rows replace the handed-back claim's under the same key."""
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("p", preemptible=True))
    assert (await claim(client, "d"))["attempt"] == 1
    await post(client, result_row("p", "d", 1, ok=True, metrics={"n": 1}, attempt=1))
    handed = await post(client, result_row("p", "d", 999_999, final=True, ok=False,
                                           preempted=True, artifacts=[SHA_A], attempt=1))
    assert handed["status"] == "queued"
    assert (await claim(client, "d"))["attempt"] == 1
    again = await post(client, result_row("p", "d", 1, ok=True, metrics={"n": 2}, attempt=1))
    assert again["duplicate"] is False
    assert (await post(client, result_row("p", "d", 1, ok=True, metrics={"n": 3},
                                          attempt=1)))["duplicate"] is True
    closing = await post(client, result_row("p", "d", 0, final=True, ok=True, attempt=1))
    assert closing["status"] == "done"
    shown = await detail(client, "p")
    assert [(r["attempt"], r["iter"], r["metrics"].get("n"), r["preempted"])
            for r in shown["results"]] == [(1, 0, None, False), (1, 1, 2, False),
                                          (1, 999_999, None, True)]
    assert [(a["attempt"], a["outcome"]) for a in shown["attempts"]] == [
        (1, "preempted"), (1, "done")]


# -- what the current attempt may still do --------------------------------------------------------


async def test_a_late_row_of_an_earlier_attempt_does_not_block_the_release_of_the_current(
        client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/devices/register", json=registration("e"))
    await client.post("/jobs", json=job("j"))
    await claim(client, "d")
    await lapse(client, db_path, "j")
    assert (await claim(client, "e"))["attempt"] == 2
    await post(client, result_row("j", "d", 1, ok=True, attempt=1))
    resp = await client.post("/jobs/j/release", json={"device_id": "e"})
    assert resp.status == 200, await resp.text()
    # a row of the current attempt still blocks it
    assert (await claim(client, "e"))["attempt"] == 2
    await post(client, result_row("j", "e", 1, ok=True))
    assert (await client.post("/jobs/j/release", json={"device_id": "e"})).status == 409


async def test_a_beacon_of_an_earlier_attempt_renews_nothing(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[job("j", lease={"ttl_s": 60}),
                                     job("h", "install", "host", lease={"ttl_s": 60})])
    await claim(client, "d")
    await lapse(client, db_path, "j")
    assert (await claim(client, "d"))["attempt"] == 2
    before = (await (await client.get("/jobs/j")).json())["lease_deadline"]
    stale = await (await client.post("/results", json={**beacon("d", "j"), "attempt": 1})).json()
    assert stale == {"lease_renewed": False, "preempt": False}
    assert (await (await client.get("/jobs/j")).json())["lease_deadline"] == before
    history = (await (await client.get("/api/devices/d/beacons")).json())["beacons"]
    assert history[-1]["job_id"] is None  # kept, but not with the job
    current = await (await client.post("/results", json={**beacon("d", "j"),
                                                          "attempt": 2})).json()
    assert current["lease_renewed"] is True
    # a host executor running a lapsed attempt learns to stop in the same way
    got = await client.get("/executor/next-job?name=mac")
    assert (await got.json())["attempt"] == 1
    await lapse(client, db_path, "h")
    assert (await (await client.get("/executor/next-job?name=mac")).json())["attempt"] == 2
    old = await (await client.post("/results", json={**beacon("mac", "h"), "attempt": 1})).json()
    assert old["lease_renewed"] is False
    now = await (await client.post("/results", json={**beacon("mac", "h"), "attempt": 2})).json()
    assert now["lease_renewed"] is True


async def test_a_row_for_an_attempt_that_never_was_is_refused_and_stores_nothing(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j"))
    await claim(client, "d")
    resp = await client.post("/results", json=result_row("j", "d", 0, final=True, ok=True,
                                                         attempt=3))
    assert resp.status == 409
    assert "has had 1 attempt(s), so a row for attempt 3" in (await resp.json())["error"]
    shown = await detail(client, "j")
    assert shown["results"] == [] and shown["status"] == "claimed"


async def test_a_template_reads_the_final_row_of_the_attempt_that_closed_the_job(
        client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("build"))
    await claim(client, "d")
    await lapse(client, db_path, "build")
    await claim(client, "d")
    await post(client, result_row("build", "d", 0, final=True, ok=True, artifacts=[SHA_B],
                                  attempt=2))
    # attempt 1's final row arrives after the job closed, naming another artifact
    late = await post(client, result_row("build", "d", 0, final=True, ok=True,
                                         artifacts=[SHA_A], attempt=1))
    assert (late["duplicate"], late["status"]) == (False, "done")
    resp = await client.post("/jobs", json=job("use", depends_on=["build"],
                                               params={"input_sha256": "${jobs.build.artifact}"}))
    assert resp.status == 201, await resp.text()
    spec = (await (await client.get("/jobs/use")).json())["spec"]
    assert spec["params"]["input_sha256"] == SHA_B


async def test_overview_progress_counts_only_the_running_attempts_rows(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j"))
    await claim(client, "d")
    await post(client, result_row("j", "d", 1, ok=True, attempt=1))
    await lapse(client, db_path, "j")
    await claim(client, "d")
    await post(client, result_row("j", "d", 2, ok=True, attempt=1))  # late
    overview = await (await client.get("/api/overview")).json()
    # the running attempt has reported nothing yet: the lapsed attempt's rows are not its own
    assert overview["running"][0]["progress"] == {"rows": 0, "last_iter": None}
    await post(client, result_row("j", "d", 1, ok=True, attempt=2))
    overview = await (await client.get("/api/overview")).json()
    assert overview["running"][0]["progress"] == {"rows": 1, "last_iter": 1}


# -- the hot path ---------------------------------------------------------------------------------


def test_the_claimants_row_costs_one_read_and_one_write(tmp_path):
    """POST /results for the claimant: the job row (with the device's last_seen) and the row's
    INSERT; the attempt comes from the job row already read."""
    conn = sqlite3.connect(tmp_path / "hot.sqlite3", isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        migrate(conn, MIGRATIONS)
        now = time.time()
        conn.execute("INSERT INTO devices (device_id, first_seen, last_seen, registered_at) "
                     "VALUES ('d', ?, ?, ?)", (now, now, now))
        queue.enqueue(conn, [job("j")], now, Effects())
        assert claims.claim(conn, claims.Claimant("device", "d"), now, Effects())["attempt"] == 1
        statements: list[str] = []
        conn.set_trace_callback(statements.append)
        reply = results.post_result(conn, result_row("j", "d", 1, ok=True, attempt=1), now,
                                    Effects())
        conn.set_trace_callback(None)
        assert (reply["duplicate"], reply["attempt"]) == (False, 1)
        assert [s.split()[0] for s in statements] == ["SELECT", "INSERT"], statements
    finally:
        conn.close()


async def test_the_legacy_job_page_shows_each_rows_attempt(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j"))
    await claim(client, "d")
    await lapse(client, db_path, "j")
    await claim(client, "d")
    await post(client, result_row("j", "d", 4, ok=True, attempt=1))
    page = await (await client.get("/dash/legacy/jobs/j")).text()
    results = page[page.index("Results"):]
    assert '<th scope="col">Attempt</th><th scope="col">Device</th>' in results
    assert "<td>1</td><td><a" in results


async def _closed_by_b_after_a_handed_back(client, stray_while: str) -> str:
    """`up` is claimed by a, handed back (release), then claimed by b, which closes it with its
    final row at iteration 3 naming SHA_B; a posts a final row for the same attempt number
    naming SHA_A while the job waits (`queued`) or while b holds it (`claimed`). The input
    the waiting `down` was promoted with."""
    for device in ("a", "b"):
        await client.post("/devices/register", json=registration(device))
    resp = await client.post("/jobs", json=[
        job("up"), job("down", depends_on=["up"],
                       params={"input_sha256": "${jobs.up.artifact}"})])
    assert resp.status == 201, await resp.text()
    assert (await claim(client, "a"))["attempt"] == 1
    released = await client.post("/jobs/up/release", json={"device_id": "a"})
    assert released.status == 200, await released.text()
    stray = result_row("up", "a", 0, final=True, ok=True, artifacts=[SHA_A], attempt=1)
    if stray_while == "queued":
        assert (await post(client, stray))["duplicate"] is False
    assert (await claim(client, "b"))["attempt"] == 1  # the number handed out again
    if stray_while == "claimed":
        assert (await post(client, stray))["duplicate"] is False
    closed = await post(client, result_row("up", "b", 3, final=True, ok=True,
                                           artifacts=[SHA_B], attempt=1))
    assert (closed["status"], closed["promoted"]) == ("done", ["down"])
    spec = (await (await client.get("/jobs/down")).json())["spec"]
    return spec["params"]["input_sha256"]


async def test_a_handed_back_claims_stray_row_does_not_choose_the_input_downstream(client):
    """A release (as a preemption or an undelivered poll) gives the attempt number back, so two
    claims share it; the first holder's final row, posted while the job waited, outranked the
    closing claim's (iteration 0 sorts first) and became the input of the job downstream."""
    assert await _closed_by_b_after_a_handed_back(client, "queued") == SHA_B


async def test_a_stray_row_from_the_earlier_holder_during_the_new_claim_does_not_either(client):
    assert await _closed_by_b_after_a_handed_back(client, "claimed") == SHA_B


async def test_the_same_device_claiming_again_is_read_from_its_new_claim(client):
    """A row the device posted for its handed-back claim, before it claimed the job again, is
    not its new claim's."""
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[job("up"), job(
        "down", depends_on=["up"], params={"input_sha256": "${jobs.up.artifact}"})])
    await claim(client, "d")
    assert (await client.post("/jobs/up/release", json={"device_id": "d"})).status == 200
    await post(client, result_row("up", "d", 0, final=True, ok=True, artifacts=[SHA_A],
                                  attempt=1))
    await claim(client, "d")
    await post(client, result_row("up", "d", 5, final=True, ok=True, artifacts=[SHA_B],
                                  attempt=1))
    spec = (await (await client.get("/jobs/down")).json())["spec"]
    assert spec["params"]["input_sha256"] == SHA_B
