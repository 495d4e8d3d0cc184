"""Cold start and idle memory of the collector: `python dist/fleet.pyz collector` from the spawn
until its first answered request, and its resident memory once idle, next to `python -c pass`.

    python bench/startup.py [--runs 7] [--settle 2] [--pyz PATH] [--quick]

The pyz is built with zipapp.py into a temporary directory (or given with `--pyz`). Three ways
to start are measured:

- `pyz`: `python fleet.pyz collector`, the figure of the target (the vendored pure-Python
  aiohttp inside the zip is imported first; uvloop is used when this Python has it);
- `pyz -S`: the same without site-packages, as on a Python with nothing else installed;
- `module`: `python -m fleet_min collector` from the source tree (compiled extensions, cached
  bytecode), for reference.

Start time is wall time from spawning the process until GET /api/health first answers 200
(polled every 2 ms). Idle RSS is VmRSS read `--settle` seconds after that answer. The ceiling
is `python -c pass` (and `python -S -c pass`) for the start, and a bare interpreter waiting on
stdin for the memory; both are reported as ratios. Runs alternate and the medians are reported.
Page caches are warm after the first run (dropping them needs root), so "cold" here means a new
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

from bench.common import ROOT, emit, free_port, memory_kib, stop_process, table

MiB = 1024


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


def start_once(argv: list[str], settle: float, path: str | None) -> dict[str, float]:
    """One start; `path` is PYTHONPATH (the source tree for `-m fleet_min`; never for the pyz)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["FLEET_LOG_LEVEL"] = "WARNING"
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
            time.sleep(settle)
            rss = memory_kib(proc.pid)["VmRSS"]
        finally:
            stop_process(proc)
            if proc.stderr:
                proc.stderr.close()
    return {"start_s": start_s, "rss_kib": rss}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="starts of each kind")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds idle before reading RSS")
    parser.add_argument("--pyz", type=Path, help="measure this pyz instead of building one")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.settle = 1, 0.2
    with tempfile.TemporaryDirectory() as folder:
        pyz = args.pyz.resolve() if args.pyz else build_pyz(Path(folder))
        kinds: dict[str, list[str]] = {
            "pyz": [sys.executable, str(pyz)],
            "pyz -S": [sys.executable, "-S", str(pyz)],
            "module": [sys.executable, "-m", "fleet_min"],
        }
        samples: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        passes: dict[str, list[float]] = {"python -c pass": [], "python -S -c pass": []}
        bare_rss: list[int] = []
        for run in range(args.runs):
            passes["python -c pass"].append(python_pass([]))
            passes["python -S -c pass"].append(python_pass(["-S"]))
            bare_rss.append(bare_interpreter_rss())
            for kind, argv in kinds.items():
                figures = start_once(argv, args.settle, str(ROOT) if kind == "module" else None)
                samples[kind].append(figures)
                emit({"bench": "startup", "figure": "run", "run": run, "kind": kind, **figures})
        pyz_kib = pyz.stat().st_size // 1024
    pass_s = statistics.median(passes["python -c pass"])
    pass_s_bare = statistics.median(passes["python -S -c pass"])
    interp_kib = statistics.median(bare_rss)
    results: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        start_s = statistics.median(s["start_s"] for s in samples[kind])
        rss = statistics.median(s["rss_kib"] for s in samples[kind])
        ceiling = pass_s_bare if kind == "pyz -S" else pass_s
        results[kind] = {"bench": "startup", "figure": "start", "kind": kind, "runs": args.runs,
                         "start_s": start_s, "idle_rss_mib": rss / MiB,
                         "python_pass_s": ceiling, "start_ratio": start_s / ceiling,
                         "interpreter_rss_mib": interp_kib / MiB,
                         "rss_ratio": rss / interp_kib,
                         "target": {"start_s": 1.0, "idle_rss_mib": 45}}
        emit(results[kind])
    emit({"bench": "startup", "figure": "ceiling", "python_pass_s": pass_s,
          "python_S_pass_s": pass_s_bare, "interpreter_rss_mib": interp_kib / MiB,
          "pyz_kib": pyz_kib, "cores": os.cpu_count()})
    rows = [("python -c pass s", f"{pass_s:.3f}", "the ceiling"),
            ("bare interpreter RSS MiB", f"{interp_kib / MiB:.1f}", "")]
    for kind, r in results.items():
        rows.append((f"{kind}: start s", f"{r['start_s']:.3f}",
                     f"{r['start_ratio']:.1f}x python -c pass; target <= 1.0"))
        rows.append((f"{kind}: idle RSS MiB", f"{r['idle_rss_mib']:.1f}", "target <= 45"))
    table(rows)


if __name__ == "__main__":
    main()
