"""Schedules: a cron expression, an enabled flag and a job template, fired by the tick.

Each function that changes state is a transaction function (fleet_min.db): the connection first,
Effects last. The tick enqueues a due run in the SAME transaction that records its slot in
schedule_runs, and UNIQUE(schedule_id, slot) makes "at most once per due minute" hold across
restarts and clock jumps.

Times: cron is read in the scheduler's time zone (the host's local time unless configured);
slots and job ids use UTC minutes, `<schedule id>-<YYYYMMDDHHMM>`, so a wall-clock hour that
repeats in autumn never produces the same id twice. A run now is `<id>-manual-<YYYYMMDDHHMMSS>`.

After downtime only the most recent due minute fires; the earlier ones are recorded as skipped
(never a storm of catch-up jobs). Handled minutes are never fired again: `next_run` only moves
forward, so a clock stepped backwards waits until it reaches `next_run` again.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from typing import Any, cast

from fleet_min import jsonio
from fleet_min.collector.jobs import queue, views
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.specs import JobSpec, check_spec
from fleet_min.cron import Cron, CronError, parse
from fleet_min.db import Database
from fleet_min.errors import BadRequest, Conflict, NotFound, Refused, TooLarge
from fleet_min.timeutil import iso

SCHEDULE_ID = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._:@][A-Za-z0-9._:@-]{0,99}")  # see validate._ID
PLACEHOLDER_JOB_ID = "schedule-template"
MISSED_RECORDED = 100   # missed minutes written to schedule_runs one by one; the rest counted
MISSED_COUNTED = 1000   # beyond this many, the count says "more than"
HISTORY_LIMIT = 50
# Schedules one collector holds. Creating one is an open route (or a dashboard change), and
# every listing reads each schedule's cron, so their number is bounded as a request's jobs
# are: a shelf needs tens; 1,000 list in well under a second on a Raspberry-Pi-class host.
MAX_SCHEDULES = 1000
# A schedule's or a saved job template's spec, as stored JSON. Every listing of schedules and
# templates carries them whole (the dashboard's forms are filled from them), and the artifact
# holds read them all, so 1,000 of them at the 1 MiB a request may carry would be a gigabyte on
# each read; a spec that needs more names its inputs by an artifact's hash.
MAX_TEMPLATE_BYTES = 64 * 1024
LATE_S = 300.0          # this late without a run is missed (FLEET_ALERT_SCHEDULE_LATE_S)
EDITABLE = ("cron", "enabled", "template")
# A schedule with its latest handled run, which is what "missed" reads.
SELECT = ("SELECT s.*, r.at AS run_at, r.outcome AS run_outcome, r.detail AS run_detail "
          "FROM schedules s LEFT JOIN schedule_runs r "
          "ON r.schedule_id = s.id AND r.slot = s.last_slot")
_MISSED = ("missed: the collector was not running (or its clock jumped) at this due minute, "
           "or the tick's job budget held its run back until a later due minute came; only the "
           "most recent due minute runs")
_DEFERRED = ("deferred: the runs fired before it in this tick created {spent} jobs, and a "
             "tick may create {ceiling} (as one request may), so this run and those due after "
             "it wait; they run in the next tick, in the order they came due")


# ---------------------------------------------------------------------------------------------
# checks


def check_id(value: Any) -> str:
    if not isinstance(value, str) or SCHEDULE_ID.fullmatch(value) is None:
        raise BadRequest("id is required: 1 to 100 letters, digits or . _ : @ - (not starting "
                         "with -, not . or ..), e.g. nightly-bench")
    return value


def check_cron(value: Any) -> Cron:
    try:
        return parse(value)
    except CronError as exc:
        raise BadRequest(str(exc)) from None


def check_template(template: Any) -> dict[str, Any]:
    """A template is a job spec without job_id, checked as POST /jobs checks a spec."""
    if not isinstance(template, dict):
        raise BadRequest("template must be a JSON object: a job spec without job_id")
    if "job_id" in template:
        raise BadRequest("template must not carry job_id; each run is named "
                         "<schedule id>-<YYYYMMDDHHMM>")
    spec = check_spec({**template, "job_id": PLACEHOLDER_JOB_ID}, context="template: ")
    kept = {k: v for k, v in spec.items() if k != "job_id"}  # in the neutral form
    size = len(json.dumps(kept).encode())
    if size > MAX_TEMPLATE_BYTES:
        raise TooLarge(f"template is {size} bytes as JSON; a template may hold at most "
                       f"{MAX_TEMPLATE_BYTES}: keep large inputs in an artifact and name its "
                       "hash (input_sha256, say)")
    return kept


# ---------------------------------------------------------------------------------------------
# slots and records


def slot_of(ts: float) -> str:
    """The UTC minute of ts as YYYYMMDDHHMM (the scheduled job id suffix)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y%m%d%H%M")


