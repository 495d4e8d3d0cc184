"""The host's service manager behind one small interface: systemd on Linux, launchd on macOS.

Both answer the same questions (is the runner's service loaded, running, with which pid) and do
the same four things (start, stop, install, uninstall), always through argv commands with a
timeout. The choice is made at run time (FLEET_SUPERVISOR, default by platform).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import plistlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleet_min.controlplane.runners import commands
from fleet_min.controlplane.runners.commands import CommandResult
from fleet_min.controlplane.runners.discovery import Runner, read_small
from fleet_min.controlplane.runners.procs import is_darwin
from fleet_min.controlplane.runners.trust import check_runnable


@dataclass
class ServiceState:
    unit: str
    scope: str | None  # "system" or "user" (systemd), "agent" (launchd); None when not found
    loaded: bool
    active: str  # active, inactive, failed, activating, deactivating, unknown
    sub: str
    main_pid: int | None

    def as_json(self) -> dict[str, Any]:
        # Spelled out rather than dataclasses.asdict (which deep-copies field by field): it runs
        # for every runner in every rebuild. test_service_state_json_has_every_field keeps it
        # in step with the fields.
        return {"unit": self.unit, "scope": self.scope, "loaded": self.loaded,
                "active": self.active, "sub": self.sub, "main_pid": self.main_pid}


class Supervisor(Protocol):
    kind: str

    async def states(self, runners: list[Runner]) -> dict[str, ServiceState]: ...
    async def start(self, runner: Runner, state: ServiceState) -> CommandResult: ...
    async def stop(self, runner: Runner, state: ServiceState) -> CommandResult: ...
    async def install(self, runner: Runner, scope: str | None) -> CommandResult: ...
    async def uninstall(self, runner: Runner, state: ServiceState) -> CommandResult: ...
    def check_uninstall(self, runner: Runner, state: ServiceState) -> None: ...


def service_name(runner: Runner) -> str:
    """The name svc.sh gives the service: actions.runner.<owner>-<repo>.<name> (80-char name)."""
    if runner.unit_hint:
        return runner.unit_hint.removesuffix(".service")
    scope = runner.repo.replace("/", "-") if runner.repo else (runner.owner or "runner")
    return f"actions.runner.{scope}.{runner.name[:80]}"


def foreign_unit(runner_dir: Path, working_directory: str) -> str | None:
    """The directory a runner's unit serves when that is not the runner's own, else None.

    Every unit svc.sh writes (systemd and launchd alike) and every unit the daemon writes runs
    in its runner's directory. The name the unit is found by is no proof it is this runner's:
    it comes from `.service` or `.runner`, which the runner's jobs can write, and a job on one
    runner that named another runner's unit there had the daemon stop that runner (a drained
    runner's service is stopped by itself once idle), deregister it or start it. A unit without
    a working directory, or with one relative to a home (`~`), cannot be told apart and is
    taken as it is named."""
    text = working_directory.lstrip("!-")  # systemd's prefixes: a missing directory is no error
    if not text.startswith("/") or text == str(runner_dir):
        return None
    try:
        if os.path.samefile(text, runner_dir):  # the same directory by another path
            return None
    except (OSError, ValueError):
        pass  # gone, unreadable, or not a path at all: not the runner's directory either
    return text


def not_its_own(unit: str, elsewhere: str) -> ServiceState:
    """The state of a runner whose unit serves another directory: never started, stopped or
    removed for it, and said so where the service's state is shown."""
    return ServiceState(unit, None, False, "unknown",
                        f"not this runner's: it runs in {elsewhere[:300]}", None)


def chain(results: list[CommandResult]) -> CommandResult:
    """Several commands reported as one: the first failure's code, all output, total time."""
    failed = next((r for r in results if not r.ok), None)
    last = failed or results[-1]
    output = "\n".join(f"$ {r.command}\n{r.output.rstrip()}" for r in results).strip()
    return CommandResult(last.argv, last.code, output, sum(r.duration_ms for r in results),
                         any(r.timed_out for r in results))


def choose(kind: str, scope: str, timeout_s: float) -> Supervisor:
    if kind == "launchd" or (kind == "auto" and is_darwin()):
        return Launchd(timeout_s)
    return Systemd(scope, timeout_s)


