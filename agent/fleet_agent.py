#!/usr/bin/env python3
"""fleet_agent: the fleet_min device agent and host executor, in one stdlib-only file.

Copy this file onto a phone (Termux), a single-board computer or a laptop and run it with Python
3.8 or newer; it needs nothing else and never imports fleet_min.

    python3 fleet_agent.py --collector http://collector:8788[,http://other:8788] [--pool lab]
    python3 fleet_agent.py --executor host --name bench-mac --collector http://collector:8788
    python3 fleet_agent.py --print-descriptor

Device mode registers with every collector, long-polls each for jobs, beacons, runs one job at a
time and posts result rows. Host mode claims host jobs and drives attached Android devices (adb),
iOS simulators (xcrun simctl) and a local Chromium from outside. See docs/agent.md.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile

AGENT_VERSION = "0.1.0"
WIRE_SCHEMA = 1
DEFAULT_LEASE_TTL_S = 600
IDLE_BEACON_S = 60.0
SYNTHETIC_ROUNDS_PER_TOKEN = 1000
SYNTHETIC_BLOCK_BYTES = 4096
SYNTHETIC_ATTESTATION_ROUNDS = 1000
# decisions.md: the hex SHA-256 of a fresh block after 1,000 rounds (tests recompute it).
SYNTHETIC_ATTESTATION = "d7e8b70dfb48593edebc84967a969e78429f9ac6da8d0c681a4b57a2fe078a84"
# Hand-back rows count down from the top of the iter range: rows are idempotent by (job, device,
# iter), so a hand-back at iter 0 would swallow the resumed attempt's summary as a duplicate.
HANDBACK_ITER_TOP = 1_000_000
PROGRESS_KIND = "fleet-agent-progress"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
DOWNLOAD_CHUNK = 1 << 20
MAX_ERROR_CHARS = 1000

log = logging.getLogger("fleet_agent")


# --------------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------------


class Refusal(Exception):
    """A job the agent will not or cannot run; the message is the sentence shown on the job."""


class Stopped(Exception):
    """Work stopped: the lease was lost, the job was cancelled or the agent is exiting."""


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def atomic_write(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write a file so a crash leaves either the old or the new content, never half of it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str, value: object) -> None:
    atomic_write(path, (json.dumps(value, sort_keys=True, indent=1) + "\n").encode("utf-8"))


def read_json(path: str) -> object | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(DOWNLOAD_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile: always one of the measured values, never an interpolation."""
    ordered = sorted(values)
    rank = max(1, int(-(-pct * len(ordered) // 100)))  # ceil without floats drifting
    return ordered[min(rank, len(ordered)) - 1]


class Backoff:
    """Exponential backoff with jitter, so a shelf of agents does not reconnect in lockstep."""

    def __init__(self, base: float = 1.0, cap: float = 60.0, rng: random.Random | None = None):
        self.base = base
        self.cap = cap
        self.failures = 0
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography

    def next_delay(self) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(self.failures, 30)))
        self.failures += 1
        # Half fixed, half random: never zero (no hot loop), never synchronised.
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.failures = 0


class CmdResult:
    def __init__(self, argv: list[str], code: int | None, out: str, err: str, ms: float,
                 raw: bytes = b""):
        self.argv = argv
        self.raw = raw
        self.code = code  # None: timed out or could not start
        self.out = out
        self.err = err
        self.ms = ms

    @property
    def ok(self) -> bool:
        return self.code == 0


def run_cmd(argv: list[str], timeout: float = 30.0, env: dict | None = None,
            cwd: str | None = None) -> CmdResult:
    """Run an argv list (never a shell string) with a timeout; never raises for tool failures."""
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, env=env, cwd=cwd,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as exc:
        return CmdResult(argv, None, _text(exc.stdout), f"timed out after {timeout:g} s",
                         (time.monotonic() - started) * 1000)
    except OSError as exc:
        return CmdResult(argv, None, "", str(exc), (time.monotonic() - started) * 1000)
    return CmdResult(argv, proc.returncode, _text(proc.stdout), _text(proc.stderr),
                     (time.monotonic() - started) * 1000, proc.stdout or b"")


def _text(raw: bytes | str | None) -> str:
    if raw is None:
        return ""
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "replace")
    return raw


def tail(text: str, limit: int = 300) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


# --------------------------------------------------------------------------------------------
# Probing the machine: descriptor and vitals
# --------------------------------------------------------------------------------------------


class Probe:
    """Where facts about the machine come from.

    Everything is read relative to `root` and tools are found on the PATH of `env`, so tests point
    a Probe at a fake /proc-like tree and fake executables instead of the real machine.
    """

    def __init__(self, root: str = "/", env: dict | None = None, system: str | None = None,
                 machine: str | None = None):
        self.root = root
        self.env = dict(os.environ if env is None else env)
        self.system = system or platform.system()
        self.machine = machine or platform.machine()

    def path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def read(self, path: str, limit: int = 1 << 16) -> str | None:
        try:
            with open(self.path(path), "rb") as fh:
                return fh.read(limit).decode("utf-8", "replace")
        except OSError:
            return None

    def exists(self, path: str) -> bool:
        return os.path.exists(self.path(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(path)))
        except OSError:
            return []

    def which(self, name: str) -> str | None:
        return shutil.which(name, path=self.env.get("PATH", os.defpath))

    def run(self, argv: list[str], timeout: float = 5.0) -> str | None:
        """stdout of a tool, or None when it is missing, fails or hangs."""
        exe = self.which(argv[0])
        if exe is None:
            return None
        result = run_cmd([exe, *argv[1:]], timeout=timeout, env=self.env)
        return result.out if result.ok else None

    @property
    def is_android(self) -> bool:
        # Termux sets these; a plain Linux box never has ANDROID_ROOT.
        return self.system == "Linux" and bool(
            self.env.get("ANDROID_ROOT") or self.env.get("TERMUX_VERSION")
            or "com.termux" in self.env.get("PREFIX", ""))

    @property
    def platform_name(self) -> str:
        if self.is_android:
            return "android"
        if self.system == "Darwin":
            return "macos"
        return self.system.lower()


