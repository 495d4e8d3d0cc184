"""Alerts are state, not events: one open row per (rule, subject) while its condition holds.

Each tick reads a snapshot of the fleet (`gather`), runs the pure rules over it (`evaluate`, one
plain function per rule, tested without a database) and applies the findings to the alerts table
(`record`): a new finding opens a row (seen_count 1, and a webhook delivery marked pending in the
same transaction), a finding that is still there raises seen_count, an open row whose finding is
gone is resolved. Ack and snooze only mute a row; they never change whether its condition holds.

Rules and default thresholds (environment FLEET_ALERT_*; docs/collector-automation.md):

  device-offline    a device an operator named, not seen for over 15 min
  job-failed        a job whose status became failed (final: it is not retried) while it
                    ran, in the last 24 h
  job-stuck         claimed, lease still being renewed, no result rows for over 2 x lease ttl
  thermal-critical  the last fresh beacon's thermal is serious or worse (THERMAL_STATES)
  low-battery       fresh beacon with battery_pct under 15 and not charging
  schedule-missed   enabled, its due minute over 5 min past without a run (or run late, failed)
  disk-size         database + artifacts, or logs, over a size; or free disk space under one
  benchmark-regressed  a device's newest benchmark run (per configuration: model, quant,
                    backend) decodes 20% or more under the median of its earlier runs (3 to 10)
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from fleet_min import numbers
from fleet_min.collector.automation.schedules import missed_reason
from fleet_min.collector.insight import result_runs
from fleet_min.collector.jobs import rules
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import JobStatus
from fleet_min.db import Database
from fleet_min.errors import BadRequest, Conflict, NotFound
from fleet_min.timeutil import iso


class AlertRule(StrEnum):
    DEVICE_OFFLINE = "device-offline"
    JOB_FAILED = "job-failed"
    JOB_STUCK = "job-stuck"
    THERMAL_CRITICAL = "thermal-critical"
    LOW_BATTERY = "low-battery"
    SCHEDULE_MISSED = "schedule-missed"
    DISK_SIZE = "disk-size"
    BENCHMARK_REGRESSED = "benchmark-regressed"


class AlertState(StrEnum):
    """An alert row is open while its condition holds, then resolved (a new row if it returns)."""

    OPEN = "open"
    RESOLVED = "resolved"


RULES = tuple(rule.value for rule in AlertRule)
# Thermal states that alert: Apple's ProcessInfo.ThermalState serious/critical and Android's
# PowerManager THERMAL_STATUS severe/critical/emergency/shutdown (nominal, fair, light and
# moderate do not). Compared case-insensitively.
THERMAL_STATES = ("serious", "severe", "critical", "emergency", "shutdown")
GIB = 1 << 30
RECENT_S = 86400.0  # GET /api/alerts by default: open rows plus rows resolved in the last day

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Thresholds:
    offline_s: float = 900.0
    beacon_fresh_s: float = 900.0
    stuck_factor: float = 2.0
    failed_window_s: float = 86400.0
    battery_pct: float = 15.0
    thermal_states: frozenset[str] = frozenset(THERMAL_STATES)
    schedule_late_s: float = 300.0
    regression_pct: float = 20.0
    data_bytes: int = 16 * GIB
    log_bytes: int = 1 * GIB
    free_bytes: int = 1 * GIB


@dataclass(frozen=True)
class Finding:
    rule: AlertRule
    subject: str
    detail: str


@dataclass(frozen=True)
class Sizes:
    """Measured outside the transaction (file system); artifact bytes come from the table."""
    database_bytes: int = 0
    log_bytes: int = 0
    free_bytes: int | None = None


@dataclass
class Snapshot:
    devices: list[Row] = field(default_factory=list)
    failed_jobs: list[Row] = field(default_factory=list)
    claimed_jobs: list[Row] = field(default_factory=list)
    schedules: list[Row] = field(default_factory=list)
    sizes: Sizes = field(default_factory=Sizes)
    artifact_bytes: int = 0
    benchmarks: list[Row] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# the rules: pure functions of rows and a time


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min"


def _label(device: Row) -> str:
    name = device.get("name")
    return f"{name} ({device['device_id']})" if name else str(device["device_id"])


def device_offline(devices: Iterable[Row], now: float, th: Thresholds) -> list[Finding]:
    """Only devices an operator named: throwaway browser devices never raise a storm."""
    found = []
    for device in devices:
        if not (device.get("name") or "").strip():
            continue
        if rules.is_expired(device.get("ttl_s"), device["last_seen"], now):
            continue  # a temporary device that left the shelf on purpose
        if now - device["last_seen"] > th.offline_s:
            found.append(Finding(AlertRule.DEVICE_OFFLINE, device["device_id"],
                                 _offline_detail(device, th)))
    return found


# The details of the rules below name a time, not a duration that grows: a detail is rewritten
# where it changed at every tick, and one that said "for 16 min", then "for 17 min", rewrote
# every open row each minute (24,500 offline devices held the writer 0.4 to 1.1 s a minute).
def _offline_detail(device: Row, th: Thresholds) -> str:
    return (f"{_label(device)} has not been seen for over {_minutes(th.offline_s)} "
            f"(last seen {iso(device['last_seen'])})")


# What the battery and thermal rules read of a device's last beacon, taken out by SQLite: a
# last beacon may be 16 KiB, and parsing 6,000 of them in Python held the event loop 3 s at
# every alert tick and every overview (57 ms this way). One json_extract of several paths
# answers a JSON array that keeps each value's type and escapes (one path would hand text back
# decoded, and a lone surrogate an older version stored would not decode in Python).
BEACON_READINGS = (
    "CASE WHEN json_valid(last_beacon) AND json_type(last_beacon) = 'object' "
    "THEN json_extract(last_beacon, '$.battery_pct', '$.charging', '$.thermal') END")
READINGS = ("battery_pct", "charging", "thermal")
# A device as the device rules read it (device_offline, thermal_critical, low_battery): rows
# for device_rows().
DEVICES_SQL = ("SELECT device_id, name, last_seen, ttl_s, last_beacon_at, "
               f"{BEACON_READINGS} AS readings FROM devices")


def device_rows(rows: Iterable[Mapping[str, Any]]) -> list[Row]:
    """Rows of DEVICES_SQL as the device rules take them: the readings as `last_beacon`."""
    found: list[Row] = []
    for row in rows:
        device = dict(row)
        readings = device.pop("readings", None)
        values = json.loads(readings) if readings else None
        device["last_beacon"] = (dict(zip(READINGS, values, strict=True))
                                 if isinstance(values, list) else None)
        found.append(device)
    return found


def _fresh_beacon(device: Row, now: float, th: Thresholds) -> dict[str, Any] | None:
    at, body = device.get("last_beacon_at"), device.get("last_beacon")
    if at is None or body is None or now - at > th.beacon_fresh_s:
        return None
    beacon = json.loads(body) if isinstance(body, str) else body
    return beacon if isinstance(beacon, dict) else None


def thermal_critical(devices: Iterable[Row], now: float, th: Thresholds) -> list[Finding]:
    found = []
    for device in devices:
        beacon = _fresh_beacon(device, now, th)
        thermal = beacon.get("thermal") if beacon else None
        if isinstance(thermal, str) and thermal.strip().lower() in th.thermal_states:
            found.append(Finding(AlertRule.THERMAL_CRITICAL, device["device_id"],
                                 f"{_label(device)} reports thermal state {thermal[:40]!r}"))
    return found


def low_battery(devices: Iterable[Row], now: float, th: Thresholds) -> list[Finding]:
    found = []
    for device in devices:
        beacon = _fresh_beacon(device, now, th)
        if not beacon:
            continue
        pct = beacon.get("battery_pct")
        if not isinstance(pct, int | float) or isinstance(pct, bool):
            continue
        if pct < th.battery_pct and beacon.get("charging") is not True:
            found.append(Finding(AlertRule.LOW_BATTERY, device["device_id"],
                                 f"{_label(device)} is at {pct:g}% battery and not charging"))
    return found


def job_failed(jobs: Iterable[Row], now: float, th: Thresholds) -> list[Finding]:
    """Jobs that failed while running; not fan-out parents (their children alert) and not
    jobs failed by a dependency before they ever ran (the dependency alerts)."""
    found = []
    for job in jobs:
        if job["status"] != JobStatus.FAILED or job.get("is_group") or not job.get("attempts"):
            continue
        finished = job.get("finished_at")
        if finished is None or now - finished > th.failed_window_s:
            continue
        error = (job.get("last_error") or "no reason recorded")[:300]
        found.append(Finding(AlertRule.JOB_FAILED, job["job_id"],
                             f"{job['workload']} job {job['job_id']} {_failed_on(job)}: {error}"))
    return found


def _failed_on(job: Row) -> str:
    """Which attempt failed, said so that nobody waits for a retry: the status `failed` is
    final (a lapsed lease with attempts left is requeued and never reaches this rule; a failing
    final row fails the job whatever attempts were left)."""
    attempts, most = job["attempts"], job["max_attempts"]
    if attempts >= most:
        return f"failed on its final attempt ({attempts} of {most})"
    return f"failed on attempt {attempts} of {most} and will not be retried"


def job_stuck(jobs: Iterable[Row], now: float, th: Thresholds) -> list[Finding]:
    """Claimed, lease kept alive by beacons, yet no result row for over factor x lease ttl."""
    found = []
    for job in jobs:
        if job["status"] != JobStatus.CLAIMED or job.get("claimed_at") is None:
            continue
        if job.get("lease_deadline") is None or job["lease_deadline"] <= now:
            continue  # a lapsed lease is the sweep's business
        if job.get("has_results"):
            continue
        limit = th.stuck_factor * job["ttl_s"]
        if now - job["claimed_at"] > limit:
            found.append(Finding(AlertRule.JOB_STUCK, job["job_id"],
                                 f"{job['workload']} job {job['job_id']} on {job['claimed_by']} "
                                 f"has run for over {_minutes(limit)} (claimed "
                                 f"{iso(job['claimed_at'])}) with no result rows (expected "
                                 f"within {_minutes(job['ttl_s'])}, its lease ttl)"))
    return found


def schedule_missed(schedules: Iterable[Row], now: float, th: Thresholds) -> list[Finding]:
    """Enabled and due minute long past without a run; or its latest due run came late or
    failed to enqueue (held until a later due minute runs on time). The rule itself is
    schedules.missed_reason, which the schedule listings' `missed` reads too."""
    found = []
    for schedule in schedules:
        reason = missed_reason(schedule, now, th.schedule_late_s)
        if reason is not None:
            found.append(Finding(AlertRule.SCHEDULE_MISSED, schedule["id"], reason))
    return found


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def disk_size(sizes: Sizes, artifact_bytes: int, th: Thresholds) -> list[Finding]:
    found = []
    data = sizes.database_bytes + artifact_bytes
    if data > th.data_bytes:
        found.append(Finding(AlertRule.DISK_SIZE, "data",
                             f"the database ({_size(sizes.database_bytes)}) and artifacts "
                             f"({_size(artifact_bytes)}) take {_size(data)}, over "
                             f"{_size(th.data_bytes)}; prune old results or artifacts"))
    if sizes.log_bytes > th.log_bytes:
        found.append(Finding(AlertRule.DISK_SIZE, "logs",
                             f"the logs take {_size(sizes.log_bytes)}, "
                             f"over {_size(th.log_bytes)}; rotate or trim them"))
    if sizes.free_bytes is not None and sizes.free_bytes < th.free_bytes:
        found.append(Finding(AlertRule.DISK_SIZE, "free-space",
                             f"only {_size(sizes.free_bytes)} free on the data disk, under "
                             f"{_size(th.free_bytes)}"))
    return found


