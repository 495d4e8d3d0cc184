"""Federation, the agent's side: `fleet-min controlplane --coordinator URL`.

The agent calls its coordinator, never the other way round. Each heartbeat carries this host's
runners, capacity and vitals, with the agent token in `Authorization: Bearer`, and asks the
coordinator to hold the reply up to one heartbeat interval for commands. Commands are run through
the same action path as the local API, but only those on AGENT_ACTIONS (the runner actions and
the health check); anything else is answered with a refusal. Results go back with
POST /api/host/results.

Order and exactly once: the coordinator numbers the commands of this host (hosts.py).
Each heartbeat says the last number applied; the agent applies the commands after it one by
one, in order, and keeps the number, each result and whether the coordinator has it in its
own database (link_state, link_results), so a restart of either side, a lost reply or a SIGSTOP
neither skips, repeats nor reorders a command. A command begun when the agent died is not run
again: its result says the outcome is unknown.

One agent per host name: every heartbeat and result carries this agent's instance id (see
`instance_id`), and the coordinator refuses a second agent calling in under a name another
instance is still using (hosts.py). Two agents sharing a name, from a cloned image say, would
otherwise share one command queue, and each command would run on both.

Domain only: no aiohttp.web here (the agent is an HTTP client of its coordinator).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from fleet_min import jsonio
from fleet_min.controlplane.federation.hosts import (
    AGENT_ACTIONS,
    COMMANDS_PER_REPLY,
    MAX_RESULTS,
    MAX_SEQ,
    QUEUE_ID,
    RUNNER_FIELDS,
)
from fleet_min.controlplane.loops import stop_tasks, wait_event
from fleet_min.controlplane.runners.actions import Actions
from fleet_min.controlplane.settings import is_http_url
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.controlplane.state import Plane
from fleet_min.controlplane.tokens import ensure_token, named_host
from fleet_min.errors import Refused
from fleet_min.http import read_within
from fleet_min.timeutil import now

log = logging.getLogger(__name__)

REMEMBERED = 500
# Queues the agent keeps a row of (link_state): the current one and a few before it, so a
# coordinator restored from an older copy, going back to a recent queue, finds its numbers
# still known. A broken or hostile coordinator naming a new queue in every reply added a row a
# heartbeat for good: some 350,000 a day at MIN_EXCHANGE_S.
KEPT_QUEUES = 8
# Results owed to a coordinator that does not take them (it refuses POST /api/host/results):
# past this many, the oldest are dropped, and the log says how many. A real coordinator sends a
# command again until its result arrives, so it never has an agent owe more than a few posts'
# worth; a broken one sending COMMANDS_PER_REPLY new commands a reply grew the table by as
# many rows a heartbeat, without end.
MAX_OWED = 500
RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)
# Far above any real reply (the coordinator pages commands: at most hosts.COMMANDS_PER_REPLY
# and hosts.REPLY_BUDGET of their args), low enough that a broken or hostile coordinator cannot
# fill a small host's memory with one answer: 8 MiB of tiny commands parsed to 180 MB.
MAX_REPLY_BYTES = 1 << 20
# The least time between two heartbeats. A coordinator answers one when it has commands or its
# wait is over; one that answers at once every time (a lying one, or a wrong URL that speaks
# JSON) had the agent call in 1,300 times a second on most of a core.
MIN_EXCHANGE_S = 0.25


def coordinator_token_file(cfg: Any) -> Path:
    if cfg.coordinator_token_file:
        return Path(cfg.coordinator_token_file).expanduser()
    return Path(cfg.state_dir).expanduser() / "coordinator-token"


def coordinator_token(path: Path) -> str:
    """The coordinator's agent token, from an owner-only file (never argv or the environment of
    child commands)."""
    try:
        text = path.read_text(encoding="ascii").strip()
        loose = path.stat().st_mode & 0o077
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the coordinator token file {path}: {exc}") from None
    if not text:
        raise ValueError(f"the coordinator token file {path} is empty")
    if loose:
        # A token other users can read is no secret: made owner-only, as the daemon keeps its
        # own token files; refused when this user may not (chmod it 600 yourself).
        try:
            path.chmod(0o600)
        except OSError as exc:
            raise ValueError(f"the coordinator token file {path} is readable by other users "
                             f"and cannot be made owner-only ({exc.strerror}); "
                             "chmod 600 it") from None
    return text


def check_token_host(token: str, host_name: str) -> None:
    """Refuse to start with a host token made for another host's name: every heartbeat would be
    refused (403), and the agent would only say so in its link's last error."""
    bound = named_host(token)
    if bound is not None and bound != host_name:
        raise ValueError(f"the coordinator token is the host token of {bound!r}, but this "
                         f"host's name is {host_name!r}: set FLEET_HOST_NAME={bound}, or make "
                         f"one for this host on the coordinator (fleet-min controlplane token "
                         f"--agent-host {host_name})")