def _clean(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.replace("\x00", " ").strip()
    return value or None


def _int_or_none(value: object) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def parse_kv(text: str | None, sep: str = ":") -> dict[str, str]:
    """First value of each key in `key: value` text such as /proc/meminfo or /proc/cpuinfo."""
    found: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(sep)
        key = key.strip()
        if key and _ and key not in found:
            found[key] = value.strip()
    return found


def meminfo_mb(probe: Probe, field: str) -> int | None:
    value = parse_kv(probe.read("/proc/meminfo")).get(field)
    kb = _int_or_none(value.split()[0]) if value else None
    return kb // 1024 if kb is not None else None


def linux_cpu_cores(probe: Probe) -> int | None:
    text = probe.read("/proc/cpuinfo")
    if text is None:
        return None
    count = sum(1 for line in text.splitlines() if re.match(r"^processor\s*:", line))
    return count or None


def os_release(probe: Probe) -> str | None:
    fields = parse_kv(probe.read("/etc/os-release"), sep="=")
    name = fields.get("PRETTY_NAME") or fields.get("NAME")
    return _clean(name.strip('"')) if name else None


DMI_PLACEHOLDERS = {"to be filled by o.e.m.", "system product name", "default string",
                    "not specified", "none", "system manufacturer", "o.e.m."}
CHASSIS_KIND = {
    **{n: "laptop" for n in (8, 9, 10, 14, 31)},
    **{n: "tablet" for n in (30, 32)},
    **{n: "desktop" for n in (3, 4, 5, 6, 7, 13, 15, 16, 35, 36)},
}


def _dmi(probe: Probe, name: str) -> str | None:
    value = _clean(probe.read("/sys/class/dmi/id/" + name))
    return None if value is None or value.lower() in DMI_PLACEHOLDERS else value


def linux_model(probe: Probe) -> str | None:
    tree = _clean(probe.read("/proc/device-tree/model")) or _clean(
        probe.read("/sys/firmware/devicetree/base/model"))
    if tree:
        return tree
    vendor, product = _dmi(probe, "sys_vendor"), _dmi(probe, "product_name")
    if vendor and product and not product.lower().startswith(vendor.lower()):
        return vendor + " " + product
    return product or vendor


def linux_soc(probe: Probe) -> str | None:
    compatible = probe.read("/proc/device-tree/compatible") or probe.read(
        "/sys/firmware/devicetree/base/compatible")
    entries = [e for e in (compatible or "").split("\x00") if e.strip()]
    if entries:
        # The last entry names the SoC family ("brcm,bcm2712"); the vendor prefix adds nothing.
        return entries[-1].split(",", 1)[-1].strip()
    cpu = parse_kv(probe.read("/proc/cpuinfo"))
    return _clean(cpu.get("model name") or cpu.get("Hardware") or cpu.get("cpu model"))


def linux_kind(probe: Probe) -> str | None:
    if probe.exists("/.dockerenv") or probe.exists("/run/.containerenv"):
        return "container"
    if linux_model(probe) and (probe.exists("/proc/device-tree/model")
                               or probe.exists("/sys/firmware/devicetree/base/model")):
        # Linux boards that boot from a device tree (Pi, Rock, Jetson) are single-board computers.
        return "sbc"
    chassis = _int_or_none(probe.read("/sys/class/dmi/id/chassis_type"))
    return CHASSIS_KIND.get(chassis) if chassis is not None else None


def nvidia_gpu(probe: Probe) -> tuple[str | None, int | None]:
    for gpu_dir in probe.listdir("/proc/driver/nvidia/gpus"):
        info = parse_kv(probe.read(f"/proc/driver/nvidia/gpus/{gpu_dir}/information"))
        if info.get("Model"):
            out = probe.run(["nvidia-smi", "--query-gpu=memory.total",
                             "--format=csv,noheader,nounits"])
            vram = _int_or_none(out.splitlines()[0]) if out and out.strip() else None
            return info["Model"], vram
    return None, None


def linux_descriptor(probe: Probe) -> dict:
    gpu, vram = nvidia_gpu(probe)
    return {
        "model": linux_model(probe), "soc": linux_soc(probe),
        "ram_mb": meminfo_mb(probe, "MemTotal"), "os": os_release(probe),
        "arch": probe.machine or None, "platform": "linux", "kind": linux_kind(probe),
        "cpu_cores": linux_cpu_cores(probe), "gpu": gpu, "vram_mb": vram,
    }


def getprop(probe: Probe, name: str) -> str | None:
    return _clean(probe.run(["getprop", name]))


def android_kind(probe: Probe) -> str:
    characteristics = (getprop(probe, "ro.build.characteristics") or "").lower()
    for kind in ("tablet", "tv", "watch"):
        if kind in characteristics:
            return kind
    # Android itself treats "no tablet/tv/watch characteristic" as the phone form factor.
    return "phone"


def android_descriptor(probe: Probe) -> dict:
    soc_model = getprop(probe, "ro.soc.model")
    soc_vendor = getprop(probe, "ro.soc.manufacturer")
    soc = (soc_vendor + " " + soc_model) if soc_vendor and soc_model else soc_model
    release = getprop(probe, "ro.build.version.release")
    gpu = _clean(probe.read("/sys/class/kgsl/kgsl-3d0/gpu_model"))
    return {
        "model": getprop(probe, "ro.product.model"),
        "soc": soc or getprop(probe, "ro.board.platform"),
        "ram_mb": meminfo_mb(probe, "MemTotal"),
        "os": ("Android " + release) if release else None,
        "arch": probe.machine or None, "platform": "android", "kind": android_kind(probe),
        "cpu_cores": linux_cpu_cores(probe), "gpu": gpu, "vram_mb": None,
    }


def sysctl(probe: Probe, name: str) -> str | None:
    return _clean(probe.run(["sysctl", "-n", name]))


def mac_kind(model: str | None) -> str | None:
    if not model:
        return None
    if model.startswith("MacBook"):
        return "laptop"
    if model.startswith(("Macmini", "iMac", "MacPro")):
        return "desktop"
    return None  # "Mac14,3" and friends do not say what they are


def macos_descriptor(probe: Probe) -> dict:
    model = sysctl(probe, "hw.model")
    brand = sysctl(probe, "machdep.cpu.brand_string")
    memsize = _int_or_none(sysctl(probe, "hw.memsize"))
    version = _clean(probe.run(["sw_vers", "-productVersion"]))
    apple_silicon = bool(brand and brand.startswith("Apple"))
    return {
        "model": model, "soc": brand,
        "ram_mb": memsize // (1 << 20) if memsize else None,
        "os": ("macOS " + version) if version else None,
        "arch": probe.machine or None, "platform": "macos", "kind": mac_kind(model),
        "cpu_cores": _int_or_none(sysctl(probe, "hw.ncpu")),
        # The GPU of Apple silicon is part of the SoC and shares its memory.
        "gpu": brand if apple_silicon else None, "vram_mb": None,
    }


def detect_descriptor(probe: Probe) -> dict:
    """Facts the machine states about itself; a field it does not state is None, never guessed."""
    if probe.is_android:
        found = android_descriptor(probe)
    elif probe.system == "Darwin":
        found = macos_descriptor(probe)
    else:
        found = linux_descriptor(probe)
    if found.get("cpu_cores") is None and probe.root == "/":
        found["cpu_cores"] = os.cpu_count()
    found["app_ver"] = "fleet_agent " + AGENT_VERSION
    return found


# --- vitals (beacon fields) ---


def termux_battery(probe: Probe) -> dict | None:
    # termux-battery-status hangs when the Termux:API app is missing, hence the short timeout.
    out = probe.run(["termux-battery-status"], timeout=8)
    try:
        data = json.loads(out) if out else None
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    status = str(data.get("status", "")).upper()
    plugged = str(data.get("plugged", "")).upper()
    on_power = bool(plugged) and plugged != "UNPLUGGED"
    found = {"battery_pct": _int_or_none(data.get("percentage")),
             "charging": status == "CHARGING" or (status == "FULL" and on_power),
             "ac": on_power}
    if isinstance(data.get("temperature"), (int, float)):
        found["battery_temp_c"] = float(data["temperature"])
    return found


def sysfs_battery(probe: Probe) -> dict | None:
    base = "/sys/class/power_supply"
    supplies = probe.listdir(base)
    if not supplies:
        return None
    battery, mains_online = None, None
    for name in supplies:
        kind = _clean(probe.read(f"{base}/{name}/type"))
        if kind == "Battery" and battery is None:
            battery = name
        elif kind in ("Mains", "USB", "USB_C", "USB_PD"):
            online = _int_or_none(probe.read(f"{base}/{name}/online"))
            mains_online = bool(mains_online) or online == 1
    if battery is None:
        # No battery at all: the machine runs from mains whenever it runs.
        return {"ac": True if mains_online is None else mains_online}
    status = _clean(probe.read(f"{base}/{battery}/status")) or ""
    charging = status == "Charging" or (status in ("Full", "Not charging") and bool(mains_online))
    found: dict = {"battery_pct": _int_or_none(probe.read(f"{base}/{battery}/capacity")),
                   "charging": charging}
    if mains_online is not None:
        found["ac"] = mains_online
    return found


def pmset_battery(probe: Probe) -> dict | None:
    out = probe.run(["pmset", "-g", "batt"])
    if not out:
        return None
    on_ac = "'AC Power'" in out
    match = re.search(r"(\d+)%;\s*([a-zA-Z ]+);", out)
    if not match:
        return {"ac": on_ac}  # a Mac without a battery
    state = match.group(2).strip().lower()
    return {"battery_pct": int(match.group(1)),
            "charging": state == "charging" or (on_ac and state in ("charged", "finishing charge")),
            "ac": on_ac}


def read_power(probe: Probe) -> dict:
    if probe.is_android:
        return termux_battery(probe) or sysfs_battery(probe) or {}
    if probe.system == "Darwin":
        return pmset_battery(probe) or {}
    return sysfs_battery(probe) or {}


def thermal_state(temp_c: float | None) -> str | None:
    if temp_c is None:
        return None
    for limit, name in ((70, "nominal"), (80, "fair"), (90, "serious")):
        if temp_c < limit:
            return name
    return "critical"


def hottest_zone_c(probe: Probe) -> float | None:
    hottest = None
    for zone in probe.listdir("/sys/class/thermal"):
        if not zone.startswith("thermal_zone"):
            continue
        milli = _int_or_none(probe.read(f"/sys/class/thermal/{zone}/temp"))
        # Some phones report garbage (negative or absurd); keep plausible readings only.
        if milli is not None and -40000 < milli < 150000:
            hottest = max(hottest if hottest is not None else -1e9, milli / 1000.0)
    return hottest


def memory_pressure(probe: Probe, avail_mb: int | None, total_mb: int | None) -> str | None:
    psi = parse_kv(probe.read("/proc/pressure/memory"), sep=" ").get("some")
    match = re.search(r"avg10=([\d.]+)", psi or "")
    if match:
        stalled = float(match.group(1))
        return "high" if stalled >= 10 else "moderate" if stalled >= 1 else "low"
    if avail_mb is None or not total_mb:
        return None
    share = avail_mb / total_mb
    return "high" if share < 0.1 else "moderate" if share < 0.25 else "low"


def load_1m(probe: Probe) -> float | None:
    text = probe.read("/proc/loadavg")
    if text:
        try:
            return float(text.split()[0])
        except (ValueError, IndexError):
            return None
    if probe.root == "/" and hasattr(os, "getloadavg"):
        try:
            return round(os.getloadavg()[0], 2)
        except OSError:
            return None
    return None


def idle_seconds(probe: Probe) -> float | None:
    if probe.system == "Darwin":
        match = re.search(r'"HIDIdleTime" = (\d+)', probe.run(["ioreg", "-c", "IOHIDSystem"]) or "")
        return round(int(match.group(1)) / 1e9, 1) if match else None
    out = probe.run(["xprintidle"])  # X11 only; elsewhere idle time is unknown, so left out
    ms = _int_or_none(out)
    return ms / 1000.0 if ms is not None else None


def mac_memory(probe: Probe) -> int | None:
    out = probe.run(["vm_stat"])
    page = re.search(r"page size of (\d+) bytes", out or "")
    if not out or not page:
        return None
    fields = parse_kv(out)
    pages = sum(_int_or_none(fields.get(k, "0").rstrip(".")) or 0
                for k in ("Pages free", "Pages inactive", "Pages speculative"))
    return pages * int(page.group(1)) // (1 << 20)


def thermal_sample(probe: Probe) -> str | None:
    """Thermal state from the sensors alone: cheap enough to take between iterations."""
    return thermal_state(hottest_zone_c(probe))


def disk_free_gb(probe: Probe, path: str) -> float | None:
    """Free space where the agent keeps its state (artifacts are cached there), in GB."""
    try:
        return round(shutil.disk_usage(probe.path(path)).free / 1e9, 2)
    except OSError:
        return None


# Beacon fields under the names the agents in the field use (decisions.md), sent as null when
# the machine cannot tell (a collector's constraint on an unknown reading fails closed).
NULLABLE_VITALS = ("on_ac", "load_1m", "disk_free_gb")


def read_vitals(probe: Probe, state_dir: str = "/") -> dict:
    """Beacon fields; a reading the machine cannot give is left out rather than invented, except
    the constraint fields of NULLABLE_VITALS, sent as null. The earlier names ac and load go
    along while known (collectors from before the field names read those; they refuse a null
    ac, load or idle_s, so idle_s too is left out when unknown)."""
    vitals: dict = dict(read_power(probe))
    temp = hottest_zone_c(probe)
    if temp is None:
        temp = vitals.pop("battery_temp_c", None)
    else:
        vitals.pop("battery_temp_c", None)
    vitals["thermal"] = thermal_state(temp)
    vitals["temp_c"] = round(temp, 1) if temp is not None else None
    if probe.system == "Darwin":
        vitals["mem_mb"] = mac_memory(probe)
    else:
        vitals["mem_mb"] = meminfo_mb(probe, "MemAvailable")
    vitals["mem_pressure"] = memory_pressure(probe, vitals["mem_mb"],
                                             meminfo_mb(probe, "MemTotal"))
    vitals["load"] = load_1m(probe)
    vitals["idle_s"] = idle_seconds(probe)
    fields = {key: value for key, value in vitals.items() if value is not None}
    fields.update(on_ac=vitals.get("ac"), load_1m=vitals["load"],
                  disk_free_gb=disk_free_gb(probe, state_dir))
    return fields


# --------------------------------------------------------------------------------------------
# Local state: device id, shell allowlist
# --------------------------------------------------------------------------------------------


def default_state_dir() -> str:
    return os.environ.get("FLEET_AGENT_STATE") or os.path.join(os.path.expanduser("~"),
                                                               ".fleet-agent")


def host_device_id(probe: Probe) -> str:
    """hostname plus a short hash of the machine id: readable, and distinct for cloned hostnames."""
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "device"
    seed = (_clean(probe.read("/etc/machine-id")) or _clean(probe.read("/var/lib/dbus/machine-id"))
            or f"{host}:{hex(random.getrandbits(64))}")
    return f"{host[:40]}-{hashlib.sha256(seed.encode()).hexdigest()[:6]}"


def load_device_id(state_dir: str, wanted: str | None, probe: Probe) -> str:
    """The id kept in state.json; a --device-id flag replaces it and is remembered."""
    path = os.path.join(state_dir, "state.json")
    state = read_json(path)
    state = state if isinstance(state, dict) else {}
    device_id = wanted or state.get("device_id") or host_device_id(probe)
    if state.get("device_id") != device_id:
        state.update(device_id=device_id, created_at=state.get("created_at") or now_iso())
        atomic_write_json(path, state)
    return device_id


def load_allowlist(path: str | None) -> set[str]:
    """SHA-256 pins of shell scripts the owner allows: one hex digest per line, # comments."""
    if not path:
        return set()
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return set()
    pins = set()
    for number, line in enumerate(lines, 1):
        word = line.split("#", 1)[0].strip().lower()
        if not word:
            continue
        if HEX64.match(word.split()[0]):
            pins.add(word.split()[0])
        else:
            log.warning("%s line %d is not a SHA-256 pin; ignored", path, number)
    return pins


# --------------------------------------------------------------------------------------------
# HTTP to a collector
# --------------------------------------------------------------------------------------------


class Unreachable(Exception):
    """The collector could not be reached or answered with a server error; try again later."""


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


# Collectors live on the LAN or a mesh network: talk to them directly, ignoring proxy variables.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_call(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
              timeout: float = 30.0) -> tuple[int, bytes]:
    if not url.startswith(("http://", "https://")):
        raise ValueError("collector addresses must start with http:// or https://: " + url)
    # The scheme was checked above: only http(s), never file:// or custom handlers.
    request = urllib.request.Request(url, data=body, method=method,  # noqa: S310
                                     headers=headers or {})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        data = exc.read() if exc.fp is not None else b""
        if exc.code >= 500:
            raise Unreachable(f"{method} {url} answered {exc.code}") from exc
        return exc.code, data
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"{method} {url} failed: {reason}") from exc
    except Exception as exc:  # http.client oddities on a dying server (RemoteDisconnected, ...)
        raise Unreachable(f"{method} {url} failed: {exc}") from exc


