"""Host vitals: cores, load, memory, swap, memory pressure, disk free, uptime.

Linux reads /proc (and /proc/pressure when the kernel has PSI); macOS asks sysctl and vm_stat.
The parsers are plain functions over text so both platforms are tested on any machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from fleet_min.controlplane.runners.procs import is_darwin


def host_vitals(disk_path: Path) -> dict[str, Any]:
    vitals = _darwin() if is_darwin() else _linux()
    vitals["cores"] = os.cpu_count() or 1
    try:
        usage = shutil.disk_usage(disk_path if disk_path.exists() else Path("/"))
        vitals["disk_free_gb"] = round(usage.free / 2**30, 2)
        vitals["disk_total_gb"] = round(usage.total / 2**30, 2)
    except OSError:
        vitals["disk_free_gb"] = vitals["disk_total_gb"] = None
    load1 = vitals.get("load", [None])[0]
    vitals["load_per_core"] = round(load1 / vitals["cores"], 2) if load1 is not None else None
    return vitals


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def _linux() -> dict[str, Any]:
    out: dict[str, Any] = parse_meminfo(_read("/proc/meminfo"))
    load = _read("/proc/loadavg").split()
    out["load"] = [float(x) for x in load[:3]] if len(load) >= 3 else [None, None, None]
    uptime = _read("/proc/uptime").split()
    out["uptime_s"] = int(float(uptime[0])) if uptime else None
    out["memory_pressure"] = parse_psi(_read("/proc/pressure/memory"))
    return out


def parse_meminfo(text: str) -> dict[str, Any]:
    kb = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            kb[key] = int(parts[0])
    total, avail = kb.get("MemTotal"), kb.get("MemAvailable", kb.get("MemFree"))
    swap_total, swap_free = kb.get("SwapTotal"), kb.get("SwapFree")
    return {"mem_total_mb": _mb(total), "mem_available_mb": _mb(avail),
            "swap_total_mb": _mb(swap_total),
            "swap_used_mb": _mb(swap_total - swap_free) if swap_total is not None
            and swap_free is not None else None}


def parse_psi(text: str) -> dict[str, float] | None:
    """PSI `some avg10=... avg60=...` -> the share of time tasks stalled on memory, in percent."""
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            try:
                return {"some_avg10_pct": float(fields["avg10"]),
                        "some_avg60_pct": float(fields["avg60"])}
            except (KeyError, ValueError):
                return None
    return None


def _mb(kb: int | None) -> int | None:
    return kb // 1024 if kb is not None else None


def _sysctl(*names: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", *names], capture_output=True, text=True,
                              timeout=5, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _darwin() -> dict[str, Any]:
    try:
        vm = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5,
                            check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        vm = ""
    return parse_darwin(_sysctl("hw.memsize"), _sysctl("vm.loadavg"), _sysctl("vm.swapusage"),
                        _sysctl("kern.boottime"), vm, _sysctl("kern.memorystatus_level"),
                        time.time())


def parse_darwin(memsize: str, loadavg: str, swapusage: str, boottime: str, vm_stat: str,
                 memorystatus: str, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    total = int(memsize.strip()) if memsize.strip().isdigit() else None
    out["mem_total_mb"] = total // 2**20 if total else None
    page = re.search(r"page size of (\d+) bytes", vm_stat)
    pages = {m.group(1): int(m.group(2)) for m in
             re.finditer(r"Pages (free|inactive|speculative|purgeable):\s+(\d+)", vm_stat)}
    out["mem_available_mb"] = (sum(pages.values()) * int(page.group(1)) // 2**20
                               if page and pages else None)
    loads = re.findall(r"\d+(?:[.,]\d+)?", loadavg)
    out["load"] = ([float(x.replace(",", ".")) for x in loads[:3]] if len(loads) >= 3
                   else [None, None, None])
    swap = dict(re.findall(r"(total|used|free) = ([\d.]+)M", swapusage))
    out["swap_total_mb"] = int(float(swap["total"])) if "total" in swap else None
    out["swap_used_mb"] = int(float(swap["used"])) if "used" in swap else None
    booted = re.search(r"sec = (\d+)", boottime)
    out["uptime_s"] = int(now - int(booted.group(1))) if booted else None
    level = memorystatus.strip()
    # kern.memorystatus_level is the percentage of memory free; pressure is its complement.
    out["memory_pressure"] = ({"pressure_pct": 100 - int(level)} if level.isdigit() else None)
    return out
