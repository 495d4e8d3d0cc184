"""report_to.ci_status on host and device jobs and fan-outs, posted to a local fake of GitHub's
commit-status API."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fleet_min.collector.access import ci_status
from tests.support.collector import job, registration, result_row
from tests.support.fake_statuses import WAIT_S, running_fake_statuses

SHA = "0123456789abcdef0123456789abcdef01234567"
TARGET = f"octo-org/my.app@{SHA}"
TOKEN = "ghp_fake_status_token_1234567890"


@pytest.fixture
async def github():
    async with running_fake_statuses() as fake:
        yield fake


async def start(collector_factory, monkeypatch, api, token=TOKEN, repos=("octo-org/my.app",)):
    monkeypatch.setenv("FLEET_GITHUB_API", api)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    monkeypatch.setenv("FLEET_CI_STATUS_REPOS", ",".join(repos))
    if token:
        monkeypatch.setenv("FLEET_CI_STATUS_TOKEN", token)
    else:
        monkeypatch.delenv("FLEET_CI_STATUS_TOKEN", raising=False)
    return await collector_factory(github_api=api, ci_status_token=token or "",
                                   ci_status_repos=tuple(repos))


def host_job(job_id="ui-1", **fields):
    return job(job_id, workload="install", executor="host", report_to={"ci_status": TARGET},
               **fields)


async def claim_host(client, name="mac-mini"):
    resp = await client.get(f"/executor/next-job?name={name}")
    assert resp.status == 200
    return await resp.json()


async def recorded(client, job_id, count):
    """The job's CI status record once `count` attempts are in it."""
    async with asyncio.timeout(WAIT_S):
        while True:
            body = await (await client.get(f"/api/jobs/{job_id}/ci-status")).json()
            if len(body["statuses"]) >= count:
                return body
            await asyncio.sleep(0.02)


async def test_pending_at_claim_and_success_at_the_end(collector_factory, monkeypatch, github):
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    assert (await client.post("/jobs", json=host_job())).status == 201
    await claim_host(client)
    [pending] = await github.wait_for(1)
    assert pending == {
        "path": f"/repos/octo-org/my.app/statuses/{SHA}", "auth": f"Bearer {TOKEN}",
        "accept": "application/vnd.github+json", "state": "pending",
        "context": "fleet-min/install",
        "description": "install is running on the device fleet."}
    await client.post("/results", json=result_row("ui-1", "pixel-7", final=True, ok=True,
                                                  executor="mac-mini"))
    calls = await github.wait_for(2)
    assert [c["state"] for c in calls] == ["pending", "success"]
    body = await recorded(client, "ui-1", 2)
    assert body["target"] == TARGET and body["armed"] is True
    assert [(s["state"], s["dry_run"], s["http_status"], s["error"])
            for s in body["statuses"]] == [("pending", False, 201, None),
                                            ("success", False, 201, None)]
    assert body["statuses"][0]["at"].endswith("Z")
    assert (await (await client.get("/api/health")).json())["ci_status_armed"] is True


async def test_failure_carries_the_error_sentence(collector_factory, monkeypatch, github):
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    await client.post("/jobs", json=host_job())
    await claim_host(client)
    await client.post("/results", json=result_row("ui-1", "pixel-7", final=True, ok=False,
                                                  error="no Android device is attached",
                                                  executor="mac-mini"))
    calls = await github.wait_for(2)
    assert calls[1]["state"] == "failure"
    assert calls[1]["description"] == "install failed: no Android device is attached"
    await recorded(client, "ui-1", 2)


async def test_cancel_before_a_claim_posts_error(collector_factory, monkeypatch, github):
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    await client.post("/jobs", json=host_job())
    assert (await client.post("/api/jobs/ui-1/cancel")).status == 200
    [call] = await github.wait_for(1)
    assert call["state"] == "error" and "cancelled" in call["description"]
    assert (await recorded(client, "ui-1", 1))["statuses"][0]["state"] == "error"