def _error_message(data: bytes) -> str:
    try:
        body = json.loads(data.decode("utf-8"))
        if isinstance(body, dict) and body.get("error"):
            return str(body["error"])
    except ValueError:
        pass
    return tail(data.decode("utf-8", "replace"), 200) or "no details"


class ArtifactError(Refusal):
    pass


class Collector:
    """One collector's HTTP API, as the agent uses it."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        self.url = base_url.rstrip("/")
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Collector({self.url})"

    def call_json(self, method: str, path: str, payload: object = None,
                  timeout: float | None = None) -> tuple[int, object]:
        body = None if payload is None else json.dumps(payload).encode("utf-8")
        headers = {"content-type": "application/json"} if body is not None else {}
        status, data = http_call(method, self.url + path, body, headers,
                                 timeout or self.timeout)
        if status >= 400:
            raise HttpError(status, _error_message(data))
        if status == 204 or not data:
            return status, None
        try:
            return status, json.loads(data.decode("utf-8"))
        except ValueError as exc:
            raise Unreachable(f"{self.url}{path} answered something that is not JSON") \
                from exc

    def register(self, body: dict) -> dict:
        _, reply = self.call_json("POST", "/devices/register", body)
        return reply if isinstance(reply, dict) else {}

    def next_device_job(self, device_id: str, timeout: float) -> dict | None:
        path = f"/devices/{urllib.parse.quote(device_id, safe='')}/next-job"
        status, reply = self.call_json("GET", path, timeout=timeout)
        return reply if status == 200 and isinstance(reply, dict) else None

    def next_host_job(self, name: str, timeout: float) -> dict | None:
        path = "/executor/next-job?" + urllib.parse.urlencode({"name": name})
        status, reply = self.call_json("GET", path, timeout=timeout)
        return reply if status == 200 and isinstance(reply, dict) else None

    def beacon(self, body: dict) -> dict:
        _, reply = self.call_json("POST", "/results", body)
        return reply if isinstance(reply, dict) else {}

    def post_result(self, row: dict) -> None:
        self.call_json("POST", "/results", row)

    def post_results(self, rows: list) -> None:
        """Several rows in one request (one transaction on the collector; all or none)."""
        self.call_json("POST", "/results", rows)

    def release(self, job_id: str, device_id: str) -> str:
        """'released', 'old-collector' (404: predates the endpoint) or 'refused' (409)."""
        path = f"/jobs/{urllib.parse.quote(job_id, safe='')}/release"
        try:
            self.call_json("POST", path, {"device_id": device_id})
        except HttpError as exc:
            return "old-collector" if exc.status == 404 else "refused"
        return "released"

    def upload_artifact(self, data: bytes, name: str, extra_headers: dict | None = None) -> str:
        headers = {"content-type": "application/octet-stream", "x-artifact-name": name}
        headers.update(extra_headers or {})
        status, reply = http_call("POST", self.url + "/artifacts", data, headers,
                                  max(self.timeout, 120.0))
        if status >= 400:
            raise HttpError(status, _error_message(reply))
        sha = json.loads(reply.decode("utf-8")).get("sha256")
        expected = hashlib.sha256(data).hexdigest()
        if sha != expected:
            raise Unreachable(f"the collector stored the upload under {sha}, not its SHA-256 "
                              f"{expected}")
        return sha

    def download_artifact(self, sha256: str, dest: str) -> str:
        """Fetch an artifact into `dest`, refusing it unless its bytes hash to `sha256`."""
        sha256 = sha256.lower()
        if not HEX64.match(sha256):
            raise ArtifactError(f"the artifact reference {sha256!r} is not a SHA-256 hex digest")
        url = self.url + "/artifacts/" + sha256
        request = urllib.request.Request(url, method="GET")  # noqa: S310 - self.url is http(s)
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(prefix=".dl-", dir=os.path.dirname(os.path.abspath(dest)))
        try:
            with os.fdopen(fd, "wb") as out, _OPENER.open(request, timeout=120) as response:
                for chunk in iter(lambda: response.read(DOWNLOAD_CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
            actual = digest.hexdigest()
            if actual != sha256:
                raise ArtifactError(
                    f"refused artifact {sha256[:12]}: its downloaded bytes have SHA-256 "
                    f"{actual[:12]}, so it was "
                    "altered or corrupted")
            os.chmod(tmp, 0o600)
            os.replace(tmp, dest)
        except urllib.error.HTTPError as exc:
            raise ArtifactError(f"artifact {sha256[:12]} could not be downloaded: the collector "
                                f"answered {exc.code}") from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ArtifactError(f"artifact {sha256[:12]} could not be downloaded: {reason}") \
                from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return dest


class ArtifactCache:
    """Verified downloads kept by hash, so a model is fetched once per device."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def fetch(self, collector: Collector, sha256: str, suffix: str = "") -> str:
        sha256 = str(sha256).lower()
        path = os.path.join(self.directory, sha256 + suffix)
        if HEX64.match(sha256) and os.path.exists(path):
            return path
        return collector.download_artifact(sha256, path)


# --------------------------------------------------------------------------------------------
# Outbox: every result row is written to disk before it is posted
# --------------------------------------------------------------------------------------------


BATCH_ROWS = 100  # spooled rows sent in one POST /results; the collector takes up to 1000


class Outbox:
    """Result rows spooled on disk (atomically, mode 0600) until a collector acknowledges them.

    Rows are posted in the order they were written, per collector, so a job's final row never
    overtakes its iteration rows. A collector that is down keeps its rows; a restarted agent
    posts whatever an earlier run left behind.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.rejected_dir = os.path.join(directory, "rejected")
        os.makedirs(self.rejected_dir, mode=0o700, exist_ok=True)
        self.counter_lock = threading.Lock()
        self.flush_lock = threading.Lock()  # one poster at a time keeps the order
        self.counter = 0

    def put(self, collector_url: str, row: dict) -> str:
        with self.counter_lock:
            self.counter += 1
            name = f"{time.time_ns():020d}-{self.counter:06d}.json"
        path = os.path.join(self.directory, name)
        atomic_write_json(path, {"collector": collector_url, "row": row})
        return path

    def pending(self, collector_url: str | None = None) -> list[str]:
        names = sorted(n for n in os.listdir(self.directory)
                       if n.endswith(".json") and not n.startswith("."))
        paths = [os.path.join(self.directory, n) for n in names]
        if collector_url is None:
            return paths
        return [p for p in paths if (read_json(p) or {}).get("collector") == collector_url]

    def flush(self, only: str | None = None) -> bool:
        """Post pending rows in order; True when nothing is left for `only` (or for anyone).

        Rows that piled up (an outage, an earlier run) go up to BATCH_ROWS at a time in one
        request; the usual single fresh row goes on its own.
        """
        with self.flush_lock:
            by_collector: dict[str, list[tuple[str, dict]]] = {}
            for path in self.pending():
                entry = read_json(path)
                if not isinstance(entry, dict) or "row" not in entry:
                    os.replace(path, os.path.join(self.rejected_dir, os.path.basename(path)))
                    continue
                url = str(entry.get("collector"))
                if only is None or url == only:
                    by_collector.setdefault(url, []).append((path, entry["row"]))
            stuck = {url for url, rows in by_collector.items() if not self._deliver(url, rows)}
            return not stuck if only is None else only not in stuck

    def _deliver(self, url: str, rows: list[tuple[str, dict]]) -> bool:
        """Post one collector's rows in order; False when it cannot be reached."""
        for start in range(0, len(rows), BATCH_ROWS):
            chunk = rows[start:start + BATCH_ROWS]
            if len(chunk) > 1:
                try:
                    Collector(url, timeout=30).post_results([row for _, row in chunk])
                except Unreachable as exc:
                    log.info("%d result rows kept on disk for later (%s)", len(chunk), exc)
                    return False
                except HttpError:
                    pass  # a refused row, or a collector without arrays: one at a time below
                else:
                    for path, _ in chunk:
                        os.unlink(path)
                    continue
            for path, row in chunk:
                if not self._post(url, row, path):
                    return False
        return True

    def _post(self, url: str, row: dict, path: str) -> bool:
        try:
            Collector(url, timeout=15).post_result(row)
        except Unreachable as exc:
            log.info("result row kept on disk for later (%s)", exc)
            return False
        except HttpError as exc:
            # The collector understood and refused the row; retrying cannot change its mind.
            log.error("collector %s refused result row %s/%s iter %s: %s; moved to %s", url,
                      row.get("job_id"), row.get("device_id"), row.get("iter"), exc.message,
                      self.rejected_dir)
            os.replace(path, os.path.join(self.rejected_dir, os.path.basename(path)))
            return True
        os.unlink(path)
        return True


# --------------------------------------------------------------------------------------------
# One job in flight
# --------------------------------------------------------------------------------------------


