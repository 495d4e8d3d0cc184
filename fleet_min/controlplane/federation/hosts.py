"""Federation, the coordinator's side: agent hosts, their reports and their command queues.

Agents call in (POST /api/host/heartbeat, POST /api/host/results); the coordinator never opens
a connection to an agent. A heartbeat stores the agent's report (its runners, capacity, vitals)
and is answered with the commands queued for it. An agent may ask to wait (`wait_s`): the reply
is then held until a command is queued for it or the wait ends, so a queued drain reaches the
agent at once rather than at its next heartbeat.

Order: each agent's commands are numbered 1, 2, 3 ... in one queue (its id is random, kept in
SQLite with the numbers; a new id restarts them). Every heartbeat says which queue and the last
number the agent has applied, and is answered with every unfinished command numbered after it,
in order. So a reply lost on a dead long poll costs nothing: the next heartbeat gets the same
commands again, and nothing queued later can overtake them (a drain then a resume never arrive
as resume, drain). The agent applies each number once, in order, and keeps the last one in its
own database (link.py), across restarts of either side.

One agent a name: an agent says which instance it is (link.instance_id) in every heartbeat
and result post, and a name whose agent was heard from within stale_after_s is refused (409) to
any other instance, for heartbeats and results alike. Two agents under one name (a cloned
image keeps its host name) would share one queue, and every command would run on both. An
agent that sends no instance (an older version) is not checked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import sqlite3
from collections.abc import Callable, Iterable
from typing import Any

from fleet_min.controlplane import store
from fleet_min.controlplane.labels import fit_labels
from fleet_min.controlplane.loops import wait_event
from fleet_min.controlplane.runners.discovery import valid_repo
from fleet_min.db import Database
from fleet_min.errors import BadRequest, Conflict
from fleet_min.logs import printable
from fleet_min.numbers import finite
from fleet_min.timeutil import iso
from fleet_min.validate import is_label

log = logging.getLogger(__name__)

HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# What an agent runs when the coordinator forwards it (runner actions on the agent's runners,
# and the health check there); an action the catalogue adds later is not sent until listed.
AGENT_ACTIONS = ("runner.duplicate", "runner.drain", "runner.resume", "runner.deregister",
                 "health.check")
QUEUE_ID = re.compile(r"[0-9a-f]{16,64}")
INSTANCE_ID = QUEUE_ID  # an agent's instance id (link.instance_id) has the same shape
MAX_SEQ = 2**53
FORGET_S = 7 * 86400.0  # an agent silent this long is dropped from the hosts list
MAX_WAIT_S = 30.0
MAX_RUNNERS = 500
# Agents' runners the coordinator keeps, all hosts together (stale ones too: every snapshot
# lists them): a fleet's worth. 100 names of 500 runners made each snapshot 18.7 MB.
MAX_REMOTE_RUNNERS = 2000
# Agent hosts the coordinator keeps: each holds up to a request body of report in memory and
# every snapshot lists its runners, so one holder of the agent token cannot make it unbounded.
MAX_HOSTS = 100
MAX_RESULTS = 200  # command results in one POST (the agent sends at most this many)
LOAD_AVERAGES = 3  # a report's `load`: over 1, 5 and 15 minutes, as an agent's vitals read them
# What the coordinator keeps of a report's capacity and vitals: the figures an agent's own
# (analysis/capacity.py, runners/vitals.py) carry, each a finite number or null. Anything else
# is dropped: these objects were kept as sent, and `{"busy": {"toString": null}}` made the
# Hosts screen throw on every render, for every host.
CAPACITY_FIGURES = ("ceiling", "runners", "busy", "idle", "headroom", "busy_headroom")
VITALS_FIGURES = ("cores", "mem_total_mb", "mem_available_mb", "swap_total_mb", "swap_used_mb",
                  "disk_free_gb", "disk_total_gb", "load_per_core", "uptime_s")
PRESSURE_FIGURES = ("some_avg10_pct", "some_avg60_pct", "pressure_pct")
# A capacity's `reasons` (why no runner fits there): an agent's own are a few short sentences.
MAX_REASONS = 10
REASON_CHARS = 300
UNMATCHED_WARN_S = 60.0  # a host posting results that settle nothing is logged this seldom
# A heartbeat reply carries the commands in order until their args pass this many bytes (the
# first always goes); the rest follow in the next replies, well under the agent's reply limit.
REPLY_BUDGET = 256 << 10
# ... and at most this many commands: each costs the agent a read and writes of its own, and
# an agent applied every command of a reply before its next heartbeat (a lying coordinator's
# 620,000 held an agent six minutes a reply). The agent takes no more than this of a reply.
COMMANDS_PER_REPLY = 200
RUNNER_FIELDS = ("name", "repo", "owner", "labels", "state", "busy", "draining", "version",
                  "registration", "registered")


def check_host(name: Any) -> str:
    if not isinstance(name, str) or not HOST_NAME.fullmatch(name):
        raise BadRequest("host must be the agent host's name (letters, digits, '.', '_', '-')")
    return name


def clean_report(body: dict[str, Any]) -> dict[str, Any]:
    """The parts of a heartbeat the coordinator keeps, with their types checked."""
    runners = body.get("runners", [])
    if not isinstance(runners, list) or len(runners) > MAX_RUNNERS:
        raise BadRequest(f"runners must be a list of at most {MAX_RUNNERS} runner objects")
    kept = []
    for runner in runners:
        if not isinstance(runner, dict) or not isinstance(runner.get("name"), str) \
                or not HOST_NAME.fullmatch(runner["name"]):
            raise BadRequest("each runner needs a name (letters, digits, '.', '_', '-')")
        kept.append(_clean_runner(runner))
    return {"runners": kept, **clean_figures(body)}


def clean_figures(report: dict[str, Any]) -> dict[str, Any]:
    """A report's capacity, vitals and load, as the coordinator keeps them: known figures only,
    each a finite number or null. Also applied to reports read back from the database, which
    an older version stored as they were sent."""
    return {"capacity": _capacity(report.get("capacity")),
            "vitals": _vitals(report.get("vitals")),
            "load": _load_averages(report.get("load"))}


def _capacity(sent: Any) -> dict[str, Any] | None:
    kept = _figures(sent, CAPACITY_FIGURES)
    if kept is not None:
        can_add = sent.get("can_add")
        kept["can_add"] = can_add if isinstance(can_add, bool) else None
        reasons = sent.get("reasons")
        # Cut again once escaped, so a report read back at start is kept as it was.
        kept["reasons"] = [printable(reason[:REASON_CHARS])[:REASON_CHARS]
                           for reason in reasons[:MAX_REASONS] if isinstance(reason, str)
                           ] if isinstance(reasons, list) else []
    return kept


def _vitals(sent: Any) -> dict[str, Any] | None:
    kept = _figures(sent, VITALS_FIGURES)
    if kept is not None:
        kept["load"] = _load_averages(sent.get("load"))
        kept["memory_pressure"] = _figures(sent.get("memory_pressure"), PRESSURE_FIGURES)
    return kept


def _figures(part: Any, names: tuple[str, ...]) -> dict[str, Any] | None:
    """`part`'s figures named in `names` (one missing or not a finite number is null); None
    when `part` is not an object or holds none of them."""
    if not isinstance(part, dict):
        return None
    kept = {name: _figure(part.get(name)) for name in names}
    return kept if any(value is not None for value in kept.values()) else None


def _figure(value: Any) -> int | float | None:
    """A finite number, an integer kept as one while a double holds it exactly."""
    number = finite(value)
    if number is None:
        return None
    return value if isinstance(value, int) and abs(value) < MAX_SEQ else number


def _load_averages(load: Any) -> list[float | None] | None:
    """The 1, 5 and 15 minute load averages as sent, or None: a list of any length was kept,
    and 100 host names sending a megabyte of numbers each took 700 MB and made one GET
    /api/hosts 105 MB."""
    if not isinstance(load, list) or len(load) > LOAD_AVERAGES:
        return None
    # finite() and not math.isfinite(): an integer of 400 digits is valid JSON, and
    # math.isfinite of it raises OverflowError instead of answering.
    averages = [None if x is None else finite(x) for x in load]
    if any(x is not None and number is None for x, number in zip(load, averages, strict=True)):
        return None
    return averages


def _clean_runner(runner: dict[str, Any]) -> dict[str, Any]:
    """An agent's runner with every field of the expected type (others become null): the
    coordinator acts on these (GitHub requests for their repositories), so nothing odd passes."""
    out: dict[str, Any] = {k: None for k in RUNNER_FIELDS}
    out["name"] = runner["name"]
    for key in ("owner", "state", "version", "registration"):
        value = runner.get(key)
        # A control character or a direction override would redraw the page that shows it.
        out[key] = value[:100] if isinstance(value, str) and is_label(value) else None
    repo = runner.get("repo")
    out["repo"] = repo if isinstance(repo, str) and valid_repo(repo) else None
    out["labels"] = fit_labels(runner.get("labels"))
    for key in ("busy", "draining"):
        out[key] = runner.get(key) is True
    out["registered"] = _registered(runner.get("registered"))
    return out


def _registered(value: Any) -> dict[str, Any] | None:
    """GitHub's registration of an agent's runner ({id, status, busy}), or null."""
    if not isinstance(value, dict):
        return None
    runner_id, status = value.get("id"), value.get("status")
    return {"id": runner_id if isinstance(runner_id, int) and not isinstance(runner_id, bool)
            and 0 <= runner_id < MAX_SEQ else None,
            "status": status[:20] if isinstance(status, str) else None,
            "busy": value.get("busy") is True}


def wait_of(body: dict[str, Any]) -> float:
    value = body.get("wait_s", 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 3600:
        raise BadRequest("wait_s must be a number of seconds from 0 to 3600")
    return min(float(value), MAX_WAIT_S)


def applied_of(body: dict[str, Any]) -> tuple[str | None, int]:
    """The queue id and last applied number an agent reports (none yet: (None, 0))."""
    queue, applied = body.get("queue"), body.get("applied", 0)
    if queue is not None and (not isinstance(queue, str) or not QUEUE_ID.fullmatch(queue)):
        raise BadRequest("queue must be the queue id a heartbeat reply gave (hex digits)")
    if isinstance(applied, bool) or not isinstance(applied, int) or not 0 <= applied < MAX_SEQ:
        raise BadRequest("applied must be the number of the last command applied (0 or more)")
    return queue, applied


def instance_of(body: dict[str, Any]) -> str | None:
    """The agent instance a heartbeat or result post names; None from an older agent."""
    instance = body.get("instance")
    if instance is not None and (not isinstance(instance, str)
                                 or not INSTANCE_ID.fullmatch(instance)):
        raise BadRequest("instance must be the agent's instance id (16 to 64 hex digits)")
    return instance


# --- database (transactions for Database.write) ----------------------------------------------

def _save_report(conn: sqlite3.Connection, host: str, report: dict[str, Any], at: float,
                 instance: str | None = None) -> None:
    conn.execute("INSERT INTO hosts (name, first_seen, last_seen, report, instance) "
                 "VALUES (?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
                 "last_seen = excluded.last_seen, report = excluded.report, "
                 "instance = coalesce(excluded.instance, hosts.instance)",
                 (host, at, at, json.dumps(report), instance))
    conn.execute("DELETE FROM hosts WHERE last_seen < ?", (at - FORGET_S,))
    conn.execute("DELETE FROM host_commands WHERE queued_at < ? AND (done_at IS NOT NULL OR "
                 "host NOT IN (SELECT name FROM hosts))", (at - FORGET_S,))
    # A forgotten host's numbering goes with it; it starts a new queue if it comes back.
    conn.execute("DELETE FROM host_queues WHERE host NOT IN (SELECT name FROM hosts) AND host "
                 "NOT IN (SELECT host FROM host_commands)")


def _host_queue(conn: sqlite3.Connection, host: str) -> tuple[str, int]:
    """The host's queue id and last number given, created on first use."""
    row = conn.execute("SELECT queue, last_seq FROM host_queues WHERE host = ?",
                       (host,)).fetchone()
    if row is not None:
        return row[0], row[1]
    queue = secrets.token_hex(8)
    conn.execute("INSERT INTO host_queues (host, queue) VALUES (?, ?)", (host, queue))
    return queue, 0


