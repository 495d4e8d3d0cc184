"""The watched repositories' workflow files, fetched from the default branch and cached.

Every `workflows_s` the directory `.github/workflows` of the default branch is listed (a
conditional request: a 304 when nothing changed). A file is downloaded only when its blob sha
differs from the cached one; the cache lives in SQLite, so a restart costs one listing per
repository, and parsed models are kept in memory by sha.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import sqlite3
from collections.abc import Callable
from typing import Any

from fleet_min.controlplane.analysis.workflows import MAX_FILE_BYTES, Workflow, parse
from fleet_min.controlplane.github.client import GitHub, GitHubError
from fleet_min.db import Database
from fleet_min.timeutil import iso

log = logging.getLogger(__name__)

FOLDER = ".github/workflows"
MAX_FILES = 200


def _store(conn: sqlite3.Connection, repo: str, ref: str, files: list[tuple[str, str, str]],
           keep: list[str], at: float) -> None:
    conn.executemany("INSERT OR REPLACE INTO workflow_files (repo, path, ref, sha, content, "
                     "fetched_at) VALUES (?, ?, ?, ?, ?, ?)",
                     [(repo, path, ref, sha, text, at) for path, sha, text in files])
    marks = ",".join("?" * len(keep))
    conn.execute(f"DELETE FROM workflow_files WHERE repo = ? AND path NOT IN ({marks})",
                 (repo, *keep))


def _plain(value: Any) -> bool:
    """Text that can name a file in a URL and in SQLite: a lone surrogate cannot be UTF-8, and
    a control character has no business in a path or a sha."""
    return isinstance(value, str) and bool(value) and value.isprintable()


def _small(size: Any) -> bool:
    # Any other type ("big", a list, a float past int's range) would raise in int() and end
    # the whole round; an entry that does not say its size plainly is skipped instead.
    return isinstance(size, int) and size <= MAX_FILE_BYTES


def _branch(value: Any) -> str:
    return value if _plain(value) else "main"


class WorkflowFiles:
    def __init__(self, github: GitHub, db: Database, clock: Callable[[], float]) -> None:
        self.github = github
        self.db = db
        self.clock = clock
        self.status: dict[str, dict[str, Any]] = {}
        self._parsed: dict[tuple[str, str, str], Workflow] = {}
        self._refreshed: dict[str, float] = {}

    def due(self, repo: str, every_s: float) -> bool:
        return self.clock() - self._refreshed.get(repo, float("-inf")) >= every_s

    async def refresh(self, repo: str) -> None:
        self._refreshed[repo] = self.clock()
        try:
            branch = _branch((await self.github.repository(repo)).get("default_branch"))
            listing = await self._listing(repo, branch)
            cached = {row["path"]: row["sha"] for row in await self.db.read(
                "SELECT path, sha FROM workflow_files WHERE repo = ?", (repo,))}
            fresh = []
            for entry in listing:
                if cached.get(entry["path"]) != entry["sha"]:
                    text = await self._download(repo, entry["path"], branch)
                    if text is not None:
                        fresh.append((entry["path"], entry["sha"], text))
            await self.db.write(_store, repo, branch, fresh, [e["path"] for e in listing],
                                self.clock())
            self.status[repo] = {"repo": repo, "default_branch": branch,
                                 "fetched_at": iso(self.clock()), "files": len(listing),
                                 "error": None}
        except GitHubError as exc:
            log.warning("workflow files of %s: %s", repo, exc)
            self.status[repo] = {**self.status.get(repo, {"repo": repo, "files": 0,
                                                          "default_branch": None,
                                                          "fetched_at": None}),
                                 "error": str(exc)}

    async def _listing(self, repo: str, branch: str) -> list[dict[str, Any]]:
        try:
            body = await self.github.contents(repo, FOLDER, branch)
        except GitHubError as exc:
            if exc.status == 404:
                return []  # no workflows at all
            raise
        entries = [e for e in body if isinstance(e, dict)] if isinstance(body, list) else []
        return [{"path": e["path"], "sha": e["sha"]} for e in entries
                if e.get("type") == "file" and _plain(e.get("path")) and _plain(e.get("sha"))
                and e["path"].endswith((".yml", ".yaml")) and _small(e.get("size") or 0)
                ][:MAX_FILES]

    async def _download(self, repo: str, path: str, branch: str) -> str | None:
        body = await self.github.contents(repo, path, branch)
        if not isinstance(body, dict) or body.get("encoding") != "base64":
            return None
        try:
            raw = base64.b64decode(str(body.get("content", "")), validate=False)
        except (binascii.Error, ValueError):
            return None
        return raw[:MAX_FILE_BYTES + 1].decode("utf-8", "replace")

    async def workflows(self, repo: str) -> list[Workflow]:
        rows = await self.db.read("SELECT path, sha, content FROM workflow_files WHERE repo = ? "
                                  "ORDER BY path", (repo,))
        out = []
        for row in rows:
            key = (repo, row["path"], row["sha"])
            if key not in self._parsed:
                # In a thread: a large file through the pure-Python parser takes a while.
                self._parsed[key] = await asyncio.to_thread(parse, row["path"], row["content"])
            out.append(self._parsed[key])
        live = {(repo, row["path"], row["sha"]) for row in rows}
        for key in [k for k in self._parsed if k[0] == repo and k not in live]:
            del self._parsed[key]
        return out
