"""End-to-end: a real collector process and real agent processes talking HTTP.

Timers are shortened (FLEET_LONG_POLL_S=2, FLEET_SWEEP_S=1, agents beacon every second) so the
whole file stays well under a minute and a half on two cores.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import signal
import time

import pytest

from tests.support.agent import http_json, python38, wait_for

pytestmark = pytest.mark.slow


# decisions.md: the hex SHA-256 of a fresh 4,096-byte block after 1,000 rounds. A token is
# 1,000 rounds over that block (about 3 ms on the development VM: sizes below are set by it).
ATTESTATION = "d7e8b70dfb48593edebc84967a969e78429f9ac6da8d0c681a4b57a2fe078a84"


def reference_block(rounds: int) -> bytes:
    block = bytearray((i * 31) & 0xFF for i in range(4096))
    for _ in range(rounds):
        block[:32] = hashlib.sha256(block).digest()
    return bytes(block)


def bench(job_id: str, measure: int, prompt: int = 20, gen: int = 5, **fields) -> dict:
    spec = {"schema": 1, "job_id": job_id, "workload": "benchmark", "executor": "device",
            "backend": "synthetic",
            "params": {"prompt_tokens": prompt, "gen_tokens": gen, "warmup_iters": 0,
                       "measure_iters": measure}}
    spec.update(fields)
    return spec


def registered(collector, device_id: str) -> bool:
    return collector.get(f"/api/devices/{device_id}")[0] == 200


def iters(rows: list[dict]) -> list[int]:
    return sorted(r["iter"] for r in rows)


def summary(rows: list[dict]) -> dict:
    return next(r for r in rows if r["iter"] == 0)


def test_synthetic_fanout_reaches_three_agents_and_every_row_lands(procs):
    collector = procs.collector()
    names = ["fan-a", "fan-b", "fan-c"]
    oldest = python38()  # one agent on the oldest Python the agent supports, when present
    for name in names:
        procs.agent([collector], name, **({"python": oldest} if oldest and name == "fan-c"
                                          else {}))
    for name in names:
        wait_for(lambda n=name: registered(collector, n), 20, what=f"{name} to register")
    reply = collector.enqueue(bench("fan", measure=3, fanout=True))
    assert sorted(reply["fanout"]) == [f"fan--{n}" for n in names]
    for name in names:
        child = collector.wait_status(f"fan--{name}", ("done", "failed"), timeout=40)
        assert child["status"] == "done", child
        rows = collector.results(f"fan--{name}")
        assert iters(rows) == [0, 1, 2, 3]
        assert all(r["device_id"] == name and r["ok"] for r in rows)
        top = summary(rows)
        assert top["final"] is True
        # The attestation, the same on every agent (the oldest Python's included).
        assert top["metrics"]["synthetic_digest"] == ATTESTATION
        assert top["metrics"]["synthetic_rounds"] == 1000
        for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms"):
            assert top["metrics"][key] > 0
    assert collector.wait_status("fan", ("done",), timeout=10)["status"] == "done"


def test_a_lease_is_renewed_across_a_job_longer_than_its_ttl(procs):
    collector = procs.collector()
    procs.agent([collector], "lease-1")
    wait_for(lambda: registered(collector, "lease-1"), 20, what="registration")
    # about 4 s of work against a 2 s lease and a 1 s sweep: only beacons keep it alive
    started = time.monotonic()
    collector.enqueue(bench("long", measure=12, prompt=90, gen=40, lease={"ttl_s": 2},
                            targets={"device_id": "lease-1"}))
    job = collector.wait_status("long", ("done", "failed"), timeout=60)
    assert time.monotonic() - started > 2.5  # the job really outlived its lease
    assert job["status"] == "done", job
    assert job["attempts"] == 1 and not job["last_error"]
    assert iters(collector.results("long")) == list(range(13))
    status, beacons = collector.get("/api/devices/lease-1/beacons")
    assert status == 200
    beacon_list = beacons.get("beacons", beacons) if isinstance(beacons, dict) else beacons
    assert sum(1 for b in beacon_list if b.get("job_id") == "long") >= 3


def test_cancel_stops_the_work_and_frees_the_agent(procs):
    collector = procs.collector()
    agent = procs.agent([collector], "cancel-1")
    wait_for(lambda: registered(collector, "cancel-1"), 20, what="registration")
    collector.enqueue(bench("endless", measure=2000, prompt=40, gen=12))
    wait_for(lambda: len(collector.results("endless")) >= 2, 30, what="first rows")
    status, reply = collector.post("/api/jobs/endless/cancel")
    assert status == 200 and reply["was"] == "claimed", reply
    wait_for(lambda: "job endless ended" in agent.log(), 15, what="the agent to stop")
    settled = len(collector.results("endless"))
    time.sleep(1.5)
    assert len(collector.results("endless")) == settled < 100  # nothing more arrives
    assert collector.job("endless")["status"] == "cancelled"
    assert "no longer renews this job's lease" in agent.log()
    collector.enqueue(bench("after-cancel", measure=1))
    assert collector.wait_status("after-cancel", ("done", "failed"), 20)["status"] == "done"


def test_preemption_hands_the_job_back_and_it_resumes(procs):
    collector = procs.collector()
    procs.agent([collector], "pre-1")
    wait_for(lambda: registered(collector, "pre-1"), 20, what="registration")
    collector.enqueue(bench("low", measure=40, prompt=40, gen=12, preemptible=True,
                            targets={"device_id": "pre-1"}))
    wait_for(lambda: len(collector.results("low")) >= 3, 30, what="some progress")
    collector.enqueue({"schema": 1, "job_id": "urgent", "workload": "self-check",
                       "executor": "device", "priority": 10, "targets": {"device_id": "pre-1"}})
    urgent = collector.wait_status("urgent", ("done", "failed"), timeout=30)
    assert urgent["status"] == "done", urgent
    low = collector.wait_status("low", ("done", "failed"), timeout=60)
    assert low["status"] == "done", low
    rows = collector.results("low")
    handed_back = [r for r in rows if r.get("preempted")]
    assert len(handed_back) == 1 and handed_back[0]["final"] is True
    assert "handed back" in handed_back[0]["error"]
    resume_from = low["spec"]["params"]["resume_from"]
    assert handed_back[0]["artifacts"] == [resume_from]
    status, progress = http_json("GET", f"{collector.url}/artifacts/{resume_from}")
    assert status == 200
    # The progress carries the job's block as it was after the last finished iteration: the
    # resumed attempt goes on from there (decisions.md: a block per job, kept across iterations).
    done = len(progress["completed"])
    assert done >= 3 and base64.b64decode(progress["block"]) == reference_block(done * 52 * 1000)
    top = summary(rows)
    assert top["ok"] is True
    assert top["metrics"]["resumed_after_iter"] >= 3
    assert top["metrics"]["iterations"] == 40
    assert sorted(r["iter"] for r in rows if not r.get("preempted")) == list(range(41))
    assert low["attempts"] == 1  # a hand-back does not burn an attempt


def test_a_lapsed_attempts_late_rows_are_its_own_and_the_next_attempt_closes_the_job(procs):
    """The agent is frozen (SIGSTOP) past its lease; the sweep requeues the job. Thawed, it
    learns from its next beacon that the lease is gone, stops, and posts attempt 1's final row
    late; then it claims the job again and runs attempt 2 through. Every row names the attempt
    that made it, nothing is refused, and attempt 2's final row closes the job."""
    collector = procs.collector()
    agent = procs.agent([collector], "lapse-1")
    wait_for(lambda: registered(collector, "lapse-1"), 20, what="registration")
    collector.enqueue(bench("lapsing", measure=10, prompt=300, gen=100, lease={"ttl_s": 2},
                            targets={"device_id": "lapse-1"}))
    wait_for(lambda: len(collector.results("lapsing")) >= 2, 30, what="some progress")
    agent.proc.send_signal(signal.SIGSTOP)
    try:
        queued = collector.wait_status("lapsing", ("queued",), timeout=30)
    finally:
        agent.proc.send_signal(signal.SIGCONT)
    assert "lease expired on lapse-1" in queued["last_error"]
    job = collector.wait_status("lapsing", ("done", "failed"), timeout=90)
    assert job["status"] == "done" and job["attempts"] == 2 and job["last_error"] is None, job
    rows = collector.results("lapsing")
    first = [r for r in rows if r["attempt"] == 1]
    second = [r for r in rows if r["attempt"] == 2]
    assert iters(second) == list(range(11)) and summary(second)["ok"] is True
    late_final = [r for r in first if r["final"]]
    assert len(late_final) == 1 and late_final[0]["ok"] is False
    assert "no longer renews this job's lease" in late_final[0]["error"]
    assert len(first) >= 3  # its iterations before the freeze and its final row
    assert all(r["device_id"] == "lapse-1" for r in rows)
    status, detail = collector.get("/api/jobs/lapsing")
    assert status == 200, detail
    assert [(a["attempt"], a["outcome"]) for a in detail["attempts"]] == [
        (1, "expired"), (2, "done")]
    assert not list((agent.state / "spool" / "rejected").iterdir())