def _numbered(conn: sqlite3.Connection, host: str) -> tuple[str, int]:
    """The host's queue id and last number, after numbering the rows queued before numbering
    existed (seq NULL, from an older version), in the order they were queued."""
    queue, last = _host_queue(conn, host)
    legacy = conn.execute("SELECT rowid FROM host_commands WHERE host = ? AND seq IS NULL "
                          "ORDER BY queued_at, rowid", (host,)).fetchall()
    for (rowid,) in legacy:
        last += 1
        conn.execute("UPDATE host_commands SET seq = ? WHERE rowid = ?", (last, rowid))
    if legacy:
        conn.execute("UPDATE host_queues SET last_seq = ? WHERE host = ?", (last, host))
    return queue, last


def _take_commands(conn: sqlite3.Connection, host: str, reported: tuple[str | None, int],
                   at: float) -> tuple[str, list[dict[str, Any]]]:
    """The host's queue id and its unfinished commands numbered after what the agent applied."""
    queue, last = _numbered(conn, host)
    applied = reported[1] if reported[0] == queue else 0  # another queue's numbers: none here
    if applied > last:
        # The agent has applied numbers this database never gave (it was restored from an
        # older copy): go on after them, or the agent would skip the next ones as done.
        conn.execute("UPDATE host_queues SET last_seq = ? WHERE host = ?", (applied, host))
    conn.execute("UPDATE host_queues SET applied = max(applied, ?) WHERE host = ?",
                 (applied, host))
    rows = _page(conn.execute("SELECT id, seq, action, args FROM host_commands WHERE host = ? "
                              "AND done_at IS NULL AND seq > ? ORDER BY seq", (host, applied)))
    conn.executemany("UPDATE host_commands SET sent_at = ?, sends = sends + 1 WHERE id = ?",
                     [(at, row[0]) for row in rows])
    return queue, [{"id": row[0], "seq": row[1], "action": row[2], "args": json.loads(row[3])}
                   for row in rows]


