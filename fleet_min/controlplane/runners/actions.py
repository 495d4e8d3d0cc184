"""Control-plane actions: duplicate, drain, resume, deregister a runner; run the health check.

Every action is validated against the freshly discovered runners first (unknown runner 404,
malformed args 400, refusals 409), runs its commands as argv lists with a timeout (tokens go to
config.sh through its ACTIONS_RUNNER_INPUT_TOKEN variable, never argv), and is written to the
audit log with who asked, the exit code and the duration, refusals included. An action for a
runner only an agent host reports is queued to that agent (federation) instead of run here.

The API, autoscale and the agent link all go through Actions.run, one action at a time.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

from fleet_min.controlplane import store
from fleet_min.controlplane.analysis.capacity import refusals_for_repo
from fleet_min.controlplane.federation.hosts import AGENT_ACTIONS, check_host
from fleet_min.controlplane.github.client import GitHub, GitHubError
from fleet_min.controlplane.runners import commands
from fleet_min.controlplane.runners.commands import CommandResult
from fleet_min.controlplane.runners.discovery import DRAIN_MARKER, Runner, load_runner, valid_name
from fleet_min.controlplane.runners.supervisor import ServiceState, Supervisor, chain
from fleet_min.controlplane.runners.trust import check_runnable
from fleet_min.controlplane.snapshot import Snapshots, clash_sentence
from fleet_min.controlplane.state import Plane
from fleet_min.errors import BadRequest, Conflict, NotFound, Refused, Unavailable
from fleet_min.timeutil import iso, now

CATALOGUE: list[dict[str, Any]] = [
    {"id": "runner.duplicate", "label": "Duplicate", "runner": True,
     "description": "Register another runner for the same repository with the same labels.",
     "args": {"name": "runner name",
              "new_name": "optional name of the new runner (default: <name>-2, or the lowest "
                          "free number, a trailing -<number> of the name left out)",
              "host": "optional agent host (when several agents report the name)"}},
    {"id": "runner.drain", "label": "Drain", "runner": True,
     "description": "Stop taking jobs: stop now when idle, else when the current job ends.",
     "args": {"name": "runner name",
              "host": "optional agent host (when several agents report the name)"}},
    {"id": "runner.resume", "label": "Resume", "runner": True,
     "description": "Clear the drain marker and start the runner's service.",
     "args": {"name": "runner name",
              "host": "optional agent host (when several agents report the name)"}},
    {"id": "runner.deregister", "label": "Deregister", "runner": True,
     "description": "Stop the service and remove the registration (refused while busy).",
     "args": {"name": "runner name", "delete_dir": "optional boolean; default false",
              "host": "optional agent host (when several agents report the name)"}},
    {"id": "health.check", "label": "Health check", "runner": False,
     "description": "Run the host health script and show its output.",
     "args": {"host": "optional agent host to run it on (queued to that agent)"}},
]
ACTION_IDS = {entry["id"] for entry in CATALOGUE}
# The runner's own files that belong to its registration or its runtime state: never copied
# into a duplicate (the new runner gets its own from config.sh).
_NOT_COPIED = re.compile(r"^(\.runner|\.credentials.*|\.service|\.fleet-drain|_work|_diag)$")


def catalogue(read_only: bool) -> dict[str, Any]:
    return {"actions": CATALOGUE, "read_only": read_only}


def _reply(action: str, result: CommandResult | None, output: str = "", **extra: Any
           ) -> dict[str, Any]:
    if result is None:
        return {"ok": True, "action": action, "code": 0, "output": output, "durationMs": 0,
                "command": None, **extra}
    reply = {"ok": result.ok, "action": action, "code": result.code,
             "output": "\n".join(x for x in (output, result.output) if x),
             "durationMs": result.duration_ms, "command": result.command, **extra}
    if not result.ok:
        reply["error"] = (f"{Path(result.argv[0]).name} did not finish in time" if result.timed_out
                          else f"{Path(result.argv[0]).name} failed with exit code {result.code}")
    return reply


def _runner_name(args: dict[str, Any]) -> str:
    name = args.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("args.name must be the name of a runner on this host")
    if not valid_name(name):
        raise BadRequest("args.name is not a valid runner name")
    return name


def parse_request(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The {id, args} of a POST /api/action body, or BadRequest naming the field at fault."""
    missing = [field for field in ("id", "args") if field not in body]
    if missing:
        raise BadRequest(f"the body has no {' and no '.join(missing)}; send "
                         '{"id": "<action id>", "args": {...}} ({} when the action takes none)')
    check_id(body["id"])
    check_args(body["args"])
    return body["id"], body["args"]