async def test_server_errors_are_retried_client_errors_are_not(collector_factory, monkeypatch,
                                                               github):
    github.script = [502, 201, 422]
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    await client.post("/jobs", json=host_job())
    await claim_host(client)
    await github.wait_for(2)  # 502 then the retry's 201
    await client.post("/results", json=result_row("ui-1", "pixel-7", final=True, ok=True,
                                                  executor="mac-mini"))
    body = await recorded(client, "ui-1", 3)
    assert [(s["state"], s["http_status"]) for s in body["statuses"]] == [
        ("pending", 502), ("pending", 201), ("success", 422)]
    assert body["statuses"][0]["error"] == "the statuses API answered 502: scripted 502"
    assert body["statuses"][2]["error"] == "the statuses API answered 422: scripted 422"
    await asyncio.sleep(0.6)  # past the first backoff step: a 422 must not have been retried
    assert len(github.calls) == 3


@pytest.mark.parametrize("answer", [b"[" * 4000, b'{"message": "\\ud800 bad"}', b"\xff\xfe",
                                    b'{"message": ["not", "text"]}'],
                         ids=["deep", "surrogate", "not-utf8", "message-a-list"])
async def test_an_odd_error_answer_is_recorded_and_not_retried(collector_factory, monkeypatch,
                                                               github, answer):
    """A statuses API (or a proxy in front of it) may answer a refusal with anything; the
    attempt is still recorded, with a sentence, and a 4xx is still not retried."""
    github.script, github.error_body = [422], answer
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    await client.post("/jobs", json=host_job())
    await claim_host(client)
    body = await recorded(client, "ui-1", 1)
    [status] = body["statuses"]
    assert status["http_status"] == 422
    assert status["error"].startswith("the statuses API answered 422")
    assert len(github.calls) == 1


async def test_without_a_token_it_is_a_dry_run(collector_factory, monkeypatch, github):
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")),
                         token=None)
    await client.post("/jobs", json=host_job())
    await claim_host(client)
    await client.post("/results", json=result_row("ui-1", "pixel-7", final=True, ok=True,
                                                  executor="mac-mini"))
    body = await recorded(client, "ui-1", 2)
    assert body["armed"] is False
    assert [(s["state"], s["dry_run"], s["http_status"]) for s in body["statuses"]] == [
        ("pending", True, None), ("success", True, None)]
    assert github.calls == []
    assert (await (await client.get("/api/health")).json())["ci_status_armed"] is False


async def test_a_cascade_past_one_read_reports_every_job(collector_factory, monkeypatch, github):
    """Cancelling the root of a chain closes every dependent in one transaction; their events
    are prepared together, in reads of at most _IDS_A_READ ids, and each is recorded."""
    count = ci_status._IDS_A_READ + 20
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")),
                         token=None)
    for n in range(count):
        after = {"depends_on": [f"c{n - 1}"]} if n else {}
        assert (await client.post("/jobs", json=host_job(f"c{n}", **after))).status == 201
    assert (await client.post("/api/jobs/c0/cancel")).status == 200
    first = await recorded(client, "c0", 1)
    assert [s["state"] for s in first["statuses"]] == ["error"]
    for n in range(1, count):
        body = await recorded(client, f"c{n}", 1)
        assert [(s["state"], s["dry_run"]) for s in body["statuses"]] == [("failure", True)]


async def test_unreachable_api_is_recorded_and_retried(collector_factory, monkeypatch, github):
    url = str(github.server.make_url(""))
    await github.server.close()
    client = await start(collector_factory, monkeypatch, url)
    await client.post("/jobs", json=host_job())
    await claim_host(client)
    body = await recorded(client, "ui-1", 2)
    first = body["statuses"][0]
    assert first["http_status"] is None and "could not be reached" in first["error"]


