"""Job templates: named job specs saved from the enqueue form, to enqueue again later.

A template is a job spec without job_id (checked as a schedule's template is, so the same
refusals apply), an id and an optional display name. Enqueueing one names the job
`<template id>-<YYYYMMDDHHMMSS>` (UTC seconds) unless the request gives a job_id, and records the
template's id as the job's template_id (as a schedule's runs record the schedule's).

Each function that changes state is a transaction function (fleet_min.db): the connection
first, Effects last.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from typing import Any

from fleet_min import jsonio, validate
from fleet_min.collector.automation.schedules import (
    LISTINGS_AT_ONCE,
    SCHEDULE_ID,
    check_template,
    prepare_stored,
)
from fleet_min.collector.jobs import queue
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.specs import check_spec
from fleet_min.db import Database
from fleet_min.errors import BadRequest, Conflict, NotFound
from fleet_min.timeutil import iso

NAME_MAX = 200
# Templates one collector keeps: saving one is an open route (or a dashboard change) and the
# enqueue and schedule forms list them all with their specs, so their number is bounded as the
# schedules' is (each spec at most MAX_TEMPLATE_BYTES).
MAX_TEMPLATES = 1000
FIELDS = ("id", "name", "spec")
EDITABLE = ("name", "spec")


def check_id(value: Any) -> str:
    if not isinstance(value, str) or SCHEDULE_ID.fullmatch(value) is None:
        raise BadRequest("id is required: 1 to 100 letters, digits or . _ : @ - (not starting "
                         "with -, not . or ..), e.g. pixel-bench")
    return value


def check_name(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > NAME_MAX or not validate.is_label(value):
        raise BadRequest(f"name must be text of at most {NAME_MAX} characters "
                         f"({validate.LABEL_WORDS}), or null")
    return value


def check_job_spec(value: Any) -> str:
    """The spec to store (JSON text): a job spec without job_id, in the neutral form."""
    if isinstance(value, dict) and "job_id" in value:
        raise BadRequest("spec must not carry job_id; each enqueue names its job "
                         "<template id>-<YYYYMMDDHHMMSS> or takes the request's job_id")
    return json.dumps(check_template(value))


def record(row: sqlite3.Row) -> dict[str, Any]:
    spec = json.loads(row["spec"])
    return {"id": row["id"], "name": row["name"], "workload": spec.get("workload"),
            "executor": spec.get("executor"), "spec": spec,
            "created_at": iso(row["created_at"]), "updated_at": iso(row["updated_at"])}


def _row(conn: sqlite3.Connection, template_id: str) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM job_templates WHERE id = ?", (template_id,)).fetchone()
    if row is None:
        raise NotFound(f"no job template {template_id!r}")
    return row


def _refuse_unknown(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequest(f"{unknown[0][:60]} is not a template field; send "
                         f"{', '.join(allowed)}")


def put(conn: sqlite3.Connection, body: dict[str, Any], now: float, effects: Effects
        ) -> tuple[bool, dict[str, Any]]:
    """Save a template under its id: a new one, or a new name and spec for an existing one (the
    enqueue form's "save as template"). Returns whether it was created, and the record."""
    _refuse_unknown(body, FIELDS)
    template_id = check_id(body.get("id"))
    name = check_name(body.get("name"))
    if "spec" not in body:
        raise BadRequest("spec is required: the job spec to save, without job_id")
    spec = check_job_spec(body["spec"])
    created = conn.execute("SELECT 1 FROM job_templates WHERE id = ?",
                           (template_id,)).fetchone() is None
    if created:
        held = conn.execute("SELECT COUNT(*) FROM job_templates").fetchone()[0]
        if held >= MAX_TEMPLATES:
            raise Conflict(f"this collector already keeps {held} job templates, the most it "
                           f"keeps is {MAX_TEMPLATES}; delete one it no longer needs (DELETE "
                           "/api/templates/{id}) before saving another")
    conn.execute(
        "INSERT INTO job_templates (id, name, spec, created_at, updated_at) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET name = excluded.name, "
        "spec = excluded.spec, updated_at = excluded.updated_at",
        (template_id, name, spec, now, now))
    effects.emit("template", template_id=template_id,
                 action="created" if created else "updated")
    return created, record(_row(conn, template_id))


def update(conn: sqlite3.Connection, template_id: str, changes: dict[str, Any], now: float,
           effects: Effects) -> dict[str, Any]:
    """Change a template's name or spec; refusals change nothing."""
    _refuse_unknown(changes, EDITABLE)
    if not changes:
        raise BadRequest("nothing to change: send name or spec")
    row = _row(conn, template_id)
    name = check_name(changes["name"]) if "name" in changes else row["name"]
    spec = check_job_spec(changes["spec"]) if "spec" in changes else row["spec"]
    conn.execute("UPDATE job_templates SET name = ?, spec = ?, updated_at = ? WHERE id = ?",
                 (name, spec, now, template_id))
    effects.emit("template", template_id=template_id, action="updated")
    return record(_row(conn, template_id))


def delete(conn: sqlite3.Connection, template_id: str, effects: Effects) -> dict[str, Any]:
    """Forget a template; the jobs enqueued from it stay, with template_id set to its id."""
    _row(conn, template_id)
    conn.execute("DELETE FROM job_templates WHERE id = ?", (template_id,))
    effects.emit("template", template_id=template_id, action="deleted")
    return {"ok": True, "id": template_id, "deleted": True}


def enqueue(conn: sqlite3.Connection, template_id: str, body: dict[str, Any], now: float,
            effects: Effects, *, prepared: queue.Prepared | None = None,
            bounded: bool = False) -> dict[str, Any]:
    """Enqueue one job from the template, as POST /jobs would enqueue its spec (`prepared` and
    `bounded` as queue.enqueue takes them)."""
    _refuse_unknown(body, ("job_id",))
    row = _row(conn, template_id)
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%d%H%M%S")
    job_id = body["job_id"] if "job_id" in body else _free_job_id(conn, f"{template_id}-{stamp}")
    spec = check_spec({**json.loads(row["spec"]), "job_id": job_id})
    queue.refuse_lone_surrogates(spec, f"job template {template_id}",
                                 "replace its spec (PATCH the template)")
    enqueued = queue.enqueue(conn, [spec], now, effects, template_id=template_id,
                             prepared=prepared, bounded=bounded)
    return {"ok": True, "template_id": template_id, **enqueued.replies[0]}


async def prepare(db: Database, template_id: str, now: float) -> queue.Prepared | None:
    """What enqueue reads of the registry for the template's spec, read off the event loop's
    thread when its transaction found it more than it may read (schedules.prepare_stored)."""
    return await prepare_stored(db, "SELECT spec FROM job_templates WHERE id = ?", template_id,
                                now)


def _free_job_id(conn: sqlite3.Connection, base: str) -> str:
    """`base` (the template and the second), or `base-2`, `base-3`, ... when taken: a template
    enqueued twice within a second (a double click, two scripts) makes two jobs, where the
    second was refused with a 409 naming a job id the caller never chose."""
    for n in range(1, 1000):
        job_id = base if n == 1 else f"{base}-{n}"
        if conn.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone() is None:
            return job_id
    raise Conflict(f"a thousand jobs named {base}[-N] exist already; try again next second")


async def listing_body(db: Database) -> bytes:
    """Every template, as an encoded JSON answer (jsonio.dumps_body) made on a worker thread,
    as schedules' listings are (schedules.LISTINGS_AT_ONCE)."""
    def encoded(conn: sqlite3.Connection) -> bytes:
        return jsonio.dumps_listing((record(row) for row in conn.execute(
            "SELECT * FROM job_templates ORDER BY id")), "templates")

    async with db.slots("automation listings", LISTINGS_AT_ONCE):
        return await db.read_in_thread(encoded, named=True)


async def get_template(db: Database, template_id: str) -> dict[str, Any]:
    row = await db.read_one("SELECT * FROM job_templates WHERE id = ?", (template_id,))
    if row is None:
        raise NotFound(f"no job template {template_id!r}")
    return record(row)