REGRESSION_HISTORY = (3, 10)  # earlier runs a benchmark's median needs, and reads at most
REGRESSION_WINDOW_S = 30 * 86400.0  # benchmark runs older than this are not read
REGRESSION_ROWS = 50_000  # newest benchmark summaries a tick reads


def benchmark_regressed(runs: Iterable[Row], th: Thresholds) -> list[Finding]:
    """Runs (device_id, config, decode_tok_s), oldest first: a device whose newest run of a
    configuration decodes regression_pct or more under the median of its earlier ones. The
    subject is `<device_id> <config>`: a device's configurations alert apart."""
    history: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        value = numbers.finite(run.get("decode_tok_s"))
        if value is not None and value >= 0:
            history.setdefault((run["device_id"], run["config"]), []).append(value)
    least, most = REGRESSION_HISTORY
    found = []
    for (device_id, config), values in sorted(history.items()):
        earlier = values[-most - 1:-1]
        if len(earlier) < least:
            continue
        median = numbers.median(earlier)
        newest = values[-1]
        if median is not None and median > 0 and newest <= median * (1 - th.regression_pct / 100):
            found.append(Finding(
                AlertRule.BENCHMARK_REGRESSED, f"{device_id} {config}",
                f"{device_id} decoded {newest:g} tok/s with {config}, "
                f"{(1 - newest / median) * 100:.0f}% under the median {median:g} of its "
                f"{len(earlier)} earlier runs"))
    return found


