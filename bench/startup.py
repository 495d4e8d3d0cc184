"""Cold start and idle memory of the collector: `python dist/fleet.pyz collector` from the spawn
until its first answered request, and its resident memory once idle, next to `python -c pass`.

    python bench/startup.py [--runs 7] [--settle 2] [--pyz PATH] [--python PATH ...] [--quick]

The pyz is built with zipapp.py into a temporary directory (or given with `--pyz`). Ways to start:

- `pyz`: `python fleet.pyz collector`, the figure of the target (the vendored pure-Python
  aiohttp inside the zip is imported first; uvloop is used when this Python has it);
- `pyz -S`: the same without site-packages, as on a Python with nothing else installed;
- `pyz 3.12` etc.: `python3.12 fleet.pyz collector`, one for each `--python` given (other
  Python versions, which need the pyz alone);
- `module`: `python -m fleet_min collector` from the source tree (compiled extensions, cached
  bytecode), for reference.

fleet.pyz keeps the bytecode it compiles in a cache folder (fleet_min/zipstart.py); the bench
gives it a fresh one (XDG_CACHE_HOME in a temporary folder, PYTHONDONTWRITEBYTECODE unset), so
the first start of each Python compiles and fills it (`first_start_s`, one start; `pyz -S`
shares the folder of `pyz`) and the runs after it read it (`start_s`, the target's figure:
"from the second start on").

Start time is wall time from spawning the process until GET /api/health first answers 200
(polled every 2 ms); `cpu_s` is the process's own CPU time (all threads, /proc/<pid>/stat) at
that moment, which moves less with the machine's other work than the wall time. Idle RSS is
VmRSS read `--settle` seconds after that answer. The ceiling is `python -c pass` (and
`python -S -c pass`) for the start, and a bare interpreter waiting on stdin for the memory; both
are reported as ratios. Runs alternate between the kinds and the medians are reported. Page
caches are warm after the first run (dropping them needs root), so "cold" here means a new
process, not an empty cache.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, cpu_seconds, emit, free_port, memory_kib, stop_process, table

MiB = 1024
TARGET_START_S = 0.5
TARGET_PYZ_BYTES = 1_500_000


def build_pyz(folder: Path) -> Path:
    target = folder / "fleet.pyz"
    subprocess.run([sys.executable, str(ROOT / "zipapp.py"), "-o", str(target)], check=True,
                   stdout=subprocess.DEVNULL)
    return target


def answered(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/api/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def start_once(argv: list[str], settle: float, path: str | None,
               cache_home: str) -> dict[str, float]:
    """One start; `path` is PYTHONPATH (the source tree for `-m fleet_min`; never for the pyz)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "CACHE_DIRECTORY")}
        env["FLEET_LOG_LEVEL"] = "WARNING"
        env["XDG_CACHE_HOME"] = cache_home
        if path:
            env["PYTHONPATH"] = path
        started = time.perf_counter()
        proc = subprocess.Popen([*argv, "collector", "--port", str(port), "--data", data,
                                 "--bind", "127.0.0.1"], env=env, cwd=data,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while not answered(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv} exited: {proc.stderr.read()[-2000:]!r}"
                                       if proc.stderr else f"{argv} exited")
                if time.perf_counter() - started > 60:
                    raise RuntimeError(f"{argv} did not answer in 60 s")
                time.sleep(0.002)
            start_s = time.perf_counter() - started
            cpu_s = cpu_seconds(proc.pid)
            time.sleep(settle)
            rss = memory_kib(proc.pid)["VmRSS"]
        finally:
            stop_process(proc)
            if proc.stderr:
                proc.stderr.close()
    return {"start_s": start_s, "cpu_s": cpu_s, "rss_kib": rss}


def python_version(python: str) -> str:
    return subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                          check=True, capture_output=True, text=True).stdout.strip()


def python_pass(flags: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *flags, "-c", "pass"], check=True)
    return time.perf_counter() - started


def bare_interpreter_rss() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        time.sleep(0.3)
        return memory_kib(proc.pid)["VmRSS"]
    finally:
        with contextlib.suppress(OSError):
            proc.communicate(b"", timeout=10)


def kinds_of(pyz: Path, others: list[str]) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {"pyz": [sys.executable, str(pyz)],
                                   "pyz -S": [sys.executable, "-S", str(pyz)]}
    for python in others:
        kinds[f"pyz {python_version(python)}"] = [python, str(pyz)]
    kinds["module"] = [sys.executable, "-m", "fleet_min"]
    return kinds


