"""Discovery: the runner installations under the root, read from their own files.

A runner is a directory holding a `.runner` file (JSON, written by config.sh with a BOM). Its
name, URL and repository come from that file; its version from the runner's own binaries; its
drain marker is ours (`.fleet-drain`); its processes are matched from the process table by path.
`.credentials*` files are never opened here or anywhere else in the control plane.

The daemon discovers every few seconds through one Discovery, which reads a runner's files again
only when their stat signature changed (see Discovery); discover() reads everything each time.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fleet_min import filemodes, jsonio
from fleet_min.controlplane.labels import fit_labels
from fleet_min.controlplane.runners.procs import Proc

DRAIN_MARKER = ".fleet-drain"
SERVICE_FILE = ".service"
# Far above any file of the runner's that discovery reads (.runner is a few hundred bytes,
# the deps file far less than this): a larger one is not one the runner wrote.
SMALL_FILE_BYTES = 1 << 20
# What drain() writes into the marker (an ISO-8601 time) and all of the marker that is shown.
_DRAIN_TIME = re.compile(r"[0-9][0-9T:.+ Z-]{0,39}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_VERSION = re.compile(r"\d+\.\d+\.\d+")
_UNIT_HINT = re.compile(r"actions\.runner\.[A-Za-z0-9@._:-]{1,240}")
_MAX_DEPTH = 3
# A GitHub URL is a host and two names of at most 100 characters; a GHES host adds at most 253.
MAX_URL_CHARS = 1000
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# Joined by concatenation (os.path.join was a sixth of a cached discovery); a folder here never
# ends with a separator (str of a Path, or a scandir entry's path).
_RUNNER_FILE = os.sep + ".runner"
_WATCHED = tuple(os.sep + name for name in (
    SERVICE_FILE, DRAIN_MARKER, os.path.join("bin", "Runner.Listener.deps.json")))


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
    owner_uid: int | None = None  # the account that owns the directory (the runner's own)
    listener: Proc | None = None
    workers: list[Proc] = field(default_factory=list)

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    @property
    def working(self) -> bool:
        return bool(self.workers)


def read_small(path: Path, limit: int = SMALL_FILE_BYTES, *, follow: bool = True
               ) -> bytes | None:
    """Up to `limit` bytes of the regular file at path; None when there is none to read.

    A runner's directory is written by the runner, by the jobs it runs and perhaps by other
    users, so a name there may be a FIFO (a plain open waits for a writer forever, and the
    snapshot with it), a device or a file of gigabytes (a plain read never ends or fills the
    memory). The file is opened without blocking, not at all when it is no regular file, and
    checked again once open (it may have been swapped between). follow=False: a symlink is
    not followed either (for text that is served: a link to `.credentials` must not be read).
    """
    try:
        return filemodes.read_regular(path, limit, follow=follow, truncate=True)
    except (OSError, ValueError):
        return None


def read_runner_file(path: Path) -> dict[str, Any]:
    """The `.runner` JSON; utf-8-sig drops the BOM the runner writes. ValueError when it is
    not a JSON object of reasonable size and depth (the parser recurses, and a RecursionError
    would end the whole discovery)."""
    raw = read_small(path, SMALL_FILE_BYTES + 1)
    if raw is None:
        raise ValueError("not a readable regular file")
    if len(raw) > SMALL_FILE_BYTES:
        raise ValueError("too large for a .runner file")
    data = jsonio.loads_foreign(raw.decode("utf-8-sig"))
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _url(value: object) -> str:
    """The runner's URL from `.runner`, or "" when it is not one config.sh could have written:
    longer than any GitHub URL (it is in every snapshot), holding a control character (it is
    shown as a link and is an argument of config.sh), or text urlsplit cannot split (a lone
    bracket, a host NFKC folds into '/', '?', '#' or '@'), which repo_of reads."""
    if not isinstance(value, str) or len(value) > MAX_URL_CHARS or _CONTROL.search(value):
        return ""
    try:
        urlsplit(value)
    except ValueError:
        return ""
    return value


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
    try:
        # Not is_symlink() and then readlink(): a job can remove or replace the link between
        # the two, and the OSError ended the whole discovery (every runner's snapshot).
        target: str | None = os.readlink(bin_dir)
    except OSError:  # no link (a directory, nothing) or gone since
        target = None
    if target is not None:
        found = _VERSION.search(Path(target).name)
        active = found.group(0) if found else None
    if active is None:
        raw = read_small(bin_dir / "Runner.Listener.deps.json")
        if raw is not None:
            text = raw.decode("utf-8", "replace")
            found = re.search(r"Runner\.Listener/(\d+\.\d+\.\d+)", text)
            active = found.group(1) if found else None
    staged = []
    for entry in path.glob("bin.*"):
        found = _VERSION.fullmatch(entry.name[4:])
        if found and entry.is_dir() and entry.name[4:] != active:
            staged.append(entry.name[4:])
    return active, sorted(staged, key=_version_key)


def _drain_since(path: Path) -> str | None:
    """When the runner was drained; None when it is not. Any entry of the marker's name
    drains it (a symlink too, even a dangling one: drain() then never writes through it). Its
    text is shown only when it is a time, as drain() writes it, and never read through a
    link: the snapshot is served to anyone who can reach the daemon, unredacted."""
    marker = path / DRAIN_MARKER
    try:
        marker.lstat()
    except FileNotFoundError:
        return None
    except OSError:
        return "unknown"
    raw = read_small(marker, 64, follow=False)
    text = raw.decode("utf-8", "replace").strip() if raw else ""
    return text if _DRAIN_TIME.fullmatch(text) else "unknown"


def _unit_hint(path: Path) -> str | None:
    raw = read_small(path / SERVICE_FILE, 4096)
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace").strip()
    # svc.sh writes the unit name (systemd) or the plist path (launchd); keep the last part only.
    name = text.rsplit("/", 1)[-1].removesuffix(".plist")
    # Only a name svc.sh gives a runner ("actions.runner.<owner>-<repo>.<name>", cut short and
    # given a suffix when long): a job writes this file, and the unit it names is the one the
    # daemon stops by itself once a drained runner is idle (with `sudo -n systemctl` for a
    # system unit). Any other name (sshd, the daemon's own unit) is not this runner's. It is an
    # argument of systemctl and launchctl too, where a leading "-" would make it an option.
    return name if _UNIT_HINT.fullmatch(name) else None


def load_runner(path: Path, root: Path) -> Runner | None:
    try:
        data = read_runner_file(path / ".runner")
    except (OSError, ValueError):
        return None
    name = str(data.get("agentName") or "")
    url = _url(data.get("gitHubUrl") or data.get("serverUrl"))
    if not valid_name(name):
        return None
    owner, repo = repo_of(url)
    active, staged = versions(path)
    agent_id = data.get("agentId")
    # The labels by the rule GitHub's and an agent's follow: a job writes this file, and its
    # labels went into every snapshot as they were (60,000 of them, escape sequences and all).
    return Runner(name=name, path=path, rel=str(path.relative_to(root)), url=url, owner=owner,
                  repo=repo, agent_id=agent_id if isinstance(agent_id, int) else None,
                  labels=fit_labels(data.get("labels")),
                  version=active, staged=staged, draining_since=_drain_since(path),
                  unit_hint=_unit_hint(path), owner_uid=_owner_uid(path))


def _owner_uid(path: Path) -> int | None:
    try:
        return path.stat().st_uid  # a change of owner changes the directory's ctime: re-read
    except OSError:
        return None


def _runner_dirs(root: Path) -> list[tuple[str, os.stat_result]]:
    """Every directory under root (to _MAX_DEPTH) holding a `.runner` file, sorted by path (as
    Path orders them: part by part), with that file's stat. Plain strings, not Path objects: at
    a thousand runners, building and comparing Paths cost more than the walk's system calls."""
    found: list[tuple[str, os.stat_result]] = []
    stack = [(str(root), 0)]
    while stack:
        here, depth = stack.pop()
        try:
            marker = os.stat(here + _RUNNER_FILE)
        except (OSError, ValueError):
            marker = None
        if marker is not None and stat.S_ISREG(marker.st_mode):
            found.append((here, marker))
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
                stack.append((entry.path, depth + 1))
    return sorted(found, key=lambda item: item[0].split(os.sep))


