"""Jobs as the original tools' clients and executors shape them (docs/api.md,
"Compatibility"), over real HTTP against a real collector: the bodies here are the ones those
clients send, written out field by field."""

from __future__ import annotations

from tests.support.collector import job, registration, result_row

SHA_A = "a" * 64


async def post(client, path, body=None):
    resp = await client.post(path, json=body)
    return resp.status, (await resp.json() if resp.status != 204 else None)


async def get(client, path):
    resp = await client.get(path)
    return resp.status, (await resp.json() if resp.status != 204 else None)


def web_job(job_id, workload="web-test", **fields):
    return job(job_id, workload, "host", suite={"kind": "playwright", "flows": "aliquant"},
               targets={"executor": "web-1", "url": "http://127.0.0.1:4173"},
               lease={"ttl_s": 900, "max_attempts": 1}, **fields)


# -- browser suites and their verdict rows -------------------------------------------------------


async def test_a_playwright_web_test_runs_with_browser_verdict_rows(client):
    status, reply = await post(client, "/jobs", web_job(
        "web", app={"name": "aliquant-web", "build": "smoke"}, params={"browser": "chromium"}))
    assert status == 201, reply
    status, claimed = await get(client, "/executor/next-job?name=web-1")
    assert claimed["job_id"] == "web"
    assert claimed["targets"]["url"] == "http://127.0.0.1:4173"
    assert claimed["suite"]["kind"] == "browser_runner"  # stored in the neutral form
    status, row = await post(client, "/results", {
        "schema": 1, "kind": "result", "job_id": "web", "device_id": "web:chromium", "ok": True,
        "test": {"passed": 1, "failed": 0}})
    assert status == 200, row
    status, closed = await post(client, "/results", {
        "schema": 1, "kind": "result", "job_id": "web", "device_id": "host:web-1", "ok": True,
        "final": True})
    assert closed["status"] == "done"
    _, shown = await get(client, "/api/jobs/web")
    browser = [r for r in shown["results"] if r["device_id"] == "web:chromium"]
    assert browser[0]["payload"]["test"] == {"passed": 1, "failed": 0}
    _, devices = await get(client, "/api/devices")
    assert not [d for d in devices["devices"] if d["device_id"].startswith("web:")]


async def test_web_shots_keep_per_page_and_per_profile_rows(client):
    assert (await post(client, "/jobs", web_job("shots", "web-shots")))[0] == 201
    await get(client, "/executor/next-job?name=web-1")
    for iteration in (1, 0):
        status, _ = await post(client, "/results", {
            "schema": 1, "kind": "result", "job_id": "shots", "device_id": "web:chromium",
            "iter": iteration, "ok": True, "test": {"passed": 1, "failed": 0}})
        assert status == 200
    await post(client, "/results", {"schema": 1, "kind": "result", "job_id": "shots",
                                    "device_id": "host:web-1", "ok": True, "final": True})
    _, shown = await get(client, "/api/jobs/shots")
    assert shown["status"] == "done"
    assert len([r for r in shown["results"] if r["device_id"] == "web:chromium"]) == 2


async def test_a_browser_row_speaks_only_while_an_executor_holds_the_job(client):
    await post(client, "/jobs", web_job("unheld", "web-audit"))
    status, reply = await post(client, "/results", {
        "schema": 1, "kind": "result", "job_id": "unheld", "device_id": "web:audit", "ok": True,
        "metrics": {"issues_error": 0}})
    assert status == 409 and "nobody holds it" in reply["error"]
    # And a device job's rows still speak for their device_id alone.
    await client.post("/devices/register", json=registration("d"))
    await post(client, "/jobs", job("bench", targets={"device_id": "d"}))
    await get(client, "/devices/d/next-job")
    status, _ = await post(client, "/results", result_row("bench", "web:chromium", 0, ok=True))
    assert status == 409


# -- credentials named by environment variable ---------------------------------------------------


def signing_in_job(job_id, credentials):
    return job(job_id, "ui-test", "host", app={"name": "greenfolio-ios", "build": "local"},
               suite={"kind": "xcuitest", "project": "/tmp/x.xcodeproj", "scheme": "X",
                      "credentials": credentials},
               targets={"executor": "never", "device_kind": "device"},
               lease={"ttl_s": 600, "max_attempts": 1})


