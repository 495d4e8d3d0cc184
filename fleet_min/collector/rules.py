"""Pure rules of the queue: workload tables, lease defaults, constraints, capabilities.

Nothing here touches the database or the network; the queue calls these with rows it has read.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

# Workloads of the spec's parameter table run by a host executor. Host executors do not register
# as devices, so these are accepted with no agent registered ("built in").
HOST_WORKLOADS = frozenset({
    "install", "ui-test", "cold-start", "app-soak", "a11y-audit", "locale-shots", "web-test",
    "web-shots", "web-audit", "web-unfurl", "drain", "archive", "digest", "soak",
})
# Device workloads accepted with no agent registered: the reference synthetic benchmark.
BUILT_IN_DEVICE = frozenset({("benchmark", "synthetic")})

# Workloads that run for hours get a long default lease (decisions.md).
LONG_WORKLOADS = frozenset({
    "drain", "soak", "app-soak", "thermal", "build", "model-convert", "dataset-prep", "serve",
})
DEFAULT_TTL_S = 600
LONG_TTL_S = 14400
DEFAULT_MAX_ATTEMPTS = 3

ONLINE_S = 180.0        # derived device status: online under 3 minutes
STALE_S = 900.0         # stale under 15 minutes, offline beyond
BUSY_STALE_S = 180.0    # a busy claim with another collector older than this no longer blocks
BEACON_FRESH_S = 180.0  # collector-enforced constraints fail closed on an older beacon


def default_ttl(workload: str) -> int:
    return LONG_TTL_S if workload in LONG_WORKLOADS else DEFAULT_TTL_S


def is_built_in(workload: str, executor: str, backend: str | None) -> bool:
    if executor == "host":
        return workload in HOST_WORKLOADS
    return (workload, backend) in BUILT_IN_DEVICE


def capability_names(workload: str, backend: str | None) -> tuple[str, ...]:
    """The declarations that satisfy a job: the bare workload, or the workload:backend pairing."""
    return (workload, f"{workload}:{backend}") if backend else (workload,)


def offers(capabilities: Iterable[str] | None, workload: str, backend: str | None) -> bool:
    """May a device with these declared capabilities be offered this job?

    None means the device never said (offered everything); an empty list means nothing.
    """
    if capabilities is None:
        return True
    if not isinstance(capabilities, (list, tuple, set, frozenset)):
        capabilities = list(capabilities)
    # capability_names, spelled out: every claim asks this of its device.
    if workload in capabilities:
        return True
    return bool(backend) and f"{workload}:{backend}" in capabilities


def declared_workloads(capabilities: Iterable[str] | None) -> list[str] | None:
    """Workload names a device can be offered, for the indexed candidate query (None = any)."""
    if capabilities is None:
        return None
    return sorted({cap.split(":", 1)[0] for cap in capabilities})


def device_status(last_seen: float, now: float) -> str:
    age = now - last_seen
    if age < ONLINE_S:
        return "online"
    if age < STALE_S:
        return "stale"
    return "offline"


def is_expired(ttl_s: int | None, last_seen: float, now: float) -> bool:
    return ttl_s is not None and now - last_seen > ttl_s


def infer_platform(os_name: Any) -> str:
    """The spec's rule when `platform` is omitted: ios if the os looks like iOS, else android."""
    text = str(os_name or "").strip().lower()
    if text.startswith(("ios", "iphone", "ipados")):
        return "ios"
    return "android"


def in_window(window: Mapping[str, int], local_hour: int) -> bool:
    """`{from, to}` hours of day; from > to crosses midnight; from == to means all day."""
    start, end = int(window["from"]), int(window["to"])
    if start == end:
        return True
    if start < end:
        return start <= local_hour < end
    return local_hour >= start or local_hour < end


def local_hour(ts: float) -> int:
    return time.localtime(ts).tm_hour


def constraint_refusal(constraints: Mapping[str, Any] | None, beacon: Mapping[str, Any] | None,
                       beacon_at: float | None, now: float) -> str | None:
    """Why the collector-enforced constraints are unmet right now, or None when they hold.

    A missing or stale beacon fails every beacon-based constraint (fail closed). The job stays
    queued and no attempt is burned.
    """
    if not constraints:
        return None
    window = constraints.get("window")
    if window and not in_window(window, local_hour(now)):
        return "outside its time window"
    needs_beacon = any(constraints.get(k) is not None and constraints.get(k) is not False
                       for k in ("require_ac", "require_idle_s", "max_load"))
    if not needs_beacon:
        return None
    if beacon is None or beacon_at is None or now - beacon_at > BEACON_FRESH_S:
        return "no fresh beacon to check its constraints against"
    if constraints.get("require_ac"):
        on_ac = beacon.get("ac")
        if on_ac is None:
            on_ac = beacon.get("charging")
        if on_ac is not True:
            return "not on mains power"
    idle_needed = constraints.get("require_idle_s")
    if idle_needed is not None:
        idle = beacon.get("idle_s")
        if not isinstance(idle, int | float) or isinstance(idle, bool) or idle < idle_needed:
            return "not idle long enough"
    max_load = constraints.get("max_load")
    if max_load is not None:
        load = beacon.get("load")
        if not isinstance(load, int | float) or isinstance(load, bool) or load > max_load:
            return "load too high"
    return None