def discover(root: Path, procs: list[Proc]) -> list[Runner]:
    """Every runner under root with its listener and worker processes attached (every file
    read afresh; the daemon keeps a Discovery instead)."""
    return Discovery(root).discover(procs)


# A signature whose newest time is this close to the moment it was taken is not trusted: a
# change within the same clock tick (coarse on many file systems, 1-2 s on some) would leave
# the times as they were, so such a runner is read again at the next discovery (as git's index
# treats "racily clean" files).
RACY_NS = 2_000_000_000

_Signature = tuple[tuple[int, int, int, int] | None, ...]


def _stat_key(path: str, follow: bool = True) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=follow)
    except (OSError, ValueError):
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Discovery:
    """discover() that reads a runner's files only when they may have changed.

    Each runner's parsed files are kept with a signature: the stat (inode, size, mtime, ctime)
    of its directory (an entry added, removed, renamed or replaced: the drain marker, `.service`,
    the `bin` link of a self-update, staged `bin.*` directories), of `.runner`, `.service` and
    `.fleet-drain` (rewritten in place) and of `bin/Runner.Listener.deps.json`. The same
    signature means the same Runner, so only the stats are paid. Not cached: a runner read
    within RACY_NS of its newest time, or one whose `bin.*` entries are symlinks (their
    targets can change without touching the runner's directory). Processes change every tick
    and are attached afresh each time.
    """

    def __init__(self, root: Path, racy_ns: int = RACY_NS) -> None:
        self.root = root
        self.racy_ns = racy_ns
        self._known: dict[str, tuple[_Signature, Runner | None]] = {}
        self.reads = 0  # runners whose files were read (not served from the cache)
        # Names that more than one directory's `.runner` claims, with those directories (see
        # discover). Replaced whole by each discovery.
        self.clashes: dict[str, list[str]] = {}

    def discover(self, procs: list[Proc]) -> list[Runner]:
        known: dict[str, tuple[_Signature, Runner | None]] = {}
        runners = []
        seen: dict[str, Runner] = {}
        clashes: dict[str, list[str]] = {}
        for path, marker in _runner_dirs(self.root):
            signature = _signature(path, marker)
            cached = self._known.get(path)
            if cached is not None and cached[0] == signature:
                known[path] = cached
                template = cached[1]
            else:
                self.reads += 1
                try:
                    template, cacheable = _load(Path(path), self.root)
                except OSError:
                    # Its files changed under the read (a job rewriting them, the runner
                    # removed): as it was last seen, and read again next time. Raised, it
                    # ended the discovery of every runner of the host.
                    template, cacheable = (cached[1] if cached is not None else None), False
                if cacheable and not _racy(signature, self.racy_ns):
                    known[path] = (signature, template)
            if template is None:
                continue
            first = seen.get(template.name)
            if first is not None:
                # A job writes its runner's `.runner`: one that took another runner's name hid
                # that runner, and the actions asked for by that name went to its own
                # directory. The first directory is listed; the name is a clash, and no action
                # is taken on it until one directory alone claims it.
                clashes.setdefault(template.name, [first.rel]).append(template.rel)
                continue
            seen[template.name] = template
            runners.append(_fresh(template))
        self._known = known  # replaced whole: runners gone from the root are forgotten
        self.clashes = clashes
        attach_all(runners, procs)
        return runners


