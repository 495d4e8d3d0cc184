"""The device registry: registration (upsert), the device view match expressions read, edits.

Transaction functions take a sqlite3 connection as their first argument and an Effects last, and
run inside the writer's open transaction on the event loop's thread (see fleet_min.db).
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from fleet_min import jsonio, validate
from fleet_min.collector.jobs import authority, room, rules
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import Executor
from fleet_min.errors import BadRequest, Conflict, NotFound, TooLarge
from fleet_min.netkind import kind_of
from fleet_min.timeutil import iso


class Device:
    """A registered device as the claim rules read it.

    Every claim loads its device, and most claims need neither its descriptor (read only by a
    match expression) nor its last beacon (read only by constraints): those two are parsed from
    their stored JSON the first time they are read.
    """

    __slots__ = ("_beacon", "_beacon_text", "_descriptor", "_descriptor_text", "_fingerprint",
                 "busy_at", "busy_job_id", "capabilities", "device_id", "holding",
                 "last_beacon_at", "last_seen", "lock_holder", "mesh_node", "pools")

    def __init__(self, row: sqlite3.Row, lock_holder: object,
                 holding: object = None) -> None:
        override = _loads(row["pools_override"], None)
        self.device_id: str = row["device_id"]
        self.pools: list[str] = (override if override is not None  # the operator's, when set
                                 else _loads(row["pools"], []))
        self.capabilities: list[str] | None = _loads(row["capabilities"], None)
        self.last_seen: float = row["last_seen"]
        self.last_beacon_at: float | None = row["last_beacon_at"]
        self.busy_job_id: str | None = row["busy_job_id"]
        self.busy_at: float | None = row["busy_at"]
        self.mesh_node: str | None = row["mesh_node"]  # the mesh node that registered it
        # The job holding the device's lock (None: unlocked), when it was read with the row;
        # NOT_READ when it was not.
        self.lock_holder = lock_holder
        # A device job it holds claimed (None: none), read with the row; or NOT_READ.
        self.holding = holding
        self._descriptor_text: str | None = row["descriptor"]
        self._descriptor: dict[str, Any] | None = None
        self._beacon_text: str | None = row["last_beacon"]
        self._beacon: dict[str, Any] | None = None
        self._fingerprint: int | None = None

    @property
    def descriptor(self) -> dict[str, Any]:
        if self._descriptor is None:
            self._descriptor = _loads(self._descriptor_text, {})
        return self._descriptor

    @property
    def last_beacon(self) -> dict[str, Any] | None:
        if self._beacon is None and self._beacon_text:
            self._beacon = _loads(self._beacon_text, None)
        return self._beacon

    @property
    def fingerprint(self) -> int:
        """The device as view() shows it, as a number: a registration that changes what a
        match expression reads changes it (verdicts.py keeps verdicts by it)."""
        if self._fingerprint is None:
            # The lists as tuples of their strings, not as their repr: a repr copies and escapes
            # every character (60 KB for a device registered at its limits), which was half the
            # cost of judging such a device. None (no opinion) stays apart from () (nothing).
            # Both lists hold strings only: registration checks them, and so does a restore's
            # row check (row_check: json:strings), so their tuples always hash.
            capabilities = None if self.capabilities is None else tuple(self.capabilities)
            self._fingerprint = hash((self.device_id, self._descriptor_text, tuple(self.pools),
                                      capabilities))
        return self._fingerprint

    def view(self) -> dict[str, Any]:
        """What a match expression reads: descriptor fields plus id, pools and capabilities."""
        view = dict(self.descriptor)
        view["device_id"] = self.device_id
        view["pools"] = self.pools
        view["capabilities"] = self.capabilities
        return view


NOT_READ = object()  # Device.lock_holder of a device loaded without its lock


def _loads(text: str | None, default: Any) -> Any:
    return jsonio.loads_stored(text) if text else default


def device_from_row(row: sqlite3.Row) -> Device:
    return Device(row, NOT_READ, NOT_READ)


def device_with_fields(row: sqlite3.Row, fields: tuple[str, ...]) -> Device:
    """A device whose row's `descriptor` holds only the values of `fields`, as a JSON array in
    their order (queue.targets_query): its descriptor is those fields alone (null or missing
    alike are None, as a match expression reads them), and its fingerprint covers exactly
    what was read."""
    device = Device(row, NOT_READ, NOT_READ)
    values = _loads(row["descriptor"], None)
    device._descriptor = (dict(zip(fields, values, strict=True))
                          if isinstance(values, list) and len(values) == len(fields) else {})
    return device


# The columns a Device reads, and the holder of the device's lock. Every claim loads its device:
# naming them rather than SELECT * skips building the strings of the others (6 against 10 us a
# load, measured), and the lock comes along so the claim rules need not ask for it again.
_DEVICE_COLUMNS = ("d.device_id, d.descriptor, d.pools, d.pools_override, d.capabilities, "
                   "d.last_seen, d.last_beacon, d.last_beacon_at, d.busy_job_id, d.busy_at, "
                   "d.mesh_node")


def load_device(conn: sqlite3.Connection, device_id: str) -> Device | None:
    # The claimed job it holds comes along too: a device is offered one job at a time, and
    # asking in the same statement spares every claim a statement of its own.
    row = conn.execute(f"SELECT {_DEVICE_COLUMNS}, l.job_id AS lock_holder, "
                       "(SELECT j.job_id FROM jobs j WHERE j.status = 'claimed' "
                       "AND j.claimed_by = d.device_id AND j.executor = 'device' LIMIT 1) "
                       "AS holding FROM devices d "
                       "LEFT JOIN device_locks l ON l.device_id = d.device_id "
                       "WHERE d.device_id = ?", (device_id,)).fetchone()
    return Device(row, row["lock_holder"], row["holding"]) if row else None


def register(conn: sqlite3.Connection, body: dict[str, Any], now: float, address: str | None,
             effects: Effects, caller: str | None = None,
             max_devices: int | None = None) -> dict[str, Any]:
    """Upsert a device from a validated registration body; returns the reply of decisions.md.
    A poll the device holds waiting looks again (its capabilities may have changed).

    `caller` is the mesh node the registration came from (None off the mesh or without
    FLEET_MESH_ALLOW): a device first registered from the mesh remembers that node, and another
    mesh node may not register it again (fleet_min.collector.jobs.authority).

    `max_devices` (FLEET_MAX_DEVICES) bounds the registry: a device already registered may
    always register again; a new one takes the place of the temporary device that left the
    shelf longest ago when the registry is full, and is refused when none has left it.
    """
    device_id = body["device_id"]
    existing = conn.execute(
        "SELECT capabilities, pools_override, mesh_node FROM devices WHERE device_id = ?",
        (device_id,)).fetchone()
    if caller is not None and existing is not None:
        authority.check_device_node(device_id, existing["mesh_node"], caller)
    if existing is None and max_devices is not None:
        _make_room(conn, max_devices, now, effects)
    descriptor: dict[str, Any] = dict(body.get("descriptor") or {})
    if not descriptor.get("platform"):
        descriptor["platform"] = rules.infer_platform(descriptor.get("os"))
    stored_descriptor = json.dumps(descriptor)
    if len(stored_descriptor) > rules.MAX_DESCRIPTOR_BYTES:
        raise TooLarge(f"the descriptor is {len(stored_descriptor):,} bytes of JSON; a collector "
                       f"keeps descriptors of at most {rules.MAX_DESCRIPTOR_BYTES:,}")
    # Omitted at first registration: no opinion (NULL). Omitted later: keep the list.
    capabilities: str | None
    if "capabilities" in body:
        capabilities = json.dumps(sorted(set(body["capabilities"])))
    else:
        capabilities = existing["capabilities"] if existing else None
    pools = json.dumps(list(dict.fromkeys(body.get("pools") or [])))
    conn.execute(
        """
        INSERT INTO devices (device_id, descriptor, platform, kind, pools, capabilities, ttl_s,
                             first_seen, last_seen, registered_at, address, mesh_node)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
        ON CONFLICT (device_id) DO UPDATE SET
            descriptor = excluded.descriptor, platform = excluded.platform,
            kind = excluded.kind, pools = excluded.pools, capabilities = excluded.capabilities,
            ttl_s = excluded.ttl_s, last_seen = excluded.last_seen,
            registered_at = excluded.registered_at, address = excluded.address,
            mesh_node = COALESCE(devices.mesh_node, excluded.mesh_node)
        """,
        (device_id, stored_descriptor, descriptor.get("platform"), descriptor.get("kind"),
         pools, capabilities, body.get("ttl_s"), now, now, now, address, caller),
    )
    device = load_device(conn, device_id)
    assert device is not None
    effects.emit("device", device_id=device_id)
    effects.claimant_changed(Executor.DEVICE, device_id)
    return {"ok": True, "device_id": device_id, "capabilities": device.capabilities,
            "pools": device.pools}


# A browser runner's tab is a new device each session: such devices come and go for good, so
# the temporary ones long gone (silent past their own TTL, holding no lock) give way rather than
# the registry filling up over months.
_DEVICES = room.BoundedTable(
    "devices", "device_id",
    "SELECT device_id FROM devices d WHERE ttl_s IS NOT NULL AND last_seen + ttl_s < ? "
    "AND NOT EXISTS (SELECT 1 FROM device_locks l WHERE l.device_id = d.device_id) "
    "ORDER BY last_seen + ttl_s LIMIT ?")


def _make_room(conn: sqlite3.Connection, max_devices: int, now: float, effects: Effects) -> None:
    """Before a new device is stored: forget expired temporary devices until the registry has
    room for one more, or refuse.

    Without a bound, anyone who can reach the port could register devices until every listing
    of them (the dashboard reloads it every few seconds) took gigabytes; with it, a flood can
    at worst keep new devices out, which the refusal's sentence tells the operator how to end.
    """
    def refusal(count: int) -> str:
        return (f"this collector's registry holds {count:,} devices, the most "
                f"FLEET_MAX_DEVICES allows ({max_devices:,}), and none is a temporary device "
                "that has left the shelf; forget devices that are gone (DELETE "
                "/api/devices/{id}, or the dashboard's Devices page) or raise FLEET_MAX_DEVICES")

    for device_id in room.make_room(conn, _DEVICES, max_devices, (now,), refusal):
        effects.emit("device", device_id=device_id, forgotten=True)


# A second's precision is plenty for minute-scale statuses, and not rewriting a fresh value
# keeps a busy agent's requests from dirtying the page each time.
TOUCH_EVERY_S = 1.0


def touch(conn: sqlite3.Connection, device_id: str, now: float) -> None:
    """Mark a device seen (when it was last marked more than TOUCH_EVERY_S ago)."""
    conn.execute("UPDATE devices SET last_seen = ? WHERE device_id = ? AND last_seen < ?",
                 (now, device_id, now - TOUCH_EVERY_S))


def touch_due(last_seen: float | None, now: float) -> bool:
    """Would touch change anything, given the device's last_seen (None: no such device)? Lets
    a transaction that already read the device skip the statement."""
    return last_seen is not None and last_seen < now - TOUCH_EVERY_S


def device_record(row: sqlite3.Row, now: float) -> dict[str, Any]:
    """The API shape of one device."""
    device = device_from_row(row)
    beacon = device.last_beacon
    return {
        "device_id": device.device_id,
        "name": row["name"],
        "notes": row["notes"],
        "descriptor": device.descriptor,
        "platform": row["platform"],
        "kind": row["kind"],
        "simulator": rules.is_simulator(device.device_id, device.descriptor),
        "pools": device.pools,
        "reported_pools": _loads(row["pools"], []),
        "pools_reported": _loads(row["pools"], []),  # the original's name for the same list
        "pools_override": _loads(row["pools_override"], None),
        "capabilities": device.capabilities,
        "status": rules.device_status(device.last_seen, now),
        "temporary": row["ttl_s"] is not None,
        "ttl_s": row["ttl_s"],
        "expired": rules.is_expired(row["ttl_s"], device.last_seen, now),
        "first_seen": iso(row["first_seen"]),
        "last_seen": iso(device.last_seen),
        "last_seen_age_s": round(max(0.0, now - device.last_seen), 3),
        "last_beacon": beacon,
        "last_beacon_at": iso(device.last_beacon_at),
        # The original's clients read the last beacon as `beacon` (an alias, docs/api.md).
        "beacon": beacon,
        "busy": ({"job_id": row["busy_job_id"], "collector": row["busy_collector"],
                  "at": iso(row["busy_at"])} if row["busy_job_id"] else None),
        "address": row["address"],
        # The network the registration came from, as the original names it (lan, mesh, ...).
        "last_net": kind_of(row["address"]) if row["address"] else None,
    }



EDITABLE = ("name", "notes", "pools")


def edit(conn: sqlite3.Connection, device_id: str, changes: dict[str, Any], effects: Effects
         ) -> None:
    """Operator edits: name, notes and the pools override (null clears the override). A poll
    the device holds waiting looks again (its pools may now match)."""
    unknown = sorted(set(changes) - set(EDITABLE))
    if unknown:
        raise BadRequest(f"{unknown[0]} cannot be edited; editable fields are name, notes, pools")
    if not changes:
        raise BadRequest("nothing to change: send name, notes or pools")
    for key, fits in (("name", validate.is_label), ("notes", validate.is_note)):
        if key in changes and changes[key] is not None and (
                not isinstance(changes[key], str) or len(changes[key]) > 2000
                or not fits(changes[key])):
            raise BadRequest(f"{key} must be a string of at most 2000 characters "
                             f"({validate.LABEL_WORDS}"
                             f"{', lines and tabs aside' if key == 'notes' else ''}), or null")
    pools = changes.get("pools")
    if pools is not None and (not isinstance(pools, list) or len(pools) > 64 or not all(
            isinstance(p, str) and 0 < len(p) <= 100 and validate.is_label(p) for p in pools)):
        raise BadRequest("pools must be a list of at most 64 non-empty strings "
                         f"({validate.LABEL_WORDS}), or null to return to the pools the device "
                         "reports")
    if conn.execute("SELECT 1 FROM devices WHERE device_id = ?", (device_id,)).fetchone() is None:
        raise NotFound(f"no device {device_id!r}")
    for key, value in changes.items():
        column = "pools_override" if key == "pools" else key
        stored = json.dumps(list(dict.fromkeys(value))) if key == "pools" and value is not None \
            else value
        conn.execute(f"UPDATE devices SET {column} = ? WHERE device_id = ?",
                     (stored, device_id))
    effects.emit("device", device_id=device_id)
    effects.claimant_changed(Executor.DEVICE, device_id)


MAX_FORGET_LISTED = 1000  # ids one request may name; `silent_for_s` reaches any number
FORGET_EVENT_IDS = 100  # ids one bulk forget's event names (the dashboard reloads on it)


def check_forget_many(body: dict[str, Any]) -> tuple[list[str] | None, float | None]:
    """A bulk forget's body: `device_ids` (a list), or `silent_for_s` (every device not seen
    for that long, an hour at least), not both; BadRequest with a sentence otherwise."""
    if set(body) - {"device_ids", "silent_for_s"} or len(body) != 1:
        raise BadRequest('name the devices to forget: {"device_ids": [...]} (at most '
                         f'{MAX_FORGET_LISTED:,}), or {{"silent_for_s": <seconds>}} for every '
                         "device not seen for that long (3600 at least)")
    ids = body.get("device_ids")
    if "device_ids" in body:
        if (not isinstance(ids, list) or not 1 <= len(ids) <= MAX_FORGET_LISTED
                or not all(isinstance(i, str) and i for i in ids)):
            raise BadRequest(f"device_ids must be a list of 1 to {MAX_FORGET_LISTED:,} device "
                             "ids")
        return list(dict.fromkeys(ids)), None
    silent = body.get("silent_for_s")
    if (not isinstance(silent, int | float) or isinstance(silent, bool)
            or not 3600 <= silent <= 10 * 365 * 86400):
        raise BadRequest("silent_for_s must be a number of seconds from 3600 (an hour) to ten "
                         "years: devices not seen for that long are forgotten")
    return None, float(silent)


def forget_many(conn: sqlite3.Connection, device_ids: list[str] | None,
                silent_for_s: float | None, now: float, effects: Effects) -> dict[str, Any]:
    """Forget the devices named, or every device silent for `silent_for_s`: what forget() does
    one at a time, for a shelf cleared out or a registry filled by a flood. A device a running
    job holds locked is kept, and the reply says so; ids not registered are listed as unknown.
    """
    locked_sql = "SELECT job_id FROM device_locks l WHERE l.device_id = d.device_id"
    if device_ids is not None:
        marks = ",".join("?" * len(device_ids))
        rows = conn.execute(f"SELECT device_id, ({locked_sql}) AS lock FROM devices d "
                            f"WHERE device_id IN ({marks})", device_ids).fetchall()
    else:
        assert silent_for_s is not None
        rows = conn.execute(f"SELECT device_id, ({locked_sql}) AS lock FROM devices d "
                            "WHERE last_seen < ? ORDER BY last_seen", (now - silent_for_s,)
                            ).fetchall()
    gone = [row["device_id"] for row in rows if row["lock"] is None]
    conn.executemany("DELETE FROM devices WHERE device_id = ?", [(d,) for d in gone])
    if gone:
        effects.emit("device", device_id=None, forgotten=True, count=len(gone),
                     device_ids=gone[:FORGET_EVENT_IDS])
    found = {row["device_id"] for row in rows}
    return {"ok": True, "forgotten": gone,
            "kept": [{"device_id": row["device_id"], "locked_by": row["lock"]}
                     for row in rows if row["lock"] is not None],
            "unknown": [d for d in device_ids or () if d not in found]}


def forget(conn: sqlite3.Connection, device_id: str, effects: Effects) -> None:
    """Forget a device; its results and beacon history stay (they belong to jobs). A device a
    running job holds locked is refused: the job is using it."""
    if conn.execute("SELECT 1 FROM devices WHERE device_id = ?", (device_id,)).fetchone() is None:
        raise NotFound(f"no device {device_id!r}")
    lock = conn.execute("SELECT job_id FROM device_locks WHERE device_id = ?",
                        (device_id,)).fetchone()
    if lock is not None:
        raise Conflict(f"device {device_id!r} is locked by job {lock[0]}, which is using it; "
                       "cancel that job or wait until it ends, then forget the device")
    conn.execute("DELETE FROM devices WHERE device_id = ?", (device_id,))
    effects.emit("device", device_id=device_id, forgotten=True)