def check_id(action: Any) -> str:
    if not isinstance(action, str) or action not in ACTION_IDS:
        raise BadRequest(f"id must be one of {', '.join(sorted(ACTION_IDS))}")
    return action


def check_args(args: Any) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise BadRequest("args must be a JSON object ({} when the action takes none)")
    return args


def audit_args(args: Any) -> dict[str, Any]:
    """The arguments worth keeping in the audit row, as short scalars: a client shaped them, so
    nothing nested or long is stored (or walked)."""
    if not isinstance(args, dict):
        return {}
    kept: dict[str, Any] = {}
    for key in ("name", "new_name", "delete_dir", "host"):
        if key not in args:
            continue
        value = args[key]
        if isinstance(value, str):
            value = value[:200]
        elif not (value is None or isinstance(value, bool | int | float)):
            value = f"<{type(value).__name__}>"
        kept[key] = value
    return kept


def _audit_name(action: Any) -> str:
    return action if isinstance(action, str) and action in ACTION_IDS else "action.invalid"


def _check_forwarded(args: dict[str, Any]) -> None:
    """What can be checked here before an agent is asked: the agent checks the rest (capacity,
    busy runners) and answers with its refusal."""
    if "delete_dir" in args and not isinstance(args["delete_dir"], bool):
        raise BadRequest("args.delete_dir must be true or false")
    new_name = args.get("new_name")
    if new_name is not None and (not isinstance(new_name, str) or not valid_name(new_name)):
        raise BadRequest("args.new_name must be letters, digits, '.', '_' or '-' (at most 100)")


def _add_duplicate(conn: sqlite3.Connection, name: str, sibling: str, repo: str,
                   who: str) -> None:
    conn.execute("INSERT OR REPLACE INTO duplicates (name, sibling, repo, created_at, who) "
                 "VALUES (?, ?, ?, ?, ?)", (name, sibling, repo, now(), who))


def _drop_duplicate(conn: sqlite3.Connection, name: str) -> None:
    conn.execute("DELETE FROM duplicates WHERE name = ?", (name,))


def _repo_of(runner: Runner) -> str:
    if runner.repo is None:
        raise BadRequest(f"{runner.name} is not a repository runner; only those are supported")
    return runner.repo


def write_marker(path: Path, text: str) -> None:
    """Create the drain marker with `text`, unless an entry of its name exists by now.

    Discovery found none a moment ago, but a job may have planted one since: a link to a file
    of the daemon's user was written through (its contents replaced by a time). O_EXCL creates
    the file or fails, and never follows a link, dangling or not; an entry of that name already
    drains the runner, so there is nothing left to write."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return
    with open(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


def clear_marker(path: Path) -> None:
    """Remove the drain marker, or refuse (Conflict) with nothing changed when it is no file or
    link: any entry of its name drains the runner (so drain never writes through it), and a
    job may have made it a directory, which unlink refused with a 500."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise Conflict(f"the drain marker {path} is not the file drain writes and could not be "
                       f"removed ({exc.strerror}); remove it by hand to resume the runner"
                       ) from None