def evaluate(snapshot: Snapshot, now: float, th: Thresholds) -> list[Finding]:
    """Every rule over one snapshot: the findings that hold right now."""
    return [
        *device_offline(snapshot.devices, now, th),
        *job_failed(snapshot.failed_jobs, now, th),
        *job_stuck(snapshot.claimed_jobs, now, th),
        *thermal_critical(snapshot.devices, now, th),
        *low_battery(snapshot.devices, now, th),
        *schedule_missed(snapshot.schedules, now, th),
        *disk_size(snapshot.sizes, snapshot.artifact_bytes, th),
        *benchmark_regressed(snapshot.benchmarks, th),
    ]


# ---------------------------------------------------------------------------------------------
# the snapshot and the sizes


def gather(conn: sqlite3.Connection, now: float, th: Thresholds, sizes: Sizes) -> Snapshot:
    """The rows the rules read, in the tick's own transaction (one consistent view)."""
    def rows(sql: str, params: tuple[Any, ...] = ()) -> list[Row]:
        return [dict(row) for row in conn.execute(sql, params)]

    artifacts = conn.execute("SELECT COALESCE(SUM(size), 0) FROM artifacts").fetchone()[0]
    return Snapshot(
        devices=device_rows(conn.execute(DEVICES_SQL)),
        failed_jobs=rows("SELECT job_id, status, workload, attempts, max_attempts, is_group, "
                         "last_error, finished_at FROM jobs WHERE status = 'failed' "
                         "AND finished_at >= ?", (now - th.failed_window_s,)),
        claimed_jobs=rows(
            "SELECT job_id, status, workload, claimed_by, ttl_s, claimed_at, lease_deadline, "
            "EXISTS (SELECT 1 FROM results r WHERE r.job_id = jobs.job_id "
            "AND r.attempt = jobs.attempts AND r.created_at >= jobs.claimed_at) AS has_results "
            "FROM jobs WHERE status = 'claimed'"),
        schedules=rows(
            "SELECT s.id, s.enabled, s.next_run, s.last_slot, r.at AS run_at, "
            "r.outcome AS run_outcome, r.detail AS run_detail FROM schedules s "
            "LEFT JOIN schedule_runs r ON r.schedule_id = s.id AND r.slot = s.last_slot "
            "WHERE s.enabled = 1"),
        sizes=sizes,
        artifact_bytes=int(artifacts),
        benchmarks=_benchmark_runs(rows(
            "SELECT r.device_id, json_extract(r.metrics, '$.decode_tok_s') AS decode_tok_s, "
            "json_extract(j.spec, '$.model.name') AS model, "
            "json_extract(j.spec, '$.model.quant') AS quant, j.backend "
            "FROM results r JOIN jobs j ON j.job_id = r.job_id "
            "WHERE r.workload = 'benchmark' AND r.iter = 0 AND r.final = 1 AND r.ok = 1 "
            "AND r.preempted = 0 AND r.created_at >= ? ORDER BY r.created_at DESC, r.id DESC "
            "LIMIT ?", (now - REGRESSION_WINDOW_S, REGRESSION_ROWS))),
    )


