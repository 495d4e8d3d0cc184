"""Autoscale as the daemon runs it: after each GitHub refresh, one decision per repository this
host's runners serve (autoscale.py decides from the queue causes, the forecast, the duplicates'
idle time and the capacity), recorded, and executed through the actions when the mode is
`execute`. GET /api/autoscale lists the decisions. Domain only: no aiohttp.web here.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from fleet_min.controlplane.analysis import autoscale
from fleet_min.controlplane.analysis.forecaster import Forecaster
from fleet_min.controlplane.runners.actions import Actions
from fleet_min.controlplane.state import Plane
from fleet_min.errors import Refused
from fleet_min.timeutil import iso

KEEP_DECISIONS = 5000


def _record_decision(conn: sqlite3.Connection, d: autoscale.Decision, mode: str, at: float,
                     result: dict[str, Any] | None) -> None:
    """A decision the same as the repository's last one (and not executed) counts as seen again
    rather than adding a row each round."""
    action = d.action["id"] if d.action else None
    args = json.dumps(d.action["args"] if d.action else {}, sort_keys=True)
    last = conn.execute("SELECT id, direction, outcome, action, args FROM autoscale WHERE "
                        "repo = ? ORDER BY id DESC LIMIT 1", (d.repo,)).fetchone()
    if (result is None and last is not None
            and tuple(last[1:]) == (d.direction, d.outcome, action, args)):
        conn.execute("UPDATE autoscale SET last_seen_at = ?, seen = seen + 1, reasons = ?, "
                     "inputs = ? WHERE id = ?",
                     (at, json.dumps(d.reasons), json.dumps(d.inputs), last[0]))
        return
    conn.execute("INSERT INTO autoscale (at, last_seen_at, repo, direction, outcome, mode, "
                 "action, args, reasons, inputs, result) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                 (at, at, d.repo, d.direction, d.outcome, mode, action, args,
                  json.dumps(d.reasons), json.dumps(d.inputs),
                  json.dumps(result) if result is not None else None))
    conn.execute("DELETE FROM autoscale WHERE id <= (SELECT max(id) FROM autoscale) - ?",
                 (KEEP_DECISIONS,))


class Autoscaler:
    def __init__(self, plane: Plane, actions: Actions, forecaster: Forecaster) -> None:
        self.plane = plane
        self.actions = actions
        self.forecaster = forecaster
        self.evaluated_at: float | None = None

    async def _repo_state(self, repo: str) -> autoscale.RepoState:
        db, snap = self.plane.db, self.plane.snapshot
        views = [v for v in self.plane.views if v["repo"] == repo]
        dups = {row["name"]: row["created_at"] for row in await db.read(
            "SELECT name, created_at FROM duplicates WHERE repo = ?", (repo,))}
        idle_since = {}
        for name, created in dups.items():
            row = await db.read_one(
                "SELECT max(completed_at) AS last FROM jobs WHERE runner = ?", (name,))
            idle_since[name] = max(created, (row["last"] if row else None) or 0)
        last = await db.read_one(
            "SELECT max(at) AS at FROM autoscale WHERE repo = ? AND outcome = 'executed'",
            (repo,))
        return autoscale.RepoState(
            repo, views, [c for c in snap.get("queue_causes", []) if c["repo"] == repo],
            self.forecaster.latest.get(repo), idle_since, last["at"] if last else None,
            snap.get("capacity", {}))

    async def evaluate(self) -> None:
        """One evaluation: a decision per local repository, executed when so configured."""
        setting = self.plane.setting
        if setting("autoscale") != "on":
            return
        mode = setting("autoscale_mode")
        at = self.plane.clock()
        self.evaluated_at = at
        for repo in sorted({v["repo"] for v in self.plane.views if v["repo"]}):
            decision = autoscale.decide(await self._repo_state(repo), at,
                                        setting("autoscale_cooldown_s"),
                                        setting("autoscale_idle_s"))
            if decision is None:
                continue
            result = None
            if mode == "execute" and decision.outcome == "proposed" and decision.action:
                result = await self._execute(decision.action)
                decision.outcome = "executed" if result.get("ok") else "failed"
            await self.plane.db.write(_record_decision, decision, mode, at, result)

    async def _execute(self, action: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = await self.actions.run(action["id"], action["args"], "autoscale")
        except Refused as exc:
            return {"ok": False, "error": exc.message}
        return {k: reply.get(k) for k in ("ok", "code", "error", "runner")}

    async def report(self, limit: int = 100) -> dict[str, Any]:
        rows = await self.plane.db.read("SELECT * FROM autoscale ORDER BY id DESC LIMIT ?",
                                        (limit,))
        setting = self.plane.setting
        return {"generated_at": iso(self.plane.clock()),
                "enabled": setting("autoscale") == "on", "mode": setting("autoscale_mode"),
                "cooldown_s": setting("autoscale_cooldown_s"),
                "idle_s": setting("autoscale_idle_s"),
                "evaluated_at": iso(self.evaluated_at),
                "decisions": [_decision(r) for r in rows]}


def _decision(r: Any) -> dict[str, Any]:
    return {"id": r["id"], "at": iso(r["at"]), "last_seen_at": iso(r["last_seen_at"]),
            "seen": r["seen"], "repo": r["repo"], "direction": r["direction"],
            "outcome": r["outcome"], "mode": r["mode"],
            "action": {"id": r["action"], "args": json.loads(r["args"])} if r["action"] else None,
            "reasons": json.loads(r["reasons"]), "inputs": json.loads(r["inputs"]),
            "result": json.loads(r["result"]) if r["result"] else None}
