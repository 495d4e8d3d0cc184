"""Where a server's CPU goes under the lifecycle's load, by part of the server: a sampling
profile (py-spy) of each server while bench/lifecycle.py's agents load it, each thread's samples
weighed by that thread's own CPU time (/proc), so the parts add up to the server's CPU a job.

    python bench/profile_split.py [--servers collector,floor] [--agents 50] [--procs 3]
                                  [--seconds 10] [--rate 400] [--rounds 2] [--quick]

The servers are profiled one after another, in the order given and then in the reverse order
in every other round (this machine's speed moves from one minute to the next); each figure is
the median over the rounds.

Each sample goes to one part, by where it was taken:

- `http`: aiohttp, asyncio, uvloop and the modules they lean on (yarl, multidict, weakref
  sets), and the connection wrapper of fleet_min.serving, whose samples are aiohttp's C parser
  running under it: what the bare server pays too;
- `bodies`: the transactions' bodies, their SQL and the Python around it (the collector: under
  fleet_min.db's `_run_bodies`, on the loop's thread; the durable servers: their writer
  thread's work functions);
- `commit`: the COMMITs (the collector's db-commit thread; the durable servers' COMMIT line);
- `writer`: the collector's group commit outside the bodies and the COMMIT;
- `app`: every other sample of the server's own code and the standard library it calls
  (validation, JSON, the dispatcher, effects, replies).

For the collector the bodies are also split by the function each transaction runs. A sample's
share is a share of the time its thread was running, not waiting, so a part's figure carries
py-spy's sampling error: about a tenth of a part under 5 us a job. Needs py-spy (the test extra
installs it; it is found on PATH or among this interpreter's scripts) and the right to read
another process's memory (root, or kernel.yama.ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, emit, server, table, thread_cpu_seconds
from bench.lifecycle import load

PARTS = ("http", "bodies", "commit", "writer", "app")
_HTTP_FILES = re.compile(r"\((aiohttp|asyncio|uvloop|yarl|multidict|aiosignal|frozenlist)/"
                         r"|\(_weakrefset\.py|\(<frozen abc>|\(selectors\.py")
_SERVING_WRAPPER = "_Counted."  # fleet_min.serving's protocol around aiohttp's
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>\d+)\)")


def py_spy() -> str | None:
    """py-spy's executable: on PATH, or where pip put the scripts of this interpreter (a venv's
    bin, or the user scheme's ~/.local/bin, which need not be on PATH when pip installs there)."""
    found = shutil.which("py-spy")
    if found:
        return found
    folders = {sysconfig.get_path("scripts"), Path(sys.executable).parent}
    with contextlib.suppress(KeyError):
        folders.add(sysconfig.get_path("scripts", f"{os.name}_user"))
    for folder in folders:
        found = shutil.which("py-spy", path=str(folder))
        if found:
            return found
    return None


def _commit_line() -> int:
    """The line of the durable servers' writer that COMMITs (their other lines run bodies)."""
    lines = (ROOT / "bench" / "durable_server.py").read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if 'execute("COMMIT")' in text)


def part_of(frames: list[str], thread_name: str, commit_line: int) -> tuple[str, str | None]:
    """A sample's part, and for a collector's body the function the transaction ran."""
    if thread_name == "db-commit":
        return "commit", None
    for i, frame in enumerate(frames):
        if frame.startswith("_run_bodies (fleet_min/db.py"):
            body = next((f for f in frames[i + 1:] if not f.startswith(
                ("Service.transact.<locals>.run", "_OpenTransaction"))), "(the batch itself)")
            return "bodies", _FRAME.sub(r"\g<func> (\g<file>)", body)
        if frame.startswith("Writer._run (bench/durable_server.py"):
            own = _FRAME.match(frame)
            if frame is frames[-1] and own and own["line"] == str(commit_line):
                return "commit", None
            return "bodies", None
    leaf = frames[-1] if frames else ""
    if "(fleet_min/db.py" in leaf or any(f.startswith("_Writer.") for f in frames):
        return "writer", None
    if _HTTP_FILES.search(leaf) or leaf.startswith(_SERVING_WRAPPER) or not frames:
        return "http", None
    if leaf.startswith(("Runner.run ", "run_app ", "run ")):
        return "http", None  # the native event loop, sampled at its Python caller
    return "app", None