def _fresh(template: Runner) -> Runner:
    """A copy of a cached runner with its own lists and no processes yet. Copied field by field
    through __dict__: dataclasses.replace (which calls __init__ through keyword arguments) was
    a tenth of a cached discovery at a thousand runners."""
    runner = object.__new__(Runner)
    runner.__dict__.update(template.__dict__)
    runner.labels = list(template.labels)
    runner.staged = list(template.staged)
    runner.listener = None
    runner.workers = []
    return runner


def _signature(folder: str, marker: os.stat_result) -> _Signature:
    return (_stat_key(folder, follow=False),
            (marker.st_ino, marker.st_size, marker.st_mtime_ns, marker.st_ctime_ns),
            *[_stat_key(folder + name) for name in _WATCHED])


def _racy(signature: _Signature, racy_ns: int) -> bool:
    newest = max((max(key[2], key[3]) for key in signature if key is not None), default=0)
    return time.time_ns() - newest < racy_ns


def _load(path: Path, root: Path) -> tuple[Runner | None, bool]:
    """(the runner read from its files, whether the result may be cached)."""
    runner = load_runner(path, root)
    cacheable = not any(entry.is_symlink() for entry in path.glob("bin.*"))
    return runner, cacheable


def attach_all(runners: list[Runner], procs: list[Proc]) -> None:
    """Each process to the runner whose directory holds one of its first three arguments: a
    `Runner.Listener` (the first one) or a `Runner.Worker`. One pass over the processes with a
    lookup by directory, not every process for every runner."""
    by_path = {str(r.path): r for r in runners}
    if not by_path:
        return
    for proc in procs:
        claimed: list[Runner] = []
        for arg in proc.argv[:3]:
            runner = _holder(arg, by_path)
            if runner is None or any(runner is other for other in claimed):
                continue  # a runner looks at its first matching argument only
            if not _may_be_its(proc, runner):
                continue
            claimed.append(runner)
            base = os.path.basename(arg)
            if base == "Runner.Listener" and runner.listener is None:
                runner.listener = proc
            elif base == "Runner.Worker":
                runner.workers.append(proc)


def _may_be_its(proc: Proc, runner: Runner) -> bool:
    """Whether a process that names the runner's directory may be its listener or worker: one
    of the account that owns the directory, or of root. Any account's process can carry any
    argv: another user's `exec -a <runner>/bin/Runner.Worker sleep` made the runner look busy
    (a deregister refused, a drain that never stopped it, capacity counted as used)."""
    if proc.uid is None or runner.owner_uid is None:
        return True
    return proc.uid in (runner.owner_uid, 0)


def _holder(arg: str, by_path: dict[str, Runner]) -> Runner | None:
    """The runner whose path + separator starts arg (at most one: runners do not nest)."""
    head = os.path.dirname(arg)
    while head:
        runner = by_path.get(head)
        if runner is not None:
            return runner if arg.startswith(head + os.sep) else None
        parent = os.path.dirname(head)
        if parent == head:
            return None
        head = parent
    return None
