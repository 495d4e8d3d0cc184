"""kill -9 at random moments under load, many times in a row, then look at what survived.

After every restart: no acknowledged job, result row, artifact or close is lost; no result row is
stored twice; no closed job is offered (or claimed) again; the database passes SQLite's check.
At the end every job has ended. The same for the control plane's settings and audit history.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import AGENT_FILE
from tests.support.collector import CollectorProcess, HttpClient, job
from tests.support.faults import (
    NET_ERRORS,
    ControlPlaneProcess,
    LeanAgent,
    Ledger,
    Producer,
    invariants,
    losses,
    offered_after_close,
    open_jobs,
    read_db,
    seeded,
    wait_until,
)

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("FLEET_FAULT_KILLS", "20"))
AGENTS = 6


@pytest.mark.timeout(240)
def test_collector_survives_repeated_kill_9_under_agent_load(tmp_path: Path, figures: Any
                                                             ) -> None:
    rng = seeded("collector kill -9")
    data = tmp_path / "data"
    db = data / "fleet.sqlite3"
    proc = CollectorProcess(data, env={"FLEET_LONG_POLL_S": "1", "FLEET_SWEEP_S": "1"}).start()
    ledger, stop, enough = Ledger(), threading.Event(), threading.Event()
    agents = [LeanAgent(proc.url, f"dev{i}", ledger, stop) for i in range(AGENTS)]
    producer = Producer(proc.url, ledger, enough, "k", {"ttl_s": 5, "max_attempts": 50})
    for worker in (*agents, producer):
        worker.start()
    ready_s: list[float] = []
    killed_after: list[float] = []
    try:
        for cycle in range(KILLS):
            alive = rng.uniform(0.3, 1.2)
            time.sleep(alive)
            proc.kill9()
            killed_after.append(round(alive, 2))
            started = time.monotonic()
            proc.start()
            ready_s.append(time.monotonic() - started)
            acked = ledger.snapshot()  # everything acknowledged before this restart
            problems = losses(db, data, acked) + invariants(db)
            assert not problems, f"after kill {cycle + 1}: {problems[:10]}"
        enough.set()
        producer.join(10)
        wait_until(lambda: open_jobs(db) == 0, 60, "every job to end")
        stop.set()  # the agents deliver what they still owe, then stop
        for agent in agents:
            agent.join(20)
        assert not any(agent.owed for agent in agents)
    finally:
        enough.set()
        stop.set()
        proc.stop()
    acked = ledger.snapshot()
    assert not ledger.violations, ledger.violations[:10]
    reoffered = offered_after_close(db, ledger.offers)
    assert not reoffered, reoffered[:10]
    assert not ledger.anomalies, ledger.anomalies[:10]
    assert not losses(db, data, acked)
    assert not invariants(db, full=True)
    conn = read_db(db)
    try:
        statuses = dict(conn.execute("SELECT status, count(*) FROM jobs GROUP BY status"))
        outcomes = dict(conn.execute("SELECT coalesce(outcome, 'open'), count(*) "
                                     "FROM job_attempts GROUP BY 1"))
        result_rows = conn.execute("SELECT count(*) FROM results").fetchone()[0]
        artifacts = conn.execute("SELECT count(*) FROM artifacts").fetchone()[0]
    finally:
        conn.close()
    assert set(statuses) <= {"done", "cancelled", "failed"}
    assert len(acked["enqueued"]) >= KILLS, "the load was too light to mean anything"
    figures.record("collector_kill_9", kills=KILLS, agents=AGENTS,
                   jobs=sum(statuses.values()), jobs_by_status=statuses,
                   acknowledged_jobs=len(acked["enqueued"]), acknowledged_rows=len(acked["rows"]),
                   acknowledged_artifacts=len(acked["artifacts"]),
                   acknowledged_closes=len(acked["closed"]), offers=len(ledger.offers),
                   sends_repeated_after_a_kill=ledger.resent,
                   result_rows=result_rows, artifacts=artifacts, attempts_by_outcome=outcomes,
                   restart_to_ready_s_median=round(statistics.median(ready_s), 3),
                   restart_to_ready_s_max=round(max(ready_s), 3),
                   kill_after_s=killed_after, lost=0, duplicated=0, reoffered_closed=0)


def _bench(job_id: str) -> dict[str, Any]:
    return job(job_id, params={"prompt_tokens": 4, "gen_tokens": 2, "warmup_iters": 0,
                               "measure_iters": 2}, lease={"ttl_s": 6, "max_attempts": 50})


@pytest.mark.timeout(180)
def test_real_agents_finish_every_job_across_collector_kills(tmp_path: Path, figures: Any
                                                             ) -> None:
    """The real agent file: its spool and retries carry every row across kill -9 of the
    collector; every job ends done with its rows stored once."""
    import subprocess
    import sys

    rng = seeded("real agents")
    data = tmp_path / "data"
    db = data / "fleet.sqlite3"
    proc = CollectorProcess(data, env={"FLEET_LONG_POLL_S": "2", "FLEET_SWEEP_S": "1"}).start()
    client = proc.client
    jobs = [f"r{i}" for i in range(40)]
    assert client.post("/jobs", [_bench(j) for j in jobs])[0] == 201
    agents = []
    for i in range(3):
        log = open(tmp_path / f"agent{i}.log", "wb")  # noqa: SIM115 - the child keeps it
        agents.append(subprocess.Popen(
            [sys.executable, str(AGENT_FILE), "--collector", proc.url, "--device-id", f"real{i}",
             "--state-dir", str(tmp_path / f"agent{i}"), "--beacon-s", "1", "--retry-base-s",
             "0.2", "--retry-cap-s", "1", "--poll-timeout-s", "10"],
            stdout=log, stderr=subprocess.STDOUT))
        log.close()
    kills = 5
    try:
        for _ in range(kills):
            time.sleep(rng.uniform(0.5, 2.0))
            proc.kill9()
            proc.start()
            assert not invariants(db)
        wait_until(lambda: open_jobs(db) == 0, 90, "every job to end")
        spools = [tmp_path / f"agent{i}" / "spool" for i in range(3)]
        wait_until(lambda: not any(any(s.glob("*.json")) for s in spools), 30,
                   "the agents' spools to empty")
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(30)
        proc.stop()
    conn = read_db(db)
    try:
        statuses = dict(conn.execute("SELECT status, count(*) FROM jobs GROUP BY status"))
        finals = dict(conn.execute("SELECT job_id, count(*) FROM results WHERE final = 1 "
                                   "AND ok = 1 GROUP BY job_id"))
        rows = conn.execute("SELECT count(*) FROM results").fetchone()[0]
    finally:
        conn.close()
    assert statuses == {"done": len(jobs)}, statuses
    assert set(finals) == set(jobs)
    assert not invariants(db, full=True)
    rejected = [p for i in range(3) for p in (tmp_path / f"agent{i}" / "spool" / "rejected")
                .glob("*.json")]
    figures.record("real_agents_kill_9", kills=kills, agents=3, jobs=len(jobs), result_rows=rows,
                   rows_rejected_by_collector=len(rejected))


# -- the control plane ------------------------------------------------------------------------


class CpPoster(threading.Thread):
    """Changes a live setting to ever larger values, or queues a health check for an agent
    host, hands it out by that host's heartbeat and posts its result (a result is audited when
    it settles a command sent to its host); records what was acknowledged. Never re-sends: a
    lost answer leaves the outcome unknown."""

    def __init__(self, cp: ControlPlaneProcess, kind: str, stop: threading.Event) -> None:
        super().__init__(name=f"cp-{kind}", daemon=True)
        self.cp, self.kind, self.stop = cp, kind, stop
        self.acked: list[Any] = []  # settings: n of the value 30 + n; results: command ids
        self.sent = 0

    def run(self) -> None:
        client = HttpClient(self.cp.url)
        while not self.stop.wait(0.01):
            self.sent += 1
            n = self.sent
            try:
                if self.kind == "settings":
                    status, _ = self._post(client, "/api/settings",
                                           {"key": "stuck_queue_s", "value": 30 + n})
                    if status == 200:
                        self.acked.append(n)
                else:
                    self._settle_one(client)
            except (*NET_ERRORS, FileNotFoundError):
                continue

    def _post(self, client: HttpClient, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return client.post(path, body, headers={"Authorization": f"Bearer {self.cp.token}"},
                           timeout=10)

    def _settle_one(self, client: HttpClient) -> None:
        # The first round's check is refused (no such host yet); the heartbeat then makes
        # "edge" known, and hands out every command left unsettled, including those whose
        # result was lost to a kill.
        self._post(client, "/api/action", {"id": "health.check", "args": {"host": "edge"}})
        status, beat = self._post(client, "/api/host/heartbeat", {"host": "edge"})
        ids = [command["id"] for command in beat["commands"]] if status == 200 else []
        if ids:
            status, reply = self._post(client, "/api/host/results", {
                "host": "edge", "results": [{"id": i, "ok": True} for i in ids]})
            if status == 200 and reply["matched"] == len(ids):
                self.acked.extend(ids)


def _audit(db: Path) -> tuple[list[str], int | None]:
    import json

    conn = read_db(db)
    try:
        ids = [json.loads(r[0])["id"] for r in conn.execute(
            "SELECT args FROM audit WHERE action = 'host.result:edge'")]
        row = conn.execute("SELECT value FROM settings WHERE key = 'stuck_queue_s'").fetchone()
        verdict = conn.execute("PRAGMA quick_check").fetchone()[0]
        assert verdict == "ok", verdict
        return ids, json.loads(row[0]) if row else None
    finally:
        conn.close()


@pytest.mark.timeout(180)
def test_control_plane_history_survives_repeated_kill_9(tmp_path: Path, figures: Any) -> None:
    rng = seeded("control plane kill -9")
    cp = ControlPlaneProcess(tmp_path).start()
    db = cp.state / "controlplane.db"
    stop = threading.Event()
    posters = [CpPoster(cp, "settings", stop), CpPoster(cp, "results", stop)]
    for poster in posters:
        poster.start()
    settings, results = posters
    try:
        for cycle in range(KILLS):
            time.sleep(rng.uniform(0.2, 0.8))
            cp.kill9()
            acked_results = list(results.acked)
            acked_settings = list(settings.acked)
            cp.start()
            ids, value = _audit(db)
            missing = set(acked_results) - set(ids)
            assert not missing, f"after kill {cycle + 1}: audit rows lost: {sorted(missing)[:5]}"
            twice = {i for i in ids if ids.count(i) > 1}
            assert not twice, f"audit rows stored twice: {sorted(twice)[:5]}"
            if acked_settings:
                # values only grow; a later change may have committed without its answer
                assert value is not None and value >= 30 + acked_settings[-1], (
                    f"after kill {cycle + 1}: setting {value} is older than the acknowledged "
                    f"{30 + acked_settings[-1]}")
    finally:
        stop.set()
        for poster in posters:
            poster.join(15)
        cp.stop()
    ids, _ = _audit(db)
    unacked_but_stored = len(set(ids) - set(results.acked))
    assert len(results.acked) >= KILLS
    figures.record("controlplane_kill_9", kills=KILLS,
                   settings_changes_acknowledged=len(settings.acked),
                   host_results_acknowledged=len(results.acked), audit_rows=len(ids),
                   stored_without_answer=unacked_but_stored, lost=0, duplicated=0)
