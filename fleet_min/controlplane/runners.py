"""Discovery: the runner installations under the root, read from their own files.

A runner is a directory holding a `.runner` file (JSON, written by config.sh with a BOM). Its
name, URL and repository come from that file; its version from the runner's own binaries; its
drain marker is ours (`.fleet-drain`); its processes are matched from the process table by path.
`.credentials*` files are never opened here or anywhere else in the control plane.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fleet_min.controlplane.procs import Proc

DRAIN_MARKER = ".fleet-drain"
SERVICE_FILE = ".service"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_VERSION = re.compile(r"\d+\.\d+\.\d+")
_MAX_DEPTH = 3


def valid_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def valid_repo(repo: str) -> bool:
    owner, _, project = repo.partition("/")
    return bool(_SLUG.fullmatch(owner) and _SLUG.fullmatch(project)) and ".." not in repo


@dataclass
class Runner:
    name: str
    path: Path
    rel: str
    url: str
    owner: str | None
    repo: str | None  # owner/project; None for an organisation-level runner
    agent_id: int | None
    labels: list[str]
    version: str | None
    staged: list[str]
    draining_since: str | None
    unit_hint: str | None  # the unit name svc.sh wrote into .service, when it did
    listener: Proc | None = None
    workers: list[Proc] = field(default_factory=list)

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    @property
    def working(self) -> bool:
        return bool(self.workers)


def read_runner_file(path: Path) -> dict[str, Any]:
    """The `.runner` JSON; utf-8-sig drops the BOM the runner writes."""
    data = json.loads(path.read_text(encoding="utf-8-sig"))
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def repo_of(url: str) -> tuple[str | None, str | None]:
    """https://github.com/owner/project -> ("owner", "owner/project"); org runners have no repo."""
    parts = [p for p in urlsplit(url).path.split("/") if p]
    if parts and parts[0] == "enterprises":
        return None, None
    owner = parts[0] if parts and _SLUG.fullmatch(parts[0]) else None
    if owner and len(parts) >= 2 and valid_repo(f"{owner}/{parts[1]}"):
        return owner, f"{owner}/{parts[1].removesuffix('.git')}"
    return owner, None


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def versions(path: Path) -> tuple[str | None, list[str]]:
    """(active version, staged versions): the `bin` symlink's target names the active one after
    a self-update; a fresh install carries it in its deps file; `bin.X.Y.Z` dirs are staged."""
    active = None
    bin_dir = path / "bin"
    if bin_dir.is_symlink():
        target = os.readlink(bin_dir)
        found = _VERSION.search(Path(target).name)
        active = found.group(0) if found else None
    if active is None:
        try:
            text = (bin_dir / "Runner.Listener.deps.json").read_text(encoding="utf-8",
                                                                     errors="replace")
            found = re.search(r"Runner\.Listener/(\d+\.\d+\.\d+)", text)
            active = found.group(1) if found else None
        except OSError:
            pass
    staged = []
    for entry in path.glob("bin.*"):
        found = _VERSION.fullmatch(entry.name[4:])
        if found and entry.is_dir() and entry.name[4:] != active:
            staged.append(entry.name[4:])
    return active, sorted(staged, key=_version_key)


def _drain_since(path: Path) -> str | None:
    try:
        text = (path / DRAIN_MARKER).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except OSError:
        return "unknown"
    return text or "unknown"


def _unit_hint(path: Path) -> str | None:
    try:
        text = (path / SERVICE_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    # svc.sh writes the unit name (systemd) or the plist path (launchd); keep the last part only.
    name = text.rsplit("/", 1)[-1].removesuffix(".plist")
    return name if re.fullmatch(r"[A-Za-z0-9@._:-]{1,255}", name) else None


def load_runner(path: Path, root: Path) -> Runner | None:
    try:
        data = read_runner_file(path / ".runner")
    except (OSError, ValueError):
        return None
    name = str(data.get("agentName") or "")
    url = str(data.get("gitHubUrl") or data.get("serverUrl") or "")
    if not valid_name(name):
        return None
    owner, repo = repo_of(url)
    labels = data.get("labels")
    active, staged = versions(path)
    agent_id = data.get("agentId")
    return Runner(name=name, path=path, rel=str(path.relative_to(root)), url=url, owner=owner,
                  repo=repo, agent_id=agent_id if isinstance(agent_id, int) else None,
                  labels=[str(x) for x in labels] if isinstance(labels, list) else [],
                  version=active, staged=staged, draining_since=_drain_since(path),
                  unit_hint=_unit_hint(path))


def _runner_dirs(root: Path) -> list[Path]:
    found: list[Path] = []
    stack = [(root, 0)]
    while stack:
        here, depth = stack.pop()
        if (here / ".runner").is_file():
            found.append(here)
            continue  # never walk into a runner's _work tree
        if depth >= _MAX_DEPTH:
            continue
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            # Symlinked directories are skipped so discovery cannot leave the root.
            if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
                stack.append((Path(entry.path), depth + 1))
    return sorted(found)


def discover(root: Path, procs: list[Proc]) -> list[Runner]:
    """Every runner under root with its listener and worker processes attached."""
    runners = []
    seen: set[str] = set()
    for path in _runner_dirs(root):
        runner = load_runner(path, root)
        if runner is None or runner.name in seen:
            continue
        seen.add(runner.name)
        attach_processes(runner, procs)
        runners.append(runner)
    return runners


def attach_processes(runner: Runner, procs: list[Proc]) -> None:
    prefix = str(runner.path) + os.sep
    for proc in procs:
        for arg in proc.argv[:3]:
            if not arg.startswith(prefix):
                continue
            base = os.path.basename(arg)
            if base == "Runner.Listener" and runner.listener is None:
                runner.listener = proc
            elif base == "Runner.Worker":
                runner.workers.append(proc)
            break
