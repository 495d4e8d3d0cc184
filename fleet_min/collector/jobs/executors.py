"""Host executors as the collector knows them: each name that registered
(POST /executors/register: what it runs, its slots, its agent) or polled /executor/next-job
(when it last did, and how many jobs it said it may hold, `?slots=`). A fan-out over executors
reaches those seen recently (queue.fanout_executors); the claim rules read what each declared.

Declared capabilities follow the devices' rule: omitted at the first registration, no opinion
(NULL: offered every host job); omitted at a later one, the previous list is kept; an empty list,
nothing. An executor that only polls never declares anything.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fleet_min import validate
from fleet_min.collector.jobs import authority, room, rules
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import Executor
from fleet_min.errors import BadRequest, Conflict, NotFound

# A second's precision is plenty for a 15-minute horizon; an executor polling in a tight loop
# does not rewrite its row every time.
SEEN_EVERY_S = 1.0
MAX_NAME = 200
# Host executors a collector keeps: a lab has a few hosts, a large one some dozens. Any name a
# poll gives is stored, so without a bound a client could add rows for ever, and every listing
# and every host job's enqueue reads them all.
MAX_EXECUTORS = 1000
MAX_CAPABILITIES = 100
MAX_CAPABILITY_CHARS = 200


@dataclass(frozen=True)
class Registration:
    """A checked POST /executors/register body. capabilities None: the key was omitted."""

    name: str
    capabilities: list[str] | None
    slots: int | None
    agent: str | None


def check_name(name: Any) -> str:
    """An executor's name as given at registration or in a poll's ?name=; BadRequest else.

    Jobs are targeted at an executor by its exact name, and people pick it from listings: a
    name with a control, zero-width or direction-changing character, or spaces at its ends,
    would list as a twin of another executor's that no operator could tell apart."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        raise BadRequest(f"name is required: the executor's label (1 to {MAX_NAME} characters), "
                         "the same name it polls /executor/next-job with, e.g. mac-mini")
    if not name.isprintable() or name != name.strip():
        raise BadRequest("the executor's name may hold no control, invisible or "
                         "direction-changing character and no space at either end: "
                         f"{json.dumps(name[:60])}")
    return name


def check_registration(body: dict[str, Any]) -> Registration:
    """A registration body as the queue stores it; BadRequest with a sentence otherwise."""
    name = check_name(body.get("name"))
    capabilities = body.get("capabilities")
    if "capabilities" in body and not _is_capability_list(capabilities):
        raise BadRequest(f"capabilities must be a list of at most {MAX_CAPABILITIES} non-empty "
                         f"strings ({validate.LABEL_WORDS}), e.g. [\"web-test\", "
                         "\"ui-test:flow_runner\"]")
    slots = body.get("slots")
    if "slots" in body and (not isinstance(slots, int) or isinstance(slots, bool)
                            or not 1 <= slots <= rules.MAX_SLOTS):
        raise BadRequest(f"slots must be an integer from 1 to {rules.MAX_SLOTS}: the jobs the "
                         "executor may hold at once")
    agent = body.get("agent")
    if "agent" in body and (not isinstance(agent, str) or len(agent) > MAX_NAME
                            or not validate.keeps_order(agent)):
        raise BadRequest(f"agent must be a string of at most {MAX_NAME} characters (none that "
                         "reorder the text after them), e.g. \"fleet_agent 0.9.0\"")
    declared = sorted(set(capabilities)) if isinstance(capabilities, list) else None
    return Registration(name, declared, slots, agent)


def _is_capability_list(value: Any) -> bool:
    return (isinstance(value, list) and len(value) <= MAX_CAPABILITIES
            and all(isinstance(cap, str) and 1 <= len(cap) <= MAX_CAPABILITY_CHARS
                    and validate.is_label(cap) for cap in value))


GONE_AFTER_S = 86400.0  # an executor silent this long gives way to a new name when full


# Silent for GONE_AFTER_S at least and holding no claimed job, the one silent longest first.
_EXECUTORS = room.BoundedTable(
    "executors", "name",
    "SELECT name FROM executors e WHERE max(first_seen, COALESCE(last_poll, 0), "
    "COALESCE(registered_at, 0)) < ? "
    "AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.status = 'claimed' AND j.executor = ? "
    "AND j.claimed_by = e.name) ORDER BY max(first_seen, COALESCE(last_poll, 0), "
    "COALESCE(registered_at, 0)) LIMIT ?")