def slot_time(slot: str | None) -> float | None:
    """Epoch seconds of a YYYYMMDDHHMM slot; None for manual slots and None."""
    if not slot or not slot.isdigit():
        return None
    return datetime.strptime(slot, "%Y%m%d%H%M").replace(tzinfo=UTC).timestamp()


@dataclass(frozen=True)
class View:
    """What a record is read against: the time, the cron's time zone, the lateness that counts
    as missed."""

    now: float
    tz: tzinfo | None = None
    late_s: float = LATE_S


def schedule_record(row: sqlite3.Row, view: View) -> dict[str, Any]:
    missed = missed_reason(row, view.now, view.late_s)
    return {
        "id": row["id"],
        "cron": row["cron"],
        "enabled": bool(row["enabled"]),
        "last_run": iso(row["last_run"]),
        "next_run": iso(row["next_run"] if row["enabled"] else _would_run(row, view)),
        "missed": missed is not None,
        "missed_detail": missed,
        "template": json.loads(row["template"]),
        "last_skip": row["last_skip"],
        "last_slot": iso(slot_time(row["last_slot"])),
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def _would_run(row: sqlite3.Row, view: View) -> float | None:
    """For a disabled schedule: the due minute enabling it now would give (listings show when it
    would run; the scheduler itself keeps next_run NULL while disabled)."""
    try:
        return _first_run(parse(row["cron"]), row["last_slot"], view.now, view.tz)
    except CronError:
        return None


def missed_reason(row: sqlite3.Row | Mapping[str, Any], now: float, late_s: float) -> str | None:
    """Why an enabled schedule counts as missed, or None: its due minute is over late_s past
    without a run, or its latest due run came late or could not enqueue (held until a later due
    minute runs on time). The schedule-missed alert and the listings' `missed` read this."""
    if not row["enabled"]:
        return None
    next_run = row["next_run"]
    if next_run is not None and now - next_run > late_s:
        return (f"schedule {row['id']} was due at {iso(next_run)} and has not run "
                f"({_minutes(now - next_run)} late)")
    due, at = slot_time(row["last_slot"]), row["run_at"]
    if due is None or at is None:
        return None
    if row["run_outcome"] == "failed":
        return (f"schedule {row['id']} could not enqueue its run due at {iso(due)}: "
                f"{(row['run_detail'] or '')[:300]}")
    if at - due > late_s:
        return (f"schedule {row['id']} ran {_minutes(at - due)} late for its due minute "
                f"{iso(due)} (was the collector down?)")
    return None


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min"


def _row(conn: sqlite3.Connection, schedule_id: str) -> sqlite3.Row:
    row = conn.execute(SELECT + " WHERE s.id = ?", (schedule_id,)).fetchone()
    if row is None:
        raise NotFound(f"no schedule {schedule_id!r}")
    return row


def _first_run(cron: Cron, row_last_slot: str | None, now: float, tz: tzinfo | None) -> float:
    """The next due minute from now, never at or before a minute already handled."""
    handled = slot_time(row_last_slot) or 0.0
    return cron.next_after(max(now, handled), tz)


def _arm(cron: Cron, row_last_slot: str | None, now: float, tz: tzinfo | None) -> float:
    """The first due minute of a schedule being enabled, or 400 when the cron has none within
    the horizon the cron module searches: an enabled schedule with nothing to wait for would
    look armed and never run.

    Checked here and not in check_cron, so a disabled schedule may still hold such a cron:
    whether a due minute comes within the horizon depends on the date, not on the text (the
    horizon slides forward, so '0 0 */31 11 */7', refused in 2026, can be enabled from late 2028
    on), and a disabled schedule waits for no minute."""
    try:
        return _first_run(cron, row_last_slot, now, tz)
    except CronError as exc:
        raise BadRequest(f"{exc}, so it cannot be enabled; keep it disabled or choose a cron "
                         "that comes round sooner") from None


# ---------------------------------------------------------------------------------------------
# create, update, delete


def create(conn: sqlite3.Connection, body: dict[str, Any], now: float, effects: Effects,
           view: View | None = None) -> dict[str, Any]:
    """A new schedule, disabled unless the body says `"enabled": true`."""
    view = view or View(now)
    unknown = sorted(set(body) - {"id", "cron", "template", "enabled"})
    if unknown:
        raise BadRequest(f"{unknown[0][:60]} is not a schedule field; send id, cron and template")
    schedule_id = check_id(body.get("id"))
    cron = check_cron(body.get("cron"))
    template = check_template(body.get("template"))
    enabled = body.get("enabled", False)
    if not isinstance(enabled, bool):
        raise BadRequest("enabled must be true or false (new schedules start disabled unless "
                         "it is true)")
    if conn.execute("SELECT 1 FROM schedules WHERE id = ?", (schedule_id,)).fetchone():
        raise Conflict(f"schedule {schedule_id!r} already exists")
    held = conn.execute("SELECT COUNT(*) FROM schedules").fetchone()[0]
    if held >= MAX_SCHEDULES:
        raise Conflict(f"this collector already holds {held} schedules, the most it keeps is "
                       f"{MAX_SCHEDULES}; delete one it no longer needs (DELETE "
                       "/api/schedules/{id}) before creating another")
    next_run = _arm(cron, None, now, view.tz) if enabled else None
    if enabled:
        note_clock(conn, now, view.tz)
    conn.execute(
        "INSERT INTO schedules (id, cron, enabled, template, next_run, created_at, updated_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (schedule_id, cron.text, int(enabled), json.dumps(template), next_run, now, now))
    effects.emit("schedule", schedule_id=schedule_id, action="created", enabled=enabled)
    return schedule_record(_row(conn, schedule_id), view)


def put(conn: sqlite3.Connection, body: dict[str, Any], now: float, effects: Effects,
        view: View | None = None) -> tuple[bool, dict[str, Any]]:
    """Create, or replace the cron, template and enabled flag of the schedule with this id (the
    original's POST /schedules). Returns whether it was created, and the record."""
    view = view or View(now)
    schedule_id = check_id(body.get("id"))
    if conn.execute("SELECT 1 FROM schedules WHERE id = ?", (schedule_id,)).fetchone() is None:
        return True, create(conn, body, now, effects, view)
    unknown = sorted(set(body) - {"id", "cron", "template", "enabled"})
    if unknown:
        raise BadRequest(f"{unknown[0][:60]} is not a schedule field; send id, cron and template")
    if "cron" not in body or "template" not in body:
        raise BadRequest("id, cron and template are required")
    changes = {"cron": body["cron"], "template": body["template"],
               "enabled": body.get("enabled", False)}
    return False, update(conn, schedule_id, changes, now, effects, view)


def update(conn: sqlite3.Connection, schedule_id: str, changes: dict[str, Any], now: float,
           effects: Effects, view: View | None = None) -> dict[str, Any]:
    view = view or View(now)
    unknown = sorted(set(changes) - set(EDITABLE))
    if unknown:
        raise BadRequest(f"{unknown[0][:60]} cannot be changed; editable fields are cron, "
                         "enabled and template")
    if not changes:
        raise BadRequest("nothing to change: send cron, enabled or template")
    if "enabled" in changes and not isinstance(changes["enabled"], bool):
        raise BadRequest("enabled must be true or false")
    cron = check_cron(changes["cron"]) if "cron" in changes else None
    template = check_template(changes["template"]) if "template" in changes else None
    row = _row(conn, schedule_id)
    enabled = changes.get("enabled", bool(row["enabled"]))
    next_run = row["next_run"] if row["enabled"] else None
    # Enabling again re-arms a schedule the tick stopped (enabled, next_run NULL); a PATCH of
    # its template alone leaves it stopped rather than refusing the edit.
    stopped = row["next_run"] is None and "enabled" in changes
    if not enabled:
        next_run = None
    elif cron is not None or not row["enabled"] or stopped:
        next_run = _arm(cron or check_cron(row["cron"]), row["last_slot"], now, view.tz)
        note_clock(conn, now, view.tz)
    conn.execute(
        "UPDATE schedules SET cron = ?, enabled = ?, template = ?, next_run = ?, updated_at = ? "
        "WHERE id = ?",
        (cron.text if cron is not None else row["cron"], int(enabled),
         json.dumps(template) if template is not None else row["template"], next_run, now,
         schedule_id))
    effects.emit("schedule", schedule_id=schedule_id, action="updated", enabled=enabled)
    return schedule_record(_row(conn, schedule_id), view)


def delete(conn: sqlite3.Connection, schedule_id: str, effects: Effects) -> dict[str, Any]:
    """Forget a schedule and its run records; the jobs it created stay (with template_id)."""
    _row(conn, schedule_id)
    conn.execute("DELETE FROM schedules WHERE id = ?", (schedule_id,))
    # Runs go too, so that a new schedule of the same id starts with no handled minutes.
    conn.execute("DELETE FROM schedule_runs WHERE schedule_id = ?", (schedule_id,))
    effects.emit("schedule", schedule_id=schedule_id, action="deleted")
    return {"ok": True, "id": schedule_id, "deleted": True}


# ---------------------------------------------------------------------------------------------
# firing


def missing_build(conn: sqlite3.Connection, template: dict[str, Any]) -> str | None:
    """Why a template using app.sha256 "latest" cannot run yet (None when it can)."""
    app = template.get("app")
    if not isinstance(app, dict) or app.get("sha256") != "latest":
        return None
    name = app.get("name")
    if isinstance(name, str) and queue.latest_build(conn, name) is not None:
        return None
    return (f"no published build of app {name!r} yet; upload one with the header "
            f"x-artifact-app: {name} and the next due run will use it")


def _record_run(conn: sqlite3.Connection, schedule_id: str, slot: str, now: float,
                job_id: str | None, outcome: str, detail: str | None) -> None:
    conn.execute("INSERT INTO schedule_runs (schedule_id, slot, at, job_id, outcome, detail) "
                 "VALUES (?, ?, ?, ?, ?, ?)", (schedule_id, slot, now, job_id, outcome, detail))


def _run_spec(template: dict[str, Any], job_id: str) -> JobSpec:
    """A run's spec: the stored template (checked by check_template when it was stored) under
    the run's job id."""
    return cast(JobSpec, {**template, "job_id": job_id})


def _enqueue(conn: sqlite3.Connection, schedule_id: str, spec: JobSpec, now: float,
             effects: Effects, spent: int = 0, prepared: queue.Prepared | None = None,
             bounded: bool = True) -> queue.Enqueued:
    """queue.enqueue inside a savepoint: a refusal undoes only this run and its effects. The
    registry is read, beyond what `prepared` holds of it, only as far as a transaction may
    (queue.ReadFirst past it) unless `bounded` is False."""
    recorded = effects.mark()
    conn.execute("SAVEPOINT schedule_run")
    try:
        queue.refuse_lone_surrogates(spec, f"the template of schedule {schedule_id}",
                                     "replace the template (PATCH the schedule)")
        enqueued = queue.enqueue(conn, [spec], now, effects, template_id=schedule_id,
                                 spent=spent, prepared=prepared, bounded=bounded)
    except (Refused, queue.ReadFirst):
        conn.execute("ROLLBACK TO schedule_run")
        conn.execute("RELEASE schedule_run")
        effects.rewind(recorded)
        raise
    conn.execute("RELEASE schedule_run")
    return enqueued


def run_now(conn: sqlite3.Connection, schedule_id: str, now: float, effects: Effects, *,
            prepared: queue.Prepared | None = None, bounded: bool = True) -> dict[str, Any]:
    """Enqueue one run of the template now, enabled or not. Refusals change nothing;
    queue.ReadFirst (when `bounded`) asks for `prepared` (prepare_run)."""
    row = _row(conn, schedule_id)
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%d%H%M%S")
    slot, job_id = f"manual-{stamp}", f"{schedule_id}-manual-{stamp}"
    if conn.execute("SELECT 1 FROM schedule_runs WHERE schedule_id = ? AND slot = ?",
                    (schedule_id, slot)).fetchone():
        raise Conflict(f"schedule {schedule_id} was already run this second; try again")
    template = json.loads(row["template"])
    reason = missing_build(conn, template)
    if reason:
        _record_run(conn, schedule_id, slot, now, None, "skipped", reason)
        effects.emit("schedule", schedule_id=schedule_id, action="skipped", slot=slot)
        return {"ok": True, "schedule_id": schedule_id, "outcome": "skipped", "job_id": None,
                "reason": reason}
    reply = _enqueue(conn, schedule_id, _run_spec(template, job_id), now, effects,
                     prepared=prepared, bounded=bounded).replies[0]
    _record_run(conn, schedule_id, slot, now, job_id, "enqueued", None)
    conn.execute("UPDATE schedules SET last_run = ? WHERE id = ?", (now, schedule_id))
    effects.emit("schedule", schedule_id=schedule_id, action="fired", slot=slot, job_id=job_id)
    return {"ok": True, "schedule_id": schedule_id, "outcome": "enqueued", "job_id": job_id,
            "status": reply["status"]}


async def prepare_run(db: Database, schedule_id: str, now: float) -> queue.Prepared | None:
    """What a run of the schedule reads of the registry, read off the event loop's thread
    when run_now's transaction found it more than it may read (prepare_stored)."""
    return await prepare_stored(db, "SELECT template FROM schedules WHERE id = ?", schedule_id,
                                now)


async def prepare_stored(db: Database, sql: str, key: str, now: float
                         ) -> queue.Prepared | None:
    """views.prepare_enqueue for a stored spec without its job id (a schedule's template, a
    job template's spec: the one column `sql` reads for `key`); None when the row is gone or
    its spec no longer passes, which the transaction run next then says."""
    row = await db.read_one(sql, (key,))
    if row is None:
        return None
    try:
        spec = check_spec(_run_spec(json.loads(row[0]), "stored-check"))
    except (BadRequest, ValueError):
        return None
    return await views.prepare_enqueue(db, [spec], now)


@dataclass
class TickReport:
    fired: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    deferred: list[dict[str, Any]] = field(default_factory=list)
    # Runs held back because checking their workload needs more of the registry than the
    # tick's transaction may read (queue.ReadFirst): their specs, for the caller to read with
    # views.prepare_enqueue before it ticks again. Not part of the reply.
    unread: list[JobSpec] = field(default_factory=list)
    prepared: queue.Prepared | None = None  # what the tick was handed (see tick)
    missed: int = 0
    jobs: int = 0  # created by this tick's runs, under one budget (queue.MAX_JOBS_PER_REQUEST)

    def reply(self) -> dict[str, Any]:
        return {"ok": True, "fired": self.fired, "skipped": self.skipped, "failed": self.failed,
                "deferred": self.deferred, "missed": self.missed}


def tick(conn: sqlite3.Connection, now: float, effects: Effects, tz: tzinfo | None = None,
         *, prepared: queue.Prepared | None = None) -> TickReport:
    """Fire every enabled schedule whose due minute has come and was not handled yet, with
    what `prepared` holds of the registry for the runs an earlier tick held back (unread)."""
    report = TickReport(prepared=prepared)
    _pull_back_next_runs(conn, now, tz)
    rows = conn.execute("SELECT * FROM schedules WHERE enabled = 1 AND next_run IS NOT NULL "
                        "AND next_run <= ? ORDER BY next_run, id", (now,)).fetchall()
    if rows:
        note_clock(conn, now, tz)  # the next_runs moved on below are computed from now
    for row in rows:
        _tick_one(conn, row, now, effects, tz, report)
    return report


CLOCK_KEY = "scheduler_clock"


def _zone_key(tz: tzinfo | None) -> str:
    return "local" if tz is None else str(getattr(tz, "key", None) or tz)


def _clock(conn: sqlite3.Connection) -> dict[str, Any] | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (CLOCK_KEY,)).fetchone()
    return cast(dict[str, Any], json.loads(row[0])) if row else None


def note_clock(conn: sqlite3.Connection, now: float, tz: tzinfo | None) -> None:
    """Remember the latest time (and the zone) any next_run was computed from. While the clock
    reads at or past it in the same zone, every stored next_run is already the next due minute
    from now, and the tick need not compute them again."""
    mark, zone = _clock(conn), _zone_key(tz)
    at = max(now, mark["at"]) if mark is not None and mark["tz"] == zone else now
    if mark is None or mark["at"] != at or mark["tz"] != zone:
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                     (CLOCK_KEY, json.dumps({"at": at, "tz": zone})))