async def test_a_job_names_the_variables_its_credentials_are_read_from(client):
    status, reply = await post(client, "/jobs", signing_in_job("signin", {
        "account": "showcase@greenfol.io", "email_var": "GREENFOLIO_TEST_EMAIL",
        "password_var": "GREENFOLIO_TEST_PASSWORD", "token_env": "CI_TOKEN"}))
    assert status == 201, reply
    _, shown = await get(client, "/api/jobs/signin")
    assert shown["spec"]["suite"]["credentials"]["account"] == "showcase@greenfol.io"
    assert shown["spec"]["suite"]["credentials"]["password_var"] == "GREENFOLIO_TEST_PASSWORD"


async def test_a_secret_under_a_variable_key_is_still_refused(client):
    for credentials in ({"password_var": "hunter2"}, {"password_var": "sk-live xyz"},
                        {"token_env": {"value": "ghp_abc"}}, {"password": "HUNTER2"}):
        status, reply = await post(client, "/jobs", signing_in_job("leak", credentials))
        assert status == 400 and "looks like a secret" in reply["error"], credentials
    assert (await get(client, "/api/jobs/leak"))[0] == 404


# -- enqueue, preview, cancel and the job record -------------------------------------------------


async def test_post_api_jobs_enqueues_like_post_jobs(client):
    status, reply = await post(client, "/api/jobs", job("via-api"))
    assert status == 201 and reply == {"ok": True, "job_id": "via-api", "status": "queued"}
    assert (await post(client, "/api/jobs", job("via-api")))[0] == 409
    status, reply = await post(client, "/api/jobs", [job("a1"), job("a2")])
    assert status == 201 and [j["job_id"] for j in reply["jobs"]] == ["a1", "a2"]
    assert (await get(client, "/jobs/a2"))[1]["status"] == "queued"


async def test_preview_without_a_workload_counts_what_fan_out_then_enqueues(client):
    for device_id, ram in (("big", 8000), ("mid", 4096), ("small", 2000)):
        await client.post("/devices/register", json=registration(
            device_id, pools=["shelf"],
            descriptor={"model": "P", "ram_mb": ram, "os": "android-14"}))
    status, preview = await post(client, "/api/jobs/preview-targets",
                                 {"targets": {"pool": "shelf", "match": "ram_mb >= 4000"}})
    assert status == 200, preview
    assert preview["count"] == 2 and {d["device_id"] for d in preview["devices"]} == {
        "big", "mid"}
    status, fan = await post(client, "/api/jobs", job(
        "fan", fanout=True, targets={"pool": "shelf", "match": "ram_mb >= 4000"}))
    assert status == 201 and len(fan["fanout"]) == preview["count"]
    status, bad = await post(client, "/api/jobs/preview-targets",
                             {"targets": {"match": "ram_mb >>> 4"}})
    assert status == 400 and "targets.match" in bad["error"]


async def test_a_cancel_keeps_the_operators_reason(client):
    await post(client, "/jobs", job("q1", targets={"pool": "nobody"}))
    status, reply = await post(client, "/api/jobs/q1/cancel", {"reason": "smoke"})
    assert status == 200 and reply["was"] == "queued"
    assert (await get(client, "/api/jobs/q1"))[1]["last_error"] == "smoke"
    await post(client, "/jobs", job("q2", targets={"pool": "nobody"}))
    assert (await post(client, "/api/jobs/q2/cancel", {}))[0] == 200
    assert (await get(client, "/api/jobs/q2"))[1]["last_error"] == "cancelled by an operator"
    await post(client, "/jobs", job("q3", targets={"pool": "nobody"}))
    for bad in ({"reason": ""}, {"reason": 7}, {"why": "x"}, ["smoke"], {"reason": "x" * 501}):
        status, reply = await post(client, "/api/jobs/q3/cancel", bad)
        assert status == 400 and reply["error"], bad
    assert (await get(client, "/api/jobs/q3"))[1]["status"] == "queued"