def check_url(url: str) -> str:
    if not is_http_url(url):
        raise ValueError(f"the coordinator must be an http(s) URL, got {url!r}")
    return url.rstrip("/")


LAST_ERROR_CHARS = 600  # of the last failed call, shown in /api/hosts and on the Hosts screen


class CoordinatorRefusal(ValueError):
    """The coordinator answered with a refusal (4xx, 5xx) and its reason."""


LEGACY_SPOOL = "federation-owed.json"  # where an older version kept what it owed
INSTANCE_FILE = "federation-instance"  # this agent's random half of its instance id
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def instance_id(state_dir: Path, boot_id: Path = BOOT_ID) -> str:
    """Who this agent is, beyond its host name: the same across restarts of the daemon, and
    different for another agent. It joins a random value kept in the state directory (another
    state directory, another agent) with the kernel's id of this boot (where there is one:
    Linux), so that two machines cloned from one image with its state directory still differ,
    while they run. A reboot makes a new id; the coordinator takes it once the old one has
    been silent for stale_after_s."""
    kept = ensure_token(state_dir, INSTANCE_FILE)
    try:
        boot = boot_id.read_text(encoding="ascii").strip()[:64]
    except (OSError, UnicodeDecodeError):
        boot = ""  # macOS: the kept value alone
    return hashlib.sha256(f"{kept}:{boot}".encode()).hexdigest()[:32]


# --- the agent's database (transactions for Database.write) ----------------------------------

def _switch(conn: sqlite3.Connection, queue: str, at: float) -> int:
    """Make `queue` the current one: the last number applied from it (0 for a new queue)."""
    row = conn.execute("SELECT applied FROM link_state WHERE queue = ?", (queue,)).fetchone()
    if row is None:
        conn.execute("INSERT INTO link_state (queue, updated_at) VALUES (?, ?)", (queue, at))
        conn.execute("DELETE FROM link_state WHERE queue != ? AND queue NOT IN (SELECT queue "
                     "FROM link_state WHERE queue != ? ORDER BY updated_at DESC LIMIT ?)",
                     (queue, queue, KEPT_QUEUES - 1))
        return 0
    conn.execute("UPDATE link_state SET updated_at = ? WHERE queue = ?", (at, queue))
    return int(row[0])


def _begin(conn: sqlite3.Connection, queue: str, seq: int, command_id: str, at: float) -> None:
    conn.execute("UPDATE link_state SET running = ?, running_id = ?, updated_at = ? "
                 "WHERE queue = ?", (seq, command_id, at, queue))


def _finish(conn: sqlite3.Connection, queue: str | None, seq: int | None,
            result: dict[str, Any], at: float) -> None:
    """The result, owed to the coordinator, and the number applied: in one transaction."""
    conn.execute("INSERT OR REPLACE INTO link_results (id, queue, seq, result, reported, at) "
                 "VALUES (?, ?, ?, ?, 0, ?)", (result["id"], queue, seq, json.dumps(result), at))
    if queue is not None and seq is not None:
        conn.execute("UPDATE link_state SET applied = max(applied, ?), running = NULL, "
                     "running_id = NULL, updated_at = ? WHERE queue = ?", (seq, at, queue))
    conn.execute("DELETE FROM link_results WHERE reported = 1 AND id NOT IN (SELECT id FROM "
                 "link_results ORDER BY at DESC LIMIT ?)", (REMEMBERED,))


