"""Pure rules of the queue: workload tables, lease defaults, constraints, capabilities.

Nothing here touches the database or the network; the queue calls these with rows it has read.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

from fleet_min.collector.jobs.kinds import DeviceStatus, Executor

# Workloads of the spec's parameter table run by a host executor. Host executors do not register
# as devices, so these are accepted with no agent registered ("built in").
HOST_WORKLOADS = frozenset({
    "install", "ui-test", "cold-start", "app-soak", "a11y-audit", "locale-shots", "web-test",
    "web-shots", "web-audit", "web-unfurl", "drain", "archive", "digest", "soak",
})
# The workloads the spec names (its parameter table, host ones included, and its capability
# list). An agent that never declared capabilities is offered every job, and counts at enqueue
# as able to run these; a workload name beyond them (a newer agent's own) is accepted only once
# an agent has declared it, since an agent that says nothing cannot know a name it never heard of.
SPEC_WORKLOADS = HOST_WORKLOADS | frozenset({
    "benchmark", "thermal", "batch", "pipeline", "vision-eval", "speech-eval", "embed-eval",
    "vantage", "model-convert", "dataset-prep", "serve", "shell", "self-check", "build",
    "llm-eval",
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
EXECUTOR_RECENT_S = 900.0  # fan-out reaches executors that polled within this (or hold a job)
MAX_SLOTS = 64          # jobs an executor may hold at once (?slots= on its poll)
# A device's descriptor and each beacon, as stored JSON. Both are read back whole by every
# device listing (a beacon's history up to 1,000 rows), so a body's 1 MiB each would make one
# client's few requests hundreds of MB of every reader's answers; an agent's own are under
# 1 KiB.
MAX_DESCRIPTOR_BYTES = 16 << 10
MAX_BEACON_BYTES = 16 << 10


def default_ttl(workload: str) -> int:
    return LONG_TTL_S if workload in LONG_WORKLOADS else DEFAULT_TTL_S


def is_built_in(workload: str, executor: str, backend: str | None) -> bool:
    if executor == Executor.HOST:
        return workload in HOST_WORKLOADS
    return (workload, backend) in BUILT_IN_DEVICE


def job_variant(workload: str, backend: str | None, params: Any, suite: Any = None) -> str | None:
    """What a capability pairing `<workload>:<variant>` names for a job: its backend
    (benchmark:jssha), for a build job its toolchain, params.kind (build:gradle), and for a
    ui-test its suite's kind (ui-test:flow_runner), as host executors declare them."""
    if workload == "build" and isinstance(params, dict) and isinstance(params.get("kind"), str):
        return str(params["kind"])
    if workload == "ui-test" and isinstance(suite, dict) and isinstance(suite.get("kind"), str):
        return str(suite["kind"])
    return backend


def spec_variant(spec: Mapping[str, Any]) -> str | None:
    """job_variant of a whole job spec."""
    return job_variant(spec["workload"], spec.get("backend"), spec.get("params"),
                       spec.get("suite"))


def capability_names(workload: str, variant: str | None) -> tuple[str, ...]:
    """The declarations that satisfy a job: the bare workload, or the pairing with its variant
    (job_variant: the backend, a build job's toolchain, a ui-test's suite kind)."""
    return (workload, f"{workload}:{variant}") if variant else (workload,)


def offers(capabilities: Iterable[str] | None, workload: str, variant: str | None) -> bool:
    """May a device with these declared capabilities be offered this job (of this variant)?

    None means the device never said (offered everything); an empty list means nothing.
    """
    if capabilities is None:
        return True
    if not isinstance(capabilities, (list, tuple, set, frozenset)):
        capabilities = list(capabilities)
    # capability_names, spelled out: every claim asks this of its device.
    if workload in capabilities:
        return True
    return bool(variant) and f"{workload}:{variant}" in capabilities


def declared_workloads(capabilities: Iterable[str] | None) -> list[str] | None:
    """Workload names a device can be offered, for the indexed candidate query (None = any)."""
    if capabilities is None:
        return None
    return sorted({cap.split(":", 1)[0] for cap in capabilities})


def declared_routes(capabilities: Iterable[str] | None
                    ) -> tuple[list[str], list[tuple[str, str]]] | None:
    """What the indexed candidate query reads for a device (None: everything): the workloads
    declared bare (any variant) and the (workload, variant) pairings of the others."""
    if capabilities is None:
        return None
    return _routes(tuple(capabilities))  # every claim asks: a device's list rarely changes


@lru_cache(maxsize=1024)
def _routes(capabilities: tuple[str, ...]) -> tuple[list[str], list[tuple[str, str]]]:
    bare = {cap for cap in capabilities if ":" not in cap}
    pairs = {(workload, variant) for workload, _, variant in
             (cap.partition(":") for cap in capabilities if ":" in cap) if workload not in bare}
    return sorted(bare), sorted(pairs)


def device_status(last_seen: float, now: float) -> DeviceStatus:
    age = now - last_seen
    if age < ONLINE_S:
        return DeviceStatus.ONLINE
    if age < STALE_S:
        return DeviceStatus.STALE
    return DeviceStatus.OFFLINE


def is_expired(ttl_s: int | None, last_seen: float, now: float) -> bool:
    return ttl_s is not None and now - last_seen > ttl_s


def is_simulator(device_id: str, descriptor: dict[str, Any]) -> bool:
    """A virtual device (an iOS simulator, an Android emulator), so it stays out of hardware
    comparisons: the host executor's descriptor says so (`simulator`, `emulator`), or `kind` or
    `soc` is `simulator`, or the model names one ("iPhone 16 Simulator"), or the id follows a
    naming convention (`-sim-` inside, as the original's fleet names them; `emulator-<port>`,
    adb's serial of an emulator)."""
    if descriptor.get("simulator") is True or descriptor.get("emulator") is True:
        return True
    if "simulator" in (str(descriptor.get("kind") or "").lower(),
                       str(descriptor.get("soc") or "").lower()):
        return True
    if "simulator" in str(descriptor.get("model") or "").lower():
        return True
    lowered = device_id.lower()
    return "-sim-" in lowered or lowered.startswith("emulator-")


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
    return _beacon_refusal(constraints, beacon)


def _reading(beacon: Mapping[str, Any], name: str, alias: str) -> Any:
    """A beacon field under the name the agents in the field use, else its earlier alias."""
    return beacon[name] if name in beacon else beacon.get(alias)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _beacon_refusal(constraints: Mapping[str, Any], beacon: Mapping[str, Any]) -> str | None:
    """The beacon-based constraints against a fresh beacon (decisions.md: on_ac, idle_s and
    load_1m, with ac and load as aliases). Unknown (null, absent, not a number) fails closed."""
    if constraints.get("require_ac") and not (
            _reading(beacon, "on_ac", "ac") is True or beacon.get("charging") is True):
        return "not on mains power"
    idle_needed = constraints.get("require_idle_s")
    if idle_needed is not None:
        idle = beacon.get("idle_s")
        if not _number(idle) or idle < idle_needed:
            return "not idle long enough"
    max_load = constraints.get("max_load")
    if max_load is not None:
        load = _reading(beacon, "load_1m", "load")
        if not _number(load) or load > max_load:
            return "load too high"
    return None
