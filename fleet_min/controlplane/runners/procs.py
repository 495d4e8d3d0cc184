"""The host's process table, as far as runners need it: pid, argv, resident memory, uptime.

Linux reads /proc directly (no subprocess per tick); macOS asks `ps`. Either way the result is
a list of Proc, matched to runner directories by discovery.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    argv: tuple[str, ...]
    rss_kb: int
    uptime_s: float
    # The account it runs as (None: not known). A process names its runner by its argv alone,
    # which any process of any account can set (`exec -a`): a runner counts only its own
    # account's processes (and root's) as its listener and workers (discovery.attach_all).
    uid: int | None = None


def process_table() -> list[Proc]:
    if Path("/proc/self/stat").exists():
        return _linux()
    return _ps()


def _linux() -> list[Proc]:
    ticks = os.sysconf("SC_CLK_TCK")
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
    with open("/proc/uptime", encoding="ascii") as handle:
        host_uptime = float(handle.read().split()[0])
    procs = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                raw = handle.read()
            if b"Runner." not in raw:  # cheap filter: only runner processes are looked at
                continue
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as handle:
                stat = handle.read()
            uid = os.stat(f"/proc/{entry.name}").st_uid  # the process's effective uid
        except OSError:
            continue  # it exited while we looked
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z":
            continue
        start_s = int(fields[19]) / ticks
        argv = tuple(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)
        procs.append(Proc(int(entry.name), argv, int(fields[21]) * page_kb,
                          max(0.0, host_uptime - start_s), uid))
    return procs


def _ps() -> list[Proc]:
    try:
        out = subprocess.run(["ps", "-axww", "-o", "pid=,uid=,rss=,etime=,command="],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_ps(out)


def parse_ps(text: str) -> list[Proc]:
    procs = []
    for line in text.splitlines():
        parts = line.split(None, 4)  # pid, uid, rss, etime, command
        if len(parts) < 5 or "Runner." not in parts[4]:
            continue
        try:
            procs.append(Proc(int(parts[0]), tuple(parts[4].split()), int(parts[2]),
                              parse_etime(parts[3]), int(parts[1])))
        except ValueError:
            continue
    return procs


def parse_etime(text: str) -> float:
    """ps elapsed time `[[dd-]hh:]mm:ss` -> seconds."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days or 0) * 86400) + parts[0] * 3600 + parts[1] * 60 + parts[2]


def is_darwin() -> bool:
    return sys.platform == "darwin"