def split(raw: str, cpu: dict[int, float], jobs: int, commit_line: int
          ) -> tuple[dict[str, float], dict[str, float]]:
    """us a job by part, and by body function, from py-spy's raw (collapsed) output."""
    samples: dict[int, collections.Counter[tuple[str, str | None]]] = collections.defaultdict(
        collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        found = _THREAD.match(head)
        if found is None:
            continue
        name = head.split(": ", 1)[1] if ": " in head else ""
        samples[int(found["tid"])][part_of(frames, name, commit_line)] += int(count)
    parts = dict.fromkeys(PARTS, 0.0)
    bodies: dict[str, float] = collections.defaultdict(float)
    for tid, counted in samples.items():
        total = sum(counted.values())
        for (part, body), n in counted.items():
            share = 1e6 * cpu.get(tid, 0.0) * n / total / max(jobs, 1)
            parts[part] += share
            if body is not None:
                bodies[body] += share
    return parts, dict(bodies)


def profile(spy_path: str, kind: str, agents: int, procs: int, seconds: float, rate: int
            ) -> dict[str, Any]:
    """One server, warmed up, then loaded for `seconds` under py-spy."""
    with server(kind) as (address, pid), tempfile.TemporaryDirectory() as scratch:
        load(address, pid, f"{kind}-warm", agents, procs, min(seconds, 3.0))
        out = Path(scratch) / "samples.txt"
        spy = subprocess.Popen(
            [spy_path, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
             "--output", str(out), "--duration", str(max(1, round(seconds))),
             "--nonblocking", "--threads"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)  # py-spy attached before the load starts
        before = thread_cpu_seconds(pid)
        got = load(address, pid, kind, agents, procs, seconds)
        after = thread_cpu_seconds(pid)
        _, why = spy.communicate(timeout=seconds + 60)
        if spy.returncode != 0 or not out.exists():
            raise SystemExit(f"py-spy could not profile the {kind} server: {why.strip()}")
        cpu = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
        parts, bodies = split(out.read_text(), cpu, int(got["jobs"]), _commit_line())
    jobs = max(got["jobs"], 1)
    return {"bench": "profile_split", "server": kind, "jobs": got["jobs"],
            "jobs_per_s": got["jobs"] / got["wall_s"],
            "cpu_us_per_job": 1e6 * got["server_cpu_s"] / jobs,
            "main_thread_us_per_job": 1e6 * got["server_main_thread_cpu_s"] / jobs,
            "parts_us_per_job": parts, "bodies_us_per_job": bodies}


def median_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's rounds as one record: the median of each figure, part and body."""
    def med(values: list[float]) -> float:
        return statistics.median(values)

    bodies = {body for r in records for body in r["bodies_us_per_job"]}
    return {"bench": "profile_split", "figure": "profile_split", "server": records[0]["server"],
            "rounds": len(records),
            **{key: med([r[key] for r in records]) for key in (
                "jobs", "jobs_per_s", "cpu_us_per_job", "main_thread_us_per_job")},
            "parts_us_per_job": {part: med([r["parts_us_per_job"][part] for r in records])
                                 for part in PARTS},
            "bodies_us_per_job": {body: med([r["bodies_us_per_job"].get(body, 0.0)
                                             for r in records]) for body in bodies}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="collector,floor",
                        help="comma-separated: collector, floor, durable, bare")
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=400, help="py-spy's samples a second")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.procs, args.seconds, args.rounds = 6, 1, 2.0, 1
    spy_path = py_spy()
    if spy_path is None:
        raise SystemExit("profile_split needs py-spy: pip install py-spy (constraints.txt "
                         "holds the version the suite uses)")
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    unknown = set(kinds) - {"collector", "floor", "durable", "bare"}
    if unknown:
        raise SystemExit(f"unknown servers: {', '.join(sorted(unknown))}; "
                         "choose from collector, floor, durable, bare")
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else reversed(kinds):
            record = {**profile(spy_path, kind, args.agents, args.procs, args.seconds, args.rate),
                      "round": r}
            emit(record)
            rounds[kind].append(record)
    got = [median_of(rounds[kind]) for kind in kinds]
    for record in got:
        emit(record)
    rows = []
    for record in got:
        rows.append((f"{record['server']} CPU us/job", f"{record['cpu_us_per_job']:.1f}",
                     f"{record['jobs_per_s']:.0f} jobs/s"))
        for part in PARTS:
            value = record["parts_us_per_job"][part]
            if value:
                rows.append((f"  {part}", f"{value:.1f}", ""))
        for body, value in sorted(record["bodies_us_per_job"].items(), key=lambda kv: -kv[1]):
            rows.append((f"    {body}", f"{value:.1f}", "a transaction body"))
    table(rows)


if __name__ == "__main__":
    main()