def _pull_back_next_runs(conn: sqlite3.Connection, now: float, tz: tzinfo | None) -> None:
    """A next_run later than the next due minute from now was computed before the clock was set
    back (or in another time zone); left alone, the schedule would stay silent until the clock
    caught up with it. It comes back to the next due minute after the current one (the minute
    the clock landed in is not fired: it may be one that already ran before the clock was set).

    Only then: a next_run computed at or before now is the next due minute from now already, so
    a tick with the clock at or past the mark note_clock keeps computes nothing here (a tick
    over every schedule's cron, each tick, held the loop for seconds with thousands of them)."""
    mark = _clock(conn)
    if mark is not None and mark["tz"] == _zone_key(tz) and now >= mark["at"]:
        return
    note_clock(conn, now, tz)
    current = math.floor(now / 60) * 60
    rows = conn.execute("SELECT id, cron, next_run FROM schedules WHERE enabled = 1 "
                        "AND next_run > ?", (current + 60,)).fetchall()
    for row in rows:
        try:
            upcoming = parse(row["cron"]).next_after(current, tz)
        except CronError:
            continue  # none within the horizon: the stored next_run, further out, stands
        handled = conn.execute("SELECT 1 FROM schedule_runs WHERE schedule_id = ? AND slot = ?",
                               (row["id"], slot_of(upcoming))).fetchone() is not None
        if upcoming < row["next_run"] and not handled:
            conn.execute("UPDATE schedules SET next_run = ? WHERE id = ?", (upcoming, row["id"]))