class Gate:
    """The single job slot shared by every collector link: check-and-set under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: tuple[str, str] | None = None

    def try_take(self, collector_url: str, job_id: str) -> bool:
        with self._lock:
            if self._holder is not None:
                return False
            self._holder = (collector_url, job_id)
            return True

    def free(self, job_id: str) -> None:
        with self._lock:
            if self._holder is not None and self._holder[1] == job_id:
                self._holder = None

    def holder(self) -> tuple[str, str] | None:
        with self._lock:
            return self._holder


class JobContext:
    """What a workload needs: its spec, a way to post rows, and the stop signal."""

    def __init__(self, runtime: Runtime, collector: Collector, spec: dict, reporter_id: str):
        self.runtime = runtime
        self.collector = collector
        self.spec = spec
        self.job_id = str(spec.get("job_id"))
        self.reporter_id = reporter_id  # device_id in rows and beacons
        self.params = spec.get("params") if isinstance(spec.get("params"), dict) else {}
        self.stop = threading.Event()
        self.reason = ""
        self.handback = False  # stop at a resumable point and give the job back
        self.workdir = tempfile.mkdtemp(prefix="job-", dir=runtime.work_root)
        self._prior: dict | None = None

    def request_stop(self, reason: str, handback: bool = False) -> None:
        if not self.stop.is_set():
            self.reason = reason
            self.handback = handback
            self.stop.set()

    def check(self) -> None:
        if self.stop.is_set():
            raise Stopped(self.reason)

    def row(self, iteration: int, ok: bool, metrics: dict | None = None, **fields: object) -> dict:
        row = {"schema": WIRE_SCHEMA, "kind": "result", "device_id": self.reporter_id,
               "job_id": self.job_id, "iter": iteration, "ok": ok, "final": False,
               "metrics": metrics or {}, "device": self.runtime.device_summary()}
        row.update({k: v for k, v in fields.items() if v is not None})
        if isinstance(row.get("error"), str) and len(row["error"]) > MAX_ERROR_CHARS:
            row["error"] = row["error"][:MAX_ERROR_CHARS - 3] + "..."
        return row

    def post(self, row: dict) -> None:
        """Spool the row, then try to deliver everything spooled for this collector."""
        self.runtime.outbox.put(self.collector.url, row)
        self.runtime.outbox.flush(self.collector.url)

    def upload(self, data: bytes, name: str) -> str:
        return self.collector.upload_artifact(data, name)

    def fetch(self, sha256: str, suffix: str = "") -> str:
        return self.runtime.cache.fetch(self.collector, sha256, suffix)

    def prior_progress(self) -> dict:
        """The progress an earlier attempt handed back (params.resume_from), verified."""
        if self._prior is None:
            sha = self.params.get("resume_from")
            self._prior = {}
            if sha:
                progress = read_json(self.fetch(str(sha)))
                if not isinstance(progress, dict) or progress.get("kind") != PROGRESS_KIND:
                    raise Refusal("params.resume_from names an artifact that is not agent "
                                  "progress")
                self._prior = progress
        return self._prior

    def lease_ttl(self) -> float:
        lease = self.spec.get("lease") if isinstance(self.spec.get("lease"), dict) else {}
        ttl = lease.get("ttl_s")
        return float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else DEFAULT_LEASE_TTL_S


def final(ok: bool, error: str | None = None, metrics: dict | None = None,
          artifacts: list[str] | None = None, preempted: bool = False, **extra: object) -> dict:
    """The closing row's fields, as a workload returns them."""
    result: dict = {"ok": ok, "metrics": metrics or {}, "artifacts": artifacts or []}
    if error:
        result["error"] = error
    if preempted:
        result["preempted"] = True
    result.update(extra)
    return result


class LeaseKeeper(threading.Thread):
    """Beacons the job's collector well inside the lease TTL and relays what it answers."""

    def __init__(self, ctx: JobContext, interval: float):
        super().__init__(name="lease-" + ctx.job_id, daemon=True)
        self.ctx = ctx
        self.interval = interval
        self.done = threading.Event()

    def run(self) -> None:
        wait = self.interval
        while not self.done.wait(wait):
            wait = self.interval
            try:
                reply = self.ctx.collector.beacon(self.ctx.runtime.beacon_body(self.ctx.job_id))
            except (Unreachable, HttpError) as exc:
                log.warning("beacon for job %s failed: %s", self.ctx.job_id, exc)
                wait = min(self.interval, 2.0)  # try again soon: the lease is running out
                continue
            self.relay(reply)

    def relay(self, reply: dict) -> None:
        if reply.get("lease_renewed") is False:
            self.ctx.request_stop("stopped: the collector no longer renews this job's lease "
                                  "(it was cancelled, expired or reassigned)")
        elif reply.get("preempt") is True and self.ctx.spec.get("preemptible"):
            self.ctx.request_stop("preempted: a higher-priority job is waiting for this device",
                                  handback=True)

    def stop(self) -> None:
        self.done.set()


def beacon_interval(ttl_s: float, cap: float) -> float:
    """A beacon every quarter of the lease, capped, so two lost beacons still leave time."""
    return max(0.5, min(cap, ttl_s / 4.0))


def int_param(params: dict, name: str, default: int, low: int, high: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Refusal(f"params.{name} must be a whole number from {low} to {high}; "
                      f"the job gave {value!r}")
    return value


def check_power_constraints(constraints: object, vitals: dict) -> None:
    """require_charging and min_battery_pct are the runner's to enforce, before any work."""
    if not isinstance(constraints, dict):
        return
    if constraints.get("require_charging"):
        if vitals.get("charging") is None:
            raise Refusal("refused: the job requires charging and this device cannot tell "
                          "whether it is charging")
        if not vitals["charging"]:
            raise Refusal("refused: the job requires charging and this device is not charging")
    minimum = constraints.get("min_battery_pct")
    if isinstance(minimum, (int, float)) and not isinstance(minimum, bool):
        pct = vitals.get("battery_pct")
        if pct is None:
            raise Refusal(f"refused: the job needs at least {minimum}% battery and this device "
                          "cannot read its battery level")
        if pct < minimum:
            raise Refusal(f"refused: the battery is at {pct}% and the job needs at least "
                          f"{minimum}%")


def run_watched(argv: list[str], ctx: JobContext, timeout: float, log_path: str,
                cwd: str | None = None) -> tuple[int | None, float, float]:
    """Run a long tool, stopping it when the job stops; (exit code, wall ms, peak RSS MB).

    os.wait4 gives the peak memory of this one child (getrusage(RUSAGE_CHILDREN) would mix in
    every earlier child). Exit code None means it was stopped or timed out.
    """
    started = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
    killed_at = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        late = time.monotonic() - started > timeout
        if (ctx.stop.is_set() or late) and killed_at is None:
            killed_at = time.monotonic()
            _signal_group(proc.pid, signal.SIGTERM)
        elif killed_at is not None and time.monotonic() - killed_at > 5:
            _signal_group(proc.pid, signal.SIGKILL)
        time.sleep(0.05)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    proc.returncode = code  # reaped here; keep Popen from waiting again
    divisor = 1 << 20 if sys.platform == "darwin" else 1 << 10  # bytes on macOS, KiB elsewhere
    return (None if killed_at else code), (time.monotonic() - started) * 1000, \
        usage.ru_maxrss / divisor


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)


def read_tail(path: str, limit: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - limit))
        return fh.read()


# --------------------------------------------------------------------------------------------
# Device workloads
# --------------------------------------------------------------------------------------------


def synthetic_block() -> bytearray:
    """A fresh synthetic block (decisions.md): byte i is (i * 31) & 0xff."""
    return bytearray((i * 31) & 0xFF for i in range(SYNTHETIC_BLOCK_BYTES))


def synthetic_rounds(block: bytearray, rounds: int) -> None:
    """Rounds over the block in place: each hashes the whole block with SHA-256 and writes the
    32-byte digest over the block's first 32 bytes."""
    sha = hashlib.sha256
    for _ in range(rounds):
        block[:32] = sha(block).digest()


def synthetic_tokens(block: bytearray, tokens: int, check) -> None:
    """Advance the block by `tokens` tokens of 1,000 rounds each (the reference loop), looking
    for a stop request between tokens."""
    for _ in range(tokens):
        check()
        synthetic_rounds(block, SYNTHETIC_ROUNDS_PER_TOKEN)


def synthetic_attestation(rounds: int = SYNTHETIC_ATTESTATION_ROUNDS) -> str:
    """The hex SHA-256 of a fresh block after `rounds` rounds: proof the figures came from a
    correct SHA-256 (SYNTHETIC_ATTESTATION for 1,000)."""
    block = synthetic_block()
    synthetic_rounds(block, rounds)
    return hashlib.sha256(block).hexdigest()


def synthetic_iteration(block: bytearray, prompt_tokens: int, gen_tokens: int, check) -> dict:
    """One iteration on the job's block (kept across iterations): prompt_tokens tokens of
    prefill, one token (the first), then gen_tokens - 1 tokens; rates as decisions.md says."""
    started = time.perf_counter()
    synthetic_tokens(block, prompt_tokens, check)
    prefilled = time.perf_counter()
    synthetic_tokens(block, min(1, gen_tokens), check)
    first = time.perf_counter()
    synthetic_tokens(block, max(0, gen_tokens - 1), check)
    ended = time.perf_counter()
    prefill_ms = (prefilled - started) * 1000
    first_ms, rest_ms = (first - prefilled) * 1000, (ended - first) * 1000
    return {"prefill_tok_s": round(prompt_tokens * 1000 / max(prefill_ms, 1.0), 3),
            "decode_tok_s": round(gen_tokens * 1000 / max(first_ms + rest_ms, 1.0), 3),
            "ttft_ms": round(prefill_ms + first_ms, 3)}


def benchmark_params(params: dict) -> dict:
    """The plan of a benchmark job, with the defaults of decisions.md."""
    return {
        "prompt_tokens": int_param(params, "prompt_tokens", 512, 0, 1_000_000),
        "gen_tokens": int_param(params, "gen_tokens", 128, 0, 1_000_000),
        "warmup_iters": int_param(params, "warmup_iters", 1, 0, 1000),
        "measure_iters": int_param(params, "measure_iters", 3, 1, 10_000),
    }


def load_progress(ctx: JobContext, plan: dict) -> tuple[list[dict], bytearray]:
    """Iterations a preempted attempt finished and the job's block as it was after the last of
    them, from the artifact named by params.resume_from (a fresh block when none was saved)."""
    progress = ctx.prior_progress()
    if not progress.get("completed"):
        return [], synthetic_block()
    if progress.get("plan") != plan or not isinstance(progress["completed"], list):
        raise Refusal("params.resume_from was saved for different benchmark parameters")
    completed = [m for m in progress["completed"] if isinstance(m, dict)]
    try:
        block = bytearray(base64.b64decode(str(progress.get("block", "")), validate=True))
    except (binascii.Error, ValueError):
        block = bytearray()
    return completed, block if len(block) == SYNTHETIC_BLOCK_BYTES else synthetic_block()


def hand_back(ctx: JobContext, progress: dict | None = None) -> dict:
    """Give the job back: upload progress (and a hand-back count), then a preempted final row."""
    try:
        handbacks = int(ctx.prior_progress().get("handbacks", 0)) + 1
    except (Refusal, ValueError, TypeError):
        handbacks = 1
    body = {"kind": PROGRESS_KIND, "job_id": ctx.job_id, "handbacks": handbacks,
            "saved_at": now_iso(), **(progress or {})}
    try:
        sha: str | None = ctx.upload(json.dumps(body, sort_keys=True).encode("utf-8"),
                                     f"progress-{ctx.job_id}.json")
    except (Unreachable, HttpError) as exc:
        log.warning("could not upload progress of %s: %s", ctx.job_id, exc)
        sha = None
    done = len((progress or {}).get("completed") or [])
    if sha is None:
        note = "progress could not be uploaded, so the job restarts from its last saved point"
    elif progress:
        note = f"progress after {done} iterations saved as artifact {sha[:12]}"
    else:
        note = "this workload restarts from the beginning"
    return final(False, f"{ctx.reason}; the job was handed back ({note})",
                 artifacts=[sha] if sha else [], preempted=True,
                 iter=HANDBACK_ITER_TOP - handbacks)


def summarise(measured: list[dict]) -> dict:
    summary: dict = {}
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms"):
        values = [m[key] for m in measured if isinstance(m.get(key), (int, float))]
        if values:
            summary[key] = round(statistics.median(values), 3)
    return summary