def _owe_again(conn: sqlite3.Connection, command_id: str, queue: str | None,
               seq: int | None) -> None:
    """A command sent again after it was applied: the coordinator lacks its result."""
    conn.execute("UPDATE link_results SET reported = 0 WHERE id = ?", (command_id,))
    if queue is not None and seq is not None:
        conn.execute("UPDATE link_state SET applied = max(applied, ?) WHERE queue = ?",
                     (seq, queue))


def _drop_owed(conn: sqlite3.Connection, kept: int) -> int:
    """Drop the oldest owed results past `kept`; how many were dropped."""
    return conn.execute("DELETE FROM link_results WHERE rowid IN (SELECT rowid FROM link_results "
                        "WHERE reported = 0 ORDER BY at DESC, rowid DESC LIMIT -1 OFFSET ?)",
                        (kept,)).rowcount


def _reported(conn: sqlite3.Connection, ids: list[str]) -> None:
    conn.executemany("UPDATE link_results SET reported = 1 WHERE id = ?", [(i,) for i in ids])


def _import_spool(conn: sqlite3.Connection, owed: list[Any], done: list[Any], at: float) -> None:
    """What an older version left in its spool file: owed results to send, ids it ran."""
    for result, reported in [(r, 1) for r in done] + [(r, 0) for r in owed]:
        if isinstance(result, dict) and isinstance(result.get("id"), str):
            conn.execute("INSERT OR REPLACE INTO link_results (id, result, reported, at) "
                         "VALUES (?, ?, ?, ?)", (result["id"], json.dumps(result), reported, at))


def parse_reply(raw: bytes) -> Any:
    """The coordinator's answer as JSON, None when it is not JSON; ValueError when it nests
    too deep to parse (it would raise RecursionError out of the link)."""
    try:
        return jsonio.loads_foreign(raw)
    except jsonio.TooDeep as exc:
        raise ValueError(f"the coordinator's answer is {exc}") from None
    except ValueError:
        return None


def _seq(command: dict[str, Any]) -> int | None:
    seq = command.get("seq")
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and 0 < seq < MAX_SEQ \
        else None


