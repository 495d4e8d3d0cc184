"""Two collector trees side by side under the job lifecycle load, at the same time: is a change
faster, and by how much?

    git worktree add /tmp/old <revision>
    python bench/compare.py /tmp/old . [--agents 30] [--procs 2] [--seconds 6] [--rounds 6]

In each round both collectors run at once, each under its own client processes (the agents of
bench/lifecycle.py), so both see the same minute of this machine. The figure is the new tree's
CPU per job over the old tree's, by round and as the median. On this shared two-core machine a
collector's CPU per job moves by 10 to 40 % from one minute to the next, so trees measured one
after the other differ by more than most changes do; measured at once, the same tree against
itself gives 0.98 to 1.01 with a spread (sd of rounds) of 0.02 to 0.04 (run it with one tree, or
none, to see that here).
The absolute figures are higher than bench/lifecycle.py's: two collectors share the two cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, checkout, cpu_seconds, emit, server, table
from bench.lifecycle import _client_process


def round_at_once(old: Path, new: Path, agents: int, procs: int, seconds: float
                  ) -> dict[str, float]:
    """One round: both collectors under load at once; CPU ms per job of each."""
    per_proc = [agents // procs + (1 if i < agents % procs else 0) for i in range(procs)]
    with server("collector", tree=old) as (old_address, old_pid), \
            server("collector", tree=new) as (new_address, new_pid):
        queues: dict[str, multiprocessing.Queue] = {}  # type: ignore[type-arg]
        workers: dict[str, list[multiprocessing.Process]] = {}
        for side, address in (("old", old_address), ("new", new_address)):
            queues[side] = multiprocessing.Queue()
            workers[side] = [multiprocessing.Process(target=_client_process,
                                                     args=(address, f"{side}{i}", n, seconds,
                                                           queues[side]))
                             for i, n in enumerate(per_proc) if n]
        before = {"old": cpu_seconds(old_pid), "new": cpu_seconds(new_pid)}
        everyone = workers["old"] + workers["new"]
        for worker in everyone:
            worker.start()
        jobs = {side: sum(queues[side].get(timeout=seconds + 60)[0] for _ in workers[side])
                for side in workers}
        for worker in everyone:
            worker.join()
        cpu = {"old": cpu_seconds(old_pid) - before["old"],
               "new": cpu_seconds(new_pid) - before["new"]}
    return {f"{side}_{key}": value for side in ("old", "new") for key, value in (
        ("jobs", float(jobs[side])), ("jobs_per_s", jobs[side] / seconds),
        ("cpu_ms_per_job", 1000 * cpu[side] / max(jobs[side], 1)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=checkout, nargs="?", default=ROOT,
                        help="the tree to compare against (default: this one)")
    parser.add_argument("new", type=checkout, nargs="?", default=ROOT,
                        help="the tree with the change (default: this one)")
    parser.add_argument("--agents", type=int, default=30, help="per collector")
    parser.add_argument("--procs", type=int, default=2, help="client processes per collector")
    parser.add_argument("--seconds", type=float, default=6.0, help="per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.procs, args.seconds, args.rounds = 4, 1, 0.5, 1
    ratios = []
    for r in range(args.rounds):
        figures = round_at_once(args.old, args.new, args.agents, args.procs, args.seconds)
        ratio = figures["new_cpu_ms_per_job"] / max(figures["old_cpu_ms_per_job"], 1e-9)
        ratios.append(ratio)
        emit({"bench": "compare", "round": r, **figures, "cpu_ratio": ratio})
        print(f"# round {r}: old {figures['old_cpu_ms_per_job']:.3f} ms a job, new "
              f"{figures['new_cpu_ms_per_job']:.3f}, new/old {ratio:.3f}", file=sys.stderr,
              flush=True)
    median = statistics.median(ratios)
    spread = statistics.pstdev(ratios) if len(ratios) > 1 else 0.0
    emit({"bench": "compare", "figure": "cpu_per_job_new_over_old", "old": str(args.old),
          "new": str(args.new), "rounds": len(ratios), "cpu_ratios": ratios, "median": median,
          "spread": spread})
    table([
        ("old tree", str(args.old), ""),
        ("new tree", str(args.new), ""),
        ("CPU per job, new / old", f"{median:.3f}", "median of rounds; below 1: the new is "
         "cheaper"),
        ("spread (sd) of rounds", f"{spread:.3f}", "a difference inside ~2x this is noise"),
    ])


if __name__ == "__main__":
    main()