def wl_benchmark_synthetic(runtime: Runtime, ctx: JobContext) -> dict:
    plan = benchmark_params(ctx.params)
    p, g = plan["prompt_tokens"], plan["gen_tokens"]
    # The job's block: made once, kept across iterations and across a hand-back (the progress
    # carries it as it was after the last finished iteration).
    completed, block = load_progress(ctx, plan)
    saved = bytes(block)
    resumed_after = len(completed)
    start_vitals = runtime.vitals()
    thermal = [start_vitals.get("thermal")]
    for _ in range(plan["warmup_iters"]):
        try:
            synthetic_iteration(block, p, g, ctx.check)
        except Stopped:
            return handback_or_raise(ctx, plan, completed, saved)
    saved = bytes(block)
    for number in range(len(completed) + 1, plan["measure_iters"] + 1):
        try:
            metrics = synthetic_iteration(block, p, g, ctx.check)
        except Stopped:
            return handback_or_raise(ctx, plan, completed, saved)
        saved = bytes(block)
        ctx.post(ctx.row(number, True, metrics))
        completed.append(metrics)
        thermal.append(thermal_sample(runtime.probe))
    end_vitals = runtime.vitals()
    metrics = summarise(completed)
    metrics.update(synthetic_rounds=SYNTHETIC_ATTESTATION_ROUNDS,
                   synthetic_digest=synthetic_attestation(),
                   thermal=[t for t in thermal if t], iterations=len(completed))
    for key, vitals in (("battery_start_pct", start_vitals), ("battery_end_pct", end_vitals)):
        if vitals.get("battery_pct") is not None:
            metrics[key] = vitals["battery_pct"]
    if metrics["synthetic_digest"] != SYNTHETIC_ATTESTATION:
        return final(False, "this device's SHA-256 gave the attestation digest {}, not the "
                     "reference {}, so its figures are not comparable".format(
                         metrics["synthetic_digest"], SYNTHETIC_ATTESTATION), metrics)
    if ctx.params.get("resume_from"):
        metrics["resumed_after_iter"] = resumed_after
    return final(True, metrics=metrics)


def handback_or_raise(ctx: JobContext, plan: dict, completed: list[dict], block: bytes) -> dict:
    if not ctx.handback:
        raise Stopped(ctx.reason)
    return hand_back(ctx, {"plan": plan, "completed": completed,
                           "block": base64.b64encode(block).decode("ascii")})


def llama_records(output: str) -> tuple[dict, dict]:
    """(prefill record, decode record) from `llama-bench -o json`."""
    start = output.find("[")
    try:
        records = json.loads(output[start:]) if start >= 0 else None
    except ValueError:
        records = None
    if not isinstance(records, list):
        raise Refusal("llama-bench did not print the JSON report the agent asked for")
    prefill = next((r for r in records if r.get("n_prompt", 0) > 0 and r.get("n_gen") == 0), {})
    decode = next((r for r in records if r.get("n_gen", 0) > 0 and r.get("n_prompt") == 0), {})
    return prefill, decode


def llama_ttft_ms(prompt_tokens: int, prefill_ts: float | None, decode_ts: float | None):
    if not prefill_ts or not decode_ts:
        return None
    return round(prompt_tokens / prefill_ts * 1000 + 1000 / decode_ts, 3)


def wl_benchmark_llama(runtime: Runtime, ctx: JobContext) -> dict:
    plan = benchmark_params(ctx.params)
    model = ctx.spec.get("model") if isinstance(ctx.spec.get("model"), dict) else {}
    if not model.get("sha256"):
        raise Refusal("a llama.cpp benchmark needs model.sha256 naming the model artifact")
    model_path = ctx.fetch(str(model["sha256"]), ".gguf")
    argv = [str(runtime.tools["llama-bench"]), "-m", model_path, "-p", str(plan["prompt_tokens"]),
            "-n", str(plan["gen_tokens"]), "-r", str(plan["measure_iters"]), "-o", "json"]
    log_path = os.path.join(ctx.workdir, "llama-bench.out")
    battery_start = runtime.vitals().get("battery_pct")
    code, wall_ms, peak_mb = run_watched(argv, ctx, ctx.lease_ttl() * 4, log_path)
    ctx.check()
    output = read_tail(log_path, 4 << 20).decode("utf-8", "replace")
    if code != 0:
        raise Refusal(f"llama-bench exited with status {code}: {tail(output, 200)}")
    prefill, decode = llama_records(output)
    pp_samples = prefill.get("samples_ts") or []
    tg_samples = decode.get("samples_ts") or []
    for index in range(max(len(pp_samples), len(tg_samples))):
        pp = pp_samples[index] if index < len(pp_samples) else None
        tg = tg_samples[index] if index < len(tg_samples) else None
        row_metrics = {"prefill_tok_s": pp, "decode_tok_s": tg,
                       "ttft_ms": llama_ttft_ms(plan["prompt_tokens"], pp, tg)}
        ctx.post(ctx.row(index + 1, True, {k: v for k, v in row_metrics.items() if v is not None}))
    metrics = {"prefill_tok_s": prefill.get("avg_ts"), "decode_tok_s": decode.get("avg_ts"),
               "ttft_ms": llama_ttft_ms(plan["prompt_tokens"], prefill.get("avg_ts"),
                                        decode.get("avg_ts")),
               "peak_mem_mb": round(peak_mb, 1), "mem_method": "wait4-maxrss-" + sys.platform,
               "battery_start_pct": battery_start,
               "battery_end_pct": runtime.vitals().get("battery_pct"),
               "wall_ms": round(wall_ms, 1)}
    return final(True, metrics={k: v for k, v in metrics.items() if v is not None},
                 llama_bench={"build": prefill.get("build_commit"),
                              "model_type": prefill.get("model_type")})


def wl_benchmark(runtime: Runtime, ctx: JobContext) -> dict:
    backend = ctx.spec.get("backend") or "synthetic"
    if backend == "synthetic":
        return wl_benchmark_synthetic(runtime, ctx)
    if backend == "llama.cpp" and runtime.tools.get("llama-bench"):
        return wl_benchmark_llama(runtime, ctx)
    raise Refusal("refused: this agent does not implement the benchmark backend {!r} (it "
                  "implements: {}), so it will not report another backend's numbers".format(
                      backend, ", ".join(runtime.benchmark_backends())))


def wl_self_check(runtime: Runtime, ctx: JobContext) -> dict:
    checks = {}
    checks["sha256"] = hashlib.sha256(b"abc").hexdigest().startswith("ba7816bf8f01cfea")
    checks["synthetic_attestation"] = synthetic_attestation() == SYNTHETIC_ATTESTATION
    started = time.perf_counter()
    synthetic_tokens(synthetic_block(), 1, ctx.check)
    token_ms = (time.perf_counter() - started) * 1000
    probe_file = os.path.join(ctx.workdir, "write-test")
    try:
        atomic_write(probe_file, b"ok")
        checks["state_writable"] = True
    except OSError:
        checks["state_writable"] = False
    checks["clock_sane"] = time.gmtime().tm_year >= 2024
    failed = sorted(name for name, passed in checks.items() if not passed)
    vitals = runtime.vitals()
    metrics = {"synthetic_token_ms": round(token_ms, 3)}
    if vitals.get("battery_pct") is not None:
        metrics["battery_start_pct"] = vitals["battery_pct"]
    report = {"python": platform.python_version(), "agent": AGENT_VERSION, "checks": checks,
              "descriptor": runtime.descriptor, "capabilities": runtime.capabilities(),
              "vitals": vitals}
    error = ("self-check failed: {}".format(", ".join(failed))) if failed else None
    return final(not failed, error, metrics, self_check=report)


def wl_shell(runtime: Runtime, ctx: JobContext) -> dict:
    sha = str(ctx.params.get("script_sha256") or "").lower()
    args = ctx.params.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise Refusal("params.args must be a list of strings")
    if sha not in load_allowlist(runtime.allowlist_path):
        raise Refusal("refused: script %s is not pinned in this machine's shell allowlist; "
                      "its owner must add the SHA-256 there first" % (sha[:12] or "(none)"))
    cached = ctx.fetch(sha)
    script = os.path.join(ctx.workdir, "script")
    shutil.copyfile(cached, script)
    os.chmod(script, 0o700)
    with open(script, "rb") as fh:
        has_shebang = fh.read(2) == b"#!"
    argv = ([script] if has_shebang else ["/bin/sh", script]) + args
    timeout = float(int_param(ctx.params, "timeout_s", 3600, 1, 7 * 86400))
    log_path = os.path.join(ctx.workdir, "output.log")
    code, wall_ms, _ = run_watched(argv, ctx, timeout, log_path, cwd=ctx.workdir)
    ctx.check()
    artifacts = []
    try:
        artifacts.append(ctx.upload(read_tail(log_path, 8 << 20), f"shell-{ctx.job_id}.log"))
    except (Unreachable, HttpError) as exc:
        log.warning("could not upload the output of %s: %s", ctx.job_id, exc)
    metrics = {"duration_ms": round(wall_ms, 1)}
    if code is None:
        return final(False, f"the script was stopped after the {timeout:g} s timeout", metrics,
                     artifacts)
    metrics["exit_code"] = code
    error = None if code == 0 else f"the script exited with status {code}"
    return final(code == 0, error, metrics, artifacts)


DEVICE_WORKLOADS = {"self-check": wl_self_check, "benchmark": wl_benchmark, "shell": wl_shell}


# --------------------------------------------------------------------------------------------
# Host executor: targets attached to this machine
# --------------------------------------------------------------------------------------------

SIM_PLATFORMS = (("iOS", "ios"), ("tvOS", "tvos"), ("watchOS", "watchos"), ("xrOS", "visionos"),
                 ("visionOS", "visionos"))
PLATFORM_ALIASES = {"ios-simulator": "ios", "simulator": "ios", "iphone": "ios",
                    "android-emulator": "android", "emulator": "android"}


def android_targets(adb: str | None) -> list[dict]:
    """Devices `adb devices -l` lists in the `device` state (not offline or unauthorized)."""
    if not adb:
        return []
    result = run_cmd([adb, "devices", "-l"], timeout=20)
    if not result.ok:
        log.warning("adb devices -l failed: %s", tail(result.err or result.out, 200))
        return []
    targets = []
    for line in result.out.splitlines():
        words = line.split()
        if len(words) < 2 or words[1] != "device" or line.startswith("List of devices"):
            continue
        props = dict(w.split(":", 1) for w in words[2:] if ":" in w)
        targets.append({"device_id": words[0], "platform": "android",
                        "model": props.get("model", "").replace("_", " ") or None,
                        "emulator": words[0].startswith("emulator-")})
    return targets


def simulator_targets(xcrun: str | None) -> list[dict]:
    """Booted simulators from `xcrun simctl list -j devices`."""
    if not xcrun:
        return []
    result = run_cmd([xcrun, "simctl", "list", "-j", "devices"], timeout=30)
    try:
        runtimes = json.loads(result.out).get("devices", {}) if result.ok else {}
    except (ValueError, AttributeError):
        runtimes = {}
    targets = []
    for runtime_id, devices in sorted(runtimes.items()):
        platform_name = next((p for key, p in SIM_PLATFORMS if key in runtime_id), None)
        for device in devices if isinstance(devices, list) else []:
            if platform_name and device.get("state") == "Booted":
                targets.append({"device_id": device.get("udid"), "platform": platform_name,
                                "model": device.get("name"), "emulator": True})
    return targets