def _tick_one(conn: sqlite3.Connection, row: sqlite3.Row, now: float, effects: Effects,
              tz: tzinfo | None, report: TickReport) -> None:
    """Fire one schedule's due minute and move its next_run on. Whatever is wrong with this one
    schedule stops it alone: an exception here would roll back the tick every schedule shares,
    and the next tick would meet the same row and fail again."""
    current = math.floor(now / 60) * 60
    try:
        cron = parse(row["cron"])
    except CronError as exc:  # stored before a grammar change
        _stop(conn, row["id"], str(exc), effects)
        return
    due = due_minutes(cron, row["next_run"], current, tz)
    # due.latest is None when next_run was not due under this time zone: it only moves on.
    if due.latest is not None and not _fire_due(conn, row, slot_of(due.latest), due, now,
                                                 effects, report):
        return  # held back: next_run stays, so the next tick takes it first
    try:
        upcoming = cron.next_after(current, tz)
    except CronError as exc:  # e.g. '0 0 */31 3 */7' after 2026-03-01: next due in 2037
        _stop(conn, row["id"], f"{exc}, so the scheduler stopped it; change the cron, or "
              "enable it again once a due minute comes within range", effects)
        return
    conn.execute("UPDATE schedules SET next_run = ? WHERE id = ?", (upcoming, row["id"]))


