"""What the fault tests share: lean agents in threads that keep what they owe, a producer of jobs,
a ledger of everything a service acknowledged, the checks run against the real database file,
and the control plane as a real process on a fixed port.

The lean agent follows the real agent's contract (docs/agent.md): it registers, long-polls, uploads
an artifact, posts an iteration row and a final row, and re-sends whatever was not acknowledged
until it is (rows are idempotent by (job, device, iter), artifacts by their hash). It never drops
what it owes because the collector went away.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fleet_min.timeutil import parse_iso
from tests.support.collector import ROOT, HttpClient, free_port, job, registration, result_row

NET_ERRORS = (OSError, http.client.HTTPException, ValueError)
CLOSED = ("done", "failed", "cancelled")
FAKETIME_LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/faketime/libfaketimeMT.so.1")


def upload(base: str, data: bytes, timeout: float = 10) -> tuple[int, Any]:
    """POST /artifacts with raw bytes: (status, JSON reply)."""
    req = urllib.request.Request(base + "/artifacts", data=data, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        return err.code, json.loads(raw) if raw else None


# -- the ledger of acknowledgements ----------------------------------------------------------


@dataclass
class Ledger:
    """Everything the collector acknowledged, and every violation seen from the client side."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    enqueued: set[str] = field(default_factory=set)
    rows: set[tuple[str, str, int]] = field(default_factory=set)
    artifacts: dict[str, bytes] = field(default_factory=dict)
    closed: dict[str, str] = field(default_factory=dict)  # job_id -> status acknowledged
    offers: list[tuple[str, str, float]] = field(default_factory=list)  # job, device, claimed
    resent: int = 0  # sends repeated because the collector went away before answering
    violations: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)

    def offered(self, spec: dict[str, Any], device_id: str) -> None:
        """Record an offer and the server time of its claim (lease deadline minus the TTL).

        An offer that arrives after the job's close was acknowledged is a violation only for a
        close by a final row: that close needs the closer to hold the claim, so no other claim
        can predate it. An operator's cancel can overtake an offer already on its way; those are
        judged on the server's times (claimed_reopened) instead.
        """
        job_id = spec["job_id"]
        claimed = parse_iso(spec["lease_deadline"]) - spec["lease"]["ttl_s"]
        with self.lock:
            self.offers.append((job_id, device_id, claimed))
            if self.closed.get(job_id) == "done":
                self.violations.append(f"{job_id} was offered to {device_id} after the collector "
                                       "acknowledged it done")

    def close(self, job_id: str, status: str) -> None:
        with self.lock:
            self.closed.setdefault(job_id, status)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"enqueued": set(self.enqueued), "rows": set(self.rows),
                    "artifacts": dict(self.artifacts), "closed": dict(self.closed)}


class LeanAgent(threading.Thread):
    """One device: claim, upload, report, and re-send what was not acknowledged."""

    def __init__(self, base: str, device_id: str, ledger: Ledger, stop: threading.Event) -> None:
        super().__init__(name=f"agent-{device_id}", daemon=True)
        self.client = HttpClient(base)
        self.device_id = device_id
        self.ledger = ledger
        self.stop = stop
        self.owed: list[tuple[str, Any]] = []
        self.registered = False

    def run(self) -> None:
        while not self.stop.is_set() or self.owed:
            try:
                self.step()
            except NET_ERRORS:
                if self.owed:
                    with self.ledger.lock:
                        self.ledger.resent += 1
                if self.stop.wait(0.05) and not self.owed:
                    return

    def step(self) -> None:
        if self.owed:
            self.deliver()
            return
        if not self.registered:
            status, _ = self.client.post("/devices/register", registration(self.device_id),
                                         timeout=10)
            self.registered = status == 200
            return
        status, spec = self.client.get(f"/devices/{self.device_id}/next-job", timeout=10)
        if status == 404:
            self.registered = False
        elif status == 200:
            self.ledger.offered(spec, self.device_id)
            self.owed = self.work(spec)

    def work(self, spec: dict[str, Any]) -> list[tuple[str, Any]]:
        job_id = spec["job_id"]
        blob = f"artifact of {job_id} by {self.device_id} attempt {spec['attempt']}\n".encode()
        sha = hashlib.sha256(blob).hexdigest()
        return [("upload", blob),
                ("row", result_row(job_id, self.device_id, 1, ok=True, metrics={"n": 1})),
                ("row", result_row(job_id, self.device_id, 0, ok=True, final=True,
                                   artifacts=[sha], metrics={"n": 1}))]

    def deliver(self) -> None:
        kind, payload = self.owed[0]
        if kind == "upload":
            status, reply = upload(self.client.base, payload)
            if status == 201:
                with self.ledger.lock:
                    self.ledger.artifacts[reply["sha256"]] = payload
        else:
            status, reply = self.client.post("/results", payload, timeout=10)
            if status == 200:
                key = (payload["job_id"], payload["device_id"], payload["iter"])
                with self.ledger.lock:
                    self.ledger.rows.add(key)
                if payload.get("final") and reply["status"] in CLOSED:
                    self.ledger.close(payload["job_id"], reply["status"])
        if status in (200, 201):
            self.owed.pop(0)
        elif status < 500:
            self.ledger.anomalies.append(f"{kind} refused {status}: {reply}")
            self.owed.pop(0)
        else:
            self.stop.wait(0.05)