def job_platform(spec: dict) -> str | None:
    targets = spec.get("targets") if isinstance(spec.get("targets"), dict) else {}
    app = spec.get("app") if isinstance(spec.get("app"), dict) else {}
    for value in (app.get("platform"), targets.get("device_kind")):
        if isinstance(value, str) and value:
            value = value.lower()
            return PLATFORM_ALIASES.get(value, value)
    return None


def select_targets(runtime: Runtime, spec: dict) -> list[dict]:
    """Attached targets the job may use: the pinned one, else every one of its platform."""
    attached = android_targets(runtime.tools.get("adb")) + simulator_targets(
        runtime.tools.get("xcrun"))
    targets = spec.get("targets") if isinstance(spec.get("targets"), dict) else {}
    pinned, platform_name = targets.get("device_id"), job_platform(spec)
    if pinned:
        chosen = [t for t in attached if t["device_id"] == pinned]
        if not chosen:
            raise Refusal(f"device {pinned} is not attached to this executor")
        return chosen
    if platform_name is None:
        platforms = sorted({t["platform"] for t in attached})
        if len(platforms) != 1:
            raise Refusal("the job names no platform (app.platform or targets.device_kind) "
                          "and this executor has %s attached, so it cannot choose"
                          % ("no targets" if not platforms else " and ".join(platforms)))
        platform_name = platforms[0]
    chosen = [t for t in attached if t["platform"] == platform_name]
    if not chosen:
        raise Refusal(f"no {platform_name} targets are attached to this executor")
    return chosen


def target_fields(target: dict) -> dict:
    """Row fields for a row about one attached device: the collector files it under that id."""
    return {"device_id": target["device_id"],
            "device": {"model": target.get("model"), "soc": None, "os": target["platform"]},
            "target": {"device_id": target["device_id"], "platform": target["platform"],
                       "emulator": target.get("emulator")}}


# --- install ---


def safe_unzip(archive: str, dest: str) -> None:
    with zipfile.ZipFile(archive) as bundle:
        for member in bundle.namelist():
            resolved = os.path.realpath(os.path.join(dest, member))
            if not resolved.startswith(os.path.realpath(dest) + os.sep):
                raise Refusal(f"the app archive contains an unsafe path ({member})")
        bundle.extractall(dest)


def find_app_bundle(root: str) -> str | None:
    for current, dirs, _ in os.walk(root):
        for name in sorted(dirs):
            if name.endswith(".app"):
                return os.path.join(current, name)
    return None


def app_payload(ctx: JobContext, platform_name: str) -> str:
    """The verified build for the job's app: an .apk path, or an unpacked .app directory."""
    app = ctx.spec.get("app") if isinstance(ctx.spec.get("app"), dict) else {}
    sha = str(app.get("sha256") or "")
    if not HEX64.match(sha.lower()):
        raise Refusal(f"app.sha256 must be the SHA-256 of a build artifact; got {sha!r}")
    if platform_name == "android":
        return ctx.fetch(sha, ".apk")
    archive = ctx.fetch(sha, ".zip")
    unpacked = os.path.join(ctx.workdir, "app-" + sha[:12])
    if not os.path.isdir(unpacked):
        os.makedirs(unpacked)
        try:
            safe_unzip(archive, unpacked)
        except zipfile.BadZipFile as exc:
            raise Refusal(f"the {platform_name} build must be a zip of an .app bundle") \
                from exc
    bundle = find_app_bundle(unpacked)
    if bundle is None:
        raise Refusal(f"the {platform_name} build archive holds no .app bundle")
    return bundle


def install_on(runtime: Runtime, target: dict, payload: str) -> str | None:
    """Install a build on one target; None on success, else the sentence saying why not."""
    if target["platform"] == "android":
        result = run_cmd([runtime.tools["adb"], "-s", target["device_id"], "install", "-r",
                          payload], timeout=600)
        if result.ok and "Success" in result.out:
            return None
        return "adb install on {} failed: {}".format(target["device_id"],
                                                 tail(result.out + result.err, 200))
    result = run_cmd([runtime.tools["xcrun"], "simctl", "install", target["device_id"],
                      payload], timeout=600)
    if result.ok:
        return None
    return "simctl install on {} failed: {}".format(target["device_id"], tail(result.err, 200))


def wl_install(runtime: Runtime, ctx: JobContext) -> dict:
    chosen = select_targets(runtime, ctx.spec)
    failures = []
    for number, target in enumerate(chosen, 1):
        ctx.check()
        started = time.monotonic()
        error = install_on(runtime, target, app_payload(ctx, target["platform"]))
        metrics = {"install_ms": round((time.monotonic() - started) * 1000, 1)}
        ctx.post(ctx.row(number, error is None, metrics, error=error, **target_fields(target)))
        if error:
            failures.append(error)
    if failures:
        return final(False, "; ".join(failures), {"targets": len(chosen)})
    return final(True, metrics={"targets": len(chosen)})


# --- ui-test ---

SUITE_KINDS = ("flow_runner", "native_bundle")


def parse_suite_report(path: str) -> list[dict]:
    """Flows from the suite tool's report: JSON {"flows": [...]} or JUnit-style XML."""
    with open(path, "rb") as fh:
        data = fh.read(16 << 20)
    if data.lstrip().startswith(b"<"):
        return parse_junit(data)
    report = json.loads(data.decode("utf-8"))
    flows = report.get("flows") if isinstance(report, dict) else None
    if not isinstance(flows, list):
        raise ValueError("the JSON report has no flows list")
    return [{"name": str(f.get("name", f"flow {n}")), "ok": f.get("ok") is True,
             "duration_ms": f.get("duration_ms"), "error": f.get("error")}
            for n, f in enumerate(flows, 1) if isinstance(f, dict)]


def parse_junit(data: bytes) -> list[dict]:
    # The report comes from a tool the executor's owner installed, not from the network.
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.fromstring(data)  # noqa: S314
    flows = []
    for case in root.iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        seconds = case.get("time")
        flows.append({"name": case.get("name") or "unnamed",
                      "ok": problem is None and case.find("skipped") is None,
                      "duration_ms": round(float(seconds) * 1000, 1) if seconds else None,
                      "error": (problem.get("message") or (problem.text or "").strip()
                                or "failed") if problem is not None else None})
    return flows


def suite_argv(runtime: Runtime, ctx: JobContext, target: dict, report: str) -> list[str]:
    suite = ctx.spec.get("suite") if isinstance(ctx.spec.get("suite"), dict) else {}
    kind = suite.get("kind")
    if kind not in SUITE_KINDS:
        raise Refusal(f"suite.kind must be flow_runner or native_bundle; the job gave {kind!r}")
    tool = runtime.tools.get(kind)
    if not tool:
        flag = kind.replace("_", "-")
        raise Refusal(f"this executor has no {kind} tool configured (--{flag} or "
                      f"FLEET_{kind.upper()})")
    argv = [tool, "--platform", target["platform"], "--device", target["device_id"],
            "--flows", str(suite.get("flows") or ""), "--report", report]
    app = ctx.spec.get("app") if isinstance(ctx.spec.get("app"), dict) else {}
    if app.get("name"):
        argv += ["--app-name", str(app["name"])]
    return argv


def wl_ui_test(runtime: Runtime, ctx: JobContext) -> dict:
    target = select_targets(runtime, ctx.spec)[0]
    app = ctx.spec.get("app") if isinstance(ctx.spec.get("app"), dict) else {}
    report = os.path.join(ctx.workdir, "report")
    argv = suite_argv(runtime, ctx, target, report)
    if app.get("sha256"):
        payload = app_payload(ctx, target["platform"])
        error = install_on(runtime, target, payload)
        if error:
            return final(False, error, **target_fields(target))
        argv += ["--app", payload]
    timeout = float(int_param(ctx.params, "timeout_s", 3600, 1, 86400))
    code, wall_ms, _ = run_watched(argv, ctx, timeout, os.path.join(ctx.workdir, "suite.log"),
                                   cwd=ctx.workdir)
    ctx.check()
    if code is None:
        return final(False, f"the suite tool was stopped after the {timeout:g} s timeout")
    try:
        flows = parse_suite_report(report)
    except (OSError, ValueError) as exc:
        return final(False, f"the suite tool exited with status {code} and left no readable "
                     f"report ({exc})", **target_fields(target))
    with open(report, "rb") as fh:
        artifacts = [ctx.upload(fh.read(), f"ui-report-{ctx.job_id}")]
    for number, flow in enumerate(flows, 1):
        metrics = {"duration_ms": flow["duration_ms"]} if flow["duration_ms"] is not None else {}
        ctx.post(ctx.row(number, flow["ok"], metrics, error=flow["error"] if not flow["ok"]
                         else None, flow=flow["name"], **target_fields(target)))
    failed = [f["name"] for f in flows if not f["ok"]]
    metrics = {"flows": len(flows), "flows_passed": len(flows) - len(failed),
               "duration_ms": round(wall_ms, 1)}
    if not flows:
        return final(False, "the suite report lists no flows", metrics, artifacts)
    if failed:
        names = ", ".join(failed[:10])
        return final(False, f"{len(failed)} of {len(flows)} flows failed: {names}", metrics,
                     artifacts, **target_fields(target))
    return final(True, None, metrics, artifacts, **target_fields(target))


# --- cold-start ---

LAUNCH_STATES = ("cold", "warm", "hot")


def android_component(adb: str, serial: str, app_id: str) -> str:
    result = run_cmd([adb, "-s", serial, "shell", "cmd", "package", "resolve-activity",
                      "--brief", app_id], timeout=30)
    lines = [line.strip() for line in result.out.splitlines() if "/" in line]
    if not result.ok or not lines:
        raise Refusal(f"{app_id} has no launchable activity on {serial}")
    return lines[-1]


def android_launch_ms(adb: str, serial: str, app_id: str, component: str, state: str) -> float:
    shell = [adb, "-s", serial, "shell"]
    # cold: no process; warm: process alive, activity gone (back); hot: activity backgrounded.
    prepare = {"cold": ["am", "force-stop", app_id],
               "warm": ["input", "keyevent", "KEYCODE_BACK"],
               "hot": ["input", "keyevent", "KEYCODE_HOME"]}[state]
    run_cmd([*shell, *prepare], timeout=30)
    result = run_cmd([*shell, "am", "start", "-W", "-n", component], timeout=120)
    match = re.search(r"TotalTime:\s*(\d+)", result.out)
    if not result.ok or not match:
        said = tail(result.out + result.err, 200)
        raise Refusal(f"am start on {serial} printed no TotalTime: {said}")
    return float(match.group(1))


def simulator_launch_ms(xcrun: str, udid: str, app_id: str, state: str) -> float:
    if state != "cold":
        raise Refusal(f"only cold launches are measured on simulators; {state} is not")
    run_cmd([xcrun, "simctl", "terminate", udid, app_id], timeout=30)
    result = run_cmd([xcrun, "simctl", "launch", udid, app_id], timeout=120)
    if not result.ok:
        raise Refusal(f"simctl launch on {udid} failed: {tail(result.err, 200)}")
    return round(result.ms, 1)