def _stop(conn: sqlite3.Connection, schedule_id: str, reason: str, effects: Effects) -> None:
    """Hold no due minute for the schedule, and say why where its record shows it."""
    conn.execute("UPDATE schedules SET next_run = NULL, last_skip = ? WHERE id = ?",
                 (reason, schedule_id))
    effects.emit("schedule", schedule_id=schedule_id, action="stopped")


def _fire_due(conn: sqlite3.Connection, row: sqlite3.Row, slot: str, due: Due, now: float,
              effects: Effects, report: TickReport) -> bool:
    """Fire the latest due minute, `slot`, and record the missed minutes as skipped; or, when
    the tick's job budget cannot take the run, hold it back (False) and record nothing."""
    note = None
    if due.missed_count:
        count = f"more than {due.missed_count}" if due.more else str(due.missed_count)
        note = (f"{count} earlier due minutes were missed while the collector was not running; "
                "they are recorded as skipped")
    if not _fire_slot(conn, row, slot, now, effects, report, note):
        return False
    for minute in due.missed:
        conn.execute("INSERT OR IGNORE INTO schedule_runs (schedule_id, slot, at, outcome, "
                     "detail) VALUES (?, ?, ?, 'skipped', ?)",
                     (row["id"], slot_of(minute), now, _MISSED))
    report.missed += due.missed_count
    conn.execute("UPDATE schedules SET last_slot = ? WHERE id = ?", (slot, row["id"]))
    return True