def _benchmark_runs(newest_first: list[Row]) -> list[Row]:
    """Summary rows oldest first, each named by its configuration as the bench view names it."""
    def text(value: Any) -> str | None:
        return value if isinstance(value, str) else None

    return [{"device_id": row["device_id"], "decode_tok_s": row["decode_tok_s"],
             "config": result_runs.config_label(text(row["model"]), text(row["quant"]),
                                                text(row["backend"]))}
            for row in reversed(newest_first)]


def measure(data_dir: Path, log_paths: Iterable[Path]) -> Sizes:
    """File sizes for the disk-size rule (blocking: run it in a thread)."""
    database = sum(_file_size(data_dir / f"fleet.sqlite3{suffix}")
                   for suffix in ("", "-wal", "-shm"))
    logs = sum(_tree_size(path) for path in log_paths)
    try:
        free: int | None = shutil.disk_usage(data_dir).free
    except OSError:
        free = None
    return Sizes(database_bytes=database, log_bytes=logs, free_bytes=free)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tree_size(path: Path) -> int:
    if not path.is_dir():
        return _file_size(path)
    total = 0
    for root, _dirs, files in os.walk(path):
        total += sum(_file_size(Path(root) / name) for name in files)
    return total


# ---------------------------------------------------------------------------------------------
# the state machine