class Producer(threading.Thread):
    """Enqueues small batches of jobs and now and then cancels one (an operator's close)."""

    def __init__(self, base: str, ledger: Ledger, stop: threading.Event, prefix: str,
                 lease: dict[str, int], pause_s: float = 0.1) -> None:
        super().__init__(name="producer", daemon=True)
        self.client = HttpClient(base)
        self.ledger = ledger
        self.stop = stop
        self.prefix = prefix
        self.lease = lease
        self.pause_s = pause_s
        self.batches = 0

    def run(self) -> None:
        while not self.stop.wait(self.pause_s):
            ids = [f"{self.prefix}{self.batches}-{i}" for i in range(3)]
            self.batches += 1
            try:
                status, _ = self.client.post("/jobs", [job(i, lease=self.lease) for i in ids],
                                             timeout=10)
                if status != 201:
                    continue
                with self.ledger.lock:
                    self.ledger.enqueued.update(ids)
                if self.batches % 5 == 0:
                    status, _ = self.client.post(f"/api/jobs/{ids[-1]}/cancel", timeout=10)
                    if status == 200:
                        self.ledger.close(ids[-1], "cancelled")
            except NET_ERRORS:
                continue


# -- checks against the database file --------------------------------------------------------


def read_db(db_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db_path, timeout=30)
    conn.row_factory = sqlite3.Row
    return conn


def losses(db_path: Path, data_dir: Path, acked: dict[str, Any]) -> list[str]:
    """Every acknowledged write that the database (or the artifact store) no longer has."""
    problems: list[str] = []
    conn = read_db(db_path)
    try:
        conn.execute("BEGIN")  # one snapshot for every question below
        jobs = {r["job_id"]: r["status"] for r in conn.execute("SELECT job_id, status FROM jobs")}
        rows = {(r[0], r[1], r[2]) for r in conn.execute(
            "SELECT job_id, device_id, iter FROM results")}
        indexed = {r[0] for r in conn.execute("SELECT sha256 FROM artifacts")}
        problems += [f"acknowledged job {j} is gone" for j in acked["enqueued"] - set(jobs)]
        problems += [f"acknowledged result row {r} is gone" for r in acked["rows"] - rows]
        for job_id, status in acked["closed"].items():
            if jobs.get(job_id) != status:
                problems.append(f"{job_id} was acknowledged {status} but is {jobs.get(job_id)}")
        for sha, data in acked["artifacts"].items():
            path = data_dir / "artifacts" / sha[:2] / sha
            if sha not in indexed:
                problems.append(f"acknowledged artifact {sha[:12]} has no row")
            if not path.exists() or path.read_bytes() != data:
                problems.append(f"acknowledged artifact {sha[:12]} lost its bytes")
        conn.execute("COMMIT")
    finally:
        conn.close()
    return problems


