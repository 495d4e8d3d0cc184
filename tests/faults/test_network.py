"""The network going away under the agents: they back off, keep what they owe on disk, and
deliver it when the peer comes back on the same address."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import AGENT_FILE
from tests.support.collector import ROOT, CollectorProcess, HttpClient, job
from tests.support.faults import (
    NET_ERRORS,
    ControlPlaneProcess,
    read_db,
    wait_until,
)

pytestmark = pytest.mark.slow

RETRY_CAP_S = 2.0
MEASURE = 3


def _spooled(state: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted((state / "spool").glob("*.json")):
        try:
            rows.append(json.loads(path.read_text())["row"])
        except (OSError, ValueError, KeyError):
            continue  # being replaced at this moment
    return rows


def link_retries(log_path: Path) -> list[float]:
    """The delays of the link's retries once the job has ended (during the job its lease
    keeper retries on a schedule of its own)."""
    _, ended, after = log_path.read_text().partition("job outage ended")
    return [float(d) for d in re.findall(r"retrying in ([0-9.]+) s", after)] if ended else []


@pytest.mark.timeout(120)
def test_agent_keeps_its_rows_through_a_collector_outage(tmp_path: Path, figures: Any) -> None:
    data = tmp_path / "data"
    collector = CollectorProcess(data, env={"FLEET_LONG_POLL_S": "2"}).start()
    client = collector.client
    state = tmp_path / "agent"
    # about a second of hashing per iteration, so the job is still running when the link drops
    spec = job("outage", params={"prompt_tokens": 1000, "gen_tokens": 200, "warmup_iters": 0,
                                 "measure_iters": MEASURE}, lease={"ttl_s": 120})
    assert client.post("/jobs", spec)[0] == 201
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, str(AGENT_FILE), "--collector", collector.url, "--device-id", "phone",
             "--state-dir", str(state), "--beacon-s", "1", "--retry-base-s", "0.2",
             "--retry-cap-s", str(RETRY_CAP_S), "--poll-timeout-s", "10",
             "--log-level", "DEBUG"],  # each retry is a DEBUG line; INFO tells an outage once
            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: client.get("/jobs/outage")[1]["status"] == "claimed", 30,
                   "the agent to claim the job")
        assert collector.stop() == 0  # the collector goes away mid-job
        # The job finishes offline: every row waits in the spool, the final one last.
        owed = wait_until(lambda: (lambda rows: rows if any(r.get("final") for r in rows)
                                   else None)(_spooled(state)), 60, "the final row in the spool")
        wait_until(lambda: len(link_retries(log_path)) >= 6, 60,
                   "the agent to retry several times")
        delays = link_retries(log_path)
        collector.start()  # the same port
        wait_until(lambda: not _spooled(state), 30, "the spool to empty")
        assert wait_until(lambda: client.get("/jobs/outage")[1]["status"] != "claimed", 30,
                          "the job to close")
        assert client.get("/jobs/outage")[1]["status"] == "done"
    finally:
        agent.terminate()
        agent.wait(30)
        collector.stop()
    assert max(delays) <= RETRY_CAP_S + 0.05, delays
    assert delays[-1] >= RETRY_CAP_S / 2, f"the agent did not back off: {delays}"
    conn = read_db(data / "fleet.sqlite3")
    try:
        iters = sorted(r[0] for r in conn.execute(
            "SELECT iter FROM results WHERE job_id = 'outage' AND device_id = 'phone'"))
    finally:
        conn.close()
    assert iters == list(range(MEASURE + 1)), iters  # iterations 1..n and the summary, once each
    assert not list((state / "spool" / "rejected").glob("*.json"))
    figures.record("agent_outage", rows_owed_while_down=len(owed), retry_delays_s=delays,
                   delivered_after_return=len(iters), lost=0, duplicated=0)


def _health_script(tmp: Path) -> tuple[Path, Path, Path]:
    """A health script that counts its runs and holds on until a gate file appears, so the test
    can take the coordinator away while the agent is running a command it owes the result of."""
    runs, gate, script = tmp / "health-runs", tmp / "health-gate", tmp / "health.sh"
    script.write_text(f"""#!/bin/sh