def test_two_collectors_never_get_two_jobs_at_once(procs):
    first, second = procs.collector("a"), procs.collector("b")
    # Work is queued on both before the agent exists, so both first long polls return a job.
    for collector in (first, second):
        for n in (1, 2):
            collector.enqueue(bench(f"{collector.port}-{n}", measure=4, prompt=60, gen=15))
    agent = procs.agent([first, second], "dual-1")
    spans = []
    for collector in (first, second):
        for n in (1, 2):
            job_id = f"{collector.port}-{n}"
            job = collector.wait_status(job_id, ("done", "failed"), timeout=60)
            assert job["status"] == "done", job
            rows = collector.results(job_id)
            assert iters(rows) == [0, 1, 2, 3, 4]
            stamps = sorted(r["created_at"] for r in rows)
            spans.append((job["claimed_at"], stamps[-1], job_id))
    spans.sort()
    for (_, end, left), (start, _, right) in itertools.pairwise(spans):
        assert end <= start, f"{left} and {right} overlapped"
    log = agent.log()
    busy_seen = False
    for collector in (first, second):
        _, beacons = collector.get("/api/devices/dual-1/beacons")
        beacon_list = beacons.get("beacons", beacons) if isinstance(beacons, dict) else beacons
        busy_seen |= any("busy" in json.dumps(b) for b in beacon_list)
    assert busy_seen, "no busy beacon reached the collector that was not running the job"
    assert "lost the race" in log or busy_seen