# What a claim for a host executor reads: its declared capabilities (None: no opinion) and slots.
ClaimView = tuple[list[str] | None, int]


def admit(conn: sqlite3.Connection, name: str, now: float) -> ClaimView | None:
    """Before a registration or a poll stores an executor's name: a known name's claim view as
    stored, or None for a new name. A new name, when the collector keeps MAX_EXECUTORS already,
    takes the place of the executor silent longest (for GONE_AFTER_S at least, holding no
    claimed job), or is refused (507, nothing stored)."""
    row = conn.execute("SELECT capabilities, slots FROM executors WHERE name = ?",
                       (name,)).fetchone()
    if row is not None:
        return decoded(row[0]), int(row[1])

    def refusal(count: int) -> str:
        return (f"this collector keeps {count:,} host executors, the most it keeps "
                f"({MAX_EXECUTORS:,}), and none has been silent for a day to give way to "
                f"the new name {name[:80]!r}")

    room.make_room(conn, _EXECUTORS, MAX_EXECUTORS, (now - GONE_AFTER_S, Executor.HOST),
                   refusal)
    return None


def view_after_poll(stored: ClaimView | None, slots: int) -> ClaimView:
    """The claim view once seen() has recorded a poll, from the view admit() read before it:
    the poll's `?slots=` replaces the stored slots when it says one (above 0), and a new name
    starts with none declared and one slot, as seen() stores it."""
    capabilities, stored_slots = stored if stored is not None else (None, 1)
    return capabilities, slots if slots > 0 else stored_slots


def register(conn: sqlite3.Connection, reg: Registration, now: float, effects: Effects,
             caller: str | None = None) -> dict[str, Any]:
    """Upsert an executor's registration. `caller` (the mesh node it came from, None off the
    mesh) is held to the executor name's binding, as its polls are. A poll it holds waiting
    looks again: what it may take may have changed."""
    admit(conn, reg.name, now)
    if caller is not None:
        authority.bind_executor(conn, reg.name, caller, now)
    capabilities = json.dumps(reg.capabilities) if reg.capabilities is not None else None
    conn.execute(
        "INSERT INTO executors (name, first_seen, last_poll, slots, capabilities, agent, "
        "registered_at) VALUES (?, ?, NULL, ?, ?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET slots = COALESCE(?, executors.slots), "
        "capabilities = COALESCE(excluded.capabilities, executors.capabilities), "
        "agent = COALESCE(excluded.agent, executors.agent), "
        "registered_at = excluded.registered_at",
        (reg.name, now, reg.slots or 1, capabilities, reg.agent, now, reg.slots))
    effects.emit("executor", name=reg.name)
    effects.claimant_changed(Executor.HOST, reg.name)
    capabilities_now, slots = claim_view(conn, reg.name)
    return {"ok": True, "name": reg.name, "capabilities": capabilities_now, "slots": slots}