def _fire_slot(conn: sqlite3.Connection, row: sqlite3.Row, slot: str, now: float,
               effects: Effects, report: TickReport, note: str | None) -> bool:
    """Enqueue, skip or fail the run of `slot`; False when the tick's budget held it back."""
    schedule_id = row["id"]
    if conn.execute("SELECT 1 FROM schedule_runs WHERE schedule_id = ? AND slot = ?",
                    (schedule_id, slot)).fetchone():
        return True  # handled already (before a restart or a clock jump)
    template = json.loads(row["template"])
    reason = missing_build(conn, template)
    if reason:
        _record_run(conn, schedule_id, slot, now, None, "skipped", reason)
        conn.execute("UPDATE schedules SET last_skip = ? WHERE id = ?", (reason, schedule_id))
        report.skipped.append({"schedule_id": schedule_id, "slot": slot, "reason": reason})
        effects.emit("schedule", schedule_id=schedule_id, action="skipped", slot=slot)
        return True
    job_id = f"{schedule_id}-{slot}"
    if report.deferred:  # the budget is spent: the rest wait their turn, untried (a refused
        _defer(conn, schedule_id, slot, effects, report)  # fan-out still reads every device)
        return False
    spec = _run_spec(template, job_id)
    try:
        enqueued = _enqueue(conn, schedule_id, spec, now, effects, report.jobs, report.prepared)
    except queue.ReadFirst:  # held back, untried: next_run stays, and nothing is recorded
        report.unread.append(spec)
        return False
    except Refused as exc:
        # Past the budget after other runs: held back. Alone past it: failed, as such a
        # request is refused (it would never fit).
        if isinstance(exc, queue.OverBudget) and report.jobs:
            _defer(conn, schedule_id, slot, effects, report)
            return False
        _record_run(conn, schedule_id, slot, now, None, "failed", exc.message)
        report.failed.append({"schedule_id": schedule_id, "slot": slot, "error": exc.message})
        effects.emit("schedule", schedule_id=schedule_id, action="failed", slot=slot)
        return True
    report.jobs += enqueued.jobs
    reply = enqueued.replies[0]
    _record_run(conn, schedule_id, slot, now, job_id, "enqueued", note)
    conn.execute("UPDATE schedules SET last_run = ?, last_skip = NULL WHERE id = ?",
                 (now, schedule_id))
    report.fired.append({"schedule_id": schedule_id, "slot": slot, "job_id": job_id,
                         "status": reply["status"]})
    effects.emit("schedule", schedule_id=schedule_id, action="fired", slot=slot, job_id=job_id)
    return True


