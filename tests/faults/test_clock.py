"""The host clock moved by hours under a running collector (libfaketime, with the monotonic clock
left real, as settimeofday or an NTP step would leave it).

What must hold: a jump neither expires every lease at once nor fires every schedule, does not
stretch a dead agent's lease, does not call every device offline, and does not pause schedules.
Four of these failed when first run (times are stored as wall-clock epoch seconds); the
collector's clock watch and the scheduler's catch-up fixed them, and these tests keep them
fixed (docs/reliability.md).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_min.timeutil import parse_iso
from tests.support.collector import CollectorProcess, beacon, job, registration
from tests.support.faults import faketime_lib, wait_until

pytestmark = pytest.mark.slow


class FakedClock:
    """A collector whose wall clock is real time plus an offset we can change while it runs."""

    def __init__(self, tmp: Path, lib: str) -> None:
        self.file = tmp / "faketime"
        self._write(0)
        # NO_CACHE: libfaketime reads the file at every clock reading, so a move is immediate.
        self.proc = CollectorProcess(tmp / "data", env={
            "LD_PRELOAD": lib, "FAKETIME_TIMESTAMP_FILE": str(self.file),
            "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FLEET_SWEEP_S": "1", "FLEET_LONG_POLL_S": "1"})

    def _write(self, offset_s: int) -> None:
        part = self.file.with_suffix(".part")
        part.write_text(f"{offset_s:+d}\n")
        part.replace(self.file)

    def set(self, offset_s: int) -> None:
        """Move the collector's clock to real time + offset_s, and wait until it reads so."""
        self._write(offset_s)
        wait_until(lambda: abs(self.skew() - offset_s) < 30, 10, "the collector's clock to move",
                   0.05)

    def skew(self) -> float:
        health = self.proc.client.get("/api/health")[1]
        return parse_iso(health["now"]) - time.time()


@pytest.fixture
def clock(tmp_path: Path) -> Iterator[FakedClock]:
    lib = faketime_lib()
    if lib is None:
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    faked = FakedClock(tmp_path, lib)
    faked.proc.start()
    try:
        yield faked
    finally:
        faked.proc.stop()


def _claimed(clock: FakedClock, count: int, ttl_s: int) -> list[str]:
    client = clock.proc.client
    ids = [f"lease{i}" for i in range(count)]
    assert client.post("/jobs", [job(i, lease={"ttl_s": ttl_s}) for i in ids])[0] == 201
    for n in range(count):
        assert client.post("/devices/register", registration(f"dev{n}"))[0] == 200
        status, spec = client.get(f"/devices/dev{n}/next-job")
        assert status == 200
        assert client.post("/results", beacon(f"dev{n}", spec["job_id"]))[1]["lease_renewed"]
    return ids


def test_the_fake_clock_moves_the_collector_and_not_the_test(clock: FakedClock) -> None:
    """The harness itself: the collector's `now` follows the file, its uptime does not."""
    client = clock.proc.client
    before = client.get("/api/health")[1]
    clock.set(3 * 3600)
    after = client.get("/api/health")[1]
    jump = parse_iso(after["now"]) - parse_iso(before["now"])
    assert 3 * 3600 <= jump < 3 * 3600 + 60
    assert after["uptime_s"] - before["uptime_s"] > 3 * 3600  # uptime is wall-clock based


def test_forward_jump_does_not_expire_every_lease(clock: FakedClock) -> None:
    ids = _claimed(clock, 4, ttl_s=600)
    client = clock.proc.client
    clock.set(3 * 3600)
    swept = client.post("/jobs/sweep")[1]
    statuses = {i: client.get(f"/jobs/{i}")[1]["status"] for i in ids}
    assert swept["requeued"] == [] and set(statuses.values()) == {"claimed"}, (swept, statuses)


def test_backward_jump_does_not_stretch_a_dead_agents_lease(clock: FakedClock) -> None:
    ids = _claimed(clock, 1, ttl_s=2)
    clock.set(-3600)
    client = clock.proc.client
    # the agent is gone; within a few sweeps past its 2 s lease the job must be requeued
    wait_until(lambda: client.get(f"/jobs/{ids[0]}")[1]["status"] == "queued", 6,
               "the dead agent's lease to run out")


def _schedule(clock: FakedClock, cron: str) -> None:
    client = clock.proc.client
    body = {"id": "tick", "cron": cron,
            "template": {"schema": 1, "workload": "benchmark", "executor": "device",
                         "backend": "synthetic"}}
    assert client.post("/api/schedules", body)[0] == 201
    assert client.request("PATCH", "/api/schedules/tick", {"enabled": True})[0] == 200


def _scheduled_jobs(clock: FakedClock) -> list[str]:
    jobs = clock.proc.client.get("/api/jobs?limit=200")[1]["jobs"]
    return sorted(j["job_id"] for j in jobs if j["job_id"].startswith("tick-"))


def test_forward_jump_fires_each_schedule_at_most_once(clock: FakedClock, figures: Any) -> None:
    _schedule(clock, "*/5 * * * *")
    before = _scheduled_jobs(clock)
    clock.set(3 * 3600)
    reply = clock.proc.client.post("/schedules/tick")[1]
    again = clock.proc.client.post("/schedules/tick")[1]
    after = _scheduled_jobs(clock)
    assert len(after) - len(before) == 1, (before, after)  # 36 due minutes, one run
    assert len(reply["fired"]) <= 1 and again["fired"] == []
    history = clock.proc.client.get("/api/schedules/tick/history")[1]
    figures.record("clock_forward_3h_schedule", due_minutes_skipped=reply["missed"],
                   runs=len(after) - len(before), history_rows=len(history.get("runs", [])))


def test_backward_jump_does_not_pause_schedules(clock: FakedClock) -> None:
    _schedule(clock, "* * * * *")
    client = clock.proc.client
    clock.set(120)
    first = client.post("/schedules/tick")[1]["fired"]
    assert len(first) == 1
    clock.set(-3600)
    assert client.post("/schedules/tick")[1]["fired"] == []  # nothing runs twice
    clock.set(-3420)  # three minutes later on the new clock
    fired = client.post("/schedules/tick")[1]["fired"]
    assert len(fired) == 1, "a minutely schedule did not run for three minutes"


def test_forward_jump_does_not_call_every_device_offline(clock: FakedClock) -> None:
    client = clock.proc.client
    for n in range(3):
        assert client.post("/devices/register", registration(f"shelf{n}"))[0] == 200
        assert client.request("PATCH", f"/api/devices/shelf{n}", {"name": f"Shelf {n}"})[0] == 200
        assert client.post("/results", beacon(f"shelf{n}", battery_pct=90))[0] == 200
    clock.set(3 * 3600)
    client.post("/api/alerts/tick")
    alerts = client.get("/api/alerts?state=open&rule=device-offline")[1]["alerts"]
    assert alerts == [], alerts