def forget(conn: sqlite3.Connection, name: str, polling: bool, now: float,
           effects: Effects) -> None:
    """Forget an executor the operator knows is gone: its row, so listings and host fan-outs
    no longer name it. Its jobs and results stay, and so does a mesh node's hold on the name
    (authority's executor_nodes), so forgetting does not hand the name to another node.

    Only an executor that is offline may go (silent OFFLINE_AFTER_S, no poll waiting, holding
    no claimed job): a live one's next poll would be a new name's, with no declared
    capabilities, offered every host job until its agent registers again."""
    row = conn.execute("SELECT first_seen, last_poll, registered_at FROM executors "
                       "WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise NotFound(f"no host executor {name[:80]!r}")
    held = conn.execute("SELECT job_id FROM jobs WHERE status = 'claimed' AND executor = ? "
                        "AND claimed_by = ? LIMIT 1", (Executor.HOST, name)).fetchone()
    if held is not None:
        raise Conflict(f"host executor {name[:80]!r} holds job {held[0]}, which is running "
                       "there; cancel that job or wait until it ends, then forget the executor")
    silent_s = now - last_seen(row)
    if polling or silent_s < OFFLINE_AFTER_S:
        waits = " and a poll of its waits now" if polling else ""
        raise Conflict(f"host executor {name[:80]!r} is not gone: it was heard "
                       f"{max(0, round(silent_s))} s ago{waits}; "
                       "stop its agent, then forget it once it has been silent "
                       f"{OFFLINE_AFTER_S / 60:g} minutes (a live executor forgotten would "
                       "poll on as a new name, offered every host job)")
    conn.execute("DELETE FROM executors WHERE name = ?", (name,))
    effects.emit("executor", name=name, forgotten=True)


def seen(conn: sqlite3.Connection, name: str, slots: int, now: float) -> None:
    """Record a poll by this executor (a statement of the poll's own transaction). `slots` is
    its `?slots=` (0: the poll did not say, the stored value stands); the last one said, by a
    poll or a registration, wins."""
    said = slots > 0
    conn.execute(
        "INSERT INTO executors (name, first_seen, last_poll, slots) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET last_poll = excluded.last_poll, "
        "slots = CASE WHEN ? THEN excluded.slots ELSE executors.slots END "
        "WHERE executors.last_poll IS NULL OR executors.last_poll < excluded.last_poll - ? "
        "OR (? AND executors.slots != excluded.slots)",
        (name, now, now, slots if said else 1, said, SEEN_EVERY_S, said))


def claim_view(conn: sqlite3.Connection, name: str) -> ClaimView:
    """What a claim for the executor reads: its declared capabilities and its slots, in one
    read by primary key (the JSON decoded once per distinct list)."""
    row = conn.execute("SELECT capabilities, slots FROM executors WHERE name = ?",
                       (name,)).fetchone()
    return (decoded(row[0]), int(row[1])) if row else (None, 1)


def decoded(text: str | None) -> list[str] | None:
    return list(_decoded(text)) if text is not None else None


@lru_cache(maxsize=256)
def _decoded(text: str) -> tuple[str, ...]:
    value = json.loads(text)
    return tuple(str(cap) for cap in value) if isinstance(value, list) else ()


# Executors that polled within EXECUTOR_RECENT_S, or hold a claimed host job now (a busy
# executor with one slot does not poll until its job is done), in name order, each with what
# it declared (NULL: no opinion). One parameter: the horizon (recent_since).
RECENT_SQL = ("SELECT r.name, e.capabilities FROM (SELECT name FROM executors "
              "WHERE last_poll >= ? UNION SELECT claimed_by FROM jobs "
              "WHERE status = 'claimed' AND executor = 'host') r "
              "LEFT JOIN executors e ON e.name = r.name ORDER BY r.name")


def recent_since(now: float) -> float:
    return now - rules.EXECUTOR_RECENT_S


def recent(conn: sqlite3.Connection, now: float) -> list[tuple[str, list[str] | None]]:
    return [(row[0], decoded(row[1]))
            for row in conn.execute(RECENT_SQL, (recent_since(now),))]


# -- the listing (GET /api/executors) -----------------------------------------------------------

POLL_ENDED_S = 60.0      # "polling": a poll waits now, or one ended this recently
OFFLINE_AFTER_S = 180.0  # "offline": no poll, registration or claimed job for this long

LIST_SQL = ("SELECT name, first_seen, last_poll, slots, capabilities, agent, registered_at "
            "FROM executors ORDER BY name")
# Claimed host jobs, by claimant (jobs_status_workload covers status).
HELD_SQL = ("SELECT claimed_by, job_id, workload FROM jobs WHERE status = 'claimed' "
            "AND executor = 'host' AND is_group = 0 ORDER BY claimed_at, seq")
# Registered devices whose descriptor names the executor they are attached to.
ATTACHED_SQL = ("SELECT device_id, last_seen, json_extract(descriptor, '$.attached_to') AS host "
                "FROM devices WHERE json_extract(descriptor, '$.attached_to') IS NOT NULL "
                "ORDER BY device_id")


def executor_status(row: Any, held: bool, waiting: bool, hold_s: float, now: float) -> str:
    """busy (holds a claimed job), polling (a poll waits, or one ended within POLL_ENDED_S),
    idle (seen within OFFLINE_AFTER_S, not polling), offline. A poll's end is not stored: it
    ended at most the long-poll hold after it began."""
    if held:
        return "busy"
    last_poll = row["last_poll"]
    if waiting or (last_poll is not None and now - last_poll < POLL_ENDED_S + hold_s):
        return "polling"
    if now - last_seen(row) < OFFLINE_AFTER_S:
        return "idle"
    return "offline"


def last_seen(row: Any) -> float:
    return float(max(v for v in (row["last_poll"], row["registered_at"], row["first_seen"])
                     if v is not None))