def test_a_tampered_artifact_is_refused(procs, tmp_path):
    collector = procs.collector()
    marker = tmp_path / "ran"
    script = f"#!/bin/sh\necho ran > {marker}\n".encode()
    sha = collector.upload(script, "touch.sh")
    assert sha == hashlib.sha256(script).hexdigest()
    allow = tmp_path / "allowlist"
    allow.write_text(f"{sha}  touch.sh\n")
    procs.agent([collector], "shell-1", "--allowlist", str(allow))
    wait_for(lambda: registered(collector, "shell-1"), 20, what="registration")
    stored = [p for p in collector.data.rglob("*") if p.is_file() and p.read_bytes() == script]
    assert len(stored) == 1, "could not find the stored artifact to tamper with"
    stored[0].write_bytes(script.replace(b"echo ran", b"echo pwn"))
    collector.enqueue({"schema": 1, "job_id": "tampered", "workload": "shell",
                       "executor": "device", "params": {"script_sha256": sha, "args": []}})
    job = collector.wait_status("tampered", ("done", "failed"), timeout=30)
    assert job["status"] == "failed"
    assert "altered or corrupted" in job["last_error"], job["last_error"]
    assert not marker.exists()
    # an untampered pinned script does run, so the refusal above was the hash check
    stored[0].write_bytes(script)
    collector.enqueue({"schema": 1, "job_id": "intact", "workload": "shell",
                       "executor": "device", "params": {"script_sha256": sha, "args": []}})
    job = collector.wait_status("intact", ("done", "failed"), timeout=30)
    assert job["status"] == "done", job
    assert marker.read_text() == "ran\n"


