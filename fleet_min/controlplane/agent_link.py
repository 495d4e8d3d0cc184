"""Federation, the agent's side: `fleet-min controlplane --coordinator URL`.

The agent calls its coordinator, never the other way round. Each heartbeat carries this host's
runners, capacity and vitals, with the agent token in `Authorization: Bearer`, and asks the
coordinator to hold the reply up to one heartbeat interval for commands. Commands are run through
the same action path as the local API, but only those on AGENT_ACTIONS (drain, resume, health
check); anything else is answered with a refusal. Results go back with POST /api/host/results.
A command id is run once: a repeated id (the coordinator resends when a result was lost) gets
the stored result again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp

from fleet_min.controlplane.actions import run_action
from fleet_min.controlplane.federation import AGENT_ACTIONS, RUNNER_FIELDS
from fleet_min.controlplane.loops import wait_event
from fleet_min.errors import Refused

if TYPE_CHECKING:
    from fleet_min.controlplane.engine import ControlPlane

log = logging.getLogger(__name__)

REMEMBERED = 500
RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)


def coordinator_token_file(cfg: Any) -> Path:
    if cfg.coordinator_token_file:
        return Path(cfg.coordinator_token_file).expanduser()
    return Path(cfg.state_dir).expanduser() / "coordinator-token"


def coordinator_token(path: Path) -> str:
    """The coordinator's agent token, from an owner-only file (never argv or the environment of
    child commands)."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the coordinator token file {path}: {exc}") from None
    if not text:
        raise ValueError(f"the coordinator token file {path} is empty")
    return text


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"the coordinator must be an http(s) URL, got {url!r}")
    return url.rstrip("/")


OWED_FILE = "federation-owed.json"


class CoordinatorLink:
    """The agent side of federation. Results the coordinator has not acknowledged are kept in a
    spool file (with the ids of commands already run) and posted after the next heartbeat that
    gets through, so an outage or a restart of either side loses nothing and runs nothing twice.
    """

    def __init__(self, cp: ControlPlane, url: str, token: str) -> None:
        self.cp = cp
        self.url = check_url(url)
        self.token = token
        self.done: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.owed: list[dict[str, Any]] = []
        self.spool = cp.state_dir / OWED_FILE
        self._load()
        self.last_ok_at: float | None = None
        self.last_error: str | None = None
        self.heartbeats = 0
        self._stop = asyncio.Event()

    def _load(self) -> None:
        try:
            data = json.loads(self.spool.read_text())
        except (OSError, ValueError):
            return  # nothing owed, or a file we cannot read: start clean
        if not isinstance(data, dict):
            return
        self.owed = [r for r in data.get("owed") or [] if isinstance(r, dict) and "id" in r]
        for result in data.get("done") or []:
            if isinstance(result, dict) and "id" in result:
                self.done[str(result["id"])] = result
        while len(self.done) > REMEMBERED:
            self.done.popitem(last=False)

    def _save(self) -> None:
        """Write the spool atomically, readable by its owner only."""
        tmp = self.spool.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"owed": self.owed, "done": list(self.done.values())}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.spool)

    def status(self) -> dict[str, Any]:
        return {"coordinator": self.url, "heartbeats": self.heartbeats,
                "last_ok_at": self.last_ok_at, "last_error": self.last_error}

    def report(self, wait_s: float) -> dict[str, Any]:
        snap = self.cp.snapshot
        return {"host": self.cp.host_name, "role": "agent", "wait_s": wait_s,
                "runners": [{k: v.get(k) for k in RUNNER_FIELDS} for v in self.cp.views],
                "capacity": snap.get("capacity"), "vitals": snap.get("vitals"),
                "load": (snap.get("vitals") or {}).get("load")}

    async def run(self) -> None:
        failures = 0
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                try:
                    await self._exchange(session)
                    failures = 0
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                    log.warning("heartbeat to %s failed: %s", self.url, self.last_error)
                    await wait_event(self._stop, RETRY_S[min(failures, len(RETRY_S) - 1)])
                    failures += 1

    async def _post(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any],
                    timeout_s: float) -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            async with session.post(self.url + path, json=body, headers={
                    "Authorization": f"Bearer {self.token}"}) as resp:
                reply = await resp.json(content_type=None)
                if resp.status != 200 or not isinstance(reply, dict):
                    message = reply.get("error") if isinstance(reply, dict) else None
                    raise ValueError(f"{path} answered {resp.status}: {message}")
                return reply

    async def _exchange(self, session: aiohttp.ClientSession) -> None:
        wait_s = float(self.cp.setting("heartbeat_s"))
        reply = await self._post(session, "/api/host/heartbeat", self.report(wait_s),
                                 wait_s + 20)
        self.heartbeats += 1
        self.last_ok_at, self.last_error = self.cp.clock(), None
        commands = reply.get("commands")
        if isinstance(commands, list) and commands:
            results = [await self.execute(c) for c in commands if isinstance(c, dict)]
            await self.cp.rebuild()  # the next heartbeat reports the commands' effect
            owed_ids = {r["id"] for r in self.owed}
            self.owed += [r for r in results if r["id"] not in owed_ids]
            self._save()
        if self.owed:
            await self._post(session, "/api/host/results",
                             {"host": self.cp.host_name, "results": self.owed}, 30)
            self.owed = []
            self._save()

    async def execute(self, command: dict[str, Any]) -> dict[str, Any]:
        command_id = str(command.get("id", ""))[:100]
        if command_id in self.done:
            return self.done[command_id]
        action, args = command.get("action"), command.get("args")
        if action not in AGENT_ACTIONS:
            result = {"id": command_id, "ok": False, "output": "",
                      "error": f"{action} is not allowed on agent hosts; only "
                               f"{', '.join(AGENT_ACTIONS)} are"}
        else:
            result = await self._run(command_id, str(action),
                                     args if isinstance(args, dict) else {})
        self.done[command_id] = result
        while len(self.done) > REMEMBERED:
            self.done.popitem(last=False)
        return result

    async def _run(self, command_id: str, action: str, args: dict[str, Any]) -> dict[str, Any]:
        local = {k: v for k, v in args.items() if k != "host"}
        try:
            reply = await run_action(self.cp, action, local, f"coordinator {self.url}")
        except Refused as exc:
            return {"id": command_id, "ok": False, "error": exc.message, "output": ""}
        return {"id": command_id, "ok": bool(reply.get("ok")), "error": reply.get("error"),
                "output": str(reply.get("output", ""))[-20000:]}

    def stop(self) -> None:
        self._stop.set()