@dataclass
class TickResult:
    opened: list[int] = field(default_factory=list)
    resolved: list[int] = field(default_factory=list)
    still_open: int = 0

    def reply(self) -> dict[str, Any]:
        return {"ok": True, "opened": self.opened, "resolved": self.resolved,
                "open": self.still_open}


def tick(conn: sqlite3.Connection, now: float, th: Thresholds, sizes: Sizes, webhook_armed: bool,
         effects: Effects) -> TickResult:
    """Evaluate every rule and bring the alerts table in line with what holds now."""
    return record(conn, findings_now(conn, now, th, sizes), now, effects, webhook_armed)


def findings_now(conn: sqlite3.Connection, now: float, th: Thresholds,
                 sizes: Sizes) -> list[Finding]:
    """What every rule finds now. The service runs it on a read connection in a worker thread
    and then records the findings in its transaction: at 25,000 devices, reading and judging
    every device on the event loop's thread held it about a second each minute."""
    return evaluate(gather(conn, now, th, sizes), now, th)


# Webhook deliveries opened one by one in any WEBHOOK_WINDOW_S: past them, the new rows of a
# tick go out as one summary delivery. Any client can fail jobs, and each failed job opened a
# row and a POST (300 failing jobs, 300 chat messages in seconds).
WEBHOOK_PER_WINDOW = 10
WEBHOOK_WINDOW_S = 60.0


def record(conn: sqlite3.Connection, findings: Iterable[Finding], now: float, effects: Effects,
           webhook_armed: bool) -> TickResult:
    result = TickResult()
    room = _webhook_room(conn, now) if webhook_armed else 0
    open_rows = {(row["rule"], row["subject"]): row for row in conn.execute(
        "SELECT * FROM alerts WHERE state = 'open'")}
    current = {(f.rule, f.subject): f for f in findings}
    for key, row in open_rows.items():
        if key not in current:
            conn.execute("UPDATE alerts SET state = 'resolved', resolved_at = ? WHERE id = ?",
                         (now, row["id"]))
            result.resolved.append(row["id"])
            effects.emit("alert", alert_id=row["id"], rule=row["rule"], subject=row["subject"],
                         state=AlertState.RESOLVED, action="resolved")
    # Every alert still open was seen again: one statement for all of them (one each was
    # 15,000 statements a tick at 25,000 devices), then the detail where it changed.
    conn.execute("UPDATE alerts SET seen_count = seen_count + 1, last_seen = ? "
                 "WHERE state = 'open'", (now,))
    for key, finding in current.items():
        row = open_rows.get(key)
        if row is None:
            result.opened.append(_open(conn, finding, now, effects, webhook_armed))
        elif row["detail"] != finding.detail:
            conn.execute("UPDATE alerts SET detail = ? WHERE id = ?", (finding.detail, row["id"]))
    result.still_open = len(current)
    if webhook_armed:
        _fold_deliveries(conn, result.opened, room)
    return result


def _webhook_room(conn: sqlite3.Connection, now: float) -> int:
    """How many more deliveries may open one by one in the window ending now."""
    row = conn.execute("SELECT COUNT(*) FROM alerts WHERE first_seen > ? AND webhook_state IN "
                       "('pending', 'delivered', 'failed') AND webhook_summary IS NULL",
                       (now - WEBHOOK_WINDOW_S,)).fetchone()
    return max(0, WEBHOOK_PER_WINDOW - int(row[0]))


def _fold_deliveries(conn: sqlite3.Connection, opened: list[int], room: int) -> None:
    """Keep the first `room` new deliveries; the first of the rest carries a summary of them
    all (itself included) and the others are marked folded into it, never posted alone."""
    if not opened:
        return
    marks = ", ".join("?" for _ in opened)
    pending = conn.execute(f"SELECT id, rule FROM alerts WHERE id IN ({marks}) AND "
                           "webhook_state = 'pending' ORDER BY id", opened).fetchall()
    rest = pending[room:]
    if not rest:
        return
    rules: dict[str, int] = {}
    for row in rest:
        rules[row["rule"]] = rules.get(row["rule"], 0) + 1
    summary = {"alerts": len(rest), "rules": rules, "last_id": rest[-1]["id"]}
    conn.execute("UPDATE alerts SET webhook_summary = ? WHERE id = ?",
                 (json.dumps(summary), rest[0]["id"]))
    conn.executemany("UPDATE alerts SET webhook_state = 'folded' WHERE id = ?",
                     [(row["id"],) for row in rest[1:]])


