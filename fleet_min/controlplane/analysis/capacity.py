"""Capacity: how many runners and busy jobs this host carries against its live limits, and
whether one more runner fits (with the reasons when it does not).

Pure functions over the snapshot's runner views, the host vitals and the live settings.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any


def capacity(runners: list[dict[str, Any]], vitals: dict[str, Any],
             setting: Callable[[str], Any]) -> dict[str, Any]:
    ceiling = int(setting("ceiling"))
    busy = sum(1 for r in runners if r["busy"])
    reasons = []
    if len(runners) >= ceiling:
        reasons.append(f"{len(runners)} runners already reach the ceiling of {ceiling}")
    avail, floor = vitals.get("mem_available_mb"), setting("min_free_mem_mb")
    if avail is not None and avail < floor:
        reasons.append(f"only {avail} MiB of memory is available; the floor is {floor} MiB")
    per_core, most = vitals.get("load_per_core"), setting("max_load_per_core")
    if per_core is not None and per_core > most:
        reasons.append(f"load per core is {per_core}, above the limit of {most}")
    disk, disk_floor = vitals.get("disk_free_gb"), setting("min_free_disk_gb")
    if disk is not None and disk < disk_floor:
        reasons.append(f"only {disk} GiB of disk is free; the floor is {disk_floor} GiB")
    return {
        "ceiling": ceiling, "runners": len(runners), "busy": busy,
        "idle": len(runners) - busy, "headroom": max(0, ceiling - len(runners)),
        "busy_headroom": max(0, ceiling - busy),
        "per_repo": dict(Counter(r["repo"] for r in runners if r["repo"])),
        "limits": {"max_per_repo": setting("max_per_repo"), "min_free_mem_mb": floor,
                   "max_load_per_core": most, "min_free_disk_gb": disk_floor},
        "can_add": not reasons, "reasons": reasons,
    }


def refusals_for_repo(cap: dict[str, Any], repo: str | None) -> list[str]:
    """Why another runner for `repo` is refused now (empty: it fits)."""
    reasons = list(cap["reasons"])
    limit = cap["limits"]["max_per_repo"]
    count = cap["per_repo"].get(repo, 0) if repo else 0
    if repo and count >= limit:
        reasons.append(f"{repo} already has {count} runners here; the per-repo limit is {limit}")
    return reasons
