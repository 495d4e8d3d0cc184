"""A control plane with something to show, for the control-plane UI's browser test.

It reuses the control-plane tests' fake host (runner installations, the fake `systemctl` on
PATH, the fake GitHub API) and starts the real `python -m fleet_min controlplane` on a port it
picks, so a test can stop the daemon and start it again on the same address (the page must
reconnect by itself).

Two fuller scenes for the page survey: `busy_scene` adds weeks of job history (analytics,
repository detail, simulation, forecast, concurrency findings), an Actions bill, admission
decisions, autoscale on and two agent hosts with their runners; `empty_scene` is a daemon with no
runner and no history.

Run it by hand to look at the UI: `python -m tests.support.cp_fixtures` (add `--busy`, `--empty`
or `--read-only`) prints the address and the control token and serves until Ctrl-C.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.support import cp_fakes as fakes
from tests.support import history_gen
from tests.support.collector import (
    free_port,
    stop_process,
)
from tests.support.controlplane import REPO_ROOT, Host
from tests.support.fake_github import FakeGitHub

# A secret in a runner's diagnostic log: the page must only ever show it redacted.
LOG_SECRET = "ghp_" + "Zq8" * 12
BUSY_RUNNER = "app-build-1"
DRAIN_RUNNER = "app-build-2"


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


# What GitHub answers for the octo organisation's Actions minutes this billing cycle.
BILLING = {"total_minutes_used": 1234, "total_paid_minutes_used": 34, "included_minutes": 3000,
           "minutes_used_breakdown": {"UBUNTU": 1200, "MACOS": 34}}
# The generated history's runner names, renamed to the scene's, so a runner's page lists its jobs.
HISTORY_RUNNERS = {"app-1": BUSY_RUNNER, "app-2": DRAIN_RUNNER, "web-1": "web-gpu-1"}
AGENTS = {"pi-shelf-2": ["pi-runner-1", "pi-runner-2"], "edge": ["edge-1"]}


def populate_history(host: Host, days: int = 28) -> None:
    """Weeks of finished jobs for both repositories (served by the fake GitHub for the daemon
    to backfill), the workflow files of octo/app and the octo organisation's Actions bill."""
    end = time.time()
    histories = [history_gen.generate("octo/app", end, days, runners=2, seed=7,
                                      ids=itertools.count(5_000_000)),
                 history_gen.generate("octo/web", end, days, runners=1, seed=11,
                                      ids=itertools.count(8_000_000))]
    for history in histories:
        for job in history.all_jobs():
            job["runner_name"] = HISTORY_RUNNERS.get(job.get("runner_name"),
                                                     job.get("runner_name"))
        host.github.load_history(history)
    host.github.repo("octo/app")["files"].update(history_gen.WORKFLOW_FILES)
    host.github.accounts["octo"] = "Organization"
    host.github.billing["octo"] = BILLING
    host.env.update({"FLEET_BACKFILL_DAYS": str(days), "FLEET_HISTORY_S": "1",
                     "FLEET_WORKFLOWS_S": "30"})


def write_admission_log(host: Host, count: int = 40) -> None:
    """The job-started hook's log: jobs admitted at once, held while the host was loaded and
    released later, over the last hours."""
    host.state.mkdir(parents=True, exist_ok=True)
    decisions = ("admitted", "held", "released")
    with open(host.state / "admission.log", "w", encoding="utf-8") as log:
        for n in range(count):
            decision = decisions[n % 3]
            log.write(json.dumps({
                "at": _ago(5 * (count - n)), "decision": decision,
                "wait_s": 40 + 7 * n if decision == "released" else None,
                "reason": "load per core 2.1 above 1.5" if decision != "admitted"
                else "load per core 0.4", "load": 2.1 if decision != "admitted" else 0.4,
                "runner": BUSY_RUNNER, "repo": "octo/app", "run_id": 5000 + n,
                "job": ("build", "unit tests", "e2e (chromium)")[n % 3], "workflow": "CI"})
                + "\n")


def heartbeat(url: str, token: str, host: str, runners: list[str] | None = None,
              repo: str = "octo/shelf") -> None:
    """An agent host reports to the coordinator at `url`, so it has more than this host."""
    body = json.dumps({"host": host, "runners": [
        {"name": name, "repo": repo, "state": "idle" if i else "working", "busy": not i,
         "registration": "registered", "labels": ["self-hosted", "linux", "arm64"]}
        for i, name in enumerate(runners or ["pi-runner-1"])],
        "load": [0.4, 0.3, 0.2], "capacity": {"ceiling": 2, "busy": 1}}).encode()
    request = urllib.request.Request(f"{url}/api/host/heartbeat", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


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


def busy_scene(tmp: Path, github: FakeGitHub) -> UiDaemon:
    """The populated scene plus history, billing, admission, autoscale and two agent hosts;
    returned once the daemon has fetched the history."""
    host = make_host(tmp, github)
    populate(host)
    populate_history(host)
    write_admission_log(host)
    # Both octo/app runners busy and a run waiting for one: autoscale proposes a copy.
    (host.root / DRAIN_RUNNER / ".fake-busy").touch()
    for name in (BUSY_RUNNER, DRAIN_RUNNER):
        github.repo("octo/app")["runners"][name]["busy"] = True
    github.add_run("octo/app", "queued", _ago(2), ["self-hosted", "linux"], name="CI")
    for runners in AGENTS.values():
        for name in runners:
            github.add_runner("octo/shelf", name, ["arm64"], busy=name.endswith("1"))
    daemon = UiDaemon(host, {"FLEET_AUTOSCALE": "on", "FLEET_STALE_AFTER_S": "3600",
                             "FLEET_CEILING": "8"}).start()
    for agent, runners in AGENTS.items():
        heartbeat(daemon.url, daemon.token, agent, runners)
    deadline = time.monotonic() + 180
    while True:
        history = get_json(f"{daemon.url}/api/analytics")["history"]
        if history and all(h["backfill_complete"] for h in history
                           if h["repo"] in ("octo/app", "octo/web")):
            return daemon
        if time.monotonic() > deadline:
            daemon.stop()
            raise AssertionError(f"the history was not fetched in time: {history}")
        time.sleep(0.5)


def empty_scene(tmp: Path, github: FakeGitHub) -> UiDaemon:
    """A daemon with no runner, no history and nothing watched."""
    return UiDaemon(make_host(tmp, github)).start()


def main() -> None:  # pragma: no cover - a manual aid
    # SIGTERM (and SIGINT, ignored by a shell's background jobs) ends it through `finally`,
    # which stops the daemon, the fake listeners and the fake GitHub.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    github = FakeGitHub()
    github.start()
    tmp = Path(tempfile.mkdtemp(prefix="fleet-cp-ui-"))
    if "--busy" in sys.argv:
        daemon = busy_scene(tmp, github)
    elif "--empty" in sys.argv:
        daemon = empty_scene(tmp, github)
    else:
        host = make_host(tmp, github)
        populate(host)
        daemon = UiDaemon(host, {"FLEET_READ_ONLY": "1"} if "--read-only" in sys.argv else None)
        daemon.start()
    host = daemon.host
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