def wl_cold_start(runtime: Runtime, ctx: JobContext) -> dict:
    app_id = ctx.params.get("app_id")
    if not isinstance(app_id, str) or not re.match(r"^[A-Za-z0-9._-]+$", app_id):
        raise Refusal("params.app_id must be an application id such as com.example.app")
    launches = int_param(ctx.params, "launches", 5, 1, 200)
    states = ctx.params.get("states") or ["cold"]
    if not isinstance(states, list) or not states or any(s not in LAUNCH_STATES for s in states):
        raise Refusal("params.states must be a list of cold, warm and hot")
    target = select_targets(runtime, ctx.spec)[0]
    serial = target["device_id"]
    if target["platform"] == "android":
        component = android_component(runtime.tools["adb"], serial, app_id)
        run_cmd([runtime.tools["adb"], "-s", serial, "shell", "am", "start", "-W", "-n",
                 component], timeout=120)  # a first, unmeasured launch makes warm/hot possible

        def launch(state: str) -> float:
            return android_launch_ms(runtime.tools["adb"], serial, app_id, component, state)
    else:
        def launch(state: str) -> float:
            return simulator_launch_ms(runtime.tools["xcrun"], serial, app_id, state)
    per_state = {}
    for number, state in enumerate(states, 1):
        samples = []
        for _ in range(launches):
            ctx.check()
            samples.append(launch(state))
        per_state[state] = {"p50_ms": percentile(samples, 50), "p95_ms": percentile(samples, 95),
                            "min_ms": min(samples), "max_ms": max(samples), "launches": launches}
        ctx.post(ctx.row(number, True, dict(per_state[state]), state=state, samples_ms=samples,
                         **target_fields(target)))
    first = per_state[states[0]]
    return final(True, metrics={"p50_ms": first["p50_ms"], "p95_ms": first["p95_ms"]},
                 states=per_state, **target_fields(target))


# --- web-test / web-shots with a local Chromium ---


def web_url(spec: dict) -> str:
    targets = spec.get("targets") if isinstance(spec.get("targets"), dict) else {}
    url = targets.get("url") or (spec.get("params") or {}).get("url")
    # Only the web: file:// or chrome:// would let a job read this machine's files.
    if not isinstance(url, str) or not re.match(r"^https?://", url):
        raise Refusal("web jobs need targets.url starting with http:// or https://")
    return url


def requested_browsers(value: object, available: list[str]) -> list[str]:
    if value in (None, "all") or value == ["all"]:
        return list(available)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise Refusal("params.browser must be a browser name, a list of names, or all")


def chromium_argv(runtime: Runtime, ctx: JobContext, profile: str) -> list[str]:
    argv = [runtime.tools["chromium"], "--headless=new", "--disable-gpu", "--no-first-run",
            "--no-default-browser-check", "--hide-scrollbars",
            "--user-data-dir=" + os.path.join(ctx.workdir, "profile-" + profile)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--no-sandbox")  # Chromium refuses to start as root otherwise
    return argv


def chromium_page(runtime: Runtime, ctx: JobContext, url: str) -> tuple[str | None, dict, bytes]:
    """(error, metrics, DOM bytes) for one load of `url`."""
    result = run_cmd([*chromium_argv(runtime, ctx, "test"), "--dump-dom", url], timeout=120)
    metrics = {"load_ms": round(result.ms, 1)}
    if not result.ok:
        return f"Chromium could not load {url}: {tail(result.err, 200)}", metrics, b""
    if "<html" not in result.out.lower():
        return f"Chromium loaded {url} but printed no HTML document", metrics, result.raw
    expected = ctx.params.get("expect_text")
    if isinstance(expected, str) and expected not in result.out:
        return f"the page at {url} does not contain {expected!r}", metrics, result.raw
    return None, metrics, result.raw


def wl_web_test(runtime: Runtime, ctx: JobContext) -> dict:
    url = web_url(ctx.spec)
    available = ["chromium"] if runtime.tools.get("chromium") else []
    failures = []
    browsers = requested_browsers(ctx.params.get("browser"), available)
    for number, browser in enumerate(browsers, 1):
        ctx.check()
        if browser not in available:
            error, metrics, artifacts = f"{browser} is not installed on this executor", {}, []
        else:
            error, metrics, dom = chromium_page(runtime, ctx, url)
            artifacts = [ctx.upload(dom, f"dom-{ctx.job_id}.html")] if dom else []
        ctx.post(ctx.row(number, error is None, metrics, error=error, browser=browser,
                         artifacts=artifacts))
        if error:
            failures.append(error)
    if not browsers:
        return final(False, "no requested browser is installed on this executor")
    return final(not failures, "; ".join(failures) or None, {"browsers": len(browsers)})


def chromium_shot(runtime: Runtime, ctx: JobContext, url: str) -> tuple[str | None, bytes]:
    path = os.path.join(ctx.workdir, "shot.png")
    size = str(ctx.params.get("viewport") or "1280x800")
    if not re.match(r"^\d{2,5}x\d{2,5}$", size):
        raise Refusal("params.viewport must look like 1280x800")
    argv = [*chromium_argv(runtime, ctx, "shots"), "--screenshot=" + path,
            "--window-size=" + size.replace("x", ","), url]
    result = run_cmd(argv, timeout=120)
    if not result.ok or not os.path.exists(path):
        return f"Chromium could not screenshot {url}: {tail(result.err, 200)}", b""
    with open(path, "rb") as fh:
        return None, fh.read()


def android_shot(runtime: Runtime, serial: str, url: str, settle_s: float):
    adb = runtime.tools["adb"]
    run_cmd([adb, "-s", serial, "shell", "am", "start", "-a", "android.intent.action.VIEW",
             "-d", url], timeout=60)
    time.sleep(settle_s)  # the page renders on the device; there is no load event to wait on
    result = run_cmd([adb, "-s", serial, "exec-out", "screencap", "-p"], timeout=60)
    if not result.ok or not result.raw.startswith(b"\x89PNG"):
        return f"screencap on {serial} returned no PNG image", b""
    return None, result.raw


def shot_profiles(runtime: Runtime, browsers: list[str]) -> list[tuple[str, str | None]]:
    """(profile, android serial) pairs; android-device expands to every attached device."""
    profiles: list[tuple[str, str | None]] = []
    for browser in browsers:
        if browser == "android-device":
            serials = [t["device_id"] for t in android_targets(runtime.tools.get("adb"))]
            profiles += [("android-device", s) for s in serials] or [("android-device", None)]
        else:
            profiles.append((browser, None))
    return profiles


def wl_web_shots(runtime: Runtime, ctx: JobContext) -> dict:
    url = web_url(ctx.spec)
    available = ["chromium"] if runtime.tools.get("chromium") else []
    browsers = requested_browsers(ctx.params.get("browser"), available)
    settle = float(int_param(ctx.params, "settle_s", 3, 0, 60))
    failures, artifacts = [], []
    for number, (profile, serial) in enumerate(shot_profiles(runtime, browsers), 1):
        ctx.check()
        if profile == "android-device":
            error, png = ("no Android device is attached for the android-device profile", b"") \
                if serial is None else android_shot(runtime, serial, url, settle)
        elif profile in available:
            error, png = chromium_shot(runtime, ctx, url)
        else:
            error, png = f"{profile} is not installed on this executor", b""
        shot = [ctx.upload(png, f"shot-{ctx.job_id}-{number}.png")] if png else []
        artifacts += shot
        ctx.post(ctx.row(number, error is None, {}, error=error, browser=profile,
                         serial=serial, artifacts=shot))
        if error:
            failures.append(error)
    return final(not failures and bool(artifacts), "; ".join(failures) or None,
                 {"shots": len(artifacts)}, artifacts)


HOST_WORKLOADS = {"install": wl_install, "ui-test": wl_ui_test, "cold-start": wl_cold_start,
                  "web-test": wl_web_test, "web-shots": wl_web_shots}


# --------------------------------------------------------------------------------------------
# The runtime: what both modes share
# --------------------------------------------------------------------------------------------

MAC_BROWSERS = ("/Applications/Chromium.app/Contents/MacOS/Chromium",
                "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")
TOOL_NAMES = {
    "llama-bench": ("llama-bench",),
    "adb": ("adb",),
    "xcrun": ("xcrun",),
    "chromium": ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
                 *MAC_BROWSERS),
    "flow_runner": ("fleet-flow-runner",),
    "native_bundle": ("fleet-native-bundle",),
}


def find_tools(explicit: dict, probe: Probe) -> dict:
    """Path of each tool the agent can drive: the configured one, else the first on PATH."""
    found = {}
    for key, names in TOOL_NAMES.items():
        for candidate in ([explicit[key]] if explicit.get(key) else []) + list(names):
            path = candidate if os.path.isabs(candidate) else probe.which(candidate)
            if path and os.path.isfile(path) and os.access(path, os.X_OK):
                found[key] = path
                break
    return found