def copy_name(name: str, taken: set[str]) -> str | None:
    """The default name of a copy: the name without a trailing `-<number>`, then `-2`, or the
    lowest free number above it (app -> app-2; app-1 -> app-2, app-3 when app-2 is taken;
    app-2 -> app-3). A family of copies stays one series rather than growing app-1-2-2."""
    base = re.sub(r"-\d+$", "", name)
    return next((f"{base}-{n}" for n in range(2, 1000) if f"{base}-{n}" not in taken), None)


# The most a top-level file of an installation is copied at: its scripts and settings are a
# few KB. A job writes the runner's directory, and a 10 GB file it left there filled the disk
# when the runner was duplicated; so did any directory of its own.
MAX_COPIED_FILE = 1 << 20


def copy_install(src: Path, dst: Path) -> None:
    """A new runner directory with the sibling's installation, not its registration.

    The runner's binaries (bin*, externals*) are hard-linked when the file system allows it:
    they are never modified in place (updates unpack into new bin.X dirs), and a copy costs
    hundreds of MB on a Pi. Top-level scripts and settings are copied, since config.sh
    rewrites some; other top-level directories, and top-level files past MAX_COPIED_FILE (the
    release tarball kept beside it, what a job left), are no part of an installation and stay.
    """
    def link_or_copy(source: str, target: str) -> object:
        info = os.lstat(source)
        if not stat.S_ISREG(info.st_mode):
            # A FIFO, socket or device node a job left there: no part of an installation, and
            # copying it fails the whole copy (a FIFO) or never ends (a device).
            return target
        top = Path(source).relative_to(src).parts
        if len(top) > 1:  # inside bin* or externals*, the only directories copied
            try:
                os.link(source, target)
                return target
            except OSError:
                pass
        elif info.st_size > MAX_COPIED_FILE:
            return target
        return shutil.copy2(source, target)

    def ignore(folder: str, names: list[str]) -> list[str]:
        if Path(folder) != src:
            return []
        return [n for n in names if _NOT_COPIED.match(n) or (
            not n.startswith(("bin", "externals")) and os.path.isdir(os.path.join(folder, n))
            and not os.path.islink(os.path.join(folder, n)))]

    shutil.copytree(src, dst, symlinks=True, ignore=ignore, copy_function=link_or_copy)