def test_a_killed_collector_loses_nothing_the_agent_reported(procs):
    collector = procs.collector()
    agent = procs.agent([collector], "crash-1")
    wait_for(lambda: registered(collector, "crash-1"), 20, what="registration")
    collector.enqueue(bench("survive", measure=16, prompt=90, gen=40, lease={"ttl_s": 120}))
    wait_for(lambda: len(collector.results("survive")) >= 2, 30, what="first rows")
    collector.kill()
    # The agent finishes while the collector is gone: its rows, the final one too, are spooled.
    wait_for(lambda: any(json.loads(p.read_text())["row"].get("final")
                         for p in agent.spooled()), 40, what="the final row to be spooled")
    assert agent.stop() == 0
    left = agent.spooled()
    assert left, "the spool must survive the agent's exit"
    collector.start()  # same port, same data directory
    procs.agent([collector], "crash-1")  # a new agent process, same state directory
    job = collector.wait_status("survive", ("done", "failed"), timeout=30)
    assert job["status"] == "done", job
    assert iters(collector.results("survive")) == list(range(17))
    wait_for(lambda: not agent.spooled(), 10, what="the spool to empty")


def test_sigterm_hands_the_running_job_back_and_a_restart_resumes_it(procs):
    collector = procs.collector()
    agent = procs.agent([collector], "term-1")
    wait_for(lambda: registered(collector, "term-1"), 20, what="registration")
    collector.enqueue(bench("interrupted", measure=30, prompt=40, gen=12,
                            targets={"device_id": "term-1"}))
    wait_for(lambda: len(collector.results("interrupted")) >= 2, 30, what="some progress")
    started = time.monotonic()
    assert agent.stop() == 0
    assert time.monotonic() - started < 10
    job = collector.job("interrupted")
    assert job["status"] == "queued" and job["attempts"] == 0, job
    handed_back = [r for r in collector.results("interrupted") if r.get("preempted")]
    assert [r["iter"] for r in handed_back] == [999_999]
    assert "the agent is shutting down" in handed_back[0]["error"]
    procs.agent([collector], "term-1")
    job = collector.wait_status("interrupted", ("done", "failed"), timeout=60)
    assert job["status"] == "done", job
    rows = collector.results("interrupted")
    assert sorted(r["iter"] for r in rows if not r.get("preempted")) == list(range(31))


def test_power_constraints_are_refused_with_a_sentence(procs, tmp_path):
    root = tmp_path / "phone-root" / "sys" / "class" / "power_supply" / "battery"
    root.mkdir(parents=True)
    for name, value in (("type", "Battery"), ("capacity", "35"), ("status", "Discharging")):
        (root / name).write_text(value + "\n")
    collector = procs.collector()
    procs.agent([collector], "batt-1", "--sysroot", str(tmp_path / "phone-root"))
    wait_for(lambda: registered(collector, "batt-1"), 20, what="registration")
    collector.enqueue(bench("plugged", measure=1, constraints={"require_charging": True}))
    collector.enqueue(bench("full", measure=1, constraints={"min_battery_pct": 50}))
    plugged = collector.wait_status("plugged", ("done", "failed"), timeout=20)
    full = collector.wait_status("full", ("done", "failed"), timeout=20)
    assert plugged["last_error"] == ("refused: the job requires charging and this device is "
                                     "not charging")
    assert full["last_error"] == "refused: the battery is at 35% and the job needs at least 50%"
    assert [r["iter"] for r in collector.results("full")] == [0]  # refused before any work
    _, device = collector.get("/api/devices/batt-1")
    assert "35" in json.dumps(device)  # the beacon carried the battery reading