echo run >> '{runs}'
n=$(wc -l < '{runs}')
i=0
while [ ! -e '{gate}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i + 1)); done
echo "disk ok, health run $n"
""")
    script.chmod(0o755)
    return script, runs, gate


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(150)
def test_federation_agent_keeps_what_it_owes(tmp_path: Path, figures: Any) -> None:
    """The coordinator goes away (SIGTERM) while its agent runs a queued health check: the agent
    keeps running and backs off, and when the coordinator returns on the same address with the
    same state its heartbeats resume and the result it owed is recorded once, from the single run
    (the agent's heartbeat says it has applied that command's number, so the coordinator does
    not send it again; the agent delivers the result it kept in its database)."""
    coord = ControlPlaneProcess(tmp_path / "coord", env={
        "FLEET_HOST_NAME": "coord", "FLEET_STALE_AFTER_S": "5"})
    token = subprocess.run(
        [sys.executable, "-m", "fleet_min", "controlplane", "token", "--agent", "--state",
         str(coord.state)], env=coord.env(), cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=True).stdout.strip()
    edge_state = tmp_path / "edge" / "state"
    edge_state.mkdir(parents=True)
    (edge_state / "coordinator-token").write_text(token + "\n")
    (edge_state / "coordinator-token").chmod(0o600)
    script, runs, gate = _health_script(tmp_path)
    edge = ControlPlaneProcess(tmp_path / "edge", env={
        "FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1", "FLEET_HEALTH_SCRIPT": str(script)},
        args=("--coordinator", coord.url))
    coord_api, edge_api = HttpClient(coord.url), HttpClient(edge.url)

    def edge_host() -> dict[str, Any] | None:
        with contextlib.suppress(*NET_ERRORS):
            status, body = coord_api.get("/api/hosts", timeout=10)
            if status == 200:
                return next((h for h in body["hosts"] if h["host"] == "edge"), None)
        return None

    def command(command_id: str) -> dict[str, Any] | None:
        status, body = coord_api.get("/api/hosts", timeout=10)
        assert status == 200, body
        return next((c for c in body["commands"] if c["id"] == command_id), None)

    def link() -> dict[str, Any]:
        status, body = edge_api.get("/api/hosts", timeout=10)
        assert status == 200, body
        return body["hosts"][0]["coordinator"]

    def failures() -> int:
        return len(re.findall(r"heartbeat to \S+ failed", edge.log_path.read_text()))

    try:
        coord.start()
        edge.start()
        # The agent's heartbeat arrives: the host is listed, fresh.
        wait_until(lambda: (lambda h: h and not h["stale"])(edge_host()), 30,
                   "the agent's first heartbeat")

        # A health check queued for the agent; it is sent and starts running there.
        status, reply = coord_api.post("/api/action", {"id": "health.check",
                                                       "args": {"host": "edge"}},
                                       headers={"Authorization": f"Bearer {coord.token}"})
        assert status == 200 and reply["queued"] and reply["host"] == "edge", reply
        command_id = reply["command_id"]
        wait_until(lambda: _lines(runs) == 1, 30, "the agent to start the health check")
        sent = command(command_id)
        assert sent is not None and sent["sends"] == 1 and sent["done_at"] is None, sent

        # The coordinator goes away before the result can come back; then the check finishes.
        assert coord.stop() == 0
        outage_started = time.monotonic()
        gate.touch()
        # The agent keeps running and backs off: failed calls, none answered, no crash.
        wait_until(lambda: failures() >= 4, 60, "the agent to fail four calls")
        outage_s = time.monotonic() - outage_started
        failed = failures()
        assert edge.proc is not None and edge.proc.poll() is None, "the agent died"
        during = link()
        assert during["last_error"], during
        assert "Traceback" not in edge.log_path.read_text()
        # 1, 2, 5, 10 s apart: a loop without back-off would have failed hundreds of times.
        assert failed <= 2 + outage_s, (failed, outage_s)
        heartbeats_before = during["heartbeats"]

        # The coordinator comes back on the same port with the same state.
        coord.start()

        # What the agent owed is delivered: the result of the one run, recorded once.
        done = wait_until(lambda: (lambda c: c if c and c["done_at"] else None)(
            command(command_id)), 30, "the owed result")
        assert done["ok"] is True and "health run 1" in done["output"], done
        assert done["sends"] == 1, done  # applied, by the agent's word: not sent again
        assert _lines(runs) == 1
        with contextlib.closing(read_db(coord.state / "controlplane.db")) as conn:
            rows = conn.execute("SELECT done_at, output FROM host_commands WHERE id = ?",
                                (command_id,)).fetchall()
        assert len(rows) == 1 and rows[0]["done_at"] is not None, rows

        # Heartbeats resume: the host is fresh again and the agent's link is healthy.
        host = wait_until(lambda: (lambda h: h if h and not h["stale"] else None)(edge_host()),
                          30, "the agent's heartbeats to resume")
        assert host["pending_commands"] == 0, host
        after = wait_until(lambda: (lambda s: s if s["heartbeats"] > heartbeats_before
                                    and s["last_error"] is None else None)(link()), 30,
                           "the agent's link to report success")
        assert edge.proc.poll() is None
        figures.record("federation_outage", failed_calls=failed, outage_s=round(outage_s, 1),
                       heartbeats_after=after["heartbeats"] - heartbeats_before,
                       command_sends=done["sends"], command_runs=_lines(runs), lost=0)
    finally:
        gate.touch()
        edge.stop()
        coord.stop()