class Actions:
    """Runs the actions (see the module's docstring) for the API, autoscale and the agent link."""

    def __init__(self, plane: Plane, snapshots: Snapshots, supervisor: Supervisor,
                 github: GitHub) -> None:
        self.plane = plane
        self.snapshots = snapshots
        self.supervisor = supervisor
        self.github = github
        self.lock = asyncio.Lock()  # one action at a time

    async def audit_refusal(self, who: str, body: Any, reason: str) -> None:
        """A request refused before any action began (a bad body) still lands in the audit log."""
        action = body.get("id") if isinstance(body, dict) else None
        args = body.get("args") if isinstance(body, dict) else None
        await self.plane.db.write(store.add_audit, who, _audit_name(action), audit_args(args),
                                  False, None, 0, reason)

    async def run(self, action: Any, args: Any, who: str, *, forward: bool = True
                  ) -> dict[str, Any]:
        """Run one action (or queue it to the agent host that has the runner); its reply. With
        forward=False (a command a coordinator sent) only on this host's own runners."""
        started = time.monotonic()
        reply: dict[str, Any] | None = None
        error: str | None = None
        try:
            action, args = check_id(action), check_args(args)
            async with self.lock:
                await self.snapshots.rebuild()  # validate against the host now, not a tick ago
                host = self._remote_host(action, args)
                if host is not None and not forward:
                    raise NotFound(f"no runner named {args.get('name')!r} on this host "
                                   f"{self.plane.host_name}; commands a coordinator sends "
                                   "act on this host's own runners only")
                if host is not None:
                    reply = await self._queue_remote(host, action, args, who)
                else:
                    reply = await self._dispatch(action, args)
                    await self._note_duplicates(action, reply, who)
                # The reply's effect is in /api/state and the stream at once.
                await self.snapshots.rebuild()
            return reply
        except Refused as exc:
            error = exc.message
            raise
        finally:
            duration = int((time.monotonic() - started) * 1000)
            await self.plane.db.write(store.add_audit, who, _audit_name(action),
                                      audit_args(args), bool(reply and reply["ok"]),
                                      reply["code"] if reply else None,
                                      reply["durationMs"] if reply else duration,
                                      error or (reply or {}).get("error"))
            self.plane.wake(github=True)

    def _remote_host(self, action: str, args: dict[str, Any]) -> str | None:
        """The agent host an action is for, or None when it runs here.

        A runner found on this host is acted on here; one only an agent reports is queued to
        that agent (args.host picks between agents reporting the same name). health.check runs
        here unless args.host names an agent.
        """
        wanted = args.get("host")
        if wanted is not None:
            wanted = check_host(wanted)
            if wanted == self.plane.host_name:
                return None
            if wanted not in self.plane.hosts.reports:
                raise NotFound(f"no agent host named {wanted!r} has sent a heartbeat")
        if action == "health.check":
            return wanted
        name = _runner_name(args)
        if wanted is None and any(r.name == name for r in self.plane.runners):
            return None
        owners = self.plane.hosts.owner_of(name, wanted)
        if len(owners) > 1:
            raise Conflict(f"agents {', '.join(owners)} all report a runner named {name!r}; "
                           "say which with args.host")
        if wanted is not None and not owners:
            # Never this host's runner of the same name instead: a stale page or a name shared
            # by two hosts would drain, or deregister and delete, the wrong runner.
            raise NotFound(f"agent host {wanted!r} reports no runner named {name!r} (its last "
                           "heartbeat lists its runners: GET /api/hosts)")
        return owners[0] if owners else None

    async def _queue_remote(self, host: str, action: str, args: dict[str, Any],
                            who: str) -> dict[str, Any]:
        """Forward an action to the agent that has the runner: queued in order, run there
        through the agent's own action path; its result comes back in GET /api/hosts
        (`commands`)."""
        if action not in AGENT_ACTIONS:
            raise Conflict(f"{action} is not sent to agent hosts; only "
                           f"{', '.join(AGENT_ACTIONS)} are")
        _check_forwarded(args)
        command_id, seq = await self.plane.hosts.queue(host, action, args, who)
        return {"ok": True, "action": action, "queued": True, "host": host,
                "command_id": command_id, "seq": seq, "code": None, "durationMs": 0,
                "command": None, "runner": args.get("name"),
                "output": f"sent to {host}; its result follows "
                          f"(GET /api/hosts lists {command_id})"}

    async def _note_duplicates(self, action: str, reply: dict[str, Any], who: str) -> None:
        """Remember which runners are duplicates: autoscale only ever removes those."""
        if not reply.get("ok"):
            return
        if action == "runner.duplicate":
            sibling = next((r for r in self.plane.runners if r.name == reply["sibling"]), None)
            await self.plane.db.write(_add_duplicate, reply["runner"], reply["sibling"],
                                      sibling.repo if sibling else "", who)
        elif action == "runner.deregister":
            await self.plane.db.write(_drop_duplicate, reply["runner"])

    async def _dispatch(self, action: str, args: dict[str, Any]) -> dict[str, Any]:
        if action == "health.check":
            return await self.health_check()
        name = _runner_name(args)
        if name in self.plane.clashes:
            raise Conflict(clash_sentence(name, self.plane.clashes[name]))
        runner, state = self.plane.find(name)
        if action == "runner.drain":
            return await self.drain(runner, state)
        if action == "runner.resume":
            return await self.resume(runner, state)
        if action == "runner.deregister":
            return await self.deregister(runner, state, args)
        return await self.duplicate(runner, state, args)

    async def drain(self, runner: Runner, state: ServiceState) -> dict[str, Any]:
        if not runner.draining:
            write_marker(runner.path / DRAIN_MARKER, iso(now()) or "")
        busy = self.plane.view(runner.name)["busy"]
        if busy:
            await self.plane.record(runner.name, "drain", "draining; stops when its job ends")
            return _reply("runner.drain", None, f"{runner.name} is busy; its service stops when "
                          "the job ends", runner=runner.name, stopped=False)
        self.snapshots.forget_drain_attempt(runner.name)
        if state.active != "active":
            await self.plane.record(runner.name, "drain", "draining; service already stopped")
            return _reply("runner.drain", None, f"{runner.name} is drained (service not running)",
                          runner=runner.name, stopped=True)
        result = await self.supervisor.stop(runner, state)
        await self.plane.record(runner.name, "drain", "idle; service stopped" if result.ok
                                else f"stopping the service failed (exit {result.code})")
        return _reply("runner.drain", result, runner=runner.name, stopped=result.ok)

    async def resume(self, runner: Runner, state: ServiceState) -> dict[str, Any]:
        clear_marker(runner.path / DRAIN_MARKER)
        self.snapshots.forget_drain_attempt(runner.name)
        if state.active == "active":
            await self.plane.record(runner.name, "resume",
                                    "drain marker cleared; service was running")
            return _reply("runner.resume", None, f"{runner.name} is running", runner=runner.name)
        if not state.loaded:
            raise Conflict(f"{runner.name} has no service unit {state.unit} to start; "
                           "install it with the runner's svc.sh")
        result = await self.supervisor.start(runner, state)
        await self.plane.record(runner.name, "resume", "service started" if result.ok
                                else f"starting the service failed (exit {result.code})")
        return _reply("runner.resume", result, runner=runner.name)

    async def _github_token(self, repo: str, kind: str) -> str:
        try:
            if kind == "registration":
                return await self.github.registration_token(repo)
            return await self.github.removal_token(repo)
        except GitHubError as exc:
            raise Unavailable(f"could not get a {kind} token for {repo}: {exc}") from None

    async def deregister(self, runner: Runner, state: ServiceState,
                         args: dict[str, Any]) -> dict[str, Any]:
        delete_dir = args.get("delete_dir", False)
        if not isinstance(delete_dir, bool):
            raise BadRequest("args.delete_dir must be true or false")
        repo = _repo_of(runner)
        if self.plane.view(runner.name)["busy"]:
            raise Conflict(f"{runner.name} is running a job; drain it and deregister when idle")
        # Every refusal before the first step: refused after the service was stopped and its
        # unit removed, the action was audited as refused with half of it done.
        check_runnable(runner.path / "config.sh", os.geteuid())
        if state.loaded:
            self.supervisor.check_uninstall(runner, state)
        token = await self._github_token(repo, "remove")
        steps = []
        if state.active == "active":
            steps.append(await self.supervisor.stop(runner, state))
        if state.loaded:
            steps.append(await self.supervisor.uninstall(runner, state))
        steps.append(await commands.run([str(runner.path / "config.sh"), "remove"],
                                        timeout_s=self.plane.cfg.command_timeout_s,
                                        cwd=runner.path,
                                        env={"ACTIONS_RUNNER_INPUT_TOKEN": token}))
        result = chain(steps)
        removed = False
        if result.ok and delete_dir:
            await asyncio.to_thread(shutil.rmtree, runner.path)
            removed = True
        await self.plane.record(runner.name, "deregister", "registration removed" if result.ok
                                else f"deregistering failed (exit {result.code})")
        return _reply("runner.deregister", result, runner=runner.name, deleted_dir=removed)

    def _new_name(self, runner: Runner, args: dict[str, Any]) -> str:
        root = self.plane.root
        taken = {r.name for r in self.plane.runners}
        wanted = args.get("new_name")
        if wanted is not None:
            if not isinstance(wanted, str) or not valid_name(wanted):
                raise BadRequest("args.new_name must be letters, digits, '.', '_' or '-' "
                                 "(at most 100)")
            if wanted in taken or (root / wanted).exists():
                raise Conflict(f"a runner or directory named {wanted!r} already exists")
            return wanted
        taken |= {entry.name for entry in root.iterdir()} if root.is_dir() else set()
        name = copy_name(runner.name, taken)
        if name is None:
            raise Conflict(f"no free name left for a copy of {runner.name}")
        return name

    async def duplicate(self, runner: Runner, state: ServiceState,
                        args: dict[str, Any]) -> dict[str, Any]:
        repo = _repo_of(runner)
        reasons = refusals_for_repo(self.plane.snapshot["capacity"], repo)
        if reasons:
            raise Conflict("no room for another runner: " + "; ".join(reasons))
        view = self.plane.view(runner.name)
        if view["registration"] == "unknown":
            raise Conflict(f"GitHub has not told us {runner.name}'s labels yet; "
                           "try again shortly")
        unfit = next((label for label in view["custom_labels"]
                      if "," in label or label.startswith("-")), None)
        if unfit is not None:
            # config.sh takes the labels as one comma-separated argument: a comma would split
            # this one in two, and a leading "-" reads as an option of its own (--ephemeral).
            raise Conflict(f"{runner.name}'s label {unfit!r} cannot be passed to config.sh "
                           "(a comma splits it, a leading '-' reads as an option); rename it "
                           "at GitHub or register the copy by hand")
        new_name = self._new_name(runner, args)
        # The copy's config.sh is the daemon's own copy, but its binaries are the sibling's
        # (hard links), and config.sh runs them.
        check_runnable(runner.path / "config.sh", os.geteuid())
        check_runnable(runner.path / "bin", os.geteuid(), "the runner's binaries (bin)")
        token = await self._github_token(repo, "registration")
        target = self.plane.root / new_name
        await asyncio.to_thread(copy_install, runner.path, target)
        argv = [str(target / "config.sh"), "--unattended", "--url", runner.url,
                "--name", new_name, "--work", "_work", "--replace"]
        if view["custom_labels"]:
            argv += ["--labels", ",".join(view["custom_labels"])]
        steps = [await commands.run(argv, timeout_s=self.plane.cfg.command_timeout_s,
                                    cwd=target, env={"ACTIONS_RUNNER_INPUT_TOKEN": token})]
        created = load_runner(target, self.plane.root) if steps[0].ok else None
        if created is None:
            await asyncio.to_thread(shutil.rmtree, target, True)
            result = chain(steps)
            if result.ok:  # config.sh said yes but left no .runner: report it as a failure
                result.code = 1
                result.output += "\nconfig.sh wrote no .runner file"
            await self.plane.record(runner.name, "duplicate", f"registering {new_name} failed")
            return _reply("runner.duplicate", result, runner=new_name)
        steps.append(await self.supervisor.install(created, state.scope))
        if steps[-1].ok:
            new_state = (await self.supervisor.states([created]))[created.name]
            steps.append(await self.supervisor.start(created, new_state))
        result = chain(steps)
        await self.plane.record(runner.name, "duplicate", f"registered {new_name}" if result.ok
                                else f"{new_name} registered but its service did not start")
        await self.plane.record(new_name, "created", f"duplicated from {runner.name}")
        return _reply("runner.duplicate", result, runner=new_name, sibling=runner.name)

    async def health_check(self) -> dict[str, Any]:
        script = self.plane.cfg.health_script
        if not script:
            raise Conflict("no health script is configured; set FLEET_HEALTH_SCRIPT")
        path = Path(script).expanduser()
        if not path.is_absolute() or not os.access(path, os.X_OK):
            raise Conflict(f"the health script {script} is not an executable file with an "
                           "absolute path")
        result = await commands.run([str(path)], timeout_s=self.plane.cfg.command_timeout_s)
        return _reply("health.check", result)
