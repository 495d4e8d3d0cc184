"""The collector's spec rules of issue 19, each through a real collector (in-process, real socket,
real SQLite file): build toolchains, fan-out over executors, one job per claimant, the job-failed
alert, unknown keys and warnings, the beacon field names of the agents in the field, the aliases
of the clients in the field, rows without iter, job detail payloads and test.artifacts."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3

from tests.support.collector import (
    age_rows,
    beacon,
    edit_rows,
    executor_claim,
    job,
    registration,
    result_row,
)


async def claim(client, device_id):
    resp = await client.get(f"/devices/{device_id}/next-job")
    assert resp.status in (200, 204), await resp.text()
    return None if resp.status == 204 else await resp.json()


async def finish(client, job_id, device_id, **fields):
    row = result_row(job_id, device_id, 0, **{"final": True, "ok": True, **fields})
    resp = await client.post("/results", json=row)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def enqueue(client, spec, status=201):
    resp = await client.post("/jobs", json=spec)
    body = await resp.json()
    assert resp.status == status, body
    return body


# -- build:<toolchain> ----------------------------------------------------------------------


def build(job_id, kind, **fields):
    return job(job_id, workload="build", params={"repo": "shop", "kind": kind}, **fields)


async def test_a_build_job_goes_to_its_toolchain_or_to_a_bare_build(collector_factory):
    client = await collector_factory(long_poll_s=30)
    await client.post("/devices/register", json=registration("mac", capabilities=["build:xcode"]))
    refused = await enqueue(client, build("early", "gradle"), status=422)
    assert "build:gradle" in refused["error"]
    await client.post("/devices/register", json=registration(
        "linux", capabilities=["build:gradle", "self-check"]))
    await client.post("/devices/register", json=registration("any", capabilities=["build"]))
    # Waiting polls: the dispatcher's cheap pre-check asks the toolchain too.
    polls = {name: asyncio.create_task(client.get(f"/devices/{name}/next-job"))
             for name in ("mac", "linux")}
    await asyncio.sleep(0.3)
    await enqueue(client, build("apk", "gradle"))
    resp = await asyncio.wait_for(polls["linux"], 10)
    assert (await resp.json())["job_id"] == "apk"
    await asyncio.sleep(0.3)
    assert not polls["mac"].done()  # build:xcode is never offered a gradle build
    await enqueue(client, build("ipa", "xcode"))
    assert (await (await asyncio.wait_for(polls["mac"], 10)).json())["job_id"] == "ipa"
    await enqueue(client, build("apk-2", "gradle"))
    assert (await claim(client, "any"))["job_id"] == "apk-2"  # bare build: any toolchain
    preview = await client.post("/api/jobs/preview-targets", json={
        "workload": "build", "params": {"kind": "gradle"}})
    assert sorted(d["device_id"] for d in (await preview.json())["devices"]) == ["any", "linux"]


# -- fan-out over executors --------------------------------------------------------------------


async def test_a_host_job_fans_out_over_the_executors_seen_recently(collector_factory, db_path):
    client = await collector_factory(long_poll_s=0.05)
    nothing = await enqueue(client, job("none", workload="web-test", executor="host",
                                        fanout=True), status=422)
    assert "executor" in nothing["error"]
    for name in ("mac-mini", "pi", "old-box"):
        assert await executor_claim(client, name) is None  # each poll records its executor
    age_rows(db_path, "UPDATE executors SET last_poll = last_poll - 3600 WHERE name = 'old-box'")
    reply = await enqueue(client, job("shots", workload="web-shots", executor="host",
                                      fanout=True, params={"browser": ["chromium"]}))
    assert reply["fanout"] == ["shots--mac-mini", "shots--pi"]
    preview = await (await client.post("/api/jobs/preview-targets", json={
        "workload": "web-shots", "executor": "host", "fanout": True})).json()
    assert preview["count"] == 2 and preview["executors"] == ["mac-mini", "pi"]
    # Each child is pinned to its executor.
    assert await executor_claim(client, "pi") == "shots--pi"
    assert await executor_claim(client, "mac-mini") == "shots--mac-mini"
    assert await executor_claim(client, "old-box") is None
    child = await (await client.get("/jobs/shots--pi")).json()
    assert child["spec"]["targets"] == {"executor": "pi"} and child["parent_job_id"] == "shots"
    await finish(client, "shots--pi", "pi")
    await finish(client, "shots--mac-mini", "mac-mini")
    assert (await (await client.get("/jobs/shots")).json())["status"] == "done"
    # {distinct} needs descriptors of attached devices, which executors do not report.
    distinct = await enqueue(client, job("d", workload="install", executor="host",
                                         fanout={"distinct": "model"}), status=400)
    assert "fanout {distinct} applies to device jobs" in distinct["error"]
    conn = sqlite3.connect(db_path)
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM executors ORDER BY name")]
    finally:
        conn.close()
    assert names == ["mac-mini", "old-box", "pi"]


# -- one job per claimant ----------------------------------------------------------------------


async def test_a_device_holds_one_claimed_job_at_a_time(client):
    await client.post("/devices/register", json=registration("d"))
    await enqueue(client, [job("one"), job("two")])
    assert (await claim(client, "d"))["job_id"] == "one"
    assert await claim(client, "d") is None  # it still holds "one"
    await finish(client, "one", "d")
    assert (await claim(client, "d"))["job_id"] == "two"


async def test_an_executor_holds_as_many_jobs_as_its_slots(client):
    await enqueue(client, [job(f"h{n}", workload="install", executor="host") for n in range(4)])
    assert await executor_claim(client, "mac") == "h0"
    assert await executor_claim(client, "mac") is None  # one slot unless it says more
    assert await executor_claim(client, "mac", "&slots=2") == "h1"
    assert await executor_claim(client, "mac", "&slots=2") is None
    for bad in ("0", "65", "two", "²"):
        resp = await client.get(f"/executor/next-job?name=mac&slots={bad}")
        assert resp.status == 400 and "slots" in (await resp.json())["error"]
    await finish(client, "h0", "mac")
    assert await executor_claim(client, "mac", "&slots=2") == "h2"


async def test_a_poll_waiting_for_a_free_slot_wakes_when_its_job_closes(collector_factory):
    client = await collector_factory(long_poll_s=30)
    await enqueue(client, [job(f"h{n}", workload="install", executor="host") for n in range(2)])
    assert await executor_claim(client, "mac") == "h0"
    waiting = asyncio.create_task(client.get("/executor/next-job?name=mac"))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await finish(client, "h0", "mac")
    resp = await asyncio.wait_for(waiting, 10)
    assert (await resp.json())["job_id"] == "h1"


# -- the job-failed alert ------------------------------------------------------------------------


async def alert_rules(client):
    tick = await client.post("/api/alerts/tick")
    assert tick.status == 200
    alerts = (await (await client.get("/api/alerts?state=open")).json())["alerts"]
    return {(a["rule"], a["subject"]): a for a in alerts}


async def test_job_failed_opens_on_the_final_failure_only(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await enqueue(client, job("flaky", lease={"ttl_s": 60, "max_attempts": 2}))
    for attempt in (1, 2):
        assert (await claim(client, "d"))["job_id"] == "flaky"
        age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 120 "
                          "WHERE job_id = 'flaky'")
        swept = await (await client.post("/jobs/sweep")).json()
        found = await alert_rules(client)
        if attempt == 1:  # requeued: it will be retried, nothing to alert on
            assert swept["requeued"] == ["flaky"]
            assert ("job-failed", "flaky") not in found
    assert swept["failed"] == ["flaky"]
    detail = found[("job-failed", "flaky")]["detail"]
    assert "failed on its final attempt (2 of 2)" in detail and "lease expired" in detail
    # A device's failing final row is final too: the job fails, whatever attempts were left.
    await enqueue(client, job("broken"))
    await claim(client, "d")
    await finish(client, "broken", "d", ok=False, error="the model file is missing")
    found = await alert_rules(client)
    assert found[("job-failed", "broken")]["detail"] == (
        "benchmark job broken failed on attempt 1 of 3 and will not be retried: the model file "
        "is missing")


# -- unknown keys, warnings, secrets -----------------------------------------------------------


async def test_a_misspelt_top_level_field_is_refused_with_the_close_match(client):
    await client.post("/devices/register", json=registration("d"))
    spec = job("typo", parms={"prompt_tokens": 8})
    refused = await enqueue(client, spec, status=400)
    assert refused["error"] == ('the job spec has an unknown field "parms"; did you mean '
                                '"params"?')
    refused = await enqueue(client, job("typo", measure_iters=3), status=400)
    assert '"measure_iters"' in refused["error"]
    assert (await client.get("/jobs/typo")).status == 404


async def test_an_unknown_param_of_a_table_workload_comes_back_as_a_warning(client):
    await client.post("/devices/register", json=registration("d"))
    reply = await enqueue(client, job("w", params={"prompt_tokens": 8, "measure_itters": 5}))
    expected = ["unknown param 'measure_itters' for benchmark; did you mean 'measure_iters'?"]
    assert reply["warnings"] == expected
    assert (await (await client.get("/jobs/w")).json())["warnings"] == expected
    assert (await (await client.get("/api/jobs/w")).json())["warnings"] == expected
    clean = await enqueue(client, job("clean", params={"prompt_tokens": 8}))
    assert "warnings" not in clean
    assert (await (await client.get("/jobs/clean")).json())["warnings"] == []
    # A workload outside the spec's table takes any params; arrays warn per job. (An agent
    # must declare such a workload before it is accepted.)
    await client.post("/devices/register", json=registration("e", capabilities=["custom-thing"]))
    batch = await enqueue(client, [job("mine", workload="custom-thing", params={"x": 1}),
                                   job("cold", workload="cold-start", executor="host",
                                       params={"lanches": 3})])
    assert "warnings" not in batch["jobs"][0]
    assert batch["jobs"][1]["warnings"] == [
        "unknown param 'lanches' for cold-start; did you mean 'launches'?"]


async def test_keys_named_like_secrets_are_refused_at_any_depth(client):
    await client.post("/devices/register", json=registration("d"))
    deep: object = {"API_KEY": "x"}
    for level in range(30):
        deep = [deep] if level % 2 else {"level": deep}
    for where in ({"password": "hunter2"}, {"params": {"auth_token": "x"}},
                  {"app": {"name": "shop", "clientSecret": "x"}},
                  {"params": {"env": [{"name": "a"}, {"GITHUB_TOKEN": "ghp"}]}},
                  {"params": {"deep": deep}}):
        refused = await enqueue(client, job("leak", **where), status=400)
        assert "looks like a secret" in refused["error"], where
    assert (await client.get("/jobs/leak")).status == 404
    named = await enqueue(client, job("named", workload="archive", executor="host",
                                      params={"account": "store-upload", "token_name": "ci"}))
    assert named["status"] == "queued"


# -- the beacon field names of the agents in the field ----------------------------------------


async def test_constraints_read_the_field_agents_beacon_names(client):
    await client.post("/devices/register", json=registration("d"))
    await enqueue(client, job("c", constraints={"require_ac": True, "max_load": 1.0,
                                                "require_idle_s": 60}))
    await client.post("/results", json=beacon("d", on_ac=None, idle_s=None, load_1m=None,
                                               disk_free_gb=None))
    assert await claim(client, "d") is None  # a probe that cannot tell: fail closed
    await client.post("/results", json=beacon("d", on_ac=True, idle_s=600, load_1m=2.5))
    assert await claim(client, "d") is None  # load too high
    await client.post("/results", json=beacon("d", on_ac=False, charging=False, idle_s=600,
                                               load_1m=0.2))
    assert await claim(client, "d") is None  # not on mains power
    await client.post("/results", json=beacon("d", on_ac=True, idle_s=600, load_1m=0.2,
                                               disk_free_gb=31.5))
    assert (await claim(client, "d"))["job_id"] == "c"
    history = (await (await client.get("/api/devices/d/beacons")).json())["beacons"]
    assert history[-1]["on_ac"] is True and history[-1]["disk_free_gb"] == 31.5  # kept as sent


async def test_the_earlier_names_ac_and_load_still_count(client):
    await client.post("/devices/register", json=registration("d"))
    await enqueue(client, job("c", constraints={"require_ac": True, "max_load": 1.0}))
    await client.post("/results", json=beacon("d", ac=True, load=0.4))
    assert (await claim(client, "d"))["job_id"] == "c"


# -- aliases of the clients in the field -------------------------------------------------------


async def test_brand_names_are_accepted_and_stored_in_the_neutral_form(client):
    spec = job("ui", workload="ui-test", executor="host",
               app={"name": "shop", "sha256": "a" * 64, "platform": "ios"},
               suite={"kind": "xcuitest", "flows": "ShopUITests"},
               report_to={"github_status": "octo/shop@0123abc"})
    await enqueue(client, spec)
    stored = (await (await client.get("/jobs/ui")).json())["spec"]
    assert stored["suite"] == {"kind": "native_bundle", "flows": "ShopUITests"}
    assert stored["report_to"] == {"ci_status": "octo/shop@0123abc"}
    assert (await (await client.get("/api/jobs/ui")).json())["spec"]["suite"]["kind"] == \
        "native_bundle"
    both = await enqueue(client, {**spec, "job_id": "two", "report_to": {
        "github_status": "octo/shop@0123abc", "ci_status": "octo/other@0123abc"}}, status=400)
    assert "github_status" in both["error"]
    schedule = await client.post("/api/schedules", json={
        "id": "nightly", "cron": "0 3 * * *",
        "template": {**{k: v for k, v in spec.items() if k != "job_id"},
                     "suite": {"kind": "maestro", "flows": "flows/"}}})
    assert schedule.status == 201, await schedule.text()
    template = (await schedule.json())["template"]
    assert template["suite"]["kind"] == "flow_runner"
    assert template["report_to"] == {"ci_status": "octo/shop@0123abc"}


# -- rows without iter, payload, test.artifacts ------------------------------------------------


async def test_a_row_without_iter_is_iteration_0_and_the_detail_carries_payloads(client):
    await client.post("/devices/register", json=registration("d"))
    await enqueue(client, job("j"))
    await claim(client, "d")
    posted = {"schema": 1, "kind": "result", "job_id": "j", "device_id": "d", "final": True,
              "ok": True, "metrics": {"decode_tok_s": 12.5}, "runner": {"app": "ios-agent"}}
    resp = await client.post("/results", json=posted)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["status"] == "done"
    [row] = (await (await client.get("/api/results?job=j")).json())["results"]
    assert row["iter"] == 0
    [detail] = (await (await client.get("/api/jobs/j")).json())["results"]
    assert detail["payload"] == {**posted, "iter": 0, "artifacts": []}
    assert detail["payload"]["runner"] == {"app": "ios-agent"}


async def test_a_template_reads_test_artifacts_when_the_row_has_none(client):
    sha = hashlib.sha256(b"report").hexdigest()
    await enqueue(client, [
        job("suite", workload="ui-test", executor="host"),
        job("publish", workload="archive", executor="host", depends_on=["suite"],
            params={"source": "${jobs.suite.artifact}"})])
    assert await executor_claim(client, "mac") == "suite"
    await finish(client, "suite", "iphone-15", executor="mac",
                 test={"artifacts": [sha], "passed": 12})
    waiter = await (await client.get("/jobs/publish")).json()
    assert waiter["status"] == "queued", waiter["last_error"]
    assert waiter["spec"]["params"]["source"] == sha


# -- a template reference resolved to what no spec may hold -----------------------------------


async def test_a_reference_resolved_to_what_no_spec_may_hold_fails_its_job(client):
    """A reference may stand where text is kept; resolved to an object (a backend) or to text
    that does not compile (a match expression), the spec is no job's, and storing it made a
    device be handed a backend that is an object. The waiter fails with the reason instead, and
    keeps the spec it was sent with."""
    await client.post("/devices/register", json=registration("d"))
    await enqueue(client, [
        job("a"),
        job("obj", backend="${jobs.a.metrics.k}", depends_on=["a"]),
        job("expr", targets={"match": "model == '${jobs.a.metrics.q}'"}, depends_on=["a"]),
        job("fine", params={"n": "${jobs.a.metrics.n}"}, depends_on=["a"])])
    assert (await claim(client, "d"))["job_id"] == "a"
    reply = await finish(client, "a", "d", metrics={"k": {"x": [1, 2]}, "q": "x' ((( ", "n": 3})
    assert reply["promoted"] == ["fine"], reply
    for job_id, words in (("obj", "backend"), ("expr", "targets.match")):
        row = await (await client.get(f"/jobs/{job_id}")).json()
        assert row["status"] == "failed", row
        assert row["last_error"].startswith("with its template references resolved, the spec "
                                            "is not one a job may have: "), row["last_error"]
        assert words in row["last_error"], row["last_error"]
        assert "${jobs.a.metrics." in str(row["spec"])  # stored as it was sent
    fine = await (await client.get("/jobs/fine")).json()
    assert fine["status"] == "queued" and fine["spec"]["params"]["n"] == 3


async def test_retrying_a_job_whose_stored_spec_no_job_may_have_is_refused(client, db_path):
    """A spec stored before resolved references were checked (or one a later rule refuses) is
    refused by retry with a sentence, not stored again: a dict where a pool is kept made the
    retry answer 500."""
    await enqueue(client, job("bad", targets={"pool": "lab"}))
    assert (await client.post("/api/jobs/bad/cancel", json={})).status == 200
    edit_rows(db_path, "UPDATE jobs SET spec = json_set(spec, '$.targets.pool', "
                       "json('{\"o\": 1}')) WHERE job_id = 'bad'")
    resp = await client.post("/api/jobs/bad/retry", json={})
    body = await resp.json()
    assert resp.status == 409, body
    assert "its stored spec does not pass the checks a new job's does" in body["error"], body
    jobs = await (await client.get("/api/jobs")).json()
    assert [j["job_id"] for j in jobs["jobs"]] == ["bad"]