class Systemd:
    kind = "systemd"

    def __init__(self, scope: str, timeout_s: float) -> None:
        self.scope = scope  # auto, system or user
        self.timeout_s = timeout_s

    def _systemctl(self, scope: str) -> list[str]:
        if scope == "user":
            return ["systemctl", "--user"]
        # A system unit needs root; sudo -n fails fast instead of waiting for a password.
        return ["systemctl"] if os.geteuid() == 0 else ["sudo", "-n", "systemctl"]

    async def _run(self, argv: list[str], cwd: Path | None = None,
                   parse_only: bool = False) -> CommandResult:
        return await commands.run(argv, timeout_s=self.timeout_s, cwd=cwd, parse_only=parse_only)

    async def states(self, runners: list[Runner]) -> dict[str, ServiceState]:
        """One `systemctl show` per scope for every unit at once (it prints one block per unit);
        its output is only parsed, so it is not redacted. A unit whose working directory is
        another runner's is not this runner's service (see foreign_unit)."""
        units = {r.name: service_name(r) + ".service" for r in runners}
        paths = {r.name: r.path for r in runners}
        found = {name: ServiceState(unit, None, False, "unknown", "", None)
                 for name, unit in units.items()}
        if not units:
            return found
        for scope in (["system", "user"] if self.scope == "auto" else [self.scope]):
            # Reading state needs no privilege, so no sudo here even for system units.
            base = ["systemctl", "--user"] if scope == "user" else ["systemctl"]
            argv = [*base, "show",
                    "--property=Id,LoadState,ActiveState,SubState,MainPID,WorkingDirectory",
                    "--", *units.values()]
            result = await self._run(argv, parse_only=True)
            if result.code is None:
                continue
            by_unit = parse_show(result.output)
            for name, unit in units.items():
                props = by_unit.get(unit)
                if props is None or found[name].loaded:
                    continue
                loaded = props.get("LoadState") == "loaded"
                elsewhere = foreign_unit(paths[name], props.get("WorkingDirectory", ""))
                if loaded and elsewhere:
                    found[name] = not_its_own(unit, elsewhere)
                    continue
                found[name] = ServiceState(unit, scope if loaded else None, loaded,
                                           props.get("ActiveState", "unknown"),
                                           props.get("SubState", ""),
                                           parse_pid(props.get("MainPID", "")))
        return found

    def _scope_of(self, state: ServiceState) -> str:
        if state.scope:
            return state.scope
        return "user" if self.scope == "auto" and os.geteuid() != 0 else \
            ("system" if self.scope == "auto" else self.scope)

    async def start(self, runner: Runner, state: ServiceState) -> CommandResult:
        return await self._run([*self._systemctl(self._scope_of(state)), "start", state.unit])

    async def stop(self, runner: Runner, state: ServiceState) -> CommandResult:
        return await self._run([*self._systemctl(self._scope_of(state)), "stop", state.unit])

    async def install(self, runner: Runner, scope: str | None) -> CommandResult:
        unit = service_name(runner) + ".service"
        chosen = scope or self._scope_of(ServiceState(unit, None, False, "", "", None))
        if chosen == "system":
            # The runner's own svc.sh writes the system unit (it needs root, hence sudo -n),
            # and runs as root: only when no job of the runner could have changed it.
            check_runnable(runner.path / "svc.sh", 0)
            prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
            return await self._run([*prefix, str(runner.path / "svc.sh"), "install",
                                    getpass.getuser()], cwd=runner.path)
        path = user_unit_dir() / unit
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(unit_text(runner), encoding="utf-8")
        (runner.path / ".service").write_text(unit + "\n", encoding="utf-8")
        systemctl = self._systemctl("user")
        return chain([await self._run([*systemctl, "daemon-reload"]),
                      await self._run([*systemctl, "enable", unit])])

    def check_uninstall(self, runner: Runner, state: ServiceState) -> None:
        """Refuse (Conflict) what uninstall would refuse, before anything is stopped."""
        if self._scope_of(state) == "system":
            check_runnable(runner.path / "svc.sh", 0)  # as install's

    async def uninstall(self, runner: Runner, state: ServiceState) -> CommandResult:
        self.check_uninstall(runner, state)
        if self._scope_of(state) == "system":
            prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
            return await self._run([*prefix, str(runner.path / "svc.sh"), "uninstall"],
                                   cwd=runner.path)
        systemctl = self._systemctl("user")
        disabled = await self._run([*systemctl, "disable", state.unit])
        (user_unit_dir() / state.unit).unlink(missing_ok=True)
        forget_hint(runner)
        return chain([disabled, await self._run([*systemctl, "daemon-reload"])])


def forget_hint(runner: Runner) -> None:
    """Remove the runner's `.service` once its unit is gone. Only a file or a link is removed:
    a job may have left a directory of that name (unlink raised IsADirectoryError, after the
    unit was stopped, disabled and deleted: a 500 for an action half done). Discovery never
    reads a directory as a hint, so one left there names no unit."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
        os.unlink(runner.path / ".service")


def user_unit_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def unit_text(runner: Runner) -> str:
    """A user unit like the one svc.sh writes for system scope. KillMode=process lets a running
    job's worker finish its cleanup when the listener is stopped, as the runner expects."""
    return (f"[Unit]\nDescription=GitHub Actions Runner ({runner.repo or runner.owner}."
            f"{runner.name})\nAfter=network-online.target\n\n[Service]\n"
            f"ExecStart=\"{runner.path / 'run.sh'}\"\nWorkingDirectory={runner.path}\n"
            "KillMode=process\nKillSignal=SIGTERM\nTimeoutStopSec=5min\n\n"
            "[Install]\nWantedBy=default.target\n")