def measure(kinds: dict[str, list[str]], runs: int, settle: float, cache_home: str
            ) -> tuple[dict[str, list[dict[str, float]]], dict[str, float], dict[str, list[float]],
                       list[int]]:
    """The first start of each pyz kind (it fills the cache), then `runs` rounds of every kind."""
    first: dict[str, float] = {}
    for kind, argv in kinds.items():
        if kind.startswith("pyz") and argv[0] not in {kinds[k][0] for k in first}:
            first[kind] = start_once(argv, settle, None, cache_home)["start_s"]
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    passes: dict[str, list[float]] = {"python -c pass": [], "python -S -c pass": []}
    bare_rss: list[int] = []
    for run in range(runs):
        passes["python -c pass"].append(python_pass([]))
        passes["python -S -c pass"].append(python_pass(["-S"]))
        bare_rss.append(bare_interpreter_rss())
        for kind, argv in kinds.items():
            figures = start_once(argv, settle, str(ROOT) if kind == "module" else None,
                                 cache_home)
            samples[kind].append(figures)
            emit({"bench": "startup", "figure": "run", "run": run, "kind": kind, **figures})
    return samples, first, passes, bare_rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="starts of each kind")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds idle before reading RSS")
    parser.add_argument("--pyz", type=Path, help="measure this pyz instead of building one")
    parser.add_argument("--python", action="append", default=[], metavar="PATH",
                        help="another Python to start the pyz with (repeatable)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.settle = 1, 0.2
    load = Path("/proc/loadavg").read_text().split()[0]  # the machine is shared
    with tempfile.TemporaryDirectory() as folder:
        pyz = args.pyz.resolve() if args.pyz else build_pyz(Path(folder))
        kinds = kinds_of(pyz, args.python)
        samples, first, passes, bare_rss = measure(kinds, args.runs, args.settle,
                                                   str(Path(folder) / "cache"))
        pyz_bytes = pyz.stat().st_size
    pass_s = statistics.median(passes["python -c pass"])
    pass_s_bare = statistics.median(passes["python -S -c pass"])
    interp_kib = statistics.median(bare_rss)
    results: dict[str, dict[str, Any]] = {}
    for kind, argv in kinds.items():
        start_s = statistics.median(s["start_s"] for s in samples[kind])
        rss = statistics.median(s["rss_kib"] for s in samples[kind])
        ceiling = pass_s_bare if kind == "pyz -S" else pass_s
        results[kind] = {"bench": "startup", "figure": "start", "kind": kind, "runs": args.runs,
                         "python": python_version(argv[0]), "start_s": start_s,
                         "first_start_s": first.get(kind),
                         "cpu_s": statistics.median(s["cpu_s"] for s in samples[kind]),
                         "idle_rss_mib": rss / MiB,
                         "python_pass_s": ceiling, "start_ratio": start_s / ceiling,
                         "interpreter_rss_mib": interp_kib / MiB,
                         "rss_ratio": rss / interp_kib,
                         "target": {"start_s": TARGET_START_S, "idle_rss_mib": 45}}
        emit(results[kind])
    emit({"bench": "startup", "figure": "ceiling", "python_pass_s": pass_s,
          "python_S_pass_s": pass_s_bare, "interpreter_rss_mib": interp_kib / MiB,
          "pyz_kib": pyz_bytes // 1024, "pyz_bytes": pyz_bytes,
          "target_pyz_bytes": TARGET_PYZ_BYTES, "cores": os.cpu_count(), "loadavg": load})
    rows = [("python -c pass s", f"{pass_s:.3f}", "the ceiling"),
            ("bare interpreter RSS MiB", f"{interp_kib / MiB:.1f}", ""),
            ("fleet.pyz size KiB", f"{pyz_bytes // 1024}",
             f"{pyz_bytes:,} bytes; target <= {TARGET_PYZ_BYTES:,}")]
    for kind, r in results.items():
        first_s = r["first_start_s"]
        rows.append((f"{kind}: start s", f"{r['start_s']:.3f}",
                     f"{r['start_ratio']:.1f}x python -c pass; CPU {r['cpu_s']:.3f} s"
                     + (f"; first start {first_s:.3f} s" if first_s is not None else "")
                     + f"; Python {r['python']}; target <= {TARGET_START_S}"))
        rows.append((f"{kind}: idle RSS MiB", f"{r['idle_rss_mib']:.1f}", "target <= 45"))
    rows.append(("load average at start", load, f"{os.cpu_count()} cores, shared"))
    table(rows)


if __name__ == "__main__":
    main()
