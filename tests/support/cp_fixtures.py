"""A control plane with something to show, for the control-plane UI's browser test.

It reuses the control-plane tests' fake host (runner installations, the fake `systemctl` on
PATH, the fake GitHub API) and starts the real `python -m fleet_min controlplane` on a port it
picks, so a test can stop the daemon and start it again on the same address (the page must
reconnect by itself).

Run it by hand to look at the UI: `python -m tests.web.cp_fixtures` prints the address and the
control token and serves until Ctrl-C.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tests.support import cp_fakes as fakes
from tests.support.collector import stop_process
from tests.support.controlplane import REPO_ROOT, Host
from tests.support.fake_github import FakeGitHub

# A secret in a runner's diagnostic log: the page must only ever show it redacted.
LOG_SECRET = "ghp_" + "Zq8" * 12
BUSY_RUNNER = "app-build-1"
DRAIN_RUNNER = "app-build-2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ago(minutes: float) -> str:
    return (datetime.now(UTC) - timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def populate(host: Host) -> None:
    """Two repositories, five runners in the states a person meets: working, idle, stopped
    (a dead service), unregistered; a queued run nobody can take, one in progress."""
    for name in (BUSY_RUNNER, DRAIN_RUNNER):
        host.add_runner(name, "octo/app", labels=["linux"])
    host.add_runner("web-gpu-1", "octo/web", labels=["gpu"])
    host.add_runner("web-old", "octo/web", labels=["gpu"])
    host.add_runner("stray", "octo/web", labels=["gpu"], registered=False)
    diag = host.root / BUSY_RUNNER / "_diag"
    diag.mkdir()
    (diag / "Runner_20250101-000000-utc.log").write_text(
        "[2025-01-01 00:00:00Z INFO Listener] Listening for Jobs\n"
        f"[2025-01-01 00:00:01Z INFO Runner] GH_TOKEN={LOG_SECRET}\n"
        "[2025-01-01 00:00:02Z WARN Runner] slow disk\n"
        "[2025-01-01 00:00:03Z ERR  Runner] job aborted: exit code 137\n")
    (host.root / BUSY_RUNNER / ".fake-busy").touch()
    for name in (BUSY_RUNNER, DRAIN_RUNNER, "web-gpu-1", "stray"):
        repo = "octo/app" if name.startswith("app") else "octo/web"
        host.start_unit(name, repo)
    host.github.add_run("octo/app", "queued", _ago(3), ["self-hosted", "arm64"], name="Release")
    host.github.add_run("octo/app", "in_progress", _ago(6), ["self-hosted", "linux"],
                        runner=BUSY_RUNNER, name="CI")


class UiDaemon:
    """`python -m fleet_min controlplane` on a fixed port: stop() and start() keep the address."""

    def __init__(self, host: Host, extra_env: dict[str, str] | None = None) -> None:
        self.host = host
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**host.full_env(), **(extra_env or {}), "PYTHONPATH": str(REPO_ROOT)}
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> UiDaemon:
        with open(self.host.tmp / "daemon.log", "ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleet_min", "controlplane", "--port", str(self.port),
                 "--root", str(self.host.root), "--state", str(self.host.state)],
                env=self.env, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "listening on" not in line:
            self.proc.kill()
            raise AssertionError(f"daemon did not start: {line!r} "
                                 f"{(self.host.tmp / 'daemon.log').read_text()[-2000:]}")
        return self

    @property
    def token(self) -> str:
        return (self.host.state / "control-token").read_text().strip()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def make_host(tmp: Path, github: FakeGitHub) -> Host:
    host = Host(tmp, github)
    # Ticks fast enough for a test to see a drain land; slower than the API tests' to keep
    # the page's work (one full snapshot per tick) small.
    host.env.update({"FLEET_TICK_S": "1", "FLEET_BUSY_TICK_S": "0.5", "FLEET_GITHUB_S": "1"})
    return host


def main() -> None:  # pragma: no cover - a manual aid
    # SIGTERM (and SIGINT, ignored by a shell's background jobs) ends it through `finally`,
    # which stops the daemon, the fake listeners and the fake GitHub.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    github = FakeGitHub()
    github.start()
    tmp = Path(tempfile.mkdtemp(prefix="fleet-cp-ui-"))
    host = make_host(tmp, github)
    populate(host)
    daemon = UiDaemon(host, {"FLEET_READ_ONLY": "1"} if "--read-only" in sys.argv else None)
    daemon.start()
    print(f"{daemon.url}  token: {daemon.token if 'FLEET_READ_ONLY' not in daemon.env else '-'}",
          flush=True)
    try:
        while daemon.proc and daemon.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        daemon.stop()
        fakes.kill_all_listeners(host.root)
        github.stop()


if __name__ == "__main__":  # pragma: no cover
    main()