def parse_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show` output (blank-line separated blocks of Key=Value) keyed by Id."""
    out: dict[str, dict[str, str]] = {}
    for block in text.split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if "Id" in props:
            out[props["Id"]] = props
    return out


class Launchd:
    kind = "launchd"

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    @staticmethod
    def plist(label: str) -> Path:
        return Path.home() / "Library" / "LaunchAgents" / f"{label}.plist"

    async def _run(self, argv: list[str], cwd: Path | None = None,
                   parse_only: bool = False) -> CommandResult:
        return await commands.run(argv, timeout_s=self.timeout_s, cwd=cwd, parse_only=parse_only)

    async def states(self, runners: list[Runner]) -> dict[str, ServiceState]:
        result = await self._run(["launchctl", "list"], parse_only=True)  # parsed, never shown
        table = parse_launchctl_list(result.output) if result.ok else {}
        found = {}
        for runner in runners:
            label = service_name(runner)
            row = table.get(label)
            if row is None:
                found[runner.name] = ServiceState(label, None, False,
                                                  "inactive" if result.ok else "unknown", "", None)
                continue
            elsewhere = foreign_unit(runner.path, _plist_directory(self.plist(label)))
            if elsewhere:
                found[runner.name] = not_its_own(label, elsewhere)
                continue
            pid, status = row
            active = "active" if pid else ("failed" if status not in (0, None) else "inactive")
            found[runner.name] = ServiceState(label, "agent", True, active,
                                              "running" if pid else f"exit {status}", pid)
        return found

    async def start(self, runner: Runner, state: ServiceState) -> CommandResult:
        return await self._run(["launchctl", "load", "-w", str(self.plist(state.unit))])

    async def stop(self, runner: Runner, state: ServiceState) -> CommandResult:
        return await self._run(["launchctl", "unload", str(self.plist(state.unit))])

    async def install(self, runner: Runner, scope: str | None) -> CommandResult:
        return await self._run([str(runner.path / "svc.sh"), "install"], cwd=runner.path)

    def check_uninstall(self, runner: Runner, state: ServiceState) -> None:
        """svc.sh runs as the daemon's account: only when no other account could change it."""
        check_runnable(runner.path / "svc.sh", os.geteuid())

    async def uninstall(self, runner: Runner, state: ServiceState) -> CommandResult:
        self.check_uninstall(runner, state)
        return await self._run([str(runner.path / "svc.sh"), "uninstall"], cwd=runner.path)


def _plist_directory(path: Path) -> str:
    """A launchd job's WorkingDirectory from its plist ("" when there is none to read)."""
    raw = read_small(path, 1 << 20, follow=True)
    if raw is None:
        return ""
    try:
        data = plistlib.loads(raw)
    except Exception:  # plistlib raises several kinds for a file that is not a plist
        return ""
    value = data.get("WorkingDirectory") if isinstance(data, dict) else None
    return value if isinstance(value, str) else ""


# What the service managers print for a pid (a pid_t: 32 bits) and an exit status. ASCII digits
# and at most ten of them: str.isdigit() also says yes to "²" and to 5,000 digits, both of
# which int() refuses with a ValueError.
_PID = re.compile(r"[0-9]{1,10}")
_STATUS = re.compile(r"-?[0-9]{1,10}")
PID_MAX = 2**31 - 1


def parse_launchctl_list(text: str) -> dict[str, tuple[int | None, int | None]]:
    """`launchctl list` rows `PID<TAB>Status<TAB>Label` -> {label: (pid, last exit status)}."""
    rows: dict[str, tuple[int | None, int | None]] = {}
    for line in text.splitlines()[1:]:
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        status = int(parts[1]) if _STATUS.fullmatch(parts[1]) else None
        rows[parts[2]] = (parse_pid(parts[0]), status)
    return rows


def parse_pid(text: str) -> int | None:
    """A service manager's pid field: a positive integer, else None (`systemctl show` prints
    MainPID=0 for a unit without a process, launchctl "-"). Whatever else the tool prints
    (`[not set]`, nothing, a word) is no pid too: a ValueError here kept the daemon from
    starting, and failed every tick and every action while it ran."""
    text = text.strip()
    if not _PID.fullmatch(text):
        return None
    pid = int(text)
    return pid if 0 < pid <= PID_MAX else None