class CoordinatorLink:
    """The agent side of federation (see the module's docstring for order and exactly once)."""

    def __init__(self, plane: Plane, actions: Actions, snapshots: Snapshots, url: str,
                 token_file: Path) -> None:
        self.plane = plane
        self.actions = actions
        self.snapshots = snapshots
        self.url = check_url(url)
        self.token_file = token_file
        self.token = ""  # read at start (load)
        self.instance = ""  # made or read at start (load)
        self.queue: str | None = None  # the coordinator's queue our numbers belong to
        self.applied = 0               # the last number of it applied here
        self.last_ok_at: float | None = None
        self.last_error: str | None = None
        self.heartbeats = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def running(self, _app: object) -> AsyncIterator[None]:
        """Load, then call the coordinator until the daemon stops (a cleanup context)."""
        await self.load()
        self._tasks = [asyncio.create_task(self.run(), name="controlplane-agent")]
        yield
        self.stop()
        await stop_tasks(self._tasks)

    async def load(self) -> None:
        """The token; the queue and number from the database; a command a crash interrupted is
        settled."""
        self.token = coordinator_token(self.token_file)
        self.instance = instance_id(self.plane.state_dir)
        await self._import_legacy_spool()
        row = await self.plane.db.read_one("SELECT queue, applied, running, running_id FROM "
                                        "link_state ORDER BY updated_at DESC LIMIT 1")
        if row is None:
            return
        if not QUEUE_ID.fullmatch(row["queue"] or ""):
            return  # kept by an agent that took any text: a new queue is taken at the next reply
        self.queue, self.applied = row["queue"], int(row["applied"])
        if row["running"] is not None and row["running"] > self.applied:
            result = {"id": row["running_id"], "seq": row["running"], "ok": False,
                      "output": "", "error": "the agent stopped (killed or crashed) while "
                      "running this command; it is not run again, so check what it did"}
            await self.plane.db.write(_finish, self.queue, row["running"], result, now())
            self.applied = int(row["running"])

    async def _import_legacy_spool(self) -> None:
        spool = self.plane.state_dir / LEGACY_SPOOL
        try:
            data = json.loads(spool.read_text())
        except (OSError, ValueError):
            return
        if isinstance(data, dict):
            await self.plane.db.write(_import_spool, list(data.get("owed") or []),
                                   list(data.get("done") or []), now())
        spool.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        return {"coordinator": self.url, "instance": self.instance,
                "heartbeats": self.heartbeats,
                "last_ok_at": self.last_ok_at, "last_error": self.last_error,
                "queue": self.queue, "applied": self.applied}

    def report(self, wait_s: float) -> dict[str, Any]:
        snap = self.plane.snapshot
        return {"host": self.plane.host_name, "instance": self.instance, "role": "agent",
                "wait_s": wait_s, "queue": self.queue, "applied": self.applied,
                "runners": [{k: v.get(k) for k in RUNNER_FIELDS} for v in self.plane.views],
                "capacity": snap.get("capacity"), "vitals": snap.get("vitals"),
                "load": (snap.get("vitals") or {}).get("load")}

    async def run(self) -> None:
        failures = 0
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                started = asyncio.get_running_loop().time()
                try:
                    await self._exchange(session)
                    failures = 0
                    spent = asyncio.get_running_loop().time() - started
                    if spent < MIN_EXCHANGE_S:
                        await wait_event(self._stop, MIN_EXCHANGE_S - spent)
                    continue
                except CoordinatorRefusal as exc:  # its own words, whole: they say what to do
                    self.last_error = str(exc)[:LAST_ERROR_CHARS]
                    log.warning("heartbeat to %s failed: %s", self.url, self.last_error)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"[:LAST_ERROR_CHARS]
                    log.warning("heartbeat to %s failed: %s", self.url, self.last_error)
                except Exception as exc:  # never the end of the link: it would go quiet for good
                    self.last_error = f"{type(exc).__name__}: {exc}"[:LAST_ERROR_CHARS]
                    log.exception("heartbeat to %s failed unexpectedly", self.url)
                await wait_event(self._stop, RETRY_S[min(failures, len(RETRY_S) - 1)])
                failures += 1

    async def _post(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any],
                    timeout_s: float) -> dict[str, Any]:
        # The deadline covers the whole answer, so a coordinator trickling it cannot hold the
        # link. A redirect is not followed: the report (and, same-origin, the token) would go
        # to an address the operator never named, and commands come only from the one named.
        async with asyncio.timeout(timeout_s):
            async with session.post(self.url + path, json=body, allow_redirects=False, headers={
                    "Authorization": f"Bearer {self.token}"}) as resp:
                if 300 <= resp.status < 400:
                    raise ValueError(f"{path} answered {resp.status}, a redirect to "
                                     f"{resp.headers.get('Location', '')[:100]!r}; the agent "
                                     "does not follow redirects: give --coordinator the final URL")
                reply = parse_reply(await read_within(resp, MAX_REPLY_BYTES, ValueError(
                    f"the coordinator's answer is larger than {MAX_REPLY_BYTES} bytes")))
                if not isinstance(reply, dict):
                    raise ValueError(f"{path} answered {resp.status} without a JSON object")
                if resp.status != 200:
                    raise CoordinatorRefusal(f"{path} answered {resp.status}: "
                                             f"{str(reply.get('error'))[:LAST_ERROR_CHARS]}")
                return reply

    async def _exchange(self, session: aiohttp.ClientSession) -> None:
        wait_s = float(self.plane.setting("heartbeat_s"))
        reply = await self._post(session, "/api/host/heartbeat", self.report(wait_s),
                                 wait_s + 20)
        self.heartbeats += 1
        self.last_ok_at, self.last_error = self.plane.clock(), None
        queue = reply.get("queue")
        # Only a queue id of the coordinator's shape: it is sent back with every heartbeat and
        # kept across restarts, and one the coordinator refuses (a wrong or hostile server
        # answered once) had every later heartbeat refused with a 400, for good.
        if isinstance(queue, str) and QUEUE_ID.fullmatch(queue) and queue != self.queue:
            self.applied = await self.plane.db.write(_switch, queue, now())
            self.queue = queue
        commands = reply.get("commands")
        commands = [c for c in commands if isinstance(c, dict)] \
            if isinstance(commands, list) else []
        # Numbered commands in their order (a reply is already ordered; this makes it so), and
        # no more than a coordinator sends in one reply: the heartbeat after them reports how
        # far this agent got, and the coordinator sends the rest again.
        commands.sort(key=lambda c: _seq(c) or 0)
        ran = [await self._take(command) for command in commands[:COMMANDS_PER_REPLY]]
        if any(ran):
            await self.snapshots.rebuild()  # the next heartbeat reports the commands' effect
        await self._drop_owed()
        await self._deliver(session)

    async def _drop_owed(self) -> None:
        dropped = await self.plane.db.write(_drop_owed, MAX_OWED)
        if dropped:
            log.warning("the coordinator %s has not taken this agent's command results; more "
                        "than %d were owed, so the oldest %d were dropped and it will never "
                        "get them", self.url, MAX_OWED, dropped)

    async def _take(self, command: dict[str, Any]) -> bool:
        """Apply one command unless it was applied before; True when it ran now."""
        command_id = str(command.get("id", ""))[:100]
        seq = _seq(command) if self.queue is not None else None
        known = await self.plane.db.read_one("SELECT 1 FROM link_results WHERE id = ?",
                                          (command_id,))
        if known is not None or (seq is not None and seq <= self.applied):
            await self.plane.db.write(_owe_again, command_id, self.queue, seq)
            self.applied = max(self.applied, seq or 0)
            return False
        if seq is not None and self.queue is not None:
            await self.plane.db.write(_begin, self.queue, seq, command_id, now())
        result = {**await self.execute(command_id, command), "seq": seq}
        await self.plane.db.write(_finish, self.queue if seq else None, seq, result, now())
        self.applied = max(self.applied, seq or 0)
        return True

    async def _deliver(self, session: aiohttp.ClientSession) -> None:
        """Post the results the coordinator does not have yet; marked once it answers."""
        rows = await self.plane.db.read("SELECT id, result FROM link_results WHERE reported = 0 "
                                     "ORDER BY at, rowid LIMIT ?", (MAX_RESULTS,))
        if rows:
            results = [json.loads(r["result"]) for r in rows]
            await self._post(session, "/api/host/results",
                             {"host": self.plane.host_name, "instance": self.instance,
                              "results": results}, 30)
            await self.plane.db.write(_reported, [r["id"] for r in rows])

    async def execute(self, command_id: str, command: dict[str, Any]) -> dict[str, Any]:
        action, args = command.get("action"), command.get("args")
        if action not in AGENT_ACTIONS:
            return {"id": command_id, "ok": False, "output": "",
                    "error": f"{action} is not allowed on agent hosts; only "
                             f"{', '.join(AGENT_ACTIONS)} are"}
        return await self._run(command_id, str(action), args if isinstance(args, dict) else {})

    async def _run(self, command_id: str, action: str, args: dict[str, Any]) -> dict[str, Any]:
        local = {k: v for k, v in args.items() if k != "host"}
        try:
            # Here only: a runner this agent's own agents report is not the coordinator's to
            # act on through this agent (a deregister with delete_dir went on down).
            reply = await self.actions.run(action, local, f"coordinator {self.url}",
                                           forward=False)
        except Refused as exc:
            return {"id": command_id, "ok": False, "error": exc.message, "output": ""}
        except Exception as exc:  # the command counts as applied; say how it failed
            log.exception("command %s (%s) failed", command_id, action)
            return {"id": command_id, "ok": False, "output": "",
                    "error": f"{action} failed on the agent: {type(exc).__name__}: {exc}"[:500]}
        return {"id": command_id, "ok": bool(reply.get("ok")), "error": reply.get("error"),
                "output": str(reply.get("output", ""))[-20000:], "code": reply.get("code"),
                "runner": reply.get("runner")}

    def stop(self) -> None:
        self._stop.set()