def _open(conn: sqlite3.Connection, finding: Finding, now: float, effects: Effects,
          webhook_armed: bool) -> int:
    # A snooze outlives a flap: a subject snoozed a moment ago that comes back stays quiet.
    previous = conn.execute("SELECT snoozed_until FROM alerts WHERE rule = ? AND subject = ? "
                            "ORDER BY id DESC LIMIT 1", (finding.rule, finding.subject)).fetchone()
    snoozed = previous["snoozed_until"] if previous and (previous["snoozed_until"] or 0) > now \
        else None
    webhook = "pending" if webhook_armed and snoozed is None else None
    cursor = conn.execute(
        "INSERT INTO alerts (rule, subject, state, seen_count, first_seen, last_seen, detail, "
        "snoozed_until, webhook_state) VALUES (?, ?, 'open', 1, ?, ?, ?, ?, ?)",
        (finding.rule, finding.subject, now, now, finding.detail, snoozed, webhook))
    alert_id = int(cursor.lastrowid or 0)
    effects.emit("alert", alert_id=alert_id, rule=finding.rule, subject=finding.subject,
                 state=AlertState.OPEN, action="opened", detail=finding.detail)
    return alert_id


# ---------------------------------------------------------------------------------------------
# operator actions and reads


def alert_record(row: sqlite3.Row | Row, now: float) -> dict[str, Any]:
    snoozed = row["snoozed_until"]
    return {
        "id": row["id"],
        "rule": row["rule"],
        "subject": row["subject"],
        "state": row["state"],
        "seen_count": row["seen_count"],
        "first_seen": iso(row["first_seen"]),
        "last_seen": iso(row["last_seen"]),
        "resolved_at": iso(row["resolved_at"]),
        "acked_at": iso(row["acked_at"]),
        "snoozed_until": iso(snoozed) if snoozed and snoozed > now else None,
        "muted": bool(row["acked_at"]) or bool(snoozed and snoozed > now),
        "status": original_status(row, now),
        "detail": row["detail"],
        "webhook_state": row["webhook_state"],
    }


def original_status(row: sqlite3.Row | Row, now: float) -> str:
    """The original's four-valued name for an alert's state: open, acked, snoozed (while the
    snooze lasts), resolved. `state` keeps our two values (open while the condition holds)."""
    if row["state"] == AlertState.RESOLVED:
        return "resolved"
    if row["acked_at"] is not None:
        return "acked"
    snoozed = row["snoozed_until"]
    return "snoozed" if snoozed and snoozed > now else "open"


def thresholds_record(th: Thresholds) -> dict[str, Any]:
    """The thresholds the rules read, in the original's camel-case names (GET /api/alerts):
    the same values the rules and the schedule listings use, not copies of their defaults."""
    return {"offlineS": th.offline_s, "beaconFreshS": th.beacon_fresh_s,
            "stuckFactor": th.stuck_factor, "failedWindowS": th.failed_window_s,
            "batteryPct": th.battery_pct, "thermalStates": sorted(th.thermal_states),
            "scheduleLateS": th.schedule_late_s, "regressionPct": th.regression_pct,
            "dataBytes": th.data_bytes, "logBytes": th.log_bytes, "freeBytes": th.free_bytes}


def _alert(conn: sqlite3.Connection, alert_id: int) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM alerts WHERE id = ?", (alert_id,)).fetchone()
    if row is None:
        raise NotFound(f"no alert {alert_id}")
    return row


def ack(conn: sqlite3.Connection, alert_id: int, now: float, effects: Effects
        ) -> dict[str, Any]:
    """Acknowledge: the row stays (open while its condition holds) but is muted."""
    row = _alert(conn, alert_id)
    if row["acked_at"] is None:
        conn.execute("UPDATE alerts SET acked_at = ? WHERE id = ?", (now, alert_id))
        effects.emit("alert", alert_id=alert_id, rule=row["rule"], subject=row["subject"],
                     state=row["state"], action="acked")
    return alert_record(_alert(conn, alert_id), now)