def _defer(conn: sqlite3.Connection, schedule_id: str, slot: str, effects: Effects,
           report: TickReport) -> None:
    """Hold a run back for the next tick: nothing is recorded for its slot and next_run stays
    (so it sorts first), and last_skip says why until a run enqueues."""
    reason = _DEFERRED.format(spent=report.jobs, ceiling=queue.MAX_JOBS_PER_REQUEST)
    conn.execute("UPDATE schedules SET last_skip = ? WHERE id = ?", (reason, schedule_id))
    report.deferred.append({"schedule_id": schedule_id, "slot": slot, "reason": reason})
    effects.emit("schedule", schedule_id=schedule_id, action="deferred", slot=slot)


@dataclass
class Due:
    latest: float | None            # the most recent due minute at or before now
    missed: list[float]             # earlier due minutes, the first MISSED_RECORDED of them
    missed_count: int               # how many earlier due minutes there were
    more: bool                      # the count stopped at MISSED_COUNTED


def due_minutes(cron: Cron, start: float, current: float, tz: tzinfo | None) -> Due:
    """The due minutes from `start` (inclusive) to `current` (inclusive), for the tick."""
    due = Due(None, [], 0, False)
    t = _next_due(cron, start - 60, tz)
    while t is not None and t <= current:
        if due.latest is not None:
            due.missed_count += 1
            if len(due.missed) < MISSED_RECORDED:
                due.missed.append(due.latest)
        due.latest = t
        if due.missed_count >= MISSED_COUNTED:
            due.latest, due.more = latest_due(cron, t, current, tz), True
            break
        t = _next_due(cron, t, tz)
    return due


