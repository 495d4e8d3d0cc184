"""GET /metrics on the control plane: a real daemon over a fake host (runner installations, fake
systemctl on PATH, the fake GitHub API) with runners in several states, queued runs, an agent
host calling in and GitHub failing for a while, scraped and read back with prometheus_client's
parser. The label helpers are checked on their own below."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest

from fleet_min.controlplane import telemetry
from tests.support.controlplane import Host, until
from tests.support.metrics import Scrape, check_reply


def _ago(minutes: float) -> str:
    return (datetime.now(UTC) - timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _scrape(http: aiohttp.ClientSession, base: str) -> Scrape:
    async with http.get(f"{base}/metrics") as resp:
        return check_reply(resp.status, resp.headers, await resp.text())


async def _host_name(http: aiohttp.ClientSession, base: str) -> str:
    async with http.get(f"{base}/api/state") as resp:
        return str((await resp.json())["host"]["name"])


def _arrange(host: Host) -> None:
    host.add_runner("r-idle", labels=["linux"])
    host.start_unit("r-idle")
    host.add_runner("r-stopped", labels=["linux"])  # its service never started
    host.github.add_run("octo/app", "queued", _ago(10), ["self-hosted", "ARM64"])
    host.github.add_run("octo/app", "queued", _ago(2), ["arm64", "self-hosted"])
    host.github.add_run("octo/app", "queued", _ago(1), ["self-hosted", "gpu"])
    host.github.add_run("octo/app", "in_progress", _ago(3), ["self-hosted", "linux"],
                        runner="r-idle")


async def _heartbeat(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> None:
    body: dict[str, Any] = {"host": "agent-1", "runners": [
        {"name": "remote-1", "repo": "octo/app", "state": "working", "busy": True},
        {"name": "remote-2", "repo": "octo/app", "state": "sideways"}]}
    async with http.post(f"{base}/api/host/heartbeat", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()


def _check_runners(scrape: Scrape, here: str) -> None:
    assert scrape.type_of("fleet_controlplane_runners") == "gauge"
    assert scrape.value("fleet_controlplane_runners", host=here, state="idle") == 1
    assert scrape.value("fleet_controlplane_runners", host=here, state="stopped") == 1
    assert scrape.value("fleet_controlplane_runners", host=here, state="working") == 0
    assert scrape.value("fleet_controlplane_runners", host="agent-1", state="working") == 1
    # An agent's state outside the known set is counted, under one bounded label value.
    assert scrape.value("fleet_controlplane_runners", host="agent-1", state="unknown") == 1


def _check_queue(scrape: Scrape) -> None:
    assert scrape.series("fleet_controlplane_queued_jobs") == {
        (("labels", "arm64,self-hosted"),): 2, (("labels", "gpu,self-hosted"),): 1}
    oldest = scrape.value("fleet_controlplane_queue_wait_seconds", labels="arm64,self-hosted")
    assert 600 <= oldest < 3600  # the older of the two runs, ten minutes ago
    assert 60 <= scrape.value("fleet_controlplane_queue_wait_seconds",
                              labels="gpu,self-hosted") < 600


def _check_github(scrape: Scrape) -> None:
    assert scrape.type_of("fleet_controlplane_github_requests") == "counter"
    assert scrape.value("fleet_controlplane_github_requests_total", status_class="2xx") > 0
    assert scrape.value("fleet_controlplane_github_rate_limit") == 5000
    assert 0 < scrape.value("fleet_controlplane_github_rate_limit_remaining") < 5000
    assert scrape.value("fleet_controlplane_github_rate_limit_reset_timestamp_seconds") > \
        time.time()


def _check_members(scrape: Scrape) -> None:
    assert scrape.value("fleet_controlplane_members") == 1
    assert 0 <= scrape.value("fleet_controlplane_member_heartbeat_age_seconds",
                             host="agent-1") < 60
    assert scrape.value("fleet_controlplane_member_stale_after_seconds") == 60
    assert scrape.value("fleet_controlplane_stream_clients") == 0
    assert scrape.value("process_resident_memory_bytes") > 1 << 20


@pytest.mark.slow
async def test_a_live_control_plane_reports_runners_queue_github_and_members(
        host: Host, daemon_factory: Any, http: aiohttp.ClientSession) -> None:
    _arrange(host)
    d = daemon_factory()
    here = await _host_name(http, d.url)
    await _heartbeat(http, d.url, d.headers())

    async def queue_seen() -> Scrape | None:
        scrape = await _scrape(http, d.url)
        listed = scrape.series("fleet_controlplane_queued_jobs")
        states = scrape.series("fleet_controlplane_runners")
        idle = states.get((("host", here), ("state", "idle")))
        return scrape if len(listed) == 2 and idle == 1 else None

    scrape = await until(queue_seen, timeout=20)
    _check_runners(scrape, here)
    _check_queue(scrape)
    _check_github(scrape)
    _check_members(scrape)

    host.github.fail_next = 6  # GitHub answers 502 for a while: counted as 5xx

    async def failures_counted() -> bool:
        scrape = await _scrape(http, d.url)
        return scrape.has("fleet_controlplane_github_requests_total", status_class="5xx")

    await until(failures_counted, timeout=20)


def test_label_sets_are_case_blind_sorted_and_bounded():
    assert telemetry.label_set(["Self-Hosted", "ARM64", "arm64"]) == "arm64,self-hosted"
    assert telemetry.label_set([]) == "(none)" and telemetry.label_set(None) == "(none)"
    now = 1_000_000.0
    at = datetime.fromtimestamp(now - 100, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    runs = [{"created_at": at, "jobs": [
        {"status": "queued", "labels": [f"l{n}"], "created_at": at} for n in range(60)]
        + [{"status": "in_progress", "labels": ["busy"]},
           {"status": "queued", "labels": ["l0"], "created_at": "not a time"}]}]
    found = telemetry.queue_by_labels(runs, now)
    assert len(found) == telemetry.MAX_LABEL_SETS
    assert found["l0"] == (2, 100.0)  # the unreadable time falls back to the run's
    assert found["(other)"] == (11, 100.0)
    assert "busy" not in found


def test_runner_states_cover_every_host_with_zeros():
    samples = dict(telemetry.runner_samples(
        [{"host": "a", "state": "idle"}, {"host": "b", "state": "idle"}], ["a", "c"]))
    assert samples[("a", "idle")] == 1 and samples[("c", "idle")] == 0
    assert samples[("b", "stopped")] == 0 and ("a", "unknown") not in samples
