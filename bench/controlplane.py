"""Control plane: snapshot rebuild time with 1,000 runners, and the simulation of 100,000 jobs
for 5 runner counts through POST /api/simulate.

    python bench/controlplane.py [--runners 1000] [--rebuilds 30] [--jobs 100000] [--quick]

The host is laid out with the test fakes (tests/support/cp_fakes.py): 1,000 runner installations
across 10 repositories, each with its `.runner` file and a user unit, a fake `systemctl` on PATH
(a real executable, here a Python script) and a fake GitHub API (tests/controlplane/
fake_github.py) that knows every runner's registration and a few queued runs.

Rebuild, two ways:

- engine: Snapshots.rebuild() called in this process (the daemon's own code, after one GitHub
  refresh) `--rebuilds` times; median and p90 of the wall time, the supervisor query (one
  `systemctl show` for all units, timed inside each rebuild; it runs while discovery walks the
  root, so it is not a part of the wall time to subtract), and this process's CPU time per
  rebuild, all threads (which leaves out the systemctl child): the control plane's own cost,
  the figure of the target. Then `--rebuilds` more with the supervisor answering at once from
  the last real answer ("without supervisor": our own code's wall time). Discovery of
  the runner directories and processes (as the daemon does it, with its cache of runner files,
  and cold, every file read), host vitals and the JSON encoding are also timed alone. The runner
  files are laid out more than runners.RACY_NS before the rebuilds are timed (as on a host whose
  runners were configured earlier; a runner changed in the last 2 s is read at every rebuild),
  and the runner reads during the timed rebuilds are reported.
- API: a real `python -m fleet_min controlplane` process; POST /api/settings changes a live
  setting, which rebuilds before answering, so its round trip is a forced rebuild plus two small
  committed writes and HTTP.

The supervisor query is an external process. The fake systemctl is a Python script started with
`python -S` (it stands for a compiled binary; without -S a start here costs ~50 ms of
site-packages import hooks), so its cost is mostly an interpreter start: `python -S -c pass` is
measured alongside as that part's floor (and `python -c pass` for reference), and the rebuild
without the supervisor query is reported as what our own code costs.

Simulation: 100,000 completed jobs of one repository are written into the daemon's history table
before it starts; POST /api/simulate {repo, runnerCounts: 5 counts, sloSec} is timed. Ceiling:
the same replay (fleet_min.controlplane.analysis.simulate.compare) on the same rows in this
process, read with plain sqlite3. When the daemon has no such route (404/405), the figure is
skipped with a message saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, emit, percentile, stop_process, table
from fleet_min import jsonio
from fleet_min.config import resolve
from fleet_min.controlplane import store
from fleet_min.controlplane.github.client import GitHub
from fleet_min.controlplane.github.sync import GitHubSync
from fleet_min.controlplane.runners.discovery import RACY_NS, discover
from fleet_min.controlplane.runners.procs import process_table
from fleet_min.controlplane.runners.supervisor import choose
from fleet_min.controlplane.runners.vitals import host_vitals
from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.controlplane.state import Plane
from fleet_min.db import migrate
from fleet_min.sse import EventHub
from tests.support import cp_fakes as fakes
from tests.support.fake_github import TOKEN, FakeGitHub

REPOS = 10
SIM_REPO = "octo/history"
RUNNER_COUNTS = [1, 2, 4, 8, 16]


class Host:
    """A fake host: runner directories, fake systemctl, environment (as the tests lay it out)."""

    def __init__(self, tmp: Path, github: FakeGitHub, runners: int) -> None:
        self.root, self.state = tmp / "runners", tmp / "state"
        self.bin = fakes.write_bin(tmp / "bin")
        xdg, home, systemd = tmp / "xdg", tmp / "home", tmp / "systemd"
        for folder in (self.root, xdg, home, systemd):
            folder.mkdir(parents=True, exist_ok=True)
        self.env = {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(home), "XDG_CONFIG_HOME": str(xdg), "FAKE_SYSTEMD_DIR": str(systemd),
            "FAKE_LAUNCHD_DIR": str(tmp / "launchd"), "FLEET_GITHUB_API": github.url,
            "GH_TOKEN": TOKEN, "FLEET_SUPERVISOR": "systemd", "FLEET_SYSTEMD_SCOPE": "user",
            "FLEET_TICK_S": "3600", "FLEET_BUSY_TICK_S": "3600", "FLEET_GITHUB_S": "3600",
            "FLEET_MIN_FREE_MEM_MB": "0", "FLEET_MIN_FREE_DISK_GB": "0",
            "FLEET_COMMAND_TIMEOUT_S": "60", "FLEET_ROOT": str(self.root),
            "FLEET_STATE_DIR": str(self.state),
        }
        for i in range(runners):
            repo, name = f"octo/app{i % REPOS}", f"runner-{i:03d}"
            path = fakes.make_install(self.root / name)
            agent_id = github.add_runner(repo, name, ["gpu"] if i % 7 == 0 else [])
            fakes.write_runner_file(path, name, repo, agent_id)
            fakes.user_unit(xdg, path, repo, name)
        self.laid_out = time.time()
        for r in range(REPOS):
            github.add_run(f"octo/app{r}", "queued", "2026-01-01T00:00:00Z",
                           ["self-hosted", "Linux"])


def timed_ms(fn: Any, times: int) -> list[float]:
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - started))
    return samples


async def engine_figures(host: Host, rebuilds: int) -> dict[str, Any]:
    cfg = resolve(CONTROLPLANE_SETTINGS, {}, environ=host.env)
    plane = Plane(cfg, host.env)
    github = GitHub(cfg.github_api, TOKEN)
    supervisor = choose(cfg.supervisor, cfg.systemd_scope, cfg.command_timeout_s)
    snapshots = Snapshots(plane, supervisor, github, EventHub(latest_only=True))
    await plane.db.open()
    try:
        plane.runners = await snapshots.discover()
        await GitHubSync(plane, github, snapshots).refresh()  # registrations and runs to show
        await snapshots.rebuild()  # the first build records every runner as seen
        # Time the supervisor query inside each rebuild (wrapping this instance's method), so
        # the rebuild's own part is measured in the same rebuild, not estimated across loops.
        real_states, in_states = snapshots.supervisor.states, []

        async def timed_states(runners: list[Any]) -> Any:
            started = time.perf_counter()
            try:
                return await real_states(runners)
            finally:
                in_states[-1] += 1000 * (time.perf_counter() - started)

        snapshots.supervisor.states = timed_states  # type: ignore[method-assign]
        reads = snapshots.discovery.reads
        totals, cpu = [], []
        for _ in range(rebuilds):
            in_states.append(0.0)
            started, cpu_started = time.perf_counter(), time.process_time()
            snapshot = await snapshots.rebuild()
            totals.append(1000 * (time.perf_counter() - started))
            cpu.append(1000 * (time.process_time() - cpu_started))
        answered = dict(snapshots.plane.states)

        async def at_once(runners: list[Any]) -> Any:
            return {r.name: answered[r.name] for r in runners if r.name in answered}

        snapshots.supervisor.states = at_once  # type: ignore[method-assign]
        own = []
        for _ in range(rebuilds):
            started = time.perf_counter()
            await snapshots.rebuild()
            own.append(1000 * (time.perf_counter() - started))
        reads = snapshots.discovery.reads - reads
        discovery = timed_ms(lambda: snapshots.discovery.discover(process_table()), rebuilds)
        cold = timed_ms(lambda: discover(host.root, process_table()), rebuilds)
        vitals = timed_ms(lambda: host_vitals(host.root), rebuilds)
        encode = timed_ms(lambda: jsonio.dumps_body(snapshot), rebuilds)
        registered = sum(1 for v in snapshot["runners"] if v["registration"] == "registered")
        return {
            "runners": len(snapshot["runners"]), "registered": registered,
            "loadavg": Path("/proc/loadavg").read_text().split()[0],
            "snapshot_kib": len(json.dumps(snapshot)) / 1024,
            "rebuild_p50_ms": percentile(totals, 0.5), "rebuild_p90_ms": percentile(totals, 0.9),
            "supervisor_p50_ms": percentile(in_states[-rebuilds:], 0.5),
            "without_supervisor_p50_ms": percentile(own, 0.5),
            "cpu_p50_ms": percentile(cpu, 0.5),
            "discovery_p50_ms": percentile(discovery, 0.5),
            "discovery_cold_p50_ms": percentile(cold, 0.5), "runner_reads": reads,
            "vitals_p50_ms": percentile(vitals, 0.5),
            "json_p50_ms": percentile(encode, 0.5), "json_library": "orjson" if jsonio.FAST
            else "json",
        }
    finally:
        await github.close()
        await plane.db.close()


def python_pass_ms(times: int, *flags: str) -> float:
    return percentile(timed_ms(lambda: subprocess.run([sys.executable, *flags, "-c", "pass"],
                                                      check=True), times), 0.5)


def load_history(state: Path, jobs: int) -> float:
    """Write `jobs` completed jobs of SIM_REPO into the daemon's history table (before it starts),
    spread over the last 29 days (the route replays 30 by default), arriving in bursts. Returns
    the seconds it took."""
    started = time.perf_counter()
    state.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(state / "controlplane.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    migrate(conn, store.MIGRATIONS)
    base = time.time() - 29 * 86400
    rows = []
    for n in range(jobs):
        created = base + (n // 20) * (28 * 86400 / max(jobs // 20, 1)) + (n % 20) * 3
        started_at = created + 5 + (n % 11) * 7
        rows.append({"job_id": 10_000_000 + n, "run_id": 5_000_000 + n // 4, "repo": SIM_REPO,
                     "name": f"job {n % 4}", "workflow": "CI", "runner": f"runner-{n % 16:03d}",
                     "status": "completed", "conclusion": "success", "created_at": created,
                     "started_at": started_at, "completed_at": started_at + 60 + (n % 37) * 10,
                     "labels": ["self-hosted", "Linux"]})
    conn.execute("BEGIN")
    store.upsert_jobs(conn, rows)
    conn.execute("COMMIT")
    conn.close()
    return time.perf_counter() - started


class Daemon:
    def __init__(self, host: Host) -> None:
        env = {**os.environ, **host.env, "PYTHONPATH": str(ROOT), "FLEET_LOG_LEVEL": "WARNING"}
        self.log = open(host.root.parent / "daemon.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet_min", "controlplane", "--port", "0",
             "--root", str(host.root), "--state", str(host.state)],
            env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"the control plane did not start: {line!r}")
        self.url = line.strip().rsplit(" ", 1)[-1]
        self.token = (host.state / "control-token").read_text().strip()

    def post(self, path: str, body: Any, timeout: float = 300) -> tuple[int, bytes, float]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, data = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, data = exc.code, exc.read()
        return status, data, time.perf_counter() - started

    def stop(self) -> None:
        stop_process(self.proc)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


def api_figures(daemon: Daemon, rebuilds: int) -> dict[str, Any]:
    samples = []
    for n in range(rebuilds):
        status, body, seconds = daemon.post("/api/settings", {
            "key": "grouping", "value": "owner" if n % 2 else "repo"})
        if status != 200:
            raise RuntimeError(f"POST /api/settings answered {status}: {body[:300]!r}")
        samples.append(1000 * seconds)
    return {"forced_rebuild_p50_ms": percentile(samples, 0.5),
            "forced_rebuild_p90_ms": percentile(samples, 0.9)}


def simulate_figures(daemon: Daemon, state: Path, jobs: int, times: int) -> dict[str, Any]:
    body = {"repo": SIM_REPO, "runnerCounts": RUNNER_COUNTS, "sloSec": 300}
    status, data, seconds = daemon.post("/api/simulate", body)
    if status in (404, 405) and b"recorded jobs" not in data:
        return {"skipped": f"POST /api/simulate answered {status}: the control plane has no "
                           "simulate route yet, so this figure was not measured"}
    if status != 200:
        raise RuntimeError(f"POST /api/simulate answered {status}: {data[:300]!r}")
    samples = [seconds]
    for _ in range(times - 1):
        status, data, seconds = daemon.post("/api/simulate", body)
        samples.append(seconds)
    replay_s = replay_alone(state, times)
    p50 = statistics.median(samples)
    return {"jobs": jobs, "runner_counts": RUNNER_COUNTS, "simulate_p50_s": p50,
            "simulate_max_s": max(samples), "response_kib": len(data) / 1024,
            "runs": len(samples), "replay_alone_s": replay_s, "ratio_to_replay": p50 / replay_s}


def replay_alone(state: Path, times: int) -> float:
    """The ceiling: the same replay (fleet_min.controlplane.analysis.simulate.compare) run in this
    process on the same rows, read with plain sqlite3; no HTTP, no event loop, no threads."""
    from fleet_min.controlplane.analysis.simulate import Trace, compare

    samples = []
    for _ in range(times):
        started = time.perf_counter()
        conn = sqlite3.connect(state / "controlplane.db")
        rows = conn.execute("SELECT job_id, created_at, started_at, completed_at FROM jobs "
                            "WHERE repo = ?", (SIM_REPO,)).fetchall()
        conn.close()
        compare(Trace.build(rows), RUNNER_COUNTS, 300)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", type=int, default=1000)
    parser.add_argument("--rebuilds", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=100_000, help="history for the simulation")
    parser.add_argument("--simulations", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.runners, args.rebuilds, args.jobs, args.simulations = 5, 3, 500, 1
    github = FakeGitHub()
    github.start()
    try:
        with tempfile.TemporaryDirectory() as folder:
            host = Host(Path(folder), github, args.runners)
            # The engine runs its commands with this process's environment, as the daemon does
            # with its own: the fake systemctl must come first on PATH.
            os.environ.update(host.env)
            floor_ms = python_pass_ms(max(3, args.rebuilds // 3), "-S")
            site_ms = python_pass_ms(max(3, args.rebuilds // 3))
            # Past the racy window of the runner files just written (see the docstring).
            time.sleep(max(0.0, host.laid_out + RACY_NS / 1e9 + 0.1 - time.time()))
            engine = asyncio.run(engine_figures(host, args.rebuilds))
            own = engine["without_supervisor_p50_ms"]
            emit({"bench": "controlplane", "figure": "rebuild", **engine,
                  "python_S_pass_p50_ms": floor_ms, "python_pass_p50_ms": site_ms,
                  "ratio_to_python_pass": engine["rebuild_p50_ms"] / floor_ms, "target_ms": 50})
            history_s = load_history(host.state, args.jobs)
            daemon = Daemon(host)
            try:
                api = api_figures(daemon, args.rebuilds)
                emit({"bench": "controlplane", "figure": "rebuild_api", "runners": args.runners,
                      **api})
                sim = simulate_figures(daemon, host.state, args.jobs, args.simulations)
            finally:
                daemon.stop()
            emit({"bench": "controlplane", "figure": "simulate", "history_load_s": history_s,
                  "target_s": 1.0, **sim})
    finally:
        github.stop()
    rows = [
        ("rebuild p50 ms (engine)", f"{engine['rebuild_p50_ms']:.1f}",
         f"{engine['runners']} runners; load average {engine['loadavg']}"),
        ("rebuild p90 ms (engine)", f"{engine['rebuild_p90_ms']:.1f}", ""),
        ("  supervisor query ms", f"{engine['supervisor_p50_ms']:.1f}",
         f"fake systemctl; python -S -c pass {floor_ms:.1f} ms (-c pass {site_ms:.1f})"),
        ("  discovery ms", f"{engine['discovery_p50_ms']:.1f}",
         f"runner dirs + /proc; {engine['runner_reads']} runner reads in the timed rebuilds"),
        ("  discovery cold ms", f"{engine['discovery_cold_p50_ms']:.1f}", "every file read"),
        ("  vitals ms", f"{engine['vitals_p50_ms']:.1f}", ""),
        ("  JSON encoding ms", f"{engine['json_p50_ms']:.1f}",
         f"snapshot {engine['snapshot_kib']:.0f} KiB, {engine['json_library']}"),
        ("rebuild without supervisor ms", f"{own:.1f}",
         "our own code, wall (the supervisor answering at once)"),
        ("rebuild CPU ms (this process)", f"{engine['cpu_p50_ms']:.1f}",
         "all threads, not the systemctl child: our own cost; target <= 50"),
        ("rebuild / python -S -c pass", f"{engine['rebuild_p50_ms'] / floor_ms:.2f}", ""),
        ("forced rebuild via API p50 ms", f"{api['forced_rebuild_p50_ms']:.1f}",
         "POST /api/settings round trip"),
    ]
    if "skipped" in sim:
        rows.append(("simulate 100k jobs x 5", "skipped", sim["skipped"]))
    else:
        rows.append(("simulate p50 s", f"{sim['simulate_p50_s']:.2f}",
                     f"{args.jobs} jobs x {len(RUNNER_COUNTS)} counts; target <= 1"))
        rows.append(("replay alone s", f"{sim['replay_alone_s']:.2f}",
                     "same rows and replay in this process"))
        rows.append(("simulate / replay alone", f"{sim['ratio_to_replay']:.2f}", ""))
    table(rows)


if __name__ == "__main__":
    main()