MAX_SNOOZE_S = 30 * 86400


def snooze_seconds(body: Mapping[str, Any]) -> float:
    """`{"duration_s": n}` (0 lifts a snooze) or `{"minutes": n}` (at least 1)."""
    given = [k for k in ("duration_s", "minutes") if k in body]
    if len(given) != 1 or set(body) - {"duration_s", "minutes"}:
        raise BadRequest('send one of {"duration_s": <seconds>} or {"minutes": <minutes>}')
    value = body[given[0]]
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"{given[0]} must be a number")
    if given[0] == "minutes" and value < 1:
        # The original's rule: a snooze in minutes is at least one; lifting one says so plainly.
        raise BadRequest('a snooze in minutes lasts at least 1 minute; send {"duration_s": 0} '
                         "to lift one")
    seconds = value * (60 if given[0] == "minutes" else 1)  # no float(): 10**400 overflows it
    if not 0 <= seconds <= MAX_SNOOZE_S:
        raise BadRequest("a snooze lasts from 0 seconds (lift it) to 30 days")
    return float(seconds)


def snooze(conn: sqlite3.Connection, alert_id: int, seconds: float, now: float,
           effects: Effects) -> dict[str, Any]:
    row = _alert(conn, alert_id)
    if row["state"] != AlertState.OPEN:
        raise Conflict(f"alert {alert_id} is already resolved; there is nothing to snooze")
    until = now + seconds if seconds > 0 else None
    conn.execute("UPDATE alerts SET snoozed_until = ? WHERE id = ?", (until, alert_id))
    effects.emit("alert", alert_id=alert_id, rule=row["rule"], subject=row["subject"],
                 state=row["state"], action="snoozed", snoozed_until=iso(until))
    return alert_record(_alert(conn, alert_id), now)


STATES = (AlertState.OPEN, AlertState.RESOLVED, "all")  # what GET /api/alerts?state= takes
# The original's filter: a comma-separated list of its four statuses (original_status).
STATUSES = ("open", "acked", "snoozed", "resolved")


def _status_filter(state: str, now: float) -> tuple[str, list[Any]]:
    """`?state=open,acked,snoozed,resolved` (two or more, or acked or snoozed alone) selects by
    the original's status; one of our values keeps its meaning (open includes muted rows)."""
    wanted = [part for part in state.split(",") if part]
    bad = [part for part in wanted if part not in STATUSES]
    if bad or not wanted:
        raise BadRequest("state must be open, resolved or all (default: open and recent), or a "
                         "comma-separated list of open, acked, snoozed, resolved")
    terms = {
        "open": ("(state = 'open' AND acked_at IS NULL AND "
                 "(snoozed_until IS NULL OR snoozed_until <= ?))", [now]),
        "acked": ("(state = 'open' AND acked_at IS NOT NULL)", []),
        "snoozed": ("(state = 'open' AND acked_at IS NULL AND snoozed_until > ?)", [now]),
        "resolved": ("state = 'resolved'", []),
    }
    chosen = [terms[part] for part in dict.fromkeys(wanted)]
    return "(" + " OR ".join(t[0] for t in chosen) + ")", [p for t in chosen for p in t[1]]


async def list_alerts(db: Database, state: str | None, rule: str | None, limit: int,
                      now: float) -> dict[str, Any]:
    """Open alerts (open first) plus those resolved in the last day, unless state says."""
    if rule is not None and rule not in RULES:
        raise BadRequest(f"rule must be one of {', '.join(RULES)}")
    filters: dict[str | None, tuple[str, list[Any]]] = {
        None: ("(state = 'open' OR resolved_at >= ?)", [now - RECENT_S]),
        AlertState.OPEN: ("state = 'open'", []),
        AlertState.RESOLVED: ("state = 'resolved'", []),
        "all": ("1 = 1", []),
    }
    where, params = filters[state] if state in filters else _status_filter(str(state), now)
    if rule is not None:
        where, params = f"{where} AND rule = ?", [*params, rule]
    rows = await db.read(f"SELECT * FROM alerts WHERE {where} "
                         "ORDER BY state = 'open' DESC, id DESC LIMIT ?", (*params, limit))
    return {"alerts": [alert_record(row, now) for row in rows]}
