"""A fake runner host for the control-plane tests (runner directories, fake systemctl and
launchctl on PATH, a fake GitHub API), the daemon as a real `python -m fleet_min controlplane`
process over it, and the daemon's parts (the plane, the GitHub client, the supervisor) for
tests that run one feature alone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet_min.config import resolve
from fleet_min.controlplane.github.client import GitHub
from fleet_min.controlplane.http.routes import PLANE
from fleet_min.controlplane.runners.supervisor import Supervisor, choose
from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS
from fleet_min.controlplane.state import Plane
from fleet_min.sse import EventHub
from tests.support import cp_fakes as fakes
from tests.support.collector import stop_process
from tests.support.fake_github import TOKEN, FakeGitHub

REPO_ROOT = Path(__file__).resolve().parents[2]


class Host:
    """One fake host: where runners live, the fake tools, and the environment to run with."""

    def __init__(self, tmp: Path, github: FakeGitHub) -> None:
        self.tmp = tmp
        self.github = github
        self.root = tmp / "runners"
        self.state = tmp / "state"
        self.bin = fakes.write_bin(tmp / "bin")
        self.xdg = tmp / "xdg"
        self.home = tmp / "home"
        self.systemd = tmp / "systemd"
        self.calls_file = tmp / "calls.jsonl"
        for folder in (self.root, self.xdg, self.home, self.systemd):
            folder.mkdir(parents=True, exist_ok=True)
        self.env = {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(self.home), "XDG_CONFIG_HOME": str(self.xdg),
            "FAKE_SYSTEMD_DIR": str(self.systemd), "FAKE_LAUNCHD_DIR": str(tmp / "launchd"),
            "FAKE_CALLS": str(self.calls_file), "FLEET_GITHUB_API": github.url,
            "GH_TOKEN": TOKEN, "FLEET_SUPERVISOR": "systemd", "FLEET_SYSTEMD_SCOPE": "user",
            "FLEET_TICK_S": "0.5", "FLEET_BUSY_TICK_S": "0.3", "FLEET_GITHUB_S": "0.5",
            "FLEET_CEILING": "4", "FLEET_MIN_FREE_MEM_MB": "0", "FLEET_MIN_FREE_DISK_GB": "0",
            "FLEET_MAX_LOAD_PER_CORE": "64", "FLEET_HEALTH_SCRIPT": str(self.bin / "health-check"),
            "FLEET_COMMAND_TIMEOUT_S": "20", "FLEET_ROOT": str(self.root),
            "FLEET_STATE_DIR": str(self.state), "FLEET_SQLITE_SYNCHRONOUS": "NORMAL",
        }

    def add_runner(self, name: str, repo: str = "octo/app", labels: list[str] | None = None,
                   *, registered: bool = True, unit: bool = True, status: str = "online",
                   staged: tuple[str, ...] = ()) -> Path:
        path = fakes.make_install(self.root / name, staged=staged)
        agent_id = self.github.add_runner(repo, name, labels, status) if registered else 7
        self.github.repo(repo)
        fakes.write_runner_file(path, name, repo, agent_id)
        if unit:
            fakes.user_unit(self.xdg, path, repo, name)
        return path

    def unit(self, name: str, repo: str = "octo/app") -> str:
        return f"actions.runner.{repo.replace('/', '-')}.{name}.service"

    def start_unit(self, name: str, repo: str = "octo/app") -> int:
        """Start a runner's service with the fake systemctl, as systemd would at boot."""
        subprocess.run(["systemctl", "--user", "start", self.unit(name, repo)], env=self.full_env(),
                       check=True, timeout=20)
        return self.wait_listener(name)

    def wait_listener(self, name: str, timeout: float = 10) -> int:
        pid_file = self.root / name / "listener.pid"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pid_file.exists() and pid_file.read_text().strip():
                pid = int(pid_file.read_text())
                if fakes.pid_alive(pid):
                    return pid
            time.sleep(0.05)
        raise AssertionError(f"the listener of {name} did not start")

    def full_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def calls(self, tool: str | None = None) -> list[dict[str, Any]]:
        return [c for c in fakes.calls(self.calls_file) if tool in (None, c["tool"])]