class Runtime:
    """State shared by every collector link: identity, tools, the job gate, the outbox."""

    def __init__(self, cfg: argparse.Namespace, probe: Probe):
        self.cfg = cfg
        self.probe = probe
        self.mode = cfg.executor
        self.state_dir = cfg.state_dir
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        if self.mode == "host":
            self.reporter_id = cfg.name
        else:
            self.reporter_id = load_device_id(self.state_dir, cfg.device_id, probe)
        self.outbox = Outbox(os.path.join(self.state_dir, "spool"))
        self.cache = ArtifactCache(os.path.join(self.state_dir, "cache"))
        self.work_root = os.path.join(self.state_dir, "work", self.reporter_id)
        shutil.rmtree(self.work_root, ignore_errors=True)  # leftovers of a crashed run
        os.makedirs(self.work_root, mode=0o700)
        self.allowlist_path = cfg.allowlist or os.path.join(self.state_dir, "shell-allowlist")
        self.tools = find_tools(self.explicit_tools(cfg), probe)
        self.descriptor = detect_descriptor(probe) if self.mode == "device" else {}
        self.descriptor.update(cfg.descriptor_overrides or {})
        self.gate = Gate()
        self.stopping = threading.Event()
        self.current: JobContext | None = None

    @staticmethod
    def explicit_tools(cfg: argparse.Namespace) -> dict:
        return {"llama-bench": cfg.llama_bench, "adb": cfg.adb, "xcrun": cfg.xcrun,
                "chromium": cfg.chromium,
                "flow_runner": cfg.flow_runner or os.environ.get("FLEET_FLOW_RUNNER"),
                "native_bundle": cfg.native_bundle or os.environ.get("FLEET_NATIVE_BUNDLE")}

    def benchmark_backends(self) -> list[str]:
        return ["synthetic"] + (["llama.cpp"] if self.tools.get("llama-bench") else [])

    def capabilities(self) -> list[str]:
        """Only what this agent really implements on this machine, right now."""
        if self.mode == "host":
            return self.host_capabilities()
        caps = ["self-check"] + ["benchmark:" + b for b in self.benchmark_backends()]
        if load_allowlist(self.allowlist_path):
            caps.append("shell")
        return caps

    def host_capabilities(self) -> list[str]:
        tools = self.tools
        drives_devices = bool(tools.get("adb") or tools.get("xcrun"))
        caps = []
        if drives_devices:
            caps += ["install", "cold-start"]
            caps += ["ui-test:" + kind for kind in SUITE_KINDS if tools.get(kind)]
        if tools.get("chromium"):
            caps.append("web-test")
        if tools.get("chromium") or tools.get("adb"):
            caps.append("web-shots")
        return caps

    def implements(self, workload: str) -> bool:
        return any(c == workload or c.startswith(workload + ":") for c in self.capabilities())

    def vitals(self) -> dict:
        return read_vitals(self.probe, self.state_dir) if self.mode == "device" else {}

    def device_summary(self) -> dict:
        return {k: self.descriptor.get(k) for k in ("model", "soc", "os")}

    def registration(self) -> dict:
        body = {"device_id": self.reporter_id, "descriptor": self.descriptor,
                "pools": self.cfg.pools, "capabilities": self.capabilities()}
        if self.cfg.ttl_s:
            body["ttl_s"] = self.cfg.ttl_s
        return body

    def beacon_body(self, job_id: str | None = None, busy: dict | None = None) -> dict:
        fields = self.vitals()
        if busy:
            fields["busy"] = busy
        body = {"schema": WIRE_SCHEMA, "kind": "beacon", "device_id": self.reporter_id,
                "beacon": fields, "at": now_iso()}
        if job_id:
            body["job_id"] = job_id
        return body

    # --- running one job ---

    def run_job(self, collector: Collector, spec: dict) -> None:
        ctx = JobContext(self, collector, spec, self.reporter_id)
        self.current = ctx
        if self.stopping.is_set():
            ctx.request_stop("the agent is shutting down", handback=True)
        log.info("job %s (%s) from %s", ctx.job_id, spec.get("workload"), collector.url)
        keeper = LeaseKeeper(ctx, beacon_interval(ctx.lease_ttl(), self.cfg.beacon_s))
        keeper.start()
        try:
            result = self.execute(ctx)
        finally:
            keeper.stop()
            self.current = None
        iteration = int(result.pop("iter", 0))
        row = ctx.row(iteration, bool(result.pop("ok")), result.pop("metrics", {}), **result)
        row["final"] = True
        ctx.post(row)
        log.info("job %s finished: ok=%s%s", ctx.job_id, row["ok"],
                 " ({})".format(row["error"]) if row.get("error") else "")
        shutil.rmtree(ctx.workdir, ignore_errors=True)

    def execute(self, ctx: JobContext) -> dict:
        workload = str(ctx.spec.get("workload"))
        table = HOST_WORKLOADS if self.mode == "host" else DEVICE_WORKLOADS
        try:
            if workload not in table or not self.implements(workload):
                raise Refusal("refused: this agent does not implement the workload {!r} (it "
                              "implements: {})".format(workload, ", ".join(self.capabilities())))
            if self.mode == "device":
                check_power_constraints(ctx.spec.get("constraints"), self.vitals())
            return table[workload](self, ctx)
        except Stopped:
            return hand_back(ctx) if ctx.handback else final(False, ctx.reason)
        except Refusal as exc:
            return final(False, str(exc))
        except Exception as exc:  # a bug or a surprise must still close the job with a sentence
            log.exception("job %s failed unexpectedly", ctx.job_id)
            return final(False, "the agent failed unexpectedly while running the job: "
                         f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------------------------
# One thread per collector: register, beacon, long-poll, claim
# --------------------------------------------------------------------------------------------


class Link(threading.Thread):
    def __init__(self, runtime: Runtime, collector: Collector):
        super().__init__(name="link-" + collector.url, daemon=True)
        self.rt = runtime
        self.collector = collector
        self.registered = runtime.mode == "host"  # executors are not devices; nothing to register
        self.last_beacon = 0.0
        self.last_busy: tuple[str, str] | None = None
        self.running_job = False

    def run(self) -> None:
        backoff = Backoff(self.rt.cfg.retry_base_s, self.rt.cfg.retry_cap_s)
        while not self.rt.stopping.is_set():
            try:
                self.step()
                backoff.reset()
            except (Unreachable, HttpError) as exc:
                if isinstance(exc, HttpError) and exc.status == 404:
                    self.registered = self.rt.mode == "host"  # unknown device: register again
                delay = backoff.next_delay()
                log.warning("%s: %s; retrying in %.1f s", self.collector.url, exc, delay)
                self.rt.stopping.wait(delay)

    def step(self) -> None:
        held = self.rt.gate.holder()
        if held is not None and held[0] != self.collector.url:
            self.beacon_if_due(busy=held)  # tell this collector why the device is quiet
            self.rt.stopping.wait(0.5)
            return
        if not self.registered:
            reply = self.collector.register(self.rt.registration())
            log.info("registered with %s as %s (capabilities %s)", self.collector.url,
                     self.rt.reporter_id, reply.get("capabilities", self.rt.capabilities()))
            self.registered = True
        self.beacon_if_due()
        timeout = self.rt.cfg.poll_timeout_s
        if self.rt.mode == "host":
            spec = self.collector.next_host_job(self.rt.reporter_id, timeout)
        else:
            spec = self.collector.next_device_job(self.rt.reporter_id, timeout)
        if spec:
            self.take(spec)

    def beacon_if_due(self, busy: tuple[str, str] | None = None) -> None:
        if self.rt.mode == "host":
            return  # an executor beacons only for the job it runs
        changed = busy != self.last_busy
        if not changed and time.monotonic() - self.last_beacon < self.rt.cfg.beacon_s:
            return
        note = {"job_id": busy[1], "collector": busy[0]} if busy else None
        self.collector.beacon(self.rt.beacon_body(busy=note))
        self.last_beacon, self.last_busy = time.monotonic(), busy

    def take(self, spec: dict) -> None:
        job_id = str(spec.get("job_id") or "")
        if not job_id:
            log.error("%s offered a job without a job_id; ignored", self.collector.url)
            return
        # The check-and-set happens under one lock: two links can never both hold a job.
        if self.rt.stopping.is_set() or not self.rt.gate.try_take(self.collector.url, job_id):
            outcome = self.collector.release(job_id, self.rt.reporter_id)
            log.info("job %s from %s lost the race for this device; release: %s", job_id,
                     self.collector.url, outcome)
            return
        self.running_job = True
        try:
            self.rt.run_job(self.collector, spec)
        finally:
            self.running_job = False
            self.rt.gate.free(job_id)
            self.last_beacon = 0.0  # beacon idle right away so constraints see fresh vitals


class Flusher(threading.Thread):
    """Re-posts spooled rows (from a collector outage or an earlier run) with backoff."""

    def __init__(self, runtime: Runtime):
        super().__init__(name="outbox", daemon=True)
        self.rt = runtime

    def run(self) -> None:
        backoff = Backoff(self.rt.cfg.retry_base_s, self.rt.cfg.retry_cap_s)
        delay = 0.0
        while not self.rt.stopping.wait(delay):
            if not self.rt.outbox.pending():
                delay = 1.0
                backoff.reset()
            elif self.rt.outbox.flush():
                delay = 0.0
                backoff.reset()
            else:
                delay = backoff.next_delay()


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def split_list(values: list[str] | None) -> list[str]:
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleet_agent.py", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--collector", action="append", help="collector URL; repeat or comma-separate for several")
    add("--executor", choices=("device", "host"), default="device",
        help="device: run jobs on this machine; host: drive attached devices (default device)")
    add("--name", help="executor name (host mode); what targets.executor pins")
    add("--device-id", help="device id to register (kept in the state file; default from host)")
    add("--pool", action="append", help="pool label; repeat or comma-separate")
    add("--ttl-s", type=int, help="register as a temporary device that leaves after this silence")
    add("--state-dir", default=default_state_dir(), help="state, spool and cache directory")
    add("--allowlist", help="file of pinned shell script SHA-256s (default STATE/shell-allowlist)")
    add("--sysroot", default="/", help="read /proc, /sys and /etc below this root (tests)")
    add("--beacon-s", type=float, default=IDLE_BEACON_S, help="idle beacon period (default 60)")
    add("--poll-timeout-s", type=float, default=45.0,
        help="client timeout of a long poll; longer than the collector's hold (default 45)")
    add("--retry-base-s", type=float, default=1.0, help="first retry delay after a failure")
    add("--retry-cap-s", type=float, default=60.0, help="longest retry delay")
    add("--grace-s", type=float, default=30.0,
        help="on SIGTERM, how long to wait for the running job to hand back and post")
    add("--set", action="append", metavar="FIELD=VALUE", default=[],
        help="override a descriptor field (e.g. kind=tablet); an empty value means null")
    for tool in ("llama-bench", "adb", "xcrun", "chromium", "flow-runner", "native-bundle"):
        add("--" + tool, help=f"path of {tool} (default: found on PATH)")
    add("--print-descriptor", action="store_true",
        help="print the descriptor, capabilities and vitals as JSON and exit")
    add("--log-level", default="INFO")
    add("--version", action="version", version="fleet_agent " + AGENT_VERSION)
    cfg = parser.parse_args(argv)
    cfg.collectors = split_list(cfg.collector)
    cfg.pools = split_list(cfg.pool)
    cfg.descriptor_overrides = parse_overrides(parser, cfg.set)
    if cfg.executor == "host" and not cfg.name:
        parser.error("--executor host needs --name")
    if not cfg.collectors and not cfg.print_descriptor:
        parser.error("give at least one --collector URL")
    for url in cfg.collectors:
        if not url.startswith(("http://", "https://")):
            parser.error(f"collector address {url!r} must start with http:// or https://")
    return cfg


def parse_overrides(parser: argparse.ArgumentParser, items: list[str]) -> dict:
    overrides: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--set wants FIELD=VALUE, not {item!r}")
        number = _int_or_none(value)
        overrides[key] = None if value == "" else number if number is not None else value
    return overrides


def serve(runtime: Runtime) -> int:
    links = [Link(runtime, Collector(url)) for url in runtime.cfg.collectors]
    log.info("fleet_agent %s as %s (%s mode), capabilities: %s", AGENT_VERSION,
             runtime.reporter_id, runtime.mode, ", ".join(runtime.capabilities()) or "none")
    Flusher(runtime).start()
    for link in links:
        link.start()
    while not runtime.stopping.wait(0.5):
        pass
    current = runtime.current
    if current is not None:
        current.request_stop("the agent is shutting down", handback=True)
    deadline = time.monotonic() + runtime.cfg.grace_s
    while any(link.running_job for link in links) and time.monotonic() < deadline:
        time.sleep(0.1)
    runtime.outbox.flush()
    left = len(runtime.outbox.pending())
    log.info("stopped%s", f"; {left} result rows stay spooled for the next start" if left
             else "")
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(message)s")
    probe = Probe(root=cfg.sysroot)
    if cfg.print_descriptor:
        cfg.collectors = cfg.collectors or []
        runtime = Runtime(cfg, probe)
        print(json.dumps({"device_id": runtime.reporter_id, "descriptor": runtime.descriptor,
                          "capabilities": runtime.capabilities(), "vitals": runtime.vitals(),
                          "tools": runtime.tools}, indent=2, sort_keys=True))
        return 0
    runtime = Runtime(cfg, probe)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        runtime.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return serve(runtime)


if __name__ == "__main__":
    sys.exit(main())