def invariants(db_path: Path, full: bool = False) -> list[str]:
    """What must hold of the stored data at any time, acknowledged or not."""
    conn = read_db(db_path)
    try:
        check = "integrity_check" if full else "quick_check"
        verdict = [r[0] for r in conn.execute(f"PRAGMA {check}")]
        problems = [] if verdict == ["ok"] else [f"{check}: {verdict[:3]}"]
        for r in conn.execute("SELECT job_id, device_id, iter, attempt, count(*) AS n "
                              "FROM results GROUP BY job_id, device_id, iter, attempt "
                              "HAVING n > 1"):
            problems.append(f"result row {tuple(r)[:4]} is stored {r['n']} times")
        for r in conn.execute(
                "SELECT a.job_id, a.attempt FROM job_attempts a JOIN jobs j USING (job_id) "
                "WHERE j.finished_at IS NOT NULL AND a.claimed_at > j.finished_at"):
            problems.append(f"closed job {r[0]} was claimed again (attempt {r[1]})")
        for r in conn.execute("SELECT job_id FROM jobs WHERE status = 'claimed' AND "
                              "lease_deadline IS NULL"):
            problems.append(f"claimed job {r[0]} has no lease")
        return problems
    finally:
        conn.close()


def offered_after_close(db_path: Path, offers: list[tuple[str, str, float]]) -> list[str]:
    """Offers whose claim the server made after the job had closed (by its own clock)."""
    conn = read_db(db_path)
    try:
        finished = {r[0]: r[1] for r in conn.execute(
            "SELECT job_id, finished_at FROM jobs WHERE finished_at IS NOT NULL")}
    finally:
        conn.close()
    return [f"{job_id} was offered to {device} {claimed - finished[job_id]:.3f} s after it closed"
            for job_id, device, claimed in offers
            if job_id in finished and claimed > finished[job_id] + 0.001]


def open_jobs(db_path: Path) -> int:
    conn = read_db(db_path)
    try:
        return int(conn.execute("SELECT count(*) FROM jobs WHERE status IN "
                                "('queued', 'waiting', 'claimed')").fetchone()[0])
    finally:
        conn.close()


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout} s")
        time.sleep(interval)


# -- the control plane as a real process -----------------------------------------------------


class ControlPlaneProcess:
    """`python -m fleet_min controlplane` on a fixed port with an empty runner root; GitHub is an
    address nothing listens on, so nothing leaves the machine."""

    def __init__(self, tmp: Path, port: int | None = None, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.port = port or free_port()
        self.state = tmp / "state"
        self.extra_env = dict(env or {})  # may be changed between a stop and the next start
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = tmp / f"controlplane-{self.port}.log"
        for folder in ("runners", "home"):
            (tmp / folder).mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(self.tmp / "home"),
                "XDG_CONFIG_HOME": str(self.tmp / "home"), "GH_TOKEN": "",
                "FLEET_GITHUB_API": f"http://127.0.0.1:{free_port()}",
                "FLEET_SUPERVISOR": "systemd", "FLEET_SYSTEMD_SCOPE": "user",
                "FLEET_SQLITE_SYNCHRONOUS": "FULL", "FLEET_TICK_S": "5", **self.extra_env}

    def start(self) -> ControlPlaneProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleet_min", "controlplane", "--port", str(self.port),
                 "--root", str(self.tmp / "runners"), "--state", str(self.state), *self.args],
                env=self.env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_until(self._ready, 20, "the control plane to answer", 0.05)
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"control plane exited:\n{self.log_path.read_text()[-3000:]}")
        with contextlib.suppress(*NET_ERRORS):
            return HttpClient(self.url).get("/api/settings", timeout=2)[0] == 200
        return False

    @property
    def token(self) -> str:
        return (self.state / "control-token").read_text().strip()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def faketime_lib() -> str | None:
    return next((lib for lib in FAKETIME_LIBS if Path(lib).exists()), None)


def seeded(name: str) -> random.Random:
    """A random source whose seed is printed, and can be fixed with FLEET_FAULT_SEED."""
    seed = int(os.environ.get("FLEET_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"{name}: FLEET_FAULT_SEED={seed}")
    return random.Random(seed)


def copy_tree(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, dirs_exist_ok=True)


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                             str(where)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or 'not root'}); the "
                    "disk-full test needs root or CAP_SYS_ADMIN")


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)