async def test_the_job_record_names_the_executor_a_host_job_wants(client):
    app = {"name": "x", "build": "1", "sha256": "0" * 64}
    await post(client, "/jobs", job("pinned", "install", "host", app=app,
                                    targets={"executor": "mac-xcode"}))
    await post(client, "/jobs", job("anyone", "install", "host", app=app))
    assert (await get(client, "/api/jobs/pinned"))[1]["wants_executor"] == "mac-xcode"
    assert (await get(client, "/api/jobs/anyone"))[1]["wants_executor"] is None
    listed = {j["job_id"]: j for j in (await get(client, "/api/jobs"))[1]["jobs"]}
    assert listed["pinned"]["wants_executor"] == "mac-xcode"


# -- app.sha256 "latest" -------------------------------------------------------------------------


async def publish(client, body, app, build):
    resp = await client.post("/artifacts", data=body, headers={
        "content-type": "application/octet-stream", "x-artifact-name": f"{build}.apk",
        "x-artifact-app": app, "x-artifact-build": build, "x-artifact-platform": "android"})
    assert resp.status == 201
    return (await resp.json())["sha256"]


LATEST_APP = {"name": "smoke-app", "build": "latest", "sha256": "latest"}


def install_latest(job_id):
    return job(job_id, "install", "host", app=dict(LATEST_APP), targets={"executor": "never"},
               lease={"ttl_s": 600, "max_attempts": 1})


async def test_latest_records_the_build_it_resolved_to(client):
    older = await publish(client, b"older", "smoke-app", "1.0.0")
    newer = await publish(client, b"newer", "smoke-app", "1.1.0")
    assert (await post(client, "/jobs", install_latest("now")))[0] == 201
    app = (await get(client, "/api/jobs/now"))[1]["spec"]["app"]
    assert app == {"name": "smoke-app", "build": "1.1.0", "sha256": newer}
    # A schedule's run resolves the same way (the original's POST /schedules, then run now).
    template = {k: v for k, v in install_latest("x").items() if k != "job_id"}
    status, _ = await post(client, "/schedules", {"id": "nightly", "cron": "0 3 * * *",
                                                  "enabled": True, "template": template})
    assert status == 201
    status, run = await post(client, "/api/schedules/nightly/run", {})
    assert status == 201, run
    app = (await get(client, f"/api/jobs/{run['job_id']}"))[1]["spec"]["app"]
    assert app["build"] == "1.1.0" and app["sha256"] == newer
    # A revert publishes the older bytes again under a new build: they are the latest now.
    assert await publish(client, b"older", "smoke-app", "1.2-revert") == older
    await post(client, "/jobs", install_latest("reverted"))
    app = (await get(client, "/api/jobs/reverted"))[1]["spec"]["app"]
    assert app["build"] == "1.2-revert" and app["sha256"] == older
    # A build the client named itself is kept.
    await post(client, "/jobs", {**install_latest("named"),
                                 "app": {**LATEST_APP, "build": "nightly-7"}})
    assert (await get(client, "/api/jobs/named"))[1]["spec"]["app"]["build"] == "nightly-7"


# -- chains and preemption, as the final row's reply tells them ----------------------------------


def chain_job(job_id, **fields):
    return job(job_id, "chain-wl", targets={"device_id": "chain-dev"}, **fields)