def _page(rows: Iterable[tuple[str, int, str, str]]) -> list[tuple[str, int, str, str]]:
    """The first commands, in order, until their args pass REPLY_BUDGET bytes or they are
    COMMANDS_PER_REPLY."""
    page: list[tuple[str, int, str, str]] = []
    size = 0
    for row in rows:
        if page and (size + len(row[3]) > REPLY_BUDGET or len(page) >= COMMANDS_PER_REPLY):
            break
        page.append(row)
        size += len(row[3])
    return page


def _queue(conn: sqlite3.Connection, command_id: str, host: str, action: str,
           args: dict[str, Any], who: str, at: float) -> int:
    _, last = _numbered(conn, host)
    seq = last + 1
    conn.execute("UPDATE host_queues SET last_seq = ? WHERE host = ?", (seq, host))
    conn.execute("INSERT INTO host_commands (id, host, action, args, who, queued_at, seq) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (command_id, host, action, json.dumps(args), who, at, seq))
    return seq


def _results(conn: sqlite3.Connection, host: str, results: list[dict[str, Any]], who: str,
             at: float) -> int:
    """Settle the host's commands these results answer: only commands a heartbeat has handed
    it (one it was never sent cannot have run there) and not settled before. Each one settled
    is audited in the same transaction; a result that settles nothing changed nothing and is
    not, so a caller cannot write the operator's audit (which keeps a fixed number of rows) by
    posting ids of its own making."""
    done = 0
    for result in results:
        code = result.get("code")
        error = _text(result.get("error"), 500)
        settled = conn.execute(
            "UPDATE host_commands SET done_at = ?, ok = ?, error = ?, output = ?, code = ?, "
            "runner = ? WHERE id = ? AND host = ? AND sent_at IS NOT NULL AND done_at IS NULL",
            (at, int(result.get("ok") is True), error, _text(result.get("output"), 20000),
             code if isinstance(code, int) and not isinstance(code, bool)
             and abs(code) < MAX_SEQ else None,
             _text(result.get("runner"), 100), result["id"], host)).rowcount
        if settled:
            store.add_audit(conn, who, f"host.result:{host}", {"id": result["id"]},
                            result.get("ok") is True, None, 0, error)
        done += settled
    return done


def _fit(report: dict[str, Any], room: int) -> dict[str, Any]:
    """The report keeping at most `room` runners, the rest counted in `dropped`."""
    runners = report.get("runners", [])
    room = max(0, room)
    return {**report, "runners": runners[:room],
            "dropped": report.get("dropped", 0) + max(0, len(runners) - room)}


def _text(value: Any, limit: int) -> str | None:
    return None if value is None else str(value)[:limit]


class Hosts:
    """The coordinator's view of its agents."""

    def __init__(self, db: Database, clock: Callable[[], float]) -> None:
        self.db = db
        self.clock = clock
        self.reports: dict[str, dict[str, Any]] = {}
        self.received: dict[str, float] = {}
        self.instances: dict[str, str] = {}  # the agent instance last heard under each name
        # (kept in the hosts table too, so a restarted coordinator knows who holds a name)
        self._bells: dict[str, asyncio.Event] = {}
        self._unmatched_warned: dict[str, float] = {}  # when each host was last warned about
        self.closed = False

    async def load(self) -> None:
        room = MAX_REMOTE_RUNNERS  # the hosts heard from last keep their runners first
        for row in await self.db.read("SELECT name, last_seen, report, instance FROM hosts "
                                      "WHERE last_seen >= ? ORDER BY last_seen DESC",
                                      (self.clock() - FORGET_S,)):
            stored = json.loads(row["report"])
            report = _fit({**stored, **clean_figures(stored)}, room)
            room -= len(report["runners"])
            self.reports[row["name"]] = report
            self.received[row["name"]] = row["last_seen"]
            if row["instance"] is not None:
                self.instances[row["name"]] = row["instance"]

    def close(self) -> None:
        """Shutdown: every held heartbeat is answered now."""
        self.closed = True
        for bell in self._bells.values():
            bell.set()

    def _bell(self, host: str) -> asyncio.Event:
        return self._bells.setdefault(host, asyncio.Event())

    def check_instance(self, host: str, instance: str | None, hold_s: float) -> None:
        """Refuse (409) an agent instance calling under a name another instance has used
        within hold_s; the name passes to it once that one has been silent longer."""
        held = self.instances.get(host)
        if instance is None or held is None or held == instance or self.age(host) > hold_s:
            return
        raise Conflict(
            f"host name {host!r} is in use by another agent (heard {self.age(host):.0f} s ago); "
            "two agents under one name would both run its commands: give this one its own "
            f"FLEET_HOST_NAME (a restarted machine is let in once the old one has been silent "
            f"{hold_s:g} s)")

    def _forget(self, at: float) -> None:
        for gone in [h for h, seen in self.received.items() if seen < at - FORGET_S]:
            self.reports.pop(gone, None)
            self.received.pop(gone, None)
            self.instances.pop(gone, None)
            self._bells.pop(gone, None)
            self._unmatched_warned.pop(gone, None)

    def fit(self, host: str, report: dict[str, Any]) -> dict[str, Any]:
        """The report with as many of its runners as MAX_REMOTE_RUNNERS leaves room for beside
        the other hosts' (the first ones, in the agent's order); `dropped` counts the rest."""
        self._forget(self.clock())
        others = sum(len(r.get("runners", [])) for name, r in self.reports.items()
                     if name != host)
        return _fit(report, MAX_REMOTE_RUNNERS - others)

    def live_repos(self, stale_after_s: float) -> set[str]:
        """The repositories of the runners of hosts heard from within stale_after_s."""
        return {runner["repo"] for host, report in self.reports.items()
                if self.age(host) <= stale_after_s
                for runner in report.get("runners", []) if runner.get("repo")}

    async def heartbeat(self, host: str, report: dict[str, Any], wait_s: float,
                        applied: tuple[str | None, int] = (None, 0),
                        instance: str | None = None, hold_s: float = 0.0
                        ) -> tuple[str, list[dict[str, Any]]]:
        """Store the report; the host's queue id and the commands after `applied`, waiting up
        to wait_s for one when there are none. Refused when another instance holds the name
        (check_instance)."""
        at = self.clock()
        self._forget(at)
        self.check_instance(host, instance, hold_s)
        if host not in self.reports and len(self.reports) >= MAX_HOSTS:
            raise Conflict(f"this coordinator already follows {MAX_HOSTS} agent hosts, the most "
                           f"it keeps; {host} is refused until one has been silent for "
                           f"{FORGET_S / 86400:g} days")
        self.reports[host], self.received[host] = report, at
        if instance is not None:
            self.instances[host] = instance
        await self.db.write(_save_report, host, report, at, instance)
        bell = self._bell(host)
        # A heartbeat held for this host answers now: one agent sends one at a time, so an
        # older one is a dead connection's, or a flood's (each held request holds its memory).
        bell.set()
        bell.clear()
        queue, commands = await self.db.write(_take_commands, host, applied, self.clock())
        if not commands and wait_s > 0 and not self.closed:
            await wait_event(bell, wait_s)
            if not self.closed:
                queue, commands = await self.db.write(_take_commands, host, applied,
                                                      self.clock())
        return queue, commands

    async def queue(self, host: str, action: str, args: dict[str, Any], who: str
                    ) -> tuple[str, int]:
        """Queue a command for the host: its id and its number in the host's queue."""
        command_id = "cmd-" + secrets.token_hex(8)
        seq = await self.db.write(_queue, command_id, host, action, args, who, self.clock())
        self._bell(host).set()
        return command_id, seq

    async def results(self, host: str, results: list[dict[str, Any]], who: str) -> int:
        """Settle and audit the commands `results` answer; how many they settled. Results that
        answer nothing sent to the host are logged, at most once a minute a host."""
        settled = await self.db.write(_results, host, results, who, self.clock())
        unmatched = len(results) - settled
        if unmatched and host in self.reports:  # a made-up name gets no log line of its own
            self._warn_unmatched(host, unmatched)
        return settled

    def _warn_unmatched(self, host: str, count: int) -> None:
        now = self.clock()
        if now - self._unmatched_warned.get(host, float("-inf")) < UNMATCHED_WARN_S:
            return
        self._unmatched_warned[host] = now
        log.warning("host %s posted %d command result(s) that answer no command sent to it "
                    "(or one settled before); they were not kept", host, count)

    def owner_of(self, runner: str, host: str | None = None) -> list[str]:
        """The agent hosts whose last report lists a runner of that name."""
        return [name for name, report in sorted(self.reports.items())
                if (host is None or name == host)
                and any(r["name"] == runner for r in report.get("runners", []))]

    def age(self, host: str) -> float:
        return max(0.0, self.clock() - self.received.get(host, 0.0))

    def remote_views(self, stale_after_s: float) -> list[dict[str, Any]]:
        out = []
        for host, report in sorted(self.reports.items()):
            stale = self.age(host) > stale_after_s
            out += [{**runner, "host": host, "remote": True, "stale": stale}
                    for runner in report.get("runners", [])]
        return out

    async def listing(self, stale_after_s: float) -> list[dict[str, Any]]:
        pending = {row["host"]: row["n"] for row in await self.db.read(
            "SELECT host, count(*) AS n FROM host_commands WHERE done_at IS NULL GROUP BY host")}
        out = []
        for host, report in sorted(self.reports.items()):
            age = self.age(host)
            out.append({"host": host, "role": "agent", "runners": report.get("runners", []),
                        "capacity": report.get("capacity"), "vitals": report.get("vitals"),
                        "load": report.get("load"), "heartbeat_age_s": round(age, 1),
                        "last_heartbeat_at": iso(self.received.get(host)),
                        "stale": age > stale_after_s, "pending_commands": pending.get(host, 0),
                        "dropped_runners": report.get("dropped", 0)})
        return out

    async def commands(self, host: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        rows = await self.db.read(
            "SELECT * FROM host_commands WHERE (? IS NULL OR host = ?) ORDER BY queued_at DESC "
            "LIMIT ?", (host, host, limit))
        return [{"id": r["id"], "host": r["host"], "seq": r["seq"], "action": r["action"],
                 "args": json.loads(r["args"]), "who": r["who"],
                 "queued_at": iso(r["queued_at"]), "sent_at": iso(r["sent_at"]),
                 "sends": r["sends"], "done_at": iso(r["done_at"]),
                 "ok": None if r["ok"] is None else bool(r["ok"]), "error": r["error"],
                 "output": r["output"], "code": r["code"], "runner": r["runner"]} for r in rows]