def make_config(host: Host, **overrides: Any) -> Any:
    return resolve(CONTROLPLANE_SETTINGS, {}, environ=host.env, **overrides)


@dataclass
class Parts:
    """What the app hands its features: the plane, a GitHub client, the supervisor, a hub."""

    plane: Plane
    github: GitHub
    supervisor: Supervisor
    hub: EventHub


@contextlib.asynccontextmanager
async def open_parts(host: Host, env: dict[str, str] | None = None,
                     **overrides: Any) -> AsyncIterator[Parts]:
    """The plane opened over the fake host (its database, tokens, settings) and a GitHub client
    with the fake API's token, as the app opens them; closed at the end."""
    env = host.full_env() if env is None else env
    cfg = resolve(CONTROLPLANE_SETTINGS, {}, environ=env, **overrides)
    plane = Plane(cfg, env)
    github = GitHub(cfg.github_api, TOKEN)
    await plane.open()
    try:
        yield Parts(plane, github, choose(cfg.supervisor, cfg.systemd_scope,
                                          cfg.command_timeout_s), EventHub(latest_only=True))
    finally:
        await github.close()
        await plane.close()


@contextlib.asynccontextmanager
async def running(*contexts: Callable[[object], AsyncIterator[None]]) -> AsyncIterator[None]:
    """Features' cleanup contexts (their `running`) entered in order and left in reverse, as
    the app does at start and stop."""
    async with contextlib.AsyncExitStack() as stack:
        for context in contexts:
            await stack.enter_async_context(contextlib.asynccontextmanager(context)(None))
        yield


def cp_of(client: Any) -> Plane:
    """The plane (the daemon's state) of an in-process control plane."""
    return client.server.app[PLANE]


def auth(cp: Plane) -> dict[str, str]:
    return {"Authorization": f"Bearer {cp.control_token}"}


async def until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


class Daemon:
    """`python -m fleet_min controlplane` as a real process on a free port."""

    def __init__(self, host: Host, extra_env: dict[str, str] | None = None,
                 args: tuple[str, ...] = (), port: int = 0) -> None:
        """port 0: any free port; a fixed one lets a restarted daemon keep its address."""
        self.host = host
        env = {**host.full_env(), **(extra_env or {}), "PYTHONPATH": str(REPO_ROOT)}
        with open(host.tmp / "daemon.log", "ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleet_min", "controlplane", "--port", str(port),
                 "--root", str(host.root), "--state", str(host.state), *args],
                env=env, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "listening on" not in line:
            self.proc.kill()
            raise AssertionError(f"daemon did not start: {line!r} "
                                 f"{(host.tmp / 'daemon.log').read_text()[-2000:]}")
        self.url = line.strip().rsplit(" ", 1)[-1]

    @property
    def token(self) -> str:
        return (self.host.state / "control-token").read_text().strip()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def stop(self) -> int:
        return stop_process(self.proc)


def agent_token(coord_host: Host, agent_host: Host) -> str:
    """A separate agent token on the coordinator (`controlplane token --agent`), written to the
    agent host's coordinator-token file (0600) as an operator would."""
    env = {**coord_host.full_env(), "PYTHONPATH": str(REPO_ROOT)}
    token = subprocess.run(
        [sys.executable, "-m", "fleet_min", "controlplane", "token", "--agent", "--state",
         str(coord_host.state)], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
        check=True, timeout=60).stdout.strip()
    agent_host.state.mkdir(parents=True, exist_ok=True)
    (agent_host.state / "coordinator-token").write_text(token + "\n")
    (agent_host.state / "coordinator-token").chmod(0o600)
    return token