async def test_a_closing_row_names_the_waiters_it_promoted_and_failed(client):
    await client.post("/devices/register",
                      json=registration("chain-dev", capabilities=["chain-wl"]))
    await post(client, "/jobs", chain_job("build"))
    status, waiting = await post(client, "/jobs", chain_job(
        "install", depends_on=["build"], params={"budget_s": "${jobs.build.metrics.build_s}"}))
    assert status == 201 and waiting["status"] == "waiting"
    assert (await get(client, "/devices/chain-dev/next-job"))[1]["job_id"] == "build"
    status, closed = await post(client, "/results", result_row(
        "build", "chain-dev", 0, final=True, ok=True, metrics={"build_s": 91}))
    assert status == 200 and closed["status"] == "done"
    assert closed["promoted"] == ["install"] and closed["failed"] == []
    assert (await get(client, "/api/jobs/install"))[1]["spec"]["params"]["budget_s"] == 91
    await post(client, "/api/jobs/install/cancel")
    # A failed dependency: the reply lists every waiter it failed, down the chain.
    await post(client, "/jobs", chain_job("faildep"))
    await post(client, "/jobs", chain_job("failwait", depends_on=["faildep"]))
    await post(client, "/jobs", chain_job("beyond", depends_on=["failwait"]))
    assert (await get(client, "/devices/chain-dev/next-job"))[1]["job_id"] == "faildep"
    status, broke = await post(client, "/results", result_row(
        "faildep", "chain-dev", 0, final=True, ok=False, error="compile error"))
    assert broke["status"] == "failed" and broke["promoted"] == []
    assert sorted(broke["failed"]) == ["beyond", "failwait"]
    failwait = (await get(client, "/api/jobs/failwait"))[1]
    assert failwait["status"] == "failed" and "faildep" in failwait["last_error"]


async def test_a_dependency_on_itself_is_refused_as_a_cycle(client):
    await client.post("/devices/register",
                      json=registration("chain-dev", capabilities=["chain-wl"]))
    status, reply = await post(client, "/jobs", chain_job("self", depends_on=["self"]))
    assert status == 400 and "cycle" in reply["error"] and "self" in reply["error"]
    assert (await get(client, "/api/jobs/self"))[0] == 404


async def test_a_preempted_final_row_says_so_and_names_the_checkpoint(client):
    await client.post("/devices/register",
                      json=registration("marathon", capabilities=["long-wl"]))
    await post(client, "/jobs", job("long", "long-wl", preemptible=True, params={"hours": 6},
                                    targets={"device_id": "marathon"}))
    claimed = (await get(client, "/devices/marathon/next-job"))[1]
    assert claimed["job_id"] == "long" and claimed["preemptible"] is True
    checkpoint = await client.post("/artifacts", data=b"checkpoint after 2 hours")
    sha = (await checkpoint.json())["sha256"]
    status, stood = await post(client, "/results", result_row(
        "long", "marathon", 0, final=True, ok=True, preempted=True, artifacts=[sha],
        metrics={"hours_done": 2}))
    assert status == 200 and stood["status"] == "queued"
    assert stood["preempted"] is True and stood["resume_from"] == sha
    shown = (await get(client, "/jobs/long"))[1]
    assert shown["status"] == "queued" and shown["attempts"] == 0
    assert shown["spec"]["params"]["resume_from"] == sha


# -- capabilities at enqueue ---------------------------------------------------------------------


async def test_an_unknown_workload_no_agent_declares_is_refused_at_enqueue(client):
    # An agent that never declared capabilities: offered everything, but it cannot know a
    # workload name the spec does not define.
    await client.post("/devices/register", json=registration("legacy"))
    status, reply = await post(client, "/jobs", job("orphan", "teleport"))
    assert status == 422 and "teleport" in reply["error"]
    assert (await get(client, "/api/jobs/orphan"))[0] == 404
    # A workload the spec names is still accepted for it, and it claims it.
    assert (await post(client, "/jobs", job("old", "pipeline",
                                            targets={"device_id": "legacy"})))[0] == 201
    assert (await get(client, "/devices/legacy/next-job"))[1]["job_id"] == "old"
    # Once an agent declares the new name, the job is accepted and goes to that agent.
    await client.post("/devices/register", json=registration("novel", capabilities=["teleport"]))
    assert (await post(client, "/jobs", job("novel-job", "teleport")))[0] == 201
    assert (await get(client, "/devices/novel/next-job"))[1]["job_id"] == "novel-job"


async def test_a_workload_of_the_spec_on_another_executor_still_counts_an_undeclared_agent(client):
    await client.post("/devices/register", json=registration("legacy"))
    status, reply = await post(client, "/jobs", job("drain-1", "drain",
                                                    targets={"pool": "unclaimable"}))
    assert status == 201, reply
    shown = (await get(client, "/jobs/drain-1"))[1]
    assert shown["lease_ttl_s"] == 14400 and shown["max_attempts"] == 3