def _next_due(cron: Cron, ts: float, tz: tzinfo | None) -> float | None:
    """The next due minute, or None when none comes within the horizon the cron module
    searches: for the tick that means no more due minutes, never a reason to abort."""
    try:
        return cron.next_after(ts, tz)
    except CronError:
        return None


def latest_due(cron: Cron, after: float, current: float, tz: tzinfo | None) -> float:
    """The last due minute in [after, current], searched in growing windows back from current
    (so a year of missed minutely runs costs an hour's worth of steps, not a year's)."""
    for window in (3600, 86400, 32 * 86400, 367 * 86400):
        low = max(after - 60, current - window)
        last, t = None, _next_due(cron, low, tz)
        while t is not None and t <= current:
            last, t = t, _next_due(cron, t, tz)
        if last is not None:
            return last
        if low <= after - 60:
            break
    return after


# ---------------------------------------------------------------------------------------------
# reads


# Listings of schedules and of job templates are built on a worker thread, at most this many
# at once: each parses every stored template (up to 1,000 of up to 64 KiB), and 1,000 templates
# of nested empty lists held the event loop 8 s and took 1.2 GB for one listing.
LISTINGS_AT_ONCE = 2


async def list_schedules(db: Database, view: View) -> dict[str, Any]:
    async with db.slots("automation listings", LISTINGS_AT_ONCE):
        return await db.read_in_thread(_schedule_records, view, named=True)


async def listing_body(db: Database, view: View, *, bare: bool = False) -> bytes:
    """list_schedules as an encoded JSON answer (jsonio.dumps_listing: a record's objects at a
    time), made on the worker thread too; `bare` the records alone, as an array (the
    original's GET /schedules)."""
    def encoded(conn: sqlite3.Connection) -> bytes:
        return jsonio.dumps_listing(_each_schedule(conn, view), None if bare else "schedules")

    async with db.slots("automation listings", LISTINGS_AT_ONCE):
        return await db.read_in_thread(encoded, named=True)


def _each_schedule(conn: sqlite3.Connection, view: View) -> Iterator[dict[str, Any]]:
    return (schedule_record(row, view) for row in conn.execute(SELECT + " ORDER BY s.id"))


def _schedule_records(conn: sqlite3.Connection, view: View) -> dict[str, Any]:
    return {"schedules": list(_each_schedule(conn, view))}


async def get_schedule(db: Database, schedule_id: str, view: View) -> dict[str, Any]:
    row = await db.read_one(SELECT + " WHERE s.id = ?", (schedule_id,))
    if row is None:
        raise NotFound(f"no schedule {schedule_id!r}")
    return schedule_record(row, view)


async def history(db: Database, schedule_id: str, limit: int = HISTORY_LIMIT) -> dict[str, Any]:
    """The schedule's runs (fired, skipped, failed) and the jobs it created, newest first."""
    if await db.read_one("SELECT 1 FROM schedules WHERE id = ?", (schedule_id,)) is None:
        raise NotFound(f"no schedule {schedule_id!r}")
    runs = await db.read(
        "SELECT r.*, j.status AS job_status FROM schedule_runs r "
        "LEFT JOIN jobs j ON j.job_id = r.job_id "
        "WHERE r.schedule_id = ? ORDER BY r.id DESC LIMIT ?", (schedule_id, limit))
    jobs = await db.read(
        "SELECT job_id, status, workload, executor, attempts, last_error, created_at, "
        "finished_at FROM jobs WHERE template_id = ? ORDER BY seq DESC LIMIT ?",
        (schedule_id, limit))
    return {
        "schedule_id": schedule_id,
        "runs": [{"slot": r["slot"], "due": iso(slot_time(r["slot"])), "at": iso(r["at"]),
                  "outcome": r["outcome"], "job_id": r["job_id"], "job_status": r["job_status"],
                  "detail": r["detail"]} for r in runs],
        "jobs": [{"job_id": j["job_id"], "status": j["status"], "workload": j["workload"],
                  "executor": j["executor"], "attempts": j["attempts"],
                  "last_error": j["last_error"], "created_at": iso(j["created_at"]),
                  "finished_at": iso(j["finished_at"])} for j in jobs],
    }