async def test_device_jobs_and_jobs_without_a_target_report_nothing(
        collector_factory, monkeypatch, github):
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("plain-host", workload="install", executor="host"))
    await claim_host(client)
    await client.post("/results", json=result_row("plain-host", "mac-mini", final=True, ok=True))
    # The key's name inside a parameter: read and found to name no target.
    assert (await client.post("/jobs", json=job("param-host", workload="install",
                                                executor="host",
                                                params={"ci_status": TARGET}))).status == 201
    await claim_host(client)
    await client.post("/results", json=result_row("param-host", "mac-mini", final=True, ok=False))
    await client.post("/jobs", json=host_job())  # the marker: reported after the others
    await claim_host(client)
    [call] = await github.wait_for(1)
    assert call["state"] == "pending"
    await recorded(client, "ui-1", 1)
    for job_id in ("plain-host", "param-host"):
        plain = await (await client.get(f"/api/jobs/{job_id}/ci-status")).json()
        assert plain["target"] is None and plain["statuses"] == []
    assert len(github.calls) == 1
    assert (await client.get("/api/jobs/nope/ci-status")).status == 404


async def test_a_device_job_reports_like_a_host_job(collector_factory, monkeypatch, github):
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    await client.post("/devices/register", json=registration("pixel"))
    await client.post("/jobs", json=job("bench", report_to={"ci_status": TARGET}))
    claimed = await client.get("/devices/pixel/next-job")
    assert (await claimed.json())["job_id"] == "bench"
    await client.post("/results", json=result_row("bench", "pixel", final=True, ok=False,
                                                  error="decode fell 30 %"))
    calls = await github.wait_for(2)
    assert [(c["state"], c["context"]) for c in calls] == [
        ("pending", "fleet-min/benchmark"), ("failure", "fleet-min/benchmark")]
    assert calls[1]["description"] == "benchmark failed: decode fell 30 %"


async def test_a_fan_out_reports_once_under_its_parent(collector_factory, monkeypatch, github):
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    for device in ("pixel", "galaxy"):
        await client.post("/devices/register", json=registration(device))
    resp = await client.post("/jobs", json=job("sweep", fanout=True,
                                               report_to={"ci_status": TARGET}))
    assert sorted((await resp.json())["fanout"]) == ["sweep--galaxy", "sweep--pixel"]
    for device in ("pixel", "galaxy"):  # two claims: one pending, the parent's
        claimed = await client.get(f"/devices/{device}/next-job")
        assert (await claimed.json())["job_id"] == f"sweep--{device}"
    await client.post("/results", json=result_row("sweep--pixel", "pixel", final=True,
                                                  ok=True))
    await client.post("/results", json=result_row("sweep--galaxy", "galaxy", final=True,
                                                  ok=False, error="thermal throttling"))
    parent = await recorded(client, "sweep", 2)
    assert [s["state"] for s in parent["statuses"]] == ["pending", "failure"]
    calls = await github.wait_for(2)
    await asyncio.sleep(0.3)  # nothing more comes: no child posts one of its own
    assert [c["state"] for c in github.calls] == ["pending", "failure"]
    assert calls[1]["description"].startswith("benchmark failed: 1 of 2 fan-out children")
    for child in ("sweep--pixel", "sweep--galaxy"):
        assert (await (await client.get(f"/api/jobs/{child}/ci-status")).json())[
            "statuses"] == []


async def test_the_token_is_never_logged(collector_factory, monkeypatch, github, caplog):
    github.script = [500]
    caplog.set_level(logging.DEBUG)
    client = await start(collector_factory, monkeypatch, str(github.server.make_url("")))
    await client.post("/jobs", json=host_job())
    await claim_host(client)
    await recorded(client, "ui-1", 2)
    assert caplog.records, "the retry should have been logged"
    assert all(TOKEN not in record.getMessage() for record in caplog.records)
    body = await (await client.get("/api/jobs/ui-1/ci-status")).text()
    health = await (await client.get("/api/health")).text()
    assert TOKEN not in body and TOKEN not in health


def test_descriptions_fit_githubs_limit():
    text = ci_status.describe("failure", "ui-test", "x" * 500)
    assert len(text) == ci_status.MAX_DESCRIPTION and text.endswith("\u2026")
    assert ci_status.statuses_url("https://api.example/", "o/r.x@abc1234").endswith(
        "/repos/o/r.x/statuses/abc1234")

