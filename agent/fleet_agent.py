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
import array
import base64
import binascii
import codecs
import collections
import contextlib
import glob
import hashlib
import html
import html.parser
import http.client
import ipaddress
import json
import logging
import math
import os
import platform
import queue
import random
import re
import selectors
import shlex
import shutil
import signal
import socket
import ssl
import stat
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # Windows: no flock (see lock_state_dir)
    fcntl = None  # type: ignore[assignment]

AGENT_VERSION = "0.1.0"
WIRE_SCHEMA = 1
DEFAULT_LEASE_TTL_S = 600
IDLE_BEACON_S = 60.0
POLL_FLOOR_S = 1.0  # the least time between two polls that brought no job
SYNTHETIC_ROUNDS_PER_TOKEN = 1000
SYNTHETIC_BLOCK_BYTES = 4096
SYNTHETIC_ATTESTATION_ROUNDS = 1000
# decisions.md: the hex SHA-256 of a fresh block after 1,000 rounds (tests recompute it).
SYNTHETIC_ATTESTATION = "d7e8b70dfb48593edebc84967a969e78429f9ac6da8d0c681a4b57a2fe078a84"
# Hand-back rows count down from the top of the iter range: rows are idempotent by (job, device,
# iter, attempt) and a handed-back job keeps its attempt number when it is claimed again, so a
# hand-back at iter 0 would swallow the resumed attempt's summary as a duplicate.
HANDBACK_ITER_TOP = 1_000_000
PROGRESS_KIND = "fleet-agent-progress"
# Progress is read whole, and parsed JSON can take 25 times its bytes in memory (a file of empty
# arrays): at 64 MiB that was 1.7 GB, an out-of-memory kill on a phone. This is the bound of a
# JSON Lines input (MAX_JSONL_BYTES), about 400 MB at worst. The agent's own progress (figures,
# and the clipped outputs of a batch's finished items: some 20,000 of them) stays below it; a
# hand-back whose progress would not is given back without it, and restarts from the start.
MAX_PROGRESS_BYTES = 16 << 20
# Used with fullmatch only: "$" also matches before a final newline, so match would take a hash
# followed by one (a cache file name, a download URL with a newline in it).
HEX64 = re.compile(r"[0-9a-f]{64}")
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


def private_dirs(path: str) -> None:
    """Make `path` and each missing directory above it mode 0700 (os.makedirs gives its mode
    to the last one only; the others would be 0755)."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise


def atomic_write(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write a file so a crash leaves either the old or the new content, never half of it."""
    directory = os.path.dirname(os.path.abspath(path))
    private_dirs(directory)
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
    """The JSON in `path`; None when it cannot be read or is not JSON. JSON nested deeper than
    the parser goes (RecursionError) counts as not JSON: a spooled row can carry a collector's
    nesting (a pipeline event's source) that the encoder wrote but the decoder, called deeper
    in the stack, cannot read back."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError, RecursionError):
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


# What run_cmd keeps of each stream of a tool. What adb prints comes from the device, which may
# print without end: a screencap of the largest tablet screen is a few MB of PNG, getprop and
# dumpsys far less, so a tool past this is stopped rather than read into memory until its timeout.
MAX_TOOL_OUTPUT = 32 << 20


class _CappedReader(threading.Thread):
    """Reads one of a tool's streams, keeping at most `limit` bytes; a tool that prints more is
    killed, so neither memory nor the wait grows with what it prints."""

    def __init__(self, stream, limit: int, proc: subprocess.Popen):
        super().__init__(name="tool-output", daemon=True)
        self.stream, self.limit, self.proc = stream, limit, proc
        self.chunks: list[bytes] = []
        self.size = 0
        self.over = False

    def run(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while chunk := self.stream.read1(1 << 16):
                room = self.limit - self.size
                self.chunks.append(chunk[:room])
                self.size += min(room, len(chunk))
                if len(chunk) > room:
                    self.over = True
                    with contextlib.suppress(OSError):
                        self.proc.kill()
                    return

    def data(self) -> bytes:
        return b"".join(self.chunks)


def run_cmd(argv: list[str], timeout: float = 30.0, env: dict | None = None,
            cwd: str | None = None, limit: int = MAX_TOOL_OUTPUT) -> CmdResult:
    """Run an argv list (never a shell string) with a timeout; never raises for tool failures.
    Each stream is kept up to `limit` bytes; a tool that prints more is stopped (code None)."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    except OSError as exc:
        return CmdResult(argv, None, "", str(exc), (time.monotonic() - started) * 1000)
    readers = [_CappedReader(proc.stdout, limit, proc), _CappedReader(proc.stderr, limit, proc)]
    for reader in readers:
        reader.start()
    deadline = started + timeout
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    try:
        code: int | None = proc.wait(max(0.0, deadline - time.monotonic()))
        late = any(reader.is_alive() for reader in readers)  # a child of it holds the pipe
    except subprocess.TimeoutExpired:
        code, late = None, True
    if late:
        proc.kill()
        proc.wait()
        for reader in readers:  # EOF follows the kill at once, unless a grandchild holds on
            reader.join(1.0)
    # A reader still blocked (a grandchild keeps the pipe open) ends with that grandchild; its
    # stream is left to it (closed once nothing holds it), as closing a file another thread
    # reads is not safe.
    for reader, stream in zip(readers, (proc.stdout, proc.stderr)):  # noqa: B905 - zip(strict=) needs Python 3.10
        if not reader.is_alive() and stream is not None:
            stream.close()
    out, ms = readers[0].data(), (time.monotonic() - started) * 1000
    if any(reader.over for reader in readers):
        return CmdResult(argv, None, _text(out), f"printed more than {limit >> 20} MB, so it "
                         "was stopped", ms)
    if late:
        return CmdResult(argv, None, _text(out), f"timed out after {timeout:g} s", ms)
    return CmdResult(argv, code, _text(out), _text(readers[1].data()), ms, out)


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


def host_device_id(probe: Probe) -> str:
    """hostname plus a short hash of the machine id: readable, and distinct for cloned hostnames."""
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "device"
    seed = (_clean(probe.read("/etc/machine-id")) or _clean(probe.read("/var/lib/dbus/machine-id"))
            or f"{host}:{hex(random.getrandbits(64))}")
    return f"{host[:40]}-{hashlib.sha256(seed.encode()).hexdigest()[:6]}"


class BadId(SystemExit):
    """An id the agent refuses at start: it names a directory below the state directory."""


# The collector's ids (schemas: jobId): letters, digits and . _ : @ -, not starting with '-'.
ID_PATTERN = re.compile(r"[A-Za-z0-9._:@][A-Za-z0-9._:@-]{0,199}")


def id_problem(value: object, device: bool = True) -> str | None:
    """Why `value` cannot be a device id (the collector's id rule) or an executor name (any
    text a directory can be named by); None when it can."""
    if not isinstance(value, str) or not 1 <= len(value) <= 200:
        return "it must be 1 to 200 characters"
    if value in (".", "..") or "/" in value or "\\" in value:
        return ("it may not contain / or \\ or be '.' or '..', as it names a directory in the "
                "state directory")
    if not value.isprintable():
        return "it may not contain control characters"
    if device and not ID_PATTERN.fullmatch(value):
        return "a device id is letters, digits and . _ : @ -, not starting with '-'"
    return None


def checked_id(value: object, source: str, device: bool = True) -> str:
    """`value` when it is a usable id; otherwise the agent stops with a sentence saying why."""
    problem = id_problem(value, device)
    if problem:
        raise BadId(f"fleet_agent: refusing the id '{printable(value, 100)}' from {source}: "
                    f"{problem}")
    return str(value)


def work_root(state_dir: str, reporter_id: str) -> str:
    """STATE/work/ID, checked to be inside STATE/work whatever the id says."""
    base = os.path.realpath(os.path.join(state_dir, "work"))
    path = os.path.realpath(os.path.join(base, checked_id(reporter_id, "the agent", False)))
    if os.path.dirname(path) != base:
        raise BadId(f"fleet_agent: refusing the id '{printable(reporter_id, 100)}': its work "
                    f"directory {path} is not inside {base}")
    return path


class UnsafeState(Exception):
    """A state directory the agent will not run from (exit status 2); the message says why."""


LOCK_NAME = "agent.lock"
# What the agent acts on from its state directory: the scripts it may run, the repositories it
# may clone, its id, and the directories of signing secrets, verified artifacts, the rows it
# reports and the scratch it deletes. Whoever can change one of them can run code as the agent,
# so each must be this user's own and none may be a link to somewhere else.
TRUSTED_FILES = ("state.json", "shell-allowlist", "build-repos")
TRUSTED_DIRS = ("spool", os.path.join("spool", "rejected"), "cache", "credentials", "work")
# work/ is only ever deleted (rmtree does not follow links), so only it, not what it holds,
# is checked; what the others hold is read and trusted.
ENTRIES_CHECKED = ("spool", os.path.join("spool", "rejected"), "cache", "credentials")


def owner_problem(info: os.stat_result) -> str | None:
    """Why a file is not this user's own; None when it is. A root agent wants root's files too,
    as sshd does: a file another user owns is theirs to change whoever runs the agent."""
    if not hasattr(os, "geteuid"):  # Windows: no owners to compare
        return None
    euid = os.geteuid()
    if info.st_uid != euid:
        return f"is owned by uid {info.st_uid}, not by uid {euid} that the agent runs as"
    return None


def make_private(path: str, info: os.stat_result, bits: int, state_dir: str) -> None:
    """Clear the mode `bits` of a file or directory this user owns, or refuse the state dir."""
    mode = stat.S_IMODE(info.st_mode)
    if os.name == "nt" or not mode & bits:
        return
    try:
        # No link to follow: the state directory is a real path, an entry was lstat'ed as no
        # link, and only this user can swap entries in a directory already private.
        os.chmod(path, mode & ~bits)
        mode = stat.S_IMODE(os.lstat(path).st_mode)
    except OSError as exc:
        raise UnsafeState(f"fleet_agent: refusing the state directory {state_dir}: {path} has "
                          f"mode {stat.S_IMODE(info.st_mode):04o} and could not be made "
                          f"private ({exc.strerror or exc})") from exc
    if mode & bits:  # a file system without Unix modes, such as FAT
        raise UnsafeState(f"fleet_agent: refusing the state directory {state_dir}: {path} has "
                          f"mode {mode:04o} and could not be made private")
    log.warning("tightened the mode of %s from %04o to %04o", path,
                stat.S_IMODE(info.st_mode), mode)


def secure_state_dir(state_dir: str) -> str:
    """The state directory, created 0700 when missing, else checked to be this user's and
    tightened to 0700; its real path, so a link that names it cannot be turned elsewhere
    once checked."""
    try:
        private_dirs(state_dir)
        real = os.path.realpath(state_dir)
        info = os.stat(real)
    except OSError as exc:
        raise UnsafeState(f"fleet_agent: cannot use the state directory {state_dir}: "
                          f"{exc.strerror or exc}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeState(f"fleet_agent: cannot use the state directory {state_dir}: it is "
                          "not a directory")
    problem = owner_problem(info)
    if problem:
        raise UnsafeState(f"fleet_agent: refusing the state directory {state_dir}: it {problem}; "
                          "give it to that user or choose another --state-dir")
    open_parent = open_parent_of(real)
    if open_parent:
        raise UnsafeState(f"fleet_agent: refusing the state directory {state_dir}: {open_parent}")
    make_private(real, info, 0o077, state_dir)
    return real


def open_parent_of(real: str) -> str | None:
    """Why a directory above the (real) state directory lets another user put a directory of
    their own in its place, or None. The agent uses the state directory by its path, so a
    parent every user may write to, without the sticky bit that keeps them from renaming what
    is not theirs (as /tmp has it), hands the directory to any of them. Only that case: a
    parent another account owns or its group may write to is the usual thing on some systems
    (Android's /data/data is system's, mode 0771), and such an account could change more than
    this agent anyway."""
    if os.name == "nt":
        return None
    parent = os.path.dirname(real)
    while True:
        try:
            mode = os.stat(parent).st_mode
        except OSError as exc:
            return f"its parent {parent} cannot be checked ({exc.strerror or exc})"
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            return (f"its parent {parent} has mode {stat.S_IMODE(mode):04o}: any user may "
                    "rename the state directory and put one of their own in its place; remove "
                    "the write bit for others (chmod o-w) or set the sticky bit (chmod +t), or "
                    "choose another --state-dir")
        above = os.path.dirname(parent)
        if above == parent:
            return None
        parent = above


def check_trusted(state_dir: str) -> None:
    """Refuse a state directory holding a trusted file or directory that is a link or another
    user's; make the directories 0700 and the files unwritable by others. Runs once the
    directory itself is private, so nobody else can add an entry after it is checked."""
    def refuse(path: str, problem: str) -> UnsafeState:
        return UnsafeState(f"fleet_agent: refusing the state directory {state_dir}: {path} "
                           f"{problem}")

    def lstat(path: str) -> os.stat_result | None:
        try:
            return os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise refuse(path, f"cannot be checked ({exc.strerror or exc})") from exc

    def check(path: str, info: os.stat_result) -> None:
        if stat.S_ISLNK(info.st_mode):
            raise refuse(path, "is a symbolic link, which the agent does not follow for what "
                               "it trusts")
        problem = owner_problem(info)
        if problem:
            raise refuse(path, problem)

    for name in TRUSTED_FILES:
        path = os.path.join(state_dir, name)
        info = lstat(path)
        if info is not None:
            check(path, info)
            make_private(path, info, 0o022, state_dir)
    for name in TRUSTED_DIRS:
        path = os.path.join(state_dir, name)
        info = lstat(path)
        if info is None:
            continue
        check(path, info)
        if not stat.S_ISDIR(info.st_mode):
            raise refuse(path, "is not a directory")
        make_private(path, info, 0o077, state_dir)
        if name not in ENTRIES_CHECKED:
            continue
        try:
            names = os.listdir(path)
        except OSError as exc:
            raise refuse(path, f"cannot be listed ({exc.strerror or exc})") from exc
        for entry in names:
            inner = os.path.join(path, entry)
            info = lstat(inner)
            if info is not None:
                check(inner, info)


def lock_state_dir(state_dir: str) -> int | None:
    """Hold an exclusive lock on the state directory for as long as this process lives, so a
    second agent cannot wipe the first one's work/ or share its spool and device id. The
    descriptor is not inherited by jobs (os.open's default), so a job's leftover child cannot
    keep the lock after the agent is gone."""
    if fcntl is None:
        # Windows has no flock: the agent runs there unlocked, as the services do, and says
        # so, rather than carry a second locking scheme for one platform.
        log.warning("cannot lock %s on this platform (no fcntl): make sure only one agent "
                    "uses it", state_dir)
        return None
    path = os.path.join(state_dir, LOCK_NAME)
    try:
        # O_NOFOLLOW: a link planted under the lock's name would have the pid written through it.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        why = ("is a symbolic link, which the agent does not follow" if os.path.islink(path)
               else f"cannot be opened ({exc.strerror or exc})")
        raise UnsafeState(f"fleet_agent: refusing the state directory {state_dir}: its lock "
                          f"file {path} {why}") from exc
    try:
        info = os.fstat(fd)
        problem = owner_problem(info) or (None if stat.S_ISREG(info.st_mode)
                                          else "is not a regular file")
        if problem:
            raise UnsafeState(f"fleet_agent: refusing the state directory {state_dir}: its lock "
                              f"file {path} {problem}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            pid = holder if holder.isdigit() else "unknown"
            raise UnsafeState(f"fleet_agent: another agent (pid {pid}) is running on the state "
                              f"directory {state_dir}; stop it, or give this agent its own "
                              "--state-dir") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def claim_state_dir(state_dir: str) -> tuple[str, int | None]:
    """The state directory, made private, checked and locked for this agent: its real path and
    the lock's descriptor, which must stay open while the agent runs."""
    real = secure_state_dir(state_dir)
    lock = lock_state_dir(real)
    try:
        check_trusted(real)
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise
    return real, lock


def load_device_id(state_dir: str, wanted: str | None, probe: Probe,
                   remember: bool = True) -> str:
    """The id kept in state.json; a --device-id flag replaces it and is remembered (unless not
    `remember`). An id that could escape the state directory is refused, from the flag or from
    the file."""
    path = os.path.join(state_dir, "state.json")
    state = read_json(path)
    state = state if isinstance(state, dict) else {}
    if wanted:
        device_id = checked_id(wanted, "--device-id")
    elif state.get("device_id"):
        device_id = checked_id(state["device_id"], path)
    else:
        device_id = host_device_id(probe)
    if remember and state.get("device_id") != device_id:
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
        if HEX64.fullmatch(word.split()[0]):
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


class Misdirected(Unreachable):
    """421: the collector does not answer to the name in this agent's URL for it (a guard
    against DNS rebinding; its FLEET_ALLOWED_HOSTS admits more names). Nothing the agent sends
    changes that, so it keeps its rows spooled and retries with backoff, like an outage."""


class Redirected(Unreachable):
    """3xx: the agent follows no redirect. A POST re-sent elsewhere (307/308) or turned into a
    body-less GET (301-303) would count a row as delivered that no collector stored; the
    sentence names the Location so the operator can give --collector the address itself."""


class BadAnswer(Unreachable):
    """A 2xx answer that is not usable JSON (garbled, or nested deeper than the parser goes).
    Retrying may help (a proxy's error page, a collector mid-restart), so it is handled like an
    outage, but it is told once per collector link rather than as the collector going away."""


# Collectors live on the LAN or a mesh network: talk to them directly, ignoring proxy variables
# (http.client never reads them; _OPENER, for a local server a job starts, is told not to).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
MAX_ANSWER_BYTES = 8 << 20  # a JSON answer (a page of results, a topic's events)
# Parsed JSON takes up to thirty times its bytes (`{},{},...`), so answers that are never large
# are read to bounds of their own: an 8 MiB answer to every beacon and row from a collector that
# lies took an agent over 500 MB, enough to have it killed on a phone or a small board.
MAX_JOB_ANSWER_BYTES = 2 << 20  # a job offered: its spec is at most the collector's 1 MiB body
MAX_REPLY_BYTES = 256 << 10  # an acknowledgement (a beacon, rows, a registration, a release)
ANSWER_CHUNK = 64 << 10
DOWNLOAD_STALL_S = 300.0  # a download ends when a whole DOWNLOAD_CHUNK takes longer than this
DOWNLOAD_PREFIX = ".dl-"  # a partial download in the cache, renamed into place once verified
# The largest artifact the agent downloads: above the biggest model a device here runs (a 70B
# GGUF at 8 bits is about 75 GB), well below what an endless answer would write to the disk.
MAX_ARTIFACT_BYTES = 128 << 30
# Free space a download always leaves on the cache's disk: a phone whose storage fills up stops
# working as a phone, and the agent's own spool needs room too. Small enough that a phone or an
# SBC with a few GB free still takes a model that fits.
DOWNLOAD_FREE_RESERVE = 256 << 20
# The most the artifact cache keeps between jobs. Past it, the least recently used artifacts are
# removed, but never one the running job has fetched (a model it still reads), so a job whose
# artifacts are larger still runs and only its own stay. Without a bound, every blob a collector
# ever named stayed on the device for good. Room for a model of 7 or 8 billion parameters at 8
# bits beside its inputs, so a device running the same model job after job fetches it once.
CACHE_MAX_BYTES = 8 * 10**9  # --cache-max-gb, 8 by default
STOP_POLL_S = 0.25  # how soon a job's fetch hears that the job was stopped
UPLOAD_FLOOR_BPS = 32 << 10  # an upload gets its timeout plus its size at this rate
_MISDIRECTED = 421
_told: set[str] = set()
_told_lock = threading.Lock()


def printable(value: object, limit: int = 300) -> str:
    """Text a collector sent, fit for one log line: control and invisible characters escaped
    (a newline in a job id must not forge a line of its own), and clipped."""
    text = clip(value if isinstance(value, str) else str(value), limit)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _first_time(key: str) -> bool:
    with _told_lock:
        first = key not in _told
        _told.add(key)
    return first


def warn_once(key: str, message: str, *args: object) -> None:
    """A warning the first time, DEBUG after: a device listed wrong is listed so at every
    presence round and every job. Past a bound of keys (a device that names itself anew each
    time) every one is a warning, so the set of keys told cannot grow without end."""
    with _told_lock:
        full = len(_told) >= 10_000
        first = full or key not in _told
        if not full:
            _told.add(key)
    (log.warning if first else log.debug)(message, *args)


def _base(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _misdirected(method: str, url: str, data: bytes) -> Misdirected:
    """The refusal, its sentence logged once per collector (each retry would repeat it)."""
    message = printable(_error_message(data))
    base = _base(url)
    if _first_time(base):
        log.error("collector %s refuses the name this agent reaches it by: %s", base, message)
    return Misdirected(f"{method} {url} answered {_MISDIRECTED}: {message}")


def _redirected(method: str, url: str, status: int, location: str | None) -> Redirected:
    """The redirect, its sentence logged once per collector and Location."""
    where = printable(location or "nowhere", 200)
    sentence = (f"{method} {url} answered {status}, a redirect to {where}; the agent follows "
                "no redirects: give --collector the address the collector answers on")
    if _first_time(f"redirect {_base(url)} {where}"):
        log.error("collector %s: %s", _base(url), sentence)
    return Redirected(sentence)


class Deadline(threading.Thread):
    """Ends an exchange that outlives its time however slowly its bytes trickle (a socket
    timeout only bounds each read): at the deadline the socket is shut down, which wakes any
    read blocked on it. `extend` moves the deadline, for a download that keeps making
    progress. With `stop` (a job's stop event) the exchange also ends as soon as that is set,
    so a cancel or a shutdown need not wait for a silent server's socket timeout."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float, what: str,
                 stop: threading.Event | None = None):
        super().__init__(name="deadline", daemon=True)
        self.conn = conn
        self.seconds = seconds
        self.what = what
        self.stop = stop
        self.until = time.monotonic() + seconds
        self.expired = False
        self.done = threading.Event()

    def run(self) -> None:
        while True:
            left = self.until - time.monotonic()
            if self.stop is not None:
                left = min(left, STOP_POLL_S)  # two events cannot be waited on at once
            if self.done.wait(max(0.0, left)):
                return
            if time.monotonic() >= self.until:
                self.expired = True
            elif self.stop is None or not self.stop.is_set():
                continue
            sock = self.conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    # The plain socket's shutdown, also for TLS: wakes a blocked read.
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
            return

    def extend(self) -> None:
        self.until = time.monotonic() + self.seconds

    def check(self) -> None:
        if self.expired:
            raise Unreachable(f"{self.what} took longer than {self.seconds:g} s")


@contextlib.contextmanager
def exchange(method: str, url: str, body: object, headers: dict, timeout: float,
             deadline: float, stop: threading.Event | None = None):
    """One request to `url`, yielding (response with its headers read, its Deadline).

    http.client follows no redirect and reads no proxy variable; `timeout` bounds each socket
    operation and `deadline` the whole exchange, which `stop` (a job's) also ends."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("collector addresses must start with http:// or https://: " + url)
    netloc = parts.netloc.rpartition("@")[2]
    conn: http.client.HTTPConnection = (
        http.client.HTTPSConnection(netloc, timeout=timeout) if parts.scheme == "https"
        else http.client.HTTPConnection(netloc, timeout=timeout))
    target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    fields = {"user-agent": "fleet_agent/" + AGENT_VERSION, "connection": "close", **headers}
    watch = Deadline(conn, deadline, f"{method} {url}", stop)
    watch.start()
    try:
        conn.connect()
        watch.check()
        conn.request(method, target, body=body, headers=fields)  # type: ignore[arg-type]
        response = conn.getresponse()
        watch.check()
        yield response, watch
    finally:
        watch.done.set()
        conn.close()


def read_answer(response: http.client.HTTPResponse, watch: Deadline, limit: int) -> bytes:
    """The whole body of an answer, read in chunks: never more than `limit` bytes."""
    length = _int_or_none(response.getheader("content-length"))
    if length is not None and length > limit:
        raise Unreachable(f"{watch.what} answered {length} bytes, more than the {limit} an "
                          "answer may have")
    chunks, size = [], 0
    for chunk in body_chunks(response, watch, ANSWER_CHUNK):
        size += len(chunk)
        if size > limit:
            raise Unreachable(f"{watch.what} answered more than the {limit} bytes an answer "
                              "may have")
        chunks.append(chunk)
    return b"".join(chunks)


def body_chunks(response: http.client.HTTPResponse, watch: Deadline, size: int):
    """The body a chunk of at most `size` bytes at a time, each read held to the exchange's
    deadline (a read the deadline cut short says so, not just that the socket closed)."""
    while True:
        try:
            chunk = response.read(size)
        except (OSError, http.client.HTTPException):
            watch.check()
            raise
        watch.check()
        if not chunk:
            return
        yield chunk


def http_call(method: str, url: str, body: object = None, headers: dict | None = None,
              timeout: float = 30.0, deadline: float | None = None,
              limit: int = MAX_ANSWER_BYTES, stop: threading.Event | None = None
              ) -> tuple[int, bytes]:
    """(status, body) of a 2xx or 4xx answer. A 5xx, a redirect (never followed), a refused
    name (421), an answer over `limit` bytes or an exchange longer than `deadline` seconds
    (default: `timeout`) raises Unreachable: the caller keeps its rows and tries again. `stop`
    (a job's) cuts the exchange within STOP_POLL_S of being set, as it does a download's."""
    if not url.startswith(("http://", "https://")):
        raise ValueError("collector addresses must start with http:// or https://: " + url)
    try:
        with exchange(method, url, body, headers or {}, timeout,
                      timeout if deadline is None else deadline, stop) as (response, watch):
            status = response.status
            if 300 <= status < 400:
                raise _redirected(method, url, status, response.getheader("location"))
            data = read_answer(response, watch, limit)
    except Unreachable:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise Unreachable(f"{method} {url} failed: {exc or type(exc).__name__}") from exc
    except Exception as exc:  # a surprise on a dying server is still an unreachable collector
        raise Unreachable(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc
    if status >= 500:
        raise Unreachable(f"{method} {url} answered {status}")
    if status == _MISDIRECTED:
        raise _misdirected(method, url, data)
    if not 200 <= status < 500:
        raise Unreachable(f"{method} {url} answered {status}, which is not an answer")
    return status, data


def _error_message(data: bytes) -> str:
    try:
        body = json.loads(data.decode("utf-8"))
        if isinstance(body, dict) and body.get("error"):
            return str(body["error"])
    except (ValueError, RecursionError):
        pass
    return tail(data.decode("utf-8", "replace"), 200) or "no details"


def parse_answer(data: bytes, what: str) -> object:
    """A collector's JSON answer. One that is not JSON, or nested too deep for the parser
    (RecursionError), is a bad answer: Unreachable, so the caller backs off and tries again."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise BadAnswer(f"{what} answered something that is not usable JSON "
                        f"({type(exc).__name__})") from exc


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
                  timeout: float | None = None, limit: int = MAX_ANSWER_BYTES
                  ) -> tuple[int, object]:
        body = None if payload is None else json.dumps(payload).encode("utf-8")
        headers = {"content-type": "application/json"} if body is not None else {}
        status, data = http_call(method, self.url + path, body, headers,
                                 timeout or self.timeout, limit=limit)
        if status >= 400:
            raise HttpError(status, _error_message(data))
        if status == 204 or not data:
            return status, None
        return status, parse_answer(data, f"{method} {self.url}{path}")

    def register(self, body: dict) -> dict:
        _, reply = self.call_json("POST", "/devices/register", body, limit=MAX_REPLY_BYTES)
        return reply if isinstance(reply, dict) else {}

    def next_device_job(self, device_id: str, timeout: float) -> dict | None:
        path = f"/devices/{urllib.parse.quote(device_id, safe='')}/next-job"
        status, reply = self.call_json("GET", path, timeout=timeout, limit=MAX_JOB_ANSWER_BYTES)
        return reply if status == 200 and isinstance(reply, dict) else None

    def next_host_job(self, name: str, timeout: float) -> dict | None:
        path = "/executor/next-job?" + urllib.parse.urlencode({"name": name})
        status, reply = self.call_json("GET", path, timeout=timeout, limit=MAX_JOB_ANSWER_BYTES)
        return reply if status == 200 and isinstance(reply, dict) else None

    def beacon(self, body: dict) -> dict:
        _, reply = self.call_json("POST", "/results", body, limit=MAX_REPLY_BYTES)
        return reply if isinstance(reply, dict) else {}

    def post_result(self, row: dict) -> None:
        self.call_json("POST", "/results", row, limit=MAX_REPLY_BYTES)

    def post_results(self, rows: list) -> None:
        """Several rows in one request (one transaction on the collector; all or none)."""
        self.call_json("POST", "/results", rows, limit=MAX_REPLY_BYTES)

    def release(self, job_id: str, device_id: str) -> str:
        """'released', 'old-collector' (404: predates the endpoint) or 'refused' (409)."""
        path = f"/jobs/{urllib.parse.quote(job_id, safe='')}/release"
        try:
            self.call_json("POST", path, {"device_id": device_id}, limit=MAX_REPLY_BYTES)
        except HttpError as exc:
            return "old-collector" if exc.status == 404 else "refused"
        return "released"

    def upload_artifact(self, data: bytes, name: str, extra_headers: dict | None = None) -> str:
        headers = {"content-type": "application/octet-stream", "x-artifact-name": name}
        headers.update(extra_headers or {})
        timeout = max(self.timeout, 120.0)
        status, reply = http_call("POST", self.url + "/artifacts", data, headers, timeout,
                                  timeout + len(data) / UPLOAD_FLOOR_BPS, MAX_REPLY_BYTES)
        if status >= 400:
            raise HttpError(status, _error_message(reply))
        answer = parse_answer(reply, f"POST {self.url}/artifacts")
        sha = answer.get("sha256") if isinstance(answer, dict) else None
        expected = hashlib.sha256(data).hexdigest()
        if sha != expected:
            raise Unreachable(f"the collector stored the upload under {sha}, not its SHA-256 "
                              f"{expected}")
        return sha

    def download_artifact(self, sha256: str, dest: str, limit: int = MAX_ARTIFACT_BYTES) -> str:
        """Fetch an artifact into `dest`, refusing it unless its bytes hash to `sha256`, and
        refusing one larger than `limit` bytes or one that would fill the disk."""
        self.download_verified(sha256, dest, limit)
        return dest

    def download_verified(self, sha256: str, dest: str, limit: int = MAX_ARTIFACT_BYTES,
                          stop: threading.Event | None = None) -> os.stat_result:
        """download_artifact, answering the lstat of `dest` once it is in place: the very file
        whose bytes were hashed as they were written (or an ArtifactError).

        With `stop` (the job's), a download that event ends (a cancel, a lost lease, the job's
        ceiling, the agent shutting down) raises Stopped within STOP_POLL_S, its partial file
        removed: a collector trickling a chunk just inside DOWNLOAD_STALL_S could otherwise
        hold the device for as long as the artifact limit lets the download run."""
        sha256 = sha256.lower()
        if not HEX64.fullmatch(sha256):
            raise ArtifactError(f"the artifact reference {sha256!r} is not a SHA-256 hex digest")
        url = self.url + "/artifacts/" + sha256
        fd, tmp = tempfile.mkstemp(prefix=DOWNLOAD_PREFIX,
                                   dir=os.path.dirname(os.path.abspath(dest)))
        try:
            with os.fdopen(fd, "wb") as out:
                actual = self._stream(url, out, limit, os.path.dirname(tmp), stop)
                written = os.fstat(out.fileno())
            if stop is not None and stop.is_set():  # a cut answer can read as a short one
                raise Stopped("the download was stopped")
            if actual != sha256:
                raise ArtifactError(
                    f"refused artifact {sha256[:12]}: its downloaded bytes have SHA-256 "
                    f"{actual[:12]}, so it was "
                    "altered or corrupted")
            os.chmod(tmp, 0o600)
            os.replace(tmp, dest)
            placed = os.lstat(dest)
            if (placed.st_dev, placed.st_ino) != (written.st_dev, written.st_ino):
                raise ArtifactError(f"artifact {sha256[:12]} was replaced in the cache as it "
                                    "was stored; refused")
        except (OSError, http.client.HTTPException, Unreachable, NoRoom) as exc:
            if stop is not None and stop.is_set():  # the stop cut the socket: not a failure
                raise Stopped("the download was stopped") from exc
            raise ArtifactError(f"artifact {sha256[:12]} could not be downloaded: {exc}") \
                from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return placed

    @staticmethod
    def _stream(url: str, out, limit: int, directory: str,
                stop: threading.Event | None = None) -> str:
        """GET url into `out` a chunk at a time; the hex SHA-256 of what came. A download may
        take as long as it keeps coming (each chunk earns DOWNLOAD_STALL_S more), but never
        grows past `limit` bytes or into the disk's last DOWNLOAD_FREE_RESERVE bytes, and ends
        as soon as `stop` is set (its Deadline shuts the socket, waking a blocked read)."""
        digest, size = hashlib.sha256(), 0
        with exchange("GET", url, None, {}, 120, DOWNLOAD_STALL_S, stop) as (response, watch):
            if response.status != 200:
                raise Unreachable(f"the collector answered {response.status}")
            declared = _int_or_none(response.getheader("content-length"))
            if declared is not None:
                download_room(directory, declared, limit)
            for chunk in body_chunks(response, watch, DOWNLOAD_CHUNK):
                if stop is not None and stop.is_set():
                    raise Stopped("the download was stopped")
                watch.extend()
                size += len(chunk)
                download_room(directory, size, limit, len(chunk))
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()


class NoRoom(Exception):
    """A download the agent ends itself: larger than its limit, or than the free disk."""


def download_room(directory: str, size: int, limit: int, coming: int = 0) -> None:
    """Refuse a download of `size` bytes over `limit`, or whose next `coming` bytes (all of a
    declared size when 0) would leave less than DOWNLOAD_FREE_RESERVE free on the disk."""
    if size > limit:
        raise NoRoom(f"it is larger than the {limit} bytes the agent takes")
    free = shutil.disk_usage(directory).free
    if free - (coming or size) < DOWNLOAD_FREE_RESERVE:
        raise NoRoom(f"it does not fit: {free} bytes are free on this device's disk and the "
                     f"agent keeps {DOWNLOAD_FREE_RESERVE} of them free")


def file_mark(info: os.stat_result) -> tuple[int, ...]:
    """What changes whenever a file's bytes may have: another file put in its place (device,
    inode), a write (size, mtime), and anything done to it, utime and touch -d included (ctime,
    which only the kernel sets)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class ArtifactCache:
    """Verified downloads kept by hash, so a model is fetched once per device.

    A cached file is trusted only while it is provably what was verified: the first use after
    each start hashes it again, and so does any use after its file_mark changed since this
    process last hashed it. Hashing at every use would be simpler, but a model can be many GB
    (minutes of hashing on a Raspberry Pi, before every job); the mark costs one fstat and no
    one but root can change a file's bytes and keep its mark. The marks live in memory only,
    so nothing on disk can vouch for a file.

    The cache holds at most `max_bytes` (trim). Recency is kept in memory too: touching a file
    to record its use would change its ctime, hence its mark, and have it hashed again at its
    next use. A file not used since this process started ranks by when it was downloaded (its
    modification time), before any file this process has used."""

    def __init__(self, directory: str, max_bytes: int = CACHE_MAX_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        private_dirs(directory)
        self.remove_abandoned()
        self.marks: dict[str, tuple[int, ...]] = {}  # path -> file_mark when last verified
        self.uses = 0
        self.last_used: dict[str, int] = {}  # path -> the number of its last use here
        self.trim(set())

    def remove_abandoned(self) -> None:
        """Partial downloads a crashed or killed run left behind. One untouched for longer
        than a download may stall is nobody's: another agent sharing this state directory may
        be writing a newer one."""
        now = time.time()
        for name in os.listdir(self.directory):
            if not name.startswith(DOWNLOAD_PREFIX):
                continue
            path = os.path.join(self.directory, name)
            with contextlib.suppress(OSError):
                if now - os.lstat(path).st_mtime > DOWNLOAD_STALL_S:
                    os.unlink(path)

    def fetch(self, collector: Collector, sha256: str, suffix: str = "",
              limit: int = MAX_ARTIFACT_BYTES, stop: threading.Event | None = None,
              in_use: set[str] | None = None) -> str:
        """The path of the artifact's verified bytes: the cached file when it still hashes to
        its name, else a fresh download (a changed cached file is removed first), which `stop`
        ends (Stopped). The path joins `in_use` (the running job's artifacts, which trimming
        the cache afterwards leaves alone)."""
        sha256 = str(sha256).lower()
        path = os.path.join(self.directory, sha256 + suffix)
        keep = in_use if in_use is not None else set()
        keep.add(path)
        if HEX64.fullmatch(sha256) and self.still_verified(path, sha256, limit):
            self.used(path)
            return path
        self.marks.pop(path, None)
        placed = collector.download_verified(sha256, path, limit, stop)
        self.marks[path] = file_mark(placed)
        self.used(path)
        self.trim(keep)  # only a download makes the cache grow
        return path

    def used(self, path: str) -> None:
        """Note a use, here and on the file: its access time is set to now (its modification
        time kept), so the next start ranks files by their last use rather than by when they
        were downloaded. A file that is not the one just verified is left alone; its changed
        mark makes the next use hash it again anyway."""
        self.uses += 1
        self.last_used[path] = self.uses
        try:
            info = os.lstat(path)
            if self.marks.get(path) != file_mark(info):
                return
            os.utime(path, ns=(time.time_ns(), info.st_mtime_ns), follow_symlinks=False)
            # utime moved the ctime: the file is still the one verified a moment ago.
            self.marks[path] = file_mark(os.lstat(path))
        except OSError:  # a read-only cache, say: the ranking falls back to download times
            pass

    def trim(self, keep: set[str]) -> None:
        """Remove the least recently used artifacts until the cache holds at most max_bytes,
        leaving those in `keep` (and partial downloads, remove_abandoned's) alone."""
        total, candidates = 0, []
        for name in os.listdir(self.directory):
            if name.startswith("."):
                continue
            path = os.path.join(self.directory, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            total += info.st_size
            if path not in keep:
                # This run's uses first, then the access time used() set in earlier runs.
                candidates.append((self.last_used.get(path, 0), info.st_atime_ns,
                                   info.st_mtime_ns, path, info.st_size))
        for _, _, _, path, size in sorted(candidates):
            if total <= self.max_bytes:
                return
            try:
                os.unlink(path)
            except OSError as exc:
                log.warning("cached artifact %s could not be removed to keep the cache within "
                            "%d bytes: %s", printable(os.path.basename(path)), self.max_bytes,
                            printable(exc))
                continue
            total -= size
            self.marks.pop(path, None)
            self.last_used.pop(path, None)
            log.info("removed cached artifact %s (%d bytes), the least recently used: the cache "
                     "keeps at most %d bytes", printable(os.path.basename(path)), size,
                     self.max_bytes)

    def still_verified(self, path: str, sha256: str, limit: int) -> bool:
        """Whether the cached `path` holds the bytes of `sha256`. One that does not (changed,
        a link, not a regular file, another user's or writable by others) is removed.

        Between this check and its use, only this user can change the file: the cache is a
        private directory of a state directory checked at start."""
        try:
            # O_NOFOLLOW: a link would be hashed as its target and then used as whatever it
            # points to by then; O_NONBLOCK: a FIFO must not hang the job.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return False
        except OSError as exc:
            return self.discard(path, sha256, f"it cannot be opened ({exc.strerror or exc})")
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return self.discard(path, sha256, "it is not a regular file")
            problem = owner_problem(info) or (
                "it is writable by others" if os.name != "nt" and info.st_mode & 0o022 else None)
            if problem:
                return self.discard(path, sha256, problem)
            if info.st_size > limit:
                raise ArtifactError(f"artifact {sha256[:12]} is larger than the {limit} bytes "
                                    "the agent takes for this use")
            if self.marks.get(path) == file_mark(info):
                return True
            digest = hashlib.sha256()
            with os.fdopen(os.dup(fd), "rb") as fh:
                for chunk in iter(lambda: fh.read(DOWNLOAD_CHUNK), b""):
                    digest.update(chunk)
            if digest.hexdigest() != sha256:
                return self.discard(path, sha256, "its bytes no longer hash to its name")
            if file_mark(os.fstat(fd)) != file_mark(info):
                return self.discard(path, sha256, "it changed while it was being hashed")
            self.marks[path] = file_mark(info)
            return True
        finally:
            os.close(fd)

    def discard(self, path: str, sha256: str, why: str) -> bool:
        log.warning("cached artifact %s was not used: %s; it is removed and downloaded again",
                    sha256[:12], why)
        self.marks.pop(path, None)
        with contextlib.suppress(OSError):  # a directory: the download then fails to replace it
            os.unlink(path)
        return False


# --------------------------------------------------------------------------------------------
# Outbox: every result row is written to disk before it is posted
# --------------------------------------------------------------------------------------------


BATCH_ROWS = 100  # spooled rows sent in one POST /results; the collector takes up to 1000
BATCH_BYTES = 512 << 10  # and at most this much of them (the collector's bodies stop at 1 MiB)
# A row as spooled: a workload copies what a collector or an input hands it (an event's
# source, an item's id) into its rows, and one row past the collector's body limit could
# never be delivered. A larger row goes without its workload's fields, saying so.
MAX_ROW_BYTES = 256 << 10
# Rows waiting on disk for their collector. A job stops adding to them past this, or when the
# disk is down to its last DOWNLOAD_FREE_RESERVE bytes: a collector that is gone for days, or
# one that answers everything but rows, must not fill a phone's storage.
SPOOL_MAX_BYTES = 256 << 20
# The fields that say which job, attempt and device a row is: a row cut down keeps them.
ROW_IDENTITY = ("schema", "kind", "device_id", "job_id", "iter", "final", "attempt", "executor",
                "device")
# Refused rows are kept for a person to read, not to be retried; a collector that refuses every
# row of an endless stream of jobs must not fill the disk with them. The newest are the ones
# worth reading (the oldest go first): a few hours of a busy device's rows, a few MB.
REJECTED_KEEP_FILES = 1000
REJECTED_KEEP_BYTES = 16 << 20


class SpoolFull(Refusal):
    """The spool holds as much as the agent keeps: the job stops adding rows to it."""


def within_row_bound(row: dict) -> dict:
    """The row, or past MAX_ROW_BYTES as JSON the row without its workload's fields: failed,
    with a sentence giving its size (a final row too, as its outcome could not be told)."""
    size = len(json.dumps(row))
    if size <= MAX_ROW_BYTES:
        return row
    kept = {key: row[key] for key in ROW_IDENTITY if key in row}
    kept.update(ok=False, metrics={}, error=f"this row was {size} bytes as JSON, more than the "
                f"{MAX_ROW_BYTES} a row may carry; its fields were left out")
    return kept


class Outbox:
    """Result rows spooled on disk (atomically, mode 0600) until a collector acknowledges them.

    Rows are posted in the order they were written, per collector, so a job's final row never
    overtakes its iteration rows. A collector that is down keeps its rows; a restarted agent
    posts whatever an earlier run left behind.

    A spooled file is never rewritten, so the collector it names is read once per process and
    remembered (and again only with a body a failed post read); a row's body is read only when
    it is about to be posted. While a collector is down, rows pile up and every new one
    triggers a flush: reading the whole spool each time would cost the square of the backlog.
    """

    def __init__(self, directory: str, max_bytes: int = SPOOL_MAX_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        self.rejected_dir = os.path.join(directory, "rejected")
        private_dirs(self.rejected_dir)
        self.counter_lock = threading.Lock()
        self.flush_lock = threading.Lock()  # one poster at a time keeps the order
        self.counter = 0
        self.last = self.newest_name()
        self.held = self._measure()  # bytes of the spooled rows, kept as they come and go
        self.delivered: dict[str, int] = {}  # rows each collector acknowledged, since start
        # Collectors whose latest row was refused or kept on disk, until one is delivered.
        self.troubled: set[str] = set()
        # File name -> the collector it names (None: not a row entry, to be set aside).
        self.owners: dict[str, str | None] = {}
        # Held across a listing and the forgetting of names it lacks, so a row put meanwhile
        # is not forgotten as gone before the listing could see it.
        self.owners_lock = threading.Lock()

    def newest_name(self) -> int:
        """The largest sequence number a spooled row is named by (0 for an empty spool)."""
        numbers = [_int_or_none(name.partition("-")[0]) for name in os.listdir(self.directory)
                   if name.endswith(".json") and not name.startswith(".")]
        return max([n for n in numbers if n is not None and n >= 0] or [0])

    def _measure(self) -> int:
        total = 0
        for name in os.listdir(self.directory):
            if name.endswith(".json") and not name.startswith("."):
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(self.directory, name)).st_size
        return total

    def _held_changed(self, by: int) -> None:
        with self.counter_lock:
            self.held = max(0, self.held + by)

    def check_room(self) -> None:
        """Raise SpoolFull when the spool is at its bound or the disk at its reserve."""
        if self.held > self.max_bytes:
            self.held = self._measure()  # rows a person removed count no more
        if self.held > self.max_bytes:
            raise SpoolFull(f"{self.held} bytes of result rows wait on disk for a collector, "
                            f"the most the agent keeps is {self.max_bytes}; the job stops "
                            "adding rows until they are delivered")
        free = shutil.disk_usage(self.directory).free
        if free < DOWNLOAD_FREE_RESERVE:
            raise SpoolFull(f"the disk holding the result spool has {free >> 20} MiB free, "
                            f"and the agent keeps {DOWNLOAD_FREE_RESERVE >> 20} MiB of it free; "
                            "the job stops adding rows")

    def put(self, collector_url: str, row: dict) -> str:
        """Spool a row (cut down to MAX_ROW_BYTES). A row that is not a job's final one is
        refused with SpoolFull past the spool's bound: the final row always goes, so the job
        still ends with a sentence."""
        row = within_row_bound(row)
        if not row.get("final"):
            self.check_room()
        # Rows are posted in the order of their names, so a name only ever grows: the wall
        # clock in nanoseconds (readable, and ordered across restarts), but never less than
        # one past the last name, whatever the clock does (NTP stepping a fast clock back, a
        # Pi without a real-time clock).
        with self.counter_lock:
            self.counter += 1
            self.last = max(time.time_ns(), self.last + 1)
            name = f"{self.last:020d}-{self.counter:06d}.json"
        path = os.path.join(self.directory, name)
        atomic_write_json(path, {"collector": collector_url, "row": row})
        with contextlib.suppress(OSError):
            self._held_changed(os.lstat(path).st_size)
        with self.owners_lock:
            self.owners[name] = collector_url
        return path

    def _remove(self, path: str) -> None:
        """A delivered row's file goes."""
        size = os.lstat(path).st_size
        os.unlink(path)
        self._held_changed(-size)

    def pending(self, collector_url: str | None = None) -> list[str]:
        names = self._names()
        if collector_url is not None:
            names = [n for n in names if self._owner(n)[0] == collector_url]
        return [os.path.join(self.directory, n) for n in names]

    def _names(self) -> list[str]:
        """Spooled file names, oldest first; the collectors of files now gone are forgotten."""
        with self.owners_lock:
            names = sorted(n for n in os.listdir(self.directory)
                           if n.endswith(".json") and not n.startswith("."))
            present = set(names)
            for gone in [n for n in self.owners if n not in present]:
                del self.owners[gone]
        return names

    def _owner(self, name: str) -> tuple[str | None, dict | None]:
        """The collector a spooled file names, and its entry when this call had to read it."""
        with self.owners_lock:
            if name in self.owners:
                return self.owners[name], None
        entry = read_json(os.path.join(self.directory, name))
        owner = _spooled_collector(entry)
        with self.owners_lock:
            self.owners[name] = owner
        return owner, entry if isinstance(entry, dict) and owner is not None else None

    def _forget(self, paths: list[str]) -> None:
        # Rows a failed post read are read again on the next try anyway; reading their
        # collector afresh then costs nothing more, and a row whose entry was pointed at
        # another collector meanwhile (a collector's new address) goes where it now says.
        with self.owners_lock:
            for path in paths:
                self.owners.pop(os.path.basename(path), None)

    def flush(self, only: str | None = None) -> bool:
        """Post pending rows in order; True when nothing is left for `only` (or for anyone).

        Rows that piled up (an outage, an earlier run) go up to BATCH_ROWS at a time in one
        request; the usual single fresh row goes on its own.
        """
        with self.flush_lock:
            queues: dict[str, list[str]] = {}
            # Entries read to learn their collector, kept only for each collector's first
            # request so that memory stays bounded by BATCH_ROWS rows per collector.
            read: dict[str, dict] = {}
            for name in self._names():
                owner, entry = self._owner(name)
                if owner is None:
                    self._reject(os.path.join(self.directory, name))
                    continue
                if only is not None and owner != only:
                    continue
                queue = queues.setdefault(owner, [])
                if entry is not None and len(queue) < BATCH_ROWS:
                    read[name] = entry
                queue.append(name)
            stuck = {url for url, names in queues.items()
                     if not self._deliver(url, names, read)}
            return not stuck if only is None else only not in stuck

    def _deliver(self, url: str, names: list[str], read: dict[str, dict]) -> bool:
        """Post one collector's rows in order; False when it cannot be reached.

        Bodies are read a request at a time, so a collector that is down costs one request's
        worth of reads, not its whole backlog.
        """
        for batch in self._batches(names):
            chunk = self._load(url, batch, read)
            if len(chunk) > 1:
                try:
                    Collector(url, timeout=30).post_results([row for _, row in chunk])
                except Unreachable as exc:
                    # The collector's link says once that it is unreachable; not every try.
                    log.debug("%d result rows kept on disk for later (%s)", len(chunk),
                              printable(exc, 500))
                    self.troubled.add(url)
                    self._forget([path for path, _ in chunk])
                    return False
                except HttpError:
                    pass  # a refused row, or a collector without arrays: one at a time below
                else:
                    for path, _ in chunk:
                        self._remove(path)
                    self._count(url, len(chunk))
                    continue
            for index, (path, row) in enumerate(chunk):
                if not self._post(url, row, path):
                    self._forget([path for path, _ in chunk[index:]])
                    return False
        return True

    def _batches(self, names: list[str]) -> Iterator[list[str]]:
        """The names in order, in runs of at most BATCH_ROWS rows and BATCH_BYTES bytes (a
        larger row alone): sizes are read as the runs are made, not for the whole backlog."""
        batch: list[str] = []
        size = 0
        for name in names:
            try:
                grows = os.lstat(os.path.join(self.directory, name)).st_size
            except OSError:
                grows = 0  # gone since the listing: _load sets it aside
            if batch and (len(batch) >= BATCH_ROWS or size + grows > BATCH_BYTES):
                yield batch
                batch, size = [], 0
            batch.append(name)
            size += grows
        if batch:
            yield batch

    def _load(self, url: str, names: list[str], read: dict[str, dict]) -> list[tuple[str, dict]]:
        """The rows of these spooled files, in order; a file that is no row is set aside."""
        rows: list[tuple[str, dict]] = []
        for name in names:
            path = os.path.join(self.directory, name)
            entry = read.pop(name, None)
            if entry is None:
                entry = read_json(path)
            owner = _spooled_collector(entry)
            if owner is None or not isinstance(entry, dict):
                self._reject(path)
            elif owner != url:
                # A row goes only to the collector its file names: here a later flush's.
                with self.owners_lock:
                    self.owners[name] = owner
            else:
                rows.append((path, entry["row"]))
        return rows

    def _post(self, url: str, row: dict, path: str) -> bool:
        try:
            Collector(url, timeout=15).post_result(row)
        except Unreachable as exc:
            log.debug("result row kept on disk for later (%s)", printable(exc, 500))
            self.troubled.add(url)
            return False
        except HttpError as exc:
            # The collector understood and refused the row; retrying cannot change its mind.
            log.error("collector %s refused result row %s/%s iter %s: %s; moved to %s", url,
                      printable(row.get("job_id")), printable(row.get("device_id")),
                      printable(row.get("iter")), printable(exc.message), self.rejected_dir)
            self._reject(path)
            self.troubled.add(url)
            return True
        self._remove(path)
        self._count(url, 1)
        return True

    def _count(self, url: str, rows: int) -> None:
        self.delivered[url] = self.delivered.get(url, 0) + rows
        self.troubled.discard(url)

    def _reject(self, path: str) -> None:
        """Move a row to rejected/, keeping only the newest REJECTED_KEEP_FILES there, in at
        most REJECTED_KEEP_BYTES."""
        try:
            size = os.lstat(path).st_size
            os.replace(path, os.path.join(self.rejected_dir, os.path.basename(path)))
        except FileNotFoundError:
            return  # gone since it was listed (a person tidying the spool): nothing to keep
        self._held_changed(-size)
        kept, size = 0, 0
        # Names start with the time the row was spooled, so they sort oldest first.
        for name in sorted(os.listdir(self.rejected_dir), reverse=True):
            target = os.path.join(self.rejected_dir, name)
            with contextlib.suppress(OSError):
                size += os.lstat(target).st_size
                kept += 1
                if kept > 1 and (kept > REJECTED_KEEP_FILES or size > REJECTED_KEEP_BYTES):
                    os.unlink(target)


def _spooled_collector(entry: object) -> str | None:
    """The collector a spooled entry is for; None when the entry is no row."""
    if not isinstance(entry, dict) or "row" not in entry:
        return None
    return str(entry.get("collector"))


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
        # The attempt the claim handed out, echoed in every row and beacon of the job so the
        # collector files a row that arrives late (spooled) under the attempt that made it.
        self.attempt = claimed_attempt(spec)
        self.params = spec.get("params") if isinstance(spec.get("params"), dict) else {}
        self.stop = threading.Event()
        self.reason = ""
        self.handback = False  # stop at a resumable point and give the job back
        self.workdir = tempfile.mkdtemp(prefix="job-", dir=runtime.work_root)
        self._prior: dict | None = None
        self.artifacts: set[str] = set()  # cache paths this job fetched: never trimmed under it

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
        # A workload's fields may name the device a row is about (device_id) and add their own,
        # never change what the row is: a field called kind once turned a row into a refusal.
        row.update(schema=WIRE_SCHEMA, kind="result", job_id=self.job_id, iter=iteration)
        if self.attempt is not None:
            row["attempt"] = self.attempt
        if self.runtime.mode == "host":
            # Rows about an attached device are filed under its id; the collector takes a host
            # job's rows only from the executor holding it, which this names.
            row["executor"] = self.runtime.reporter_id
        if isinstance(row.get("error"), str) and len(row["error"]) > MAX_ERROR_CHARS:
            row["error"] = row["error"][:MAX_ERROR_CHARS - 3] + "..."
        return row

    def post(self, row: dict) -> None:
        """Spool the row, then try to deliver everything spooled for this collector."""
        self.runtime.outbox.put(self.collector.url, row)
        self.runtime.outbox.flush(self.collector.url)

    def upload(self, data: bytes, name: str) -> str:
        return self.collector.upload_artifact(data, name)

    def fetch(self, sha256: str, suffix: str = "", limit: int = MAX_ARTIFACT_BYTES) -> str:
        try:
            return self.runtime.cache.fetch(self.collector, sha256, suffix, limit, self.stop,
                                            self.artifacts)
        except Stopped:
            self.check()  # the job ends as its stop says (cancelled, handed back, ...)
            raise

    def prior_progress(self) -> dict:
        """The progress an earlier attempt handed back (params.resume_from), verified."""
        if self._prior is None:
            sha = self.params.get("resume_from")
            self._prior = {}
            if sha:
                try:
                    path = self.fetch(str(sha), limit=MAX_PROGRESS_BYTES)
                except ArtifactError as exc:
                    raise ArtifactError(f"params.resume_from: {exc}") from exc
                progress = read_json(path)
                if not isinstance(progress, dict) or progress.get("kind") != PROGRESS_KIND:
                    raise Refusal("params.resume_from names an artifact that is not agent "
                                  "progress")
                self._prior = progress
        return self._prior

    def lease_ttl(self) -> float:
        """The lease's TTL; anything unusable (not a number, not positive, beyond a float or
        infinite) means the default."""
        lease = self.spec.get("lease") if isinstance(self.spec.get("lease"), dict) else {}
        ttl = lease.get("ttl_s")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            return DEFAULT_LEASE_TTL_S
        try:
            seconds = float(ttl)
        except OverflowError:
            return DEFAULT_LEASE_TTL_S
        return seconds if math.isfinite(seconds) and seconds > 0 else DEFAULT_LEASE_TTL_S


def claimed_attempt(spec: dict) -> int | None:
    """The attempt number a claimed job carries (None from a collector that sends none)."""
    value = spec.get("attempt")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        return None
    return value


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


def unexpected(exc: BaseException) -> dict:
    return final(False, "the agent failed unexpectedly while running the job: "
                 f"{type(exc).__name__}: {exc}")


def final_row(ctx: JobContext, result: dict) -> dict:
    """The job's closing row from what its workload returned; a result that cannot make one
    still closes the job, as a failure that says why."""
    try:
        fields = dict(result)
        iteration = int(fields.pop("iter", 0))
        row = ctx.row(iteration, bool(fields.pop("ok")), fields.pop("metrics", {}), **fields)
    except Exception as exc:
        log.exception("job %s returned a result that is no row", printable(ctx.job_id))
        row = ctx.row(0, False, {}, error=unexpected(exc)["error"])
    row["final"] = True
    return row


def outcome(row: dict) -> str:
    """A closing row in a word, for the log."""
    if row.get("preempted"):
        return "handed back"
    return "ok" if row.get("ok") else "failed"


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
            outage = self.ctx.runtime.outage(self.ctx.collector.url)
            try:
                reply = self.ctx.collector.beacon(
                    self.ctx.runtime.beacon_body(self.ctx.job_id, attempt=self.ctx.attempt))
                outage.recovered()
                self.relay(reply)
            except Exception as exc:  # nothing may end the lease keeper: told, tried again
                wait = min(self.interval, 2.0)  # try again soon: the lease is running out
                if isinstance(exc, Unreachable):
                    outage.failed(exc, wait)  # said once per outage, not once per try
                elif isinstance(exc, HttpError):
                    log.warning("beacon for job %s failed: %s", printable(self.ctx.job_id),
                                printable(exc))
                else:
                    log.exception("beacon for job %s failed unexpectedly; retrying in %.1f s",
                                  printable(self.ctx.job_id), wait)

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


def synthetic_run(prompt_tokens: int, gen_tokens: int, check) -> dict:
    """One iteration on a fresh block, for the workloads that size the synthetic loop by their
    input (batch, pipeline, the evals): its figures, and `synthetic_digest`, the hex SHA-256 of
    the block after it, which depends only on the token counts, so every device answers the
    same."""
    block = synthetic_block()
    metrics = synthetic_iteration(block, prompt_tokens, gen_tokens, check)
    metrics["synthetic_digest"] = hashlib.sha256(block).hexdigest()
    return metrics


# The synthetic tokens one benchmark job may run, warm-up included: about 14 minutes at 3 ms a
# token (the development VM), a few hours on a slow SBC. The defaults run 2,560.
SYNTHETIC_MAX_TOKENS = 250_000


def benchmark_params(params: dict, synthetic: bool = True) -> dict:
    """The plan of a benchmark job, with the defaults of decisions.md. A synthetic one is
    refused past SYNTHETIC_MAX_TOKENS in all: every device declares it, so anyone who can
    enqueue could otherwise keep a device's CPU busy for months."""
    plan = {
        "prompt_tokens": int_param(params, "prompt_tokens", 512, 0, 1_000_000),
        "gen_tokens": int_param(params, "gen_tokens", 128, 0, 1_000_000),
        "warmup_iters": int_param(params, "warmup_iters", 1, 0, 1000),
        "measure_iters": int_param(params, "measure_iters", 3, 1, 10_000),
    }
    tokens = (plan["warmup_iters"] + plan["measure_iters"]) * (plan["prompt_tokens"]
                                                               + plan["gen_tokens"])
    if synthetic and tokens > SYNTHETIC_MAX_TOKENS:
        raise Refusal(f"refused: a synthetic benchmark runs at most {SYNTHETIC_MAX_TOKENS} "
                      "tokens in all, (warmup_iters + measure_iters) x (prompt_tokens + "
                      f"gen_tokens); this job asks for {tokens}")
    return plan


def load_progress(ctx: JobContext, plan: dict) -> list[dict]:
    """The units (iterations, items, events) a preempted attempt finished, from the artifact
    named by params.resume_from; none when nothing was saved."""
    progress = ctx.prior_progress()
    if not progress.get("completed"):
        return []
    if progress.get("plan") != plan or not isinstance(progress["completed"], list):
        raise Refusal("params.resume_from was saved for different parameters")
    return [m for m in progress["completed"] if isinstance(m, dict)]


def load_benchmark_progress(ctx: JobContext, plan: dict) -> tuple[list[dict], bytearray]:
    """The iterations a preempted benchmark finished and the job's block as it was after the
    last of them (a fresh block when none was saved)."""
    completed = load_progress(ctx, plan)
    if not completed:
        return [], synthetic_block()
    try:
        saved = str(ctx.prior_progress().get("block", ""))
        block = bytearray(base64.b64decode(saved, validate=True))
    except (binascii.Error, ValueError):
        block = bytearray()
    return completed, block if len(block) == SYNTHETIC_BLOCK_BYTES else synthetic_block()


def hand_back(ctx: JobContext, progress: dict | None = None) -> dict:
    """Give the job back: upload progress (and a hand-back count), then a preempted final row."""
    try:
        handbacks = int(ctx.prior_progress().get("handbacks", 0)) + 1
    except Exception:  # an unreadable earlier progress still lets the job be handed back
        handbacks = 1
    handbacks = min(max(handbacks, 1), HANDBACK_ITER_TOP // 2)
    body = {"kind": PROGRESS_KIND, "job_id": ctx.job_id, "handbacks": handbacks,
            "saved_at": now_iso(), **(progress or {})}
    try:
        data = json.dumps(body, sort_keys=True).encode("utf-8")
        if len(data) > MAX_PROGRESS_BYTES:  # the next attempt would refuse it
            raise ValueError(f"it is {len(data)} bytes, more than the {MAX_PROGRESS_BYTES} "
                             "progress may have")
        sha: str | None = ctx.upload(data, f"progress-{ctx.job_id}.json")
    except Exception as exc:  # a failed upload: the job is handed back all the same
        log.warning("could not upload progress of %s: %s", printable(ctx.job_id),
                    printable(exc, 500))
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
    completed, block = load_benchmark_progress(ctx, plan)
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


def handback_or_raise(ctx: JobContext, plan: dict, completed: list[dict],
                      block: bytes | None = None) -> dict:
    """Hand the job back with its finished units (and the benchmark's block, when it keeps
    one), or stop when it is not to be handed back."""
    if not ctx.handback:
        raise Stopped(ctx.reason)
    progress: dict = {"plan": plan, "completed": completed}
    if block is not None:
        progress["block"] = base64.b64encode(block).decode("ascii")
    return hand_back(ctx, progress)


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
    plan = benchmark_params(ctx.params, synthetic=False)
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
    cached = ctx.fetch(sha, limit=MAX_ITEM_FILE_BYTES)
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
        log.warning("could not upload the output of %s: %s", printable(ctx.job_id),
                    printable(exc, 500))
    metrics = {"duration_ms": round(wall_ms, 1)}
    if code is None:
        return final(False, f"the script was stopped after the {timeout:g} s timeout", metrics,
                     artifacts)
    metrics["exit_code"] = code
    error = None if code == 0 else f"the script exited with status {code}"
    return final(code == 0, error, metrics, artifacts)


# --------------------------------------------------------------------------------------------
# Device workloads of the spec's table beyond benchmark, self-check and shell
# --------------------------------------------------------------------------------------------
#
# Each workload validates its params before any work (a bad one is a Refusal: a failed final
# row with the sentence), posts a row per unit of work (an item, an iteration, an event, a
# report period), checks ctx.stop between units (cancel, preemption, shutdown) and, where a unit
# boundary is a resumable point, hands the job back with the finished units (hand_back and
# load_progress, as the synthetic benchmark does). Downloads go through the verifying cache.

# The backends each workload runs on and the tools (keys of TOOL_NAMES) each needs. A pairing is
# declared only when its tools are found, so the queue keeps a job for an agent that has them.
WORKLOAD_BACKENDS = {
    "thermal": {"synthetic": (), "llama.cpp": ("llama-bench",)},
    "batch": {"synthetic": (), "llama.cpp": ("llama-cli",)},
    "pipeline": {"synthetic": (), "llama.cpp": ("llama-cli",)},
    "llm-eval": {"synthetic": (), "llama.cpp": ("llama-cli",)},
    "vision-eval": {"synthetic": (), "llama.cpp": ("llama-mtmd-cli",)},
    "speech-eval": {"synthetic": (), "whisper.cpp": ("whisper-cli",)},
    "embed-eval": {"synthetic": (), "llama.cpp": ("llama-embedding",)},
    "serve": {"synthetic": (), "llama.cpp": ("llama-server",)},
}
STDLIB_WORKLOADS = ("vantage", "dataset-prep")  # need nothing but Python: every agent has them
CONVERT_TOOLS = ("llama-quantize", "llama-convert")
# Tools with a --flag and a FLEET_* variable; llama-convert may be a plain .py script.
DEVICE_TOOL_KEYS = ("llama-cli", "llama-embedding", "llama-server", "llama-quantize",
                    "llama-convert", "llama-mtmd-cli", "whisper-cli")
SCRIPT_TOOLS = ("llama-convert",)
MAX_ITEM_BYTES = 1 << 20  # one JSON Lines record
# All the records of a JSON Lines input, which are parsed and kept before the first item runs:
# parsed JSON can take 25 times its bytes (a line of empty objects), so this keeps an input
# under about 400 MB of memory, and it still holds 4,000 prompts of 4 KiB.
MAX_JSONL_BYTES = 16 << 20
# An artifact that is neither a model nor a build: an eval item's image or recording, or a shell
# script. Each download is held to what its use takes (a JSON Lines input to MAX_JSONL_BYTES,
# progress to MAX_PROGRESS_BYTES), not to MAX_ARTIFACT_BYTES, which is for models: a collector
# naming a blob of many GB for a 1 MB use would have it written to the device's disk whole
# before anything read it. An hour of 48 kHz stereo WAV is 660 MiB.
MAX_ITEM_FILE_BYTES = 1 << 30
ROW_TEXT_CHARS = 500  # generated text carried in a row; the whole of it goes to an artifact
SOURCE_CHARS = 200  # a topic event's source, as the collector bounds it
TOOL_TIMEOUT_S = 900.0  # one generation, transcription or embedding
SYNTHETIC_MAX_PROMPT_TOKENS = 4096
MAX_ROWS = 900_000  # iter numbers stay below the hand-back range


class ItemError(Exception):
    """One item of a job failed (its row says why); the job goes on with the next item."""


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def clip(text: str, limit: int = ROW_TEXT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def number_param(params: dict, name: str, default: float, low: float, high: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise Refusal(f"params.{name} must be a number from {low:g} to {high:g}; the job gave "
                      f"{shown(value)}")
    return float(value)


def sha_param(params: dict, name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not HEX64.fullmatch(value.lower()):
        raise Refusal(f"params.{name} must be the SHA-256 of an artifact (64 hex digits); the "
                      f"job gave {shown(value)}")
    return value.lower()


def text_param(params: dict, name: str, default: str | None, pattern: re.Pattern,
               what: str) -> str:
    value = params.get(name, default)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise Refusal(f"params.{name} must be {what}; the job gave {shown(value)}")
    return value


def strings_param(params: dict, name: str, low: int, high: int, what: str) -> list[str]:
    value = params.get(name)
    if (not isinstance(value, list) or not low <= len(value) <= high
            or not all(isinstance(v, str) and v for v in value)):
        raise Refusal(f"params.{name} must be a list of {low} to {high} {what}; the job gave "
                      f"{shown(value)}")
    return list(value)


def job_backend(runtime: Runtime, ctx: JobContext) -> str:
    """The job's backend (synthetic when it names none), refused unless declared here."""
    workload = str(ctx.spec.get("workload"))
    backend = ctx.spec.get("backend") or "synthetic"
    declared = runtime.capabilities()
    if not isinstance(backend, str) or f"{workload}:{backend}" not in declared:
        offered = [c.split(":", 1)[1] for c in declared if c.startswith(workload + ":")]
        raise Refusal("refused: this agent does not implement the {} backend {} (it implements: "
                      "{}), so it will not report another backend's numbers".format(
                          workload, shown(backend), ", ".join(offered) or "none"))
    return backend


def model_file(ctx: JobContext, what: str) -> str:
    model = ctx.spec.get("model") if isinstance(ctx.spec.get("model"), dict) else {}
    sha = model.get("sha256")
    if not isinstance(sha, str) or not HEX64.fullmatch(sha.lower()):
        raise Refusal(f"{what} needs model.sha256 naming the model artifact (a GGUF file)")
    return ctx.fetch(sha.lower(), ".gguf")


def jsonl_input(ctx: JobContext, plan: dict) -> str:
    """The job's JSON Lines input (params.input_sha256), downloaded only up to what read_jsonl
    takes: a larger one is refused by its declared size, before a byte of it is written."""
    return ctx.fetch(plan["input_sha256"], ".jsonl", MAX_JSONL_BYTES)


def read_jsonl(path: str, limit: int, what: str, require: tuple[str, ...] = ()) -> list[dict]:
    """Up to `limit` records of a JSON Lines file; each must be an object with `require` keys.

    A line that is a bare JSON string stands for {"<first required key>": string}, so a file of
    quoted prompts is a batch input too. A bad line refuses the job before any work.
    """
    items: list[dict] = []
    with open(path, "rb") as fh:
        number = 0
        while len(items) < limit:
            raw = fh.readline(MAX_ITEM_BYTES + 1)
            number += 1
            if not raw:
                break
            if len(raw) > MAX_ITEM_BYTES:
                raise Refusal(f"{what} line {number} is longer than {MAX_ITEM_BYTES} bytes")
            if fh.tell() > MAX_JSONL_BYTES:
                raise Refusal(f"{what} is larger than the {MAX_JSONL_BYTES} bytes a JSON Lines "
                              f"input may have (line {number} goes past it); split it into "
                              "several jobs")
            if not raw.strip():
                continue
            try:
                item = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):
                raise Refusal(f"{what} line {number} is not valid JSON") from None
            if isinstance(item, str) and require:
                item = {require[0]: item}
            missing = [k for k in require if not isinstance(item, dict) or item.get(k) in
                       (None, "")]
            if missing:
                raise Refusal(f"{what} line {number} must be a JSON object with "
                              f"{', '.join(require)}; it lacks {', '.join(missing)}")
            items.append(item)
    if not items:
        raise Refusal(f"{what} holds no records")
    return items


def item_id(item: dict, number: int) -> object:
    value = item.get("id")
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else number


def run_items(ctx: JobContext, plan: dict, items: list, work) -> tuple[list[dict], dict | None]:
    """`work(number, item)` for each item, a row each; resumable between items.

    work returns a record {"ok", "metrics", "fields"} (plus keys kept for the summary); an
    ItemError fails that item's row only. Returns (records, hand-back result or None).
    """
    records = load_progress(ctx, plan)
    for number in range(len(records) + 1, len(items) + 1):
        started = time.monotonic()
        try:
            record = work(number, items[number - 1])
        except Stopped:
            return records, handback_or_raise(ctx, plan, records)
        except ItemError as exc:
            record = {"ok": False, "metrics": {}, "fields": {"error": str(exc)}}
        record["metrics"].setdefault("duration_ms", round((time.monotonic() - started) * 1000, 1))
        record["fields"].setdefault("item", item_id(items[number - 1], number)
                                    if isinstance(items[number - 1], dict) else number)
        ctx.post(ctx.row(number, record["ok"], record["metrics"], **record["fields"]))
        records.append(record)
    return records, None


def median_of(records: list[dict], key: str) -> float | None:
    values = [r["metrics"][key] for r in records
              if isinstance(r.get("metrics", {}).get(key), (int, float))]
    return round(statistics.median(values), 3) if values else None


def items_summary(records: list[dict]) -> dict:
    """Counts, latency percentiles (nearest rank) and median rates of a job's item records."""
    durations = [r["metrics"]["duration_ms"] for r in records
                 if r["ok"] and isinstance(r["metrics"].get("duration_ms"), (int, float))]
    metrics: dict = {"items": len(records), "items_ok": sum(1 for r in records if r["ok"])}
    if durations:
        metrics.update(p50_ms=percentile(durations, 50), p95_ms=percentile(durations, 95),
                       items_per_s=round(len(durations) * 1000 / max(sum(durations), 1e-3), 3))
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms"):
        value = median_of([r for r in records if r["ok"]], key)
        if value is not None:
            metrics[key] = value
    return metrics


def items_final(records: list[dict], metrics: dict, artifacts: list[str], noun: str = "items",
                **extra: object) -> dict:
    failed = [r for r in records if not r["ok"]]
    if failed:
        first = failed[0]["fields"]
        return final(False, "{} of {} {} failed; item {}: {}".format(
            len(failed), len(records), noun, first.get("item"), first.get("error")),
            metrics, artifacts, **extra)
    return final(True, None, metrics, artifacts, **extra)


def run_tool(argv: list[str], ctx: JobContext, timeout: float, out_path: str, err_path: str,
             cwd: str | None = None) -> tuple[int | None, float]:
    """Like run_watched, with stdout and stderr kept apart (llama.cpp prints its answer on one
    and its timings on the other); (exit code or None when stopped or late, wall ms)."""
    started = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    cwd=cwd, start_new_session=True)
        except OSError as exc:
            raise ItemError(f"could not start {os.path.basename(argv[0])}: {exc}") from exc
    killed_at = None
    while proc.poll() is None:
        late = time.monotonic() - started > timeout
        if (ctx.stop.is_set() or late) and killed_at is None:
            killed_at = time.monotonic()
            _signal_group(proc.pid, signal.SIGTERM)
        elif killed_at is not None and time.monotonic() - killed_at > 5:
            _signal_group(proc.pid, signal.SIGKILL)
        time.sleep(0.02)
    return (None if killed_at else proc.returncode), (time.monotonic() - started) * 1000


def tool_output(ctx: JobContext, argv: list[str], name: str,
                timeout: float = TOOL_TIMEOUT_S) -> tuple[str, str, float]:
    """(stdout, stderr tail, wall ms) of one tool run for one item; an ItemError unless it
    exits 0. Its files are removed, so a long job does not fill the disk."""
    base = os.path.join(ctx.workdir, name)
    try:
        code, wall_ms = run_tool(argv, ctx, timeout, base + ".out", base + ".err")
        ctx.check()
        err = read_tail(base + ".err", 64 << 10).decode("utf-8", "replace")
        with open(base + ".out", "rb") as fh:
            out = fh.read(4 << 20).decode("utf-8", "replace")
    finally:
        for suffix in (".out", ".err"):
            with contextlib.suppress(OSError):
                os.unlink(base + suffix)
    tool = os.path.basename(argv[0])
    if code is None:
        raise ItemError(f"{tool} was stopped after the {timeout:g} s timeout")
    if code != 0:
        raise ItemError(f"{tool} exited with status {code}: {tail(err, 200) or 'no message'}")
    return out, err, wall_ms


def upload_file(ctx: JobContext, path: str, name: str, headers: dict | None = None) -> str:
    """Stream a file to the job's collector (models and builds can be larger than memory).

    The collector checks x-artifact-sha256 against the bytes; a reply naming another hash is
    refused. Three tries, since the artifact is the point of the job; whatever stops the job
    (a cancel, a lost lease, its ceiling, the agent shutting down) ends the upload and its
    retries within STOP_POLL_S (Stopped): a collector that read the body and never answered
    held a cancelled job's device for the upload's whole deadline, three times over.
    """
    sha = sha256_file(path)
    fields = {"content-type": "application/octet-stream",
              "content-length": str(os.path.getsize(path)), "x-artifact-name": clip(name, 200),
              "x-artifact-sha256": sha, **(headers or {})}
    problem = ""
    for attempt in range(3):
        try:
            with open(path, "rb") as body:
                status, reply = http_call("POST", ctx.collector.url + "/artifacts", body,
                                          fields, 600, upload_deadline(600, path),
                                          stop=ctx.stop)
        except Unreachable as exc:
            problem = str(exc)
            if ctx.stop.is_set() or ctx.stop.wait(1 + attempt):
                raise Stopped(f"the upload of {name} was stopped") from None
            continue
        if status >= 400:
            raise Refusal(f"the collector refused the upload of {name}: "
                          f"{_error_message(reply)}")
        try:
            stored = json.loads(reply.decode("utf-8")).get("sha256")
        except (ValueError, AttributeError, RecursionError):
            stored = None
        if stored != sha:
            raise Refusal(f"the collector stored {name} under {shown(stored)}, not its SHA-256")
        return sha
    raise Refusal(f"{name} could not be uploaded: {problem}")


def upload_deadline(timeout: float, path: str) -> float:
    """The time a streamed upload may take: its timeout plus its size at UPLOAD_FLOOR_BPS."""
    return timeout + os.path.getsize(path) / UPLOAD_FLOOR_BPS


def upload_bytes(ctx: JobContext, data: bytes, name: str, headers: dict | None = None) -> str:
    path = os.path.join(ctx.workdir, "upload-" + hashlib.sha256(data).hexdigest()[:16])
    atomic_write(path, data)
    try:
        return upload_file(ctx, path, name, headers)
    finally:
        os.unlink(path)


# --- text generation: the synthetic reference loop, or llama.cpp's completion tool ---


def approx_tokens(text: str) -> int:
    """About four UTF-8 bytes a token, the usual rule of thumb for English text."""
    return max(1, (len(text.encode("utf-8")) + 3) // 4)


def synthetic_generate(prompt: str, max_tokens: int, check) -> dict:
    """The synthetic loop sized by the prompt: its digest is the 'text', its rates the figures.

    The digest depends only on the token counts, so every device answers the same; an eval set
    whose expected answers are those digests checks that a device computes the reference.
    """
    tokens = min(SYNTHETIC_MAX_PROMPT_TOKENS, approx_tokens(prompt))
    started = time.perf_counter()
    metrics = synthetic_run(tokens, max_tokens, check)
    metrics.update(prompt_tokens=tokens, gen_tokens=max_tokens,
                   duration_ms=round((time.perf_counter() - started) * 1000, 1))
    return {"text": metrics["synthetic_digest"], "metrics": metrics}


LLAMA_PERF = re.compile(r"(?m)^\S*(?:perf_context_print|print_timings):\s+"
                        r"(prompt eval|eval|load) time\s*=\s*([\d.]+) ms"
                        r"(?:\s*/\s*(\d+) (?:tokens|runs))?")


def llama_perf(text: str) -> dict:
    """Load time and rates from the timings llama.cpp's tools print on stderr."""
    found = {m.group(1): (float(m.group(2)), int(m.group(3)) if m.group(3) else 0)
             for m in LLAMA_PERF.finditer(text)}
    metrics: dict = {}
    if "load" in found:
        metrics["load_ms"] = found["load"][0]
    prompt_ms, prompt_n = found.get("prompt eval", (0.0, 0))
    eval_ms, eval_n = found.get("eval", (0.0, 0))
    if prompt_n:
        metrics.update(prompt_tokens=prompt_n,
                       prefill_tok_s=round(prompt_n * 1000 / max(prompt_ms, 1e-3), 3))
    if eval_n:
        metrics.update(gen_tokens=eval_n,
                       decode_tok_s=round(eval_n * 1000 / max(eval_ms, 1e-3), 3))
        if prompt_n:
            metrics["ttft_ms"] = round(prompt_ms + eval_ms / eval_n, 3)
    return metrics


def llama_generate(tool: str, ctx: JobContext, model: str, prompt: str, max_tokens: int,
                   number: int) -> dict:
    prompt_path = os.path.join(ctx.workdir, f"prompt-{number}.txt")
    with open(prompt_path, "w", encoding="utf-8") as fh:
        fh.write(prompt)  # a file, not argv: prompts can be longer than an argument may be
    argv = [tool, "-m", model, "-f", prompt_path, "-n", str(max_tokens), "--temp", "0",
            "--seed", "1", "--no-display-prompt", "-no-cnv"]
    try:
        out, err, wall_ms = tool_output(ctx, argv, f"gen-{number}")
    finally:
        os.unlink(prompt_path)
    metrics = llama_perf(err)
    metrics["duration_ms"] = round(wall_ms, 1)
    return {"text": out.strip(), "metrics": metrics}


def text_generator(runtime: Runtime, ctx: JobContext, backend: str):
    """generate(prompt, max_tokens, number) -> {"text", "metrics"} for the job's backend."""
    if backend == "synthetic":
        return lambda prompt, max_tokens, number: synthetic_generate(prompt, max_tokens,
                                                                     ctx.check)
    model = model_file(ctx, "the llama.cpp backend")
    tool = runtime.tools["llama-cli"]
    return lambda prompt, max_tokens, number: llama_generate(tool, ctx, model, prompt,
                                                             max_tokens, number)


# --- thermal: the benchmark again and again, with the machine's temperatures beside it ---

CPU_ZONE = re.compile(r"cpu|soc|pkg|core|tsens|apc|cluster|k10temp|coretemp|x86")
THERMAL_ROWS_IN_SUMMARY = 500


def cpu_zone_c(probe: Probe) -> float | None:
    """The hottest thermal zone whose type names a CPU (phones and PCs name theirs so)."""
    hottest = None
    for zone in probe.listdir("/sys/class/thermal"):
        kind = (_clean(probe.read(f"/sys/class/thermal/{zone}/type")) or "").lower()
        if not zone.startswith("thermal_zone") or not CPU_ZONE.search(kind):
            continue
        milli = _int_or_none(probe.read(f"/sys/class/thermal/{zone}/temp"))
        if milli is not None and -40000 < milli < 150000:
            hottest = max(hottest if hottest is not None else -1e9, milli / 1000.0)
    return hottest


def pmset_therm(probe: Probe) -> dict:
    """macOS gives no temperature without root, but `pmset -g therm` says how far it throttles."""
    out = probe.run(["pmset", "-g", "therm"]) or ""
    found: dict = {}
    limit = re.search(r"CPU_Speed_Limit\s*=\s*(\d+)", out)
    if limit:
        found["cpu_speed_limit_pct"] = int(limit.group(1))
    level = re.search(r"[Tt]hermal [Ww]arning [Ll]evel\s*=\s*(\d+)", out)
    if level:
        found["thermal_warning_level"] = int(level.group(1))
    return found


def speed_limit_state(limit_pct: int | None) -> str | None:
    if limit_pct is None:
        return None
    for floor, name in ((100, "nominal"), (80, "fair"), (50, "serious")):
        if limit_pct >= floor:
            return name
    return "critical"


def thermal_reading(probe: Probe) -> dict:
    """What one thermal row carries: state, CPU and battery temperature, battery level."""
    power = read_power(probe)
    hottest = hottest_zone_c(probe)
    cpu = cpu_zone_c(probe)
    reading: dict = {"cpu_temp_c": cpu if cpu is not None else hottest,
                     "battery_temp_c": power.get("battery_temp_c"),
                     "battery_pct": power.get("battery_pct"), "charging": power.get("charging")}
    if probe.system == "Darwin":
        reading.update(pmset_therm(probe))
    hot = hottest if hottest is not None else reading["battery_temp_c"]
    reading["thermal_state"] = thermal_state(hot) or speed_limit_state(
        reading.get("cpu_speed_limit_pct"))
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in reading.items()
            if v is not None}


def thermal_plan(ctx: JobContext, backend: str) -> dict:
    params = ctx.params
    return {"backend": backend,
            "prompt_tokens": int_param(params, "prompt_tokens", 128, 1, 100_000),
            "gen_tokens": int_param(params, "gen_tokens", 32, 1, 100_000),
            "duration_s": number_param(params, "duration_s", 300, 0, 7 * 86400),
            "max_iters": int_param(params, "max_iters", 10_000, 1, MAX_ROWS)}


def llama_bench_once(runtime: Runtime, ctx: JobContext, model: str, plan: dict) -> dict:
    argv = [str(runtime.tools["llama-bench"]), "-m", model, "-p", str(plan["prompt_tokens"]),
            "-n", str(plan["gen_tokens"]), "-r", "1", "-o", "json"]
    try:
        out, _, _ = tool_output(ctx, argv, "llama-bench")
    except ItemError as exc:
        raise Refusal(str(exc)) from None
    prefill, decode = llama_records(out)
    pp, tg = prefill.get("avg_ts"), decode.get("avg_ts")
    metrics = {"prefill_tok_s": pp, "decode_tok_s": tg,
               "ttft_ms": llama_ttft_ms(plan["prompt_tokens"], pp, tg)}
    return {k: v for k, v in metrics.items() if v is not None}


def thermal_iteration(runtime: Runtime, ctx: JobContext, plan: dict):
    if plan["backend"] == "synthetic":
        block = synthetic_block()  # one per job, kept across its iterations (decisions.md)
        return lambda: synthetic_iteration(block, plan["prompt_tokens"], plan["gen_tokens"],
                                           ctx.check)
    model = model_file(ctx, "a llama.cpp thermal run")
    return lambda: llama_bench_once(runtime, ctx, model, plan)


def wl_thermal(runtime: Runtime, ctx: JobContext) -> dict:
    backend = job_backend(runtime, ctx)
    plan = thermal_plan(ctx, backend)
    iteration = thermal_iteration(runtime, ctx, plan)
    done = load_progress(ctx, plan)
    before_s = float(done[-1].get("elapsed_s", 0)) if done else 0.0
    started, start_reading = time.monotonic(), thermal_reading(runtime.probe)
    while len(done) < plan["max_iters"]:
        if done and before_s + time.monotonic() - started >= plan["duration_s"]:
            break  # at least one iteration, then until the duration is spent
        try:
            metrics = iteration()
        except Stopped:
            return handback_or_raise(ctx, plan, done)
        metrics.update(thermal_reading(runtime.probe),
                       elapsed_s=round(before_s + time.monotonic() - started, 3))
        metrics.pop("charging", None)
        done.append(metrics)
        ctx.post(ctx.row(len(done), True, metrics))
    return thermal_summary(ctx, plan, done, start_reading, thermal_reading(runtime.probe))


def thermal_summary(ctx: JobContext, plan: dict, done: list[dict], start: dict,
                    end: dict) -> dict:
    rates = [m["decode_tok_s"] for m in done if isinstance(m.get("decode_tok_s"), (int, float))]
    states = [m.get("thermal_state") for m in done if m.get("thermal_state")]
    step = -(-len(states) // THERMAL_ROWS_IN_SUMMARY) or 1
    temps = [m["cpu_temp_c"] for m in done if isinstance(m.get("cpu_temp_c"), (int, float))]
    metrics: dict = {"iterations": len(done), "elapsed_s": done[-1]["elapsed_s"],
                     "thermal": states[::step], "prefill_tok_s": median_of_metrics(done,
                                                                                  "prefill_tok_s")}
    if rates:
        first, last = statistics.median(rates[:3]), statistics.median(rates[-3:])
        metrics.update(decode_tok_s=round(statistics.median(rates), 3),
                       decode_first_tok_s=round(first, 3), decode_last_tok_s=round(last, 3),
                       throttle_pct=round(max(0.0, 1 - last / first) * 100, 1) if first else 0.0)
    if temps:
        metrics["max_cpu_temp_c"] = max(temps)
    for key, reading in (("battery_start_pct", start), ("battery_end_pct", end)):
        if reading.get("battery_pct") is not None:
            metrics[key] = reading["battery_pct"]
    if ctx.params.get("resume_from"):
        metrics["resumed_after_iter"] = len(load_progress(ctx, plan))
    if plan["backend"] == "synthetic":  # the attestation, as the benchmark's final row
        digest = synthetic_attestation()
        metrics.update(synthetic_digest=digest, synthetic_rounds=SYNTHETIC_ATTESTATION_ROUNDS)
        if digest != SYNTHETIC_ATTESTATION:
            return final(False, f"the synthetic digest {digest} is not the reference "
                         f"{SYNTHETIC_ATTESTATION}: this device computes SHA-256 wrongly, so "
                         "its figures do not compare", drop_none(metrics))
    return final(True, None, drop_none(metrics))


def median_of_metrics(rows: list[dict], key: str) -> float | None:
    values = [m[key] for m in rows if isinstance(m.get(key), (int, float))]
    return round(statistics.median(values), 3) if values else None


def drop_none(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if v is not None}


# --- batch and llm-eval: a JSON Lines artifact through the backend, a row per item ---


def wl_batch(runtime: Runtime, ctx: JobContext) -> dict:
    backend = job_backend(runtime, ctx)
    plan = {"backend": backend, "input_sha256": sha_param(ctx.params, "input_sha256"),
            "max_items": int_param(ctx.params, "max_items", 1000, 1, MAX_ROWS),
            "max_tokens": int_param(ctx.params, "max_tokens", 128, 1, 8192)}
    generate = text_generator(runtime, ctx, backend)
    items = read_jsonl(jsonl_input(ctx, plan), plan["max_items"],
                       "the batch input", ("prompt",))

    def work(number: int, item: dict) -> dict:
        result = generate(str(item["prompt"]), plan["max_tokens"], number)
        return {"ok": True, "metrics": result["metrics"], "output": result["text"],
                "fields": {"output": clip(result["text"])}}

    records, handback = run_items(ctx, plan, items, work)
    if handback is not None:
        return handback
    lines = [json.dumps({"item": r["fields"].get("item"), "ok": r["ok"],
                         "output": r.get("output"), "error": r["fields"].get("error")},
                        ensure_ascii=False) for r in records]
    outputs = upload_bytes(ctx, ("\n".join(lines) + "\n").encode("utf-8"),
                           f"batch-{ctx.job_id}.jsonl")
    metrics = items_summary(records)
    metrics["gen_tokens"] = sum(int(r["metrics"].get("gen_tokens") or 0) for r in records)
    return items_final(records, metrics, [outputs], outputs_sha256=outputs)


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def answer_matches(output: str, expected: str, scoring: str) -> bool:
    """exact: the whole answer; contains: the expected words appear as words in the answer."""
    got, wanted = normalised(output), normalised(expected)
    if scoring == "exact" or not wanted:
        return got == wanted
    return re.search(r"(?<!\w)" + re.escape(wanted) + r"(?!\w)", got) is not None


def score_final(records: list[dict], metrics: dict, score_key: str, minimum: float | None,
                artifacts: list[str] | None = None) -> dict:
    """An eval passes when every item ran and, if the job set one, the score reached its floor."""
    score = metrics.get(score_key)
    if minimum is not None and isinstance(score, (int, float)) and score < minimum \
            and all(r["ok"] for r in records):
        return final(False, f"the {score_key} of {score:g} is below the job's floor of "
                     f"{minimum:g}", metrics, artifacts or [])
    return items_final(records, metrics, artifacts or [])


def optional_floor(params: dict, name: str) -> float | None:
    return number_param(params, name, 0, 0, 100) if name in params else None


def wl_llm_eval(runtime: Runtime, ctx: JobContext) -> dict:
    backend = job_backend(runtime, ctx)
    plan = {"backend": backend, "input_sha256": sha_param(ctx.params, "input_sha256"),
            "max_items": int_param(ctx.params, "max_items", 1000, 1, MAX_ROWS),
            "max_tokens": int_param(ctx.params, "max_tokens", 64, 1, 8192),
            "scoring": text_param(ctx.params, "scoring", "contains",
                                  re.compile(r"^(exact|contains)$"), "exact or contains")}
    floor = optional_floor(ctx.params, "min_score_pct")
    generate = text_generator(runtime, ctx, backend)
    items = read_jsonl(jsonl_input(ctx, plan), plan["max_items"],
                       "the evaluation set", ("prompt", "expected"))

    def work(number: int, item: dict) -> dict:
        result = generate(str(item["prompt"]), plan["max_tokens"], number)
        correct = answer_matches(result["text"], str(item["expected"]), plan["scoring"])
        return {"ok": True, "metrics": dict(result["metrics"], correct=int(correct)),
                "fields": {"output": clip(result["text"]),
                           "expected": clip(str(item["expected"])), "correct": correct}}

    records, handback = run_items(ctx, plan, items, work)
    if handback is not None:
        return handback
    metrics = items_summary(records)
    ran = [r for r in records if r["ok"]]
    metrics["correct"] = sum(r["metrics"].get("correct", 0) for r in ran)
    metrics["score_pct"] = round(100.0 * metrics["correct"] / max(len(records), 1), 2)
    return score_final(records, metrics, "score_pct", floor)


# --- pipeline: a collector topic's events through the backend as they arrive ---

TOPIC = re.compile(r"^[A-Za-z0-9._:-]{1,100}$")
TOPIC_WHAT = "a topic name: 1 to 100 characters from A-Z a-z 0-9 . _ : -"
PIPELINE_POLL_S = 5.0  # the collector answers the moment an event arrives; this bounds a stop


def topic_path(topic: str, suffix: str = "") -> str:
    return "/api/events/" + urllib.parse.quote(topic, safe="") + suffix


def topic_end(collector: Collector, topic: str) -> int:
    """The topic's newest seq: a new subscription starts after it, with what arrives next."""
    try:
        _, reply = collector.call_json("GET", topic_path(topic, "?limit=1"))
    except (Unreachable, HttpError) as exc:
        raise Refusal(f"could not read topic {topic} from the collector: {exc}") from None
    last = reply.get("last_seq") if isinstance(reply, dict) else None
    return int(last) if isinstance(last, int) else 0


def topic_next(ctx: JobContext, topic: str, cursor: int, wait_s: float) -> list[dict]:
    query = urllib.parse.urlencode({"after": cursor, "wait_s": round(wait_s, 1), "limit": 50})
    started = time.monotonic()
    try:
        status, reply = ctx.collector.call_json("GET", topic_path(topic, "/next?" + query),
                                                timeout=wait_s + 15)
    except Unreachable as exc:
        log.warning("topic %s: %s; trying again", printable(topic), printable(exc, 500))
        ctx.stop.wait(1.0)
        return []
    except HttpError as exc:
        raise Refusal(f"the collector refused to read topic {topic}: {exc.message}") from None
    events = reply.get("events") if status == 200 and isinstance(reply, dict) else None
    found = [e for e in events if isinstance(e, dict) and isinstance(e.get("seq"), int)] \
        if isinstance(events, list) else []
    if not found:
        # The idle poll's floor here too: a collector (or a proxy) that answers an empty poll
        # at once instead of holding it must not have the job poll hundreds of times a second.
        ctx.stop.wait(max(0.0, min(POLL_FLOOR_S, wait_s) - (time.monotonic() - started)))
    return found


def event_prompt(payload: object) -> str:
    """A string payload is the prompt; an object's "prompt" field, else the object as JSON."""
    if isinstance(payload, str):
        return payload
    if isinstance(payload, dict) and isinstance(payload.get("prompt"), str):
        return payload["prompt"]
    return json.dumps(payload, sort_keys=True)


def pipeline_plan(ctx: JobContext, backend: str) -> dict:
    params = ctx.params
    plan = {"backend": backend, "topic": text_param(params, "topic", None, TOPIC, TOPIC_WHAT),
            "max_tokens": int_param(params, "max_tokens", 128, 1, 8192)}
    if "output_topic" in params:
        plan["output_topic"] = text_param(params, "output_topic", None, TOPIC, TOPIC_WHAT)
    return plan


def publish_output(ctx: JobContext, plan: dict, event: dict, text: str) -> None:
    if "output_topic" not in plan:
        return
    path = topic_path(plan["output_topic"]).replace("/api/events/", "/events/", 1)
    path += "?" + urllib.parse.urlencode({"source": ctx.job_id[:200]})
    try:
        ctx.collector.call_json("POST", path, {"job_id": ctx.job_id, "topic": plan["topic"],
                                               "seq": event["seq"], "output": text})
    except (Unreachable, HttpError) as exc:
        log.warning("could not publish to %s: %s", printable(plan["output_topic"]),
                    printable(exc, 500))


def wl_pipeline(runtime: Runtime, ctx: JobContext) -> dict:
    backend = job_backend(runtime, ctx)
    plan = pipeline_plan(ctx, backend)
    duration = number_param(ctx.params, "duration_s", ctx.lease_ttl(), 1, 30 * 86400)
    max_events = int_param(ctx.params, "max_events", 100_000, 1, MAX_ROWS)
    start_after = int_param(ctx.params, "after", 0, 0, 1 << 62) if "after" in ctx.params \
        else None
    generate = text_generator(runtime, ctx, backend)
    done = load_progress(ctx, plan)
    cursor = int(done[-1]["seq"]) if done else (
        start_after if start_after is not None else topic_end(ctx.collector, plan["topic"]))
    deadline = time.monotonic() + duration
    try:
        while len(done) < max_events and time.monotonic() < deadline:
            ctx.check()
            wait = min(PIPELINE_POLL_S, max(0.0, deadline - time.monotonic()))
            for event in topic_next(ctx, plan["topic"], cursor, wait)[:max_events - len(done)]:
                done.append(pipeline_event(ctx, plan, generate, event, len(done) + 1))
                cursor = event["seq"]
    except Stopped:
        if ctx.handback:
            return hand_back(ctx, {"plan": plan, "completed": done})
        ended = ctx.reason
    else:
        ended = "max_events reached" if len(done) >= max_events else "duration_s reached"
    return pipeline_summary(plan, done, cursor, ended)


def pipeline_event(ctx: JobContext, plan: dict, generate, event: dict, number: int) -> dict:
    started = time.monotonic()
    try:
        result = generate(event_prompt(event.get("payload")), plan["max_tokens"], number)
        ok, metrics, error = True, result["metrics"], None
    except ItemError as exc:
        result, ok, metrics, error = {"text": ""}, False, {}, str(exc)
    metrics.setdefault("duration_ms", round((time.monotonic() - started) * 1000, 1))
    source = event.get("source")
    ctx.post(ctx.row(number, ok, metrics, error=error, seq=event["seq"],
                     # the collector keeps a source to SOURCE_CHARS; a row carries no more
                     source=clip(source, SOURCE_CHARS) if isinstance(source, str) else None,
                     output=clip(result["text"]) if ok else None))
    if ok:
        publish_output(ctx, plan, event, result["text"])
    return {"seq": event["seq"], "ok": ok, "metrics": {"duration_ms": metrics["duration_ms"]}}


def pipeline_summary(plan: dict, done: list[dict], cursor: int, ended: str) -> dict:
    metrics = items_summary(done)
    metrics["events"] = metrics.pop("items")
    metrics["events_ok"] = metrics.pop("items_ok")
    failed = metrics["events"] - metrics["events_ok"]
    error = f"{failed} of {metrics['events']} events failed" if failed else None
    # Ending on a cancel is how a person stops a pipeline: the summary is still the outcome.
    return final(not failed, error, metrics, topic=plan["topic"], cursor=cursor, ended=ended)


# --- vision-eval, speech-eval, embed-eval: a dataset artifact through the matching backend ---
#
# The synthetic backend runs the reference loop sized by each input, so latency and throughput
# are real figures; its answers are a fixed function of the data (the same on every device),
# which checks the plumbing and compares speed, not a model. embed-eval's synthetic embedding
# (hashed bag of words) is a real, if simple, lexical model.

MAX_PROMPT_CHARS = 4000  # prompts that go on a command line
WER_MAX_WORDS = 2000  # word error rate is quadratic in the words compared


def eval_plan(ctx: JobContext, backend: str) -> dict:
    return {"backend": backend, "input_sha256": sha_param(ctx.params, "input_sha256"),
            "max_items": int_param(ctx.params, "max_items", 1000, 1, MAX_ROWS)}


def eval_items(ctx: JobContext, plan: dict, what: str, require: tuple[str, ...],
               sha_key: str | None = None) -> list[dict]:
    items = read_jsonl(jsonl_input(ctx, plan), plan["max_items"], what,
                       require)
    for number, item in enumerate(items, 1):
        if sha_key and not HEX64.fullmatch(str(item[sha_key]).lower()):
            raise Refusal(f"{what} record {number}: {sha_key} must be the SHA-256 of an "
                          "artifact")
    return items


def synthetic_sized(path: str, check) -> tuple[str, dict]:
    """(hex digest of the file, synthetic figures): one token per 4 KiB, at most 256."""
    metrics = synthetic_run(min(256, 1 + os.path.getsize(path) // 4096), 1, check)
    return sha256_file(path), {"ttft_ms": metrics["ttft_ms"]}


def item_choices(item: dict) -> list[str]:
    choices = item.get("choices")
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return choices[:100]
    return []


def vision_prompt(ctx: JobContext, item: dict, choices: list[str]) -> str:
    prompt = item.get("prompt") or ctx.params.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        prompt = "What is in this image? Answer with one word."
        if choices:
            prompt = "What is in this image? Answer with one of: {}.".format(", ".join(choices))
    return prompt[:MAX_PROMPT_CHARS]


def vision_predictor(runtime: Runtime, ctx: JobContext, backend: str):
    """predict(image path, prompt, choices, number) -> (answer, metrics)."""
    if backend == "synthetic":
        def synthetic(image: str, prompt: str, choices: list[str], number: int):
            digest, metrics = synthetic_sized(image, ctx.check)
            return (choices[int(digest, 16) % len(choices)] if choices else digest), metrics
        return synthetic
    mmproj_sha = sha_param(ctx.params, "mmproj_sha256")
    max_tokens = int_param(ctx.params, "max_tokens", 16, 1, 512)
    model = model_file(ctx, "the llama.cpp vision backend")
    mmproj = ctx.fetch(mmproj_sha, ".gguf")
    tool = runtime.tools["llama-mtmd-cli"]

    def llama(image: str, prompt: str, choices: list[str], number: int):
        argv = [tool, "-m", model, "--mmproj", mmproj, "--image", image, "-p", prompt,
                "-n", str(max_tokens), "--temp", "0"]
        out, err, _ = tool_output(ctx, argv, f"vision-{number}")
        return out.strip(), llama_perf(err)
    return llama


def wl_vision_eval(runtime: Runtime, ctx: JobContext) -> dict:
    backend = job_backend(runtime, ctx)
    plan = eval_plan(ctx, backend)
    floor = optional_floor(ctx.params, "min_score_pct")
    predict = vision_predictor(runtime, ctx, backend)
    items = eval_items(ctx, plan, "the vision dataset", ("image_sha256", "label"),
                       "image_sha256")

    def work(number: int, item: dict) -> dict:
        image = ctx.fetch(str(item["image_sha256"]).lower(), limit=MAX_ITEM_FILE_BYTES)
        choices = item_choices(item)
        answer, metrics = predict(image, vision_prompt(ctx, item, choices), choices, number)
        correct = answer_matches(answer, str(item["label"]), "contains")
        return {"ok": True, "metrics": dict(metrics, correct=int(correct)),
                "fields": {"label": clip(str(item["label"])), "output": clip(answer),
                           "correct": correct}}

    records, handback = run_items(ctx, plan, items, work)
    if handback is not None:
        return handback
    metrics = items_summary(records)
    metrics["images_per_s"] = metrics.pop("items_per_s", 0.0)
    metrics["top1_pct"] = round(100.0 * sum(r["metrics"].get("correct", 0) for r in records)
                                / len(records), 2)
    return score_final(records, metrics, "top1_pct", floor)


def word_errors(reference: list[str], hypothesis: list[str]) -> int:
    """Word-level edit distance (substitutions, deletions, insertions), two rows at a time."""
    previous = list(range(len(hypothesis) + 1))
    for i, word in enumerate(reference, 1):
        current = [i]
        for j, other in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (word != other)))
        previous = current
    return previous[-1]


def words_of(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.lower())[:WER_MAX_WORDS]


def audio_seconds(path: str) -> float | None:
    import wave

    try:
        with wave.open(path, "rb") as audio:
            return audio.getnframes() / float(audio.getframerate())
    except (wave.Error, EOFError, OSError, ZeroDivisionError):
        return None  # not a WAV file; whisper.cpp may still read it


def speech_transcriber(runtime: Runtime, ctx: JobContext, backend: str):
    if backend == "synthetic":
        def synthetic(audio: str, number: int):
            return synthetic_sized(audio, ctx.check)
        return synthetic
    language = text_param(ctx.params, "language", "auto", re.compile(r"^(auto|[a-z]{2,3})$"),
                          "auto or a language code such as en")
    model = model_file(ctx, "the whisper.cpp backend")
    tool = runtime.tools["whisper-cli"]

    def whisper(audio: str, number: int):
        argv = [tool, "-m", model, "-f", audio, "-l", language, "-nt", "-np"]
        out, _, _ = tool_output(ctx, argv, f"speech-{number}")
        return " ".join(line.strip() for line in out.splitlines() if line.strip()), {}
    return whisper


def wl_speech_eval(runtime: Runtime, ctx: JobContext) -> dict:
    backend = job_backend(runtime, ctx)
    plan = eval_plan(ctx, backend)
    floor = optional_floor(ctx.params, "max_wer_pct")
    transcribe = speech_transcriber(runtime, ctx, backend)
    items = eval_items(ctx, plan, "the speech dataset", ("audio_sha256", "text"),
                       "audio_sha256")

    def work(number: int, item: dict) -> dict:
        audio = ctx.fetch(str(item["audio_sha256"]).lower(), limit=MAX_ITEM_FILE_BYTES)
        started = time.monotonic()
        heard, metrics = transcribe(audio, number)
        reference, hypothesis = words_of(str(item["text"])), words_of(heard)
        errors = word_errors(reference, hypothesis)
        metrics.update(words=len(reference), word_errors=errors,
                       wer_pct=round(100.0 * errors / max(len(reference), 1), 2))
        seconds = audio_seconds(audio)
        if seconds:
            metrics.update(audio_s=round(seconds, 3),
                           rtf=round((time.monotonic() - started) / seconds, 4))
        return {"ok": True, "metrics": metrics,
                "fields": {"text": clip(str(item["text"])), "output": clip(heard)}}

    records, handback = run_items(ctx, plan, items, work)
    if handback is not None:
        return handback
    return speech_final(records, floor)


def speech_final(records: list[dict], ceiling: float | None) -> dict:
    metrics = items_summary(records)
    ran = [r["metrics"] for r in records if r["ok"]]
    words = sum(m.get("words", 0) for m in ran)
    metrics["wer_pct"] = round(100.0 * sum(m.get("word_errors", 0) for m in ran)
                               / max(words, 1), 2)
    rtf = [m["rtf"] for m in ran if isinstance(m.get("rtf"), (int, float))]
    if rtf:
        metrics["rtf"] = round(statistics.median(rtf), 4)
    if ceiling is not None and metrics["wer_pct"] > ceiling and all(r["ok"] for r in records):
        return final(False, f"the wer_pct of {metrics['wer_pct']:g} is above the job's ceiling "
                     f"of {ceiling:g}", metrics)
    return items_final(records, metrics, [])


EMBED_DIMS = 256


def hashed_embedding(text: str) -> list[float]:
    """Feature hashing of lower-cased words, signed, L2-normalised: a lexical embedding."""
    vector = [0.0] * EMBED_DIMS
    for word in re.findall(r"\w+", text.lower()):
        code = int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:4], "big")
        vector[code % EMBED_DIMS] += 1.0 if code & (1 << 31) else -1.0
    norm = sum(v * v for v in vector) ** 0.5
    return [v / norm for v in vector] if norm else vector


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))  # noqa: B905 - zip(strict=) needs Python 3.10
    norm = (sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5)
    return dot / norm if norm else 0.0


def llama_embeddings(tool: str, ctx: JobContext, model: str, texts: list[str],
                     number: int) -> list[list[float]]:
    path = os.path.join(ctx.workdir, f"embed-{number}.txt")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(" ".join(t.split()) or "." for t in texts))  # one text a line
    try:
        out, _, _ = tool_output(ctx, [tool, "-m", model, "-f", path, "--embd-output-format",
                                      "json"], f"embed-{number}")
    finally:
        os.unlink(path)
    try:
        data = json.loads(out[out.index("{"):])["data"]
        vectors = [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ItemError("llama-embedding did not print the JSON embeddings asked for") from None
    if len(vectors) != len(texts):
        raise ItemError(f"llama-embedding returned {len(vectors)} embeddings for "
                        f"{len(texts)} texts")
    return vectors


def embedder(runtime: Runtime, ctx: JobContext, backend: str):
    """embed(texts, number) -> vectors."""
    if backend == "synthetic":
        def synthetic(texts: list[str], number: int) -> list[list[float]]:
            tokens = min(SYNTHETIC_MAX_PROMPT_TOKENS, sum(approx_tokens(t) for t in texts))
            synthetic_run(tokens, 0, ctx.check)
            return [hashed_embedding(t) for t in texts]
        return synthetic
    model = model_file(ctx, "the llama.cpp embedding backend")
    tool = runtime.tools["llama-embedding"]
    return lambda texts, number: llama_embeddings(tool, ctx, model, texts, number)


def check_embed_items(items: list[dict]) -> None:
    for number, item in enumerate(items, 1):
        candidates, expected = item["candidates"], item["expected"]
        if not isinstance(candidates, list) or not 1 <= len(candidates) <= 100 or not all(
                isinstance(c, str) for c in candidates):
            raise Refusal(f"the embedding dataset record {number}: candidates must be a list "
                          "of 1 to 100 strings")
        if isinstance(expected, bool) or not isinstance(expected, int) or not (
                0 <= expected < len(candidates)):
            raise Refusal(f"the embedding dataset record {number}: expected must be the index "
                          "of the matching candidate")


def wl_embed_eval(runtime: Runtime, ctx: JobContext) -> dict:
    backend = job_backend(runtime, ctx)
    plan = eval_plan(ctx, backend)
    floor = optional_floor(ctx.params, "min_score_pct")
    embed = embedder(runtime, ctx, backend)
    items = eval_items(ctx, plan, "the embedding dataset", ("query", "candidates"))
    for item in items:
        item.setdefault("expected", 0)
    check_embed_items(items)

    def work(number: int, item: dict) -> dict:
        vectors = embed([str(item["query"]), *item["candidates"]], number)
        scores = [cosine(vectors[0], v) for v in vectors[1:]]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        rank = order.index(item["expected"]) + 1
        return {"ok": True, "metrics": {"rank": rank, "similarity": round(
            scores[item["expected"]], 4)}, "fields": {"query": clip(str(item["query"]))}}

    records, handback = run_items(ctx, plan, items, work)
    if handback is not None:
        return handback
    metrics = items_summary(records)
    ranks = [r["metrics"]["rank"] for r in records if r["ok"]]
    for name, cut in (("top1_pct", 1), ("top5_pct", 5)):
        metrics[name] = round(100.0 * sum(1 for k in ranks if k <= cut) / len(records), 2)
    metrics["mrr"] = round(sum(1.0 / k for k in ranks) / len(records), 4)
    return score_final(records, metrics, "top1_pct", floor)


# --- vantage and dataset-prep: the web as this device reaches it, standard library only ---
#
# Jobs come from anyone who can reach the collector, so a URL that resolves to a private,
# loopback or link-local address (this device's LAN, its own services) is refused unless the
# owner started the agent with --allow-private-urls. The check is made on the address actually
# connected to, after resolution, so a name cannot point somewhere else in between.

URL_CHARS = re.compile(r"^https?://[^\s\x00-\x1f\x7f]{1,2000}$")
MAX_REDIRECTS = 5


def check_url(url: object, name: str) -> str:
    if not isinstance(url, str) or not URL_CHARS.fullmatch(url):  # $ alone admits a final \n
        raise Refusal(f"{name} must be http:// or https:// URLs without spaces; the job gave "
                      f"{shown(url)}")
    try:  # raises on a lone bracket, or a host NFKC folds into '/', '?', '#' or '@'
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise Refusal(f"{name}: {shown(url)} is not a URL") from None
    if not parts.hostname or parts.username is not None or parts.password is not None:
        raise Refusal(f"{name}: {shown(url)} must name a host and carry no user or password")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        raise Refusal(f"{name}: {shown(url)} has an invalid port") from None
    return url


# IPv6 forms that carry an IPv4 address: NAT64's well-known prefix (RFC 6052: the last 32 bits,
# how an IPv6-only phone network reaches 169.254.169.254 or the LAN's 192.168.1.1) and 6to4 are
# judged by the IPv4 address inside. ipaddress calls several of them global whatever they carry.
NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")
# Refused outright: local-use NAT64 (RFC 8215, where the IPv4 bits sit depends on the network's
# prefix length), Teredo, IPv4-compatible (::a.b.c.d, deprecated) and IPv4-translated addresses.
REFUSED_IPV6 = tuple(ipaddress.IPv6Network(net) for net in (
    "64:ff9b:1::/48", "2001::/32", "::/96", "::ffff:0:0:0/96"))


def address_allowed(address: str, allow_private: bool) -> bool:
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(
        address.split("%", 1)[0])
    if allow_private:
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in NAT64_PREFIX:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        elif ip.sixtofour is not None:
            ip = ip.sixtofour
        elif any(ip in net for net in REFUSED_IPV6):
            return False
    return ip.is_global and not ip.is_multicast


LOOKUP_POLL_S = 0.05  # how often a lookup in progress looks at its fetch's limit and stop


def lookup(host: str, port: int, limit: WebLimit) -> list:
    """socket.getaddrinfo for a stream socket, held to `limit`: its deadline and its job's stop.

    getaddrinfo takes no timeout and no signal ends it; a resolver that does not answer holds
    its caller for the system's own retries (five seconds a server and attempt by default, more
    on some phones). The lookup runs in a thread of its own, and the fetch waits for it only as
    long as its limit allows: past that it goes on without the answer (TimeoutError, or
    Stopped), and the thread ends when the system gives up."""
    answer: dict = {}
    done = threading.Event()

    def look() -> None:
        try:
            answer["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except BaseException as exc:  # handed to the fetch, which raises it
            answer["error"] = exc
        finally:
            done.set()

    threading.Thread(target=look, name="lookup " + host, daemon=True).start()
    while not done.wait(LOOKUP_POLL_S):
        limit.check()
    if "error" in answer:
        raise answer["error"]
    return answer["infos"]


def connect_timed(url: str, limit: WebLimit, allow_private: bool,
                  conn: http.client.HTTPConnection | None = None) -> tuple[object, dict]:
    """(connected socket, TLS-wrapped for https; phase times in ms from the start).

    Each address the name resolves to is tried in turn, as a browser would (a host with an
    IPv6 address this network cannot route still answers on IPv4); refused ones are skipped.
    A TLS socket is put on `conn` before its handshake, so the fetch's Deadline can cut a
    handshake that trickles. `limit` is the fetch's: its timeout for each connect, and its
    deadline and stop for the name's lookup (see lookup).
    """
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    started = time.perf_counter()
    infos = lookup(parts.hostname or "", parts.port or (443 if https else 80), limit)
    phases = {"dns_ms": (time.perf_counter() - started) * 1000, "started": started}
    allowed = [info for info in infos if address_allowed(str(info[4][0]), allow_private)]
    if not allowed:
        raise PermissionError(f"{parts.hostname} resolves to {infos[0][4][0]}, a private or "
                              "local address; the agent's owner can allow those with "
                              "--allow-private-urls")
    sock = connect_first(allowed, limit.timeout)
    phases["connect_ms"] = (time.perf_counter() - started) * 1000
    if https:
        try:
            sock = ssl.create_default_context().wrap_socket(
                sock, server_hostname=parts.hostname, do_handshake_on_connect=False)
            if conn is not None:
                conn.sock = sock
            sock.do_handshake()
        except BaseException:
            sock.close()
            raise
        phases["tls_ms"] = (time.perf_counter() - started) * 1000
    return sock, phases


def connect_first(infos: list, timeout: float) -> socket.socket:
    problem: OSError = OSError("no address to connect to")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            problem = exc
    raise problem


WEB_CHUNK = 64 << 10  # the most one read of a page takes; the job's stop is checked between


class WebLimit:
    """The limits of one web fetch of a job: `timeout` for each socket operation, `seconds`
    for the whole fetch (every hop and every byte: a socket timeout alone lets a page that
    trickles a byte a second hold the device for days), and the job, whose stop (a cancel,
    a preemption, the agent shutting down) ends the fetch at once."""

    def __init__(self, timeout: float, seconds: float, ctx: JobContext | None = None):
        self.timeout = timeout
        self.seconds = seconds
        self.until = time.monotonic() + seconds
        self.ctx = ctx

    def watch(self, conn: http.client.HTTPConnection, url: str) -> Deadline:
        watch = Deadline(conn, max(0.0, self.until - time.monotonic()), url,
                         self.ctx.stop if self.ctx is not None else None)
        watch.start()
        return watch

    def check(self) -> None:
        """After each step of a fetch: a connection the Deadline cut reads as one the server
        closed, so say what cut it (Stopped, or TimeoutError at the deadline)."""
        if self.ctx is not None:
            self.ctx.check()
        if time.monotonic() >= self.until:
            raise TimeoutError(f"took longer than {self.seconds:g} s")


@contextlib.contextmanager
def web_exchange(url: str, limit: WebLimit, allow_private: bool, method: str = "GET"):
    """`method` `url` over a connection made by connect_timed, held to `limit`; yields
    (response with its status and headers read, phase times)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    # An IPv6 literal keeps its brackets: http.client reads what follows a bare one's last colon
    # as a port. (The connection itself is connect_timed's; this only names the host.)
    conn = http.client.HTTPConnection(f"[{host}]" if ":" in host else host,
                                      timeout=limit.timeout)
    watch = limit.watch(conn, url)
    target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    try:
        try:
            sock, phases = connect_timed(url, limit, allow_private, conn)
            conn.sock = sock
            limit.check()
            conn.request(method, target, headers={
                "Host": parts.netloc, "User-Agent": "fleet_agent/" + AGENT_VERSION,
                "Accept": "*/*", "Accept-Encoding": "identity", "Connection": "close"})
            response = conn.getresponse()
        except (OSError, http.client.HTTPException):
            limit.check()
            raise
        limit.check()
        phases["ttfb_ms"] = (time.perf_counter() - phases["started"]) * 1000
        yield response, phases
    finally:
        watch.done.set()
        conn.close()


def web_body(response: http.client.HTTPResponse, limit: WebLimit, max_bytes: int):
    """Up to `max_bytes` of the body, as it comes: read1 returns what has arrived rather than
    waiting for a whole chunk, so `limit` is checked between reads however slow the page."""
    size = 0
    while size < max_bytes:
        try:
            chunk = response.read1(min(WEB_CHUNK, max_bytes - size))
        except (OSError, http.client.HTTPException):
            limit.check()
            raise
        limit.check()
        if not chunk:
            return
        size += len(chunk)
        yield chunk


def network_error(exc: BaseException) -> str:
    if isinstance(exc, socket.gaierror):
        return f"the name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({getattr(exc, 'reason', None) or exc})"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out" if str(exc) in ("", "timed out") else f"timed out: {exc}"
    if isinstance(exc, PermissionError) and exc.args:
        return str(exc.args[0])
    return f"{type(exc).__name__}: {exc}"


def measure_url(url: str, timeout: float, allow_private: bool, max_bytes: int,
                ctx: JobContext | None = None) -> dict:
    """One measurement, all of it within `timeout` s: DNS, connect, TLS, first byte (status
    line and headers), total."""
    sample: dict = {}
    limit = WebLimit(timeout, timeout, ctx)
    try:
        with web_exchange(url, limit, allow_private) as (response, phases):
            size = sum(len(chunk) for chunk in web_body(response, limit, max_bytes))
        started = phases.pop("started")
        phases["total_ms"] = (time.perf_counter() - started) * 1000
        sample = {k: round(v, 2) for k, v in phases.items()}
        sample.update(status=response.status, bytes=size)
    except (OSError, ssl.SSLError, http.client.HTTPException, ValueError) as exc:
        sample["error"] = network_error(exc)
    return sample


VANTAGE_PHASES = ("dns_ms", "connect_ms", "tls_ms", "ttfb_ms", "total_ms")


def vantage_record(url: str, samples: list[dict]) -> dict:
    answered = [s for s in samples if "status" in s]
    metrics: dict = {"repeats": len(samples), "failures": len(samples) - len(answered)}
    for phase in VANTAGE_PHASES:
        values = [s[phase] for s in answered if phase in s]
        if values:
            metrics[phase] = round(statistics.median(values), 2)
    if answered:
        metrics["p95_ms"] = percentile([s["total_ms"] for s in answered], 95)
        metrics["status"] = answered[-1]["status"]
        metrics["bytes"] = answered[-1]["bytes"]
    errors = [s["error"] for s in samples if "error" in s]
    error = f"{url}: {errors[0]}" if errors else None
    return {"ok": not errors, "metrics": metrics,
            "fields": {"url": url, "samples": samples, "error": error}}


def wl_vantage(runtime: Runtime, ctx: JobContext) -> dict:
    urls = [check_url(u, "params.urls") for u in strings_param(ctx.params, "urls", 1, 50,
                                                                  "URLs")]
    plan = {"urls": urls, "repeats": int_param(ctx.params, "repeats", 3, 1, 100),
            "timeout_s": number_param(ctx.params, "timeout_s", 10, 0.1, 120),
            "max_bytes": int_param(ctx.params, "max_bytes", 10 << 20, 0, 1 << 30)}
    allow_private = bool(getattr(runtime.cfg, "allow_private_urls", False))

    def work(number: int, url: str) -> dict:
        samples = []
        for _ in range(plan["repeats"]):
            ctx.check()
            samples.append(measure_url(url, plan["timeout_s"], allow_private,
                                       plan["max_bytes"], ctx))
        return vantage_record(url, samples)

    records, handback = run_items(ctx, plan, urls, work)
    if handback is not None:
        return handback
    answered = [r for r in records if r["ok"]]
    metrics = {"urls": len(records), "urls_ok": len(answered)}
    total = [r["metrics"]["total_ms"] for r in answered if "total_ms" in r["metrics"]]
    if total:
        metrics["total_ms"] = round(statistics.median(total), 2)
    return items_final(records, metrics, [], noun="URLs")


# dataset-prep


SPLIT_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def parse_split(value: object) -> list[tuple[str, float]]:
    """'train:80,val:10,test:10' -> [(name, weight), ...]; names are safe artifact names."""
    what = ("params.split must look like train:80,test:20 (names of lower-case letters, "
            f"digits, _ and -; positive weights); the job gave {shown(value)}")
    if not isinstance(value, str):
        raise Refusal(what)
    splits = []
    for part in value.split(","):
        name, _, weight = part.strip().partition(":")
        try:
            number = float(weight)
        except ValueError:
            raise Refusal(what) from None
        if not SPLIT_NAME.fullmatch(name) or not 0 < number < 1e9 or name in dict(splits):
            raise Refusal(what)
        splits.append((name, number))
    if not 1 <= len(splits) <= 10:
        raise Refusal(what)
    return splits


def split_counts(total: int, weights: list[float]) -> list[int]:
    """Whole counts in proportion to the weights, summing to total (largest remainder)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: -(exact[i] - counts[i]))
    for index in by_remainder[:total - sum(counts)]:
        counts[index] += 1
    return counts


def fetch_url(ctx: JobContext, url: str, dest: str, max_bytes: int, allow_private: bool,
              seconds: float) -> str:
    """Download `url` (following up to 5 redirects, each checked again) to dest within
    `seconds` in all; its SHA-256."""
    limit = WebLimit(60.0, seconds, ctx)
    for _ in range(MAX_REDIRECTS + 1):
        try:
            with web_exchange(url, limit, allow_private) as (response, _):
                location = response.getheader("location")
                if response.status in (301, 302, 303, 307, 308) and location:
                    url = check_url(urllib.parse.urljoin(url, location), "a redirect")
                    continue
                if response.status != 200:
                    raise Refusal(f"params.source {url} answered HTTP {response.status}")
                return stream_to_file(response, limit, dest, max_bytes, url)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise Refusal(f"params.source {url} could not be fetched: {network_error(exc)}") \
                from None
    raise Refusal(f"params.source {url} redirects more than {MAX_REDIRECTS} times")


def stream_to_file(response: http.client.HTTPResponse, limit: WebLimit, dest: str,
                   max_bytes: int, url: str) -> str:
    """The body into dest; its SHA-256. Never past max_bytes, nor into the disk's last
    DOWNLOAD_FREE_RESERVE bytes, as with an artifact download (download_room)."""
    digest, size = hashlib.sha256(), 0
    directory = os.path.dirname(os.path.abspath(dest))
    declared = _int_or_none(response.getheader("content-length"))
    try:
        if declared is not None and declared > 0:  # past max_bytes, it is cut there
            download_room(directory, min(declared, max_bytes), max_bytes)
        with open(dest, "wb") as out:
            for chunk in web_body(response, limit, max_bytes + 1):
                size += len(chunk)
                if size > max_bytes:
                    raise Refusal(f"params.source {url} is larger than params.max_bytes "
                                  f"({max_bytes} bytes)")
                download_room(directory, size, max_bytes, len(chunk))
                digest.update(chunk)
                out.write(chunk)
    except NoRoom as exc:
        raise Refusal(f"params.source {url} was not downloaded: {exc}") from None
    return digest.hexdigest()


def index_lines(path: str, limit: int, fmt: str) -> tuple[array.array, array.array]:
    """Offsets and lengths of the first `limit` non-blank lines (checked as JSON for jsonl).

    Two arrays of integers rather than the lines, so a million-record dataset costs 16 MB.
    """
    offsets, lengths = array.array("q"), array.array("q")
    with open(path, "rb") as fh:
        position, number = 0, 0
        while len(offsets) < limit:
            raw = fh.readline(MAX_ITEM_BYTES + 1)
            number += 1
            if not raw:
                break
            if len(raw) > MAX_ITEM_BYTES:
                raise Refusal(f"the source's line {number} is longer than {MAX_ITEM_BYTES} bytes")
            line = raw.rstrip(b"\r\n")
            if line.strip():
                if fmt == "jsonl":
                    try:
                        json.loads(line.decode("utf-8"))
                    except (ValueError, RecursionError):
                        raise Refusal(f"the source's line {number} is not valid JSON (use "
                                      "params.format lines for plain text)") from None
                offsets.append(position)
                lengths.append(len(line))
            position += len(raw)
    if not offsets:
        raise Refusal("the source holds no records")
    return offsets, lengths


def write_split(source: str, dest: str, order: list[int], offsets: array.array,
                lengths: array.array) -> int:
    size = 0
    with open(source, "rb") as src, open(dest, "wb") as out:
        for index in order:
            src.seek(offsets[index])
            out.write(src.read(lengths[index]) + b"\n")
            size += lengths[index] + 1
    return size


def dataset_source(ctx: JobContext, runtime: Runtime, source: str, max_bytes: int
                   ) -> tuple[str, str]:
    """(local path, SHA-256) of params.source: an artifact by hash, or an http(s) URL."""
    if HEX64.fullmatch(source.lower()):
        path = ctx.fetch(source.lower(), limit=max_bytes)  # as a URL's source is held to it
        return path, source.lower()
    check_url(source, "params.source")
    seconds = number_param(ctx.params, "timeout_s", 3600, 1, 86400)
    path = os.path.join(ctx.workdir, "source")
    allow = bool(getattr(runtime.cfg, "allow_private_urls", False))
    return path, fetch_url(ctx, source, path, max_bytes, allow, seconds)


def wl_dataset_prep(runtime: Runtime, ctx: JobContext) -> dict:
    params = ctx.params
    source = params.get("source")
    if not isinstance(source, str) or not (HEX64.fullmatch(source.lower()) or URL_CHARS.fullmatch(
            source)):
        raise Refusal("params.source must be an artifact's SHA-256 or an http(s) URL; the job "
                      f"gave {shown(source)}")
    splits = parse_split(params.get("split", "train:90,test:10"))
    max_items = int_param(params, "max_items", 100_000, 1, 1_000_000)
    fmt = text_param(params, "format", "jsonl", re.compile(r"^(jsonl|lines)$"), "jsonl or lines")
    seed = int_param(params, "seed", 0, 0, 2**31)
    max_bytes = int_param(params, "max_bytes", 1 << 30, 1, 64 << 30)
    path, source_sha = dataset_source(ctx, runtime, source, max_bytes)
    offsets, lengths = index_lines(path, max_items, fmt)
    order = list(range(len(offsets)))
    random.Random(seed).shuffle(order)  # noqa: S311 - a reproducible split, not a secret
    counts = split_counts(len(order), [w for _, w in splits])
    artifacts, summary, start = [], {}, 0
    for number, ((name, _), count) in enumerate(zip(splits, counts), 1):  # noqa: B905
        ctx.check()
        part = sorted(order[start:start + count])  # keep the source's order inside a split
        start += count
        dest = os.path.join(ctx.workdir, f"split-{number}")
        needed = sum(lengths[index] for index in part) + len(part)
        try:  # a second copy of the source: held to the rule a download is
            download_room(ctx.workdir, needed, max_bytes + len(part))
        except NoRoom as exc:
            raise Refusal(f"split {name} ({needed} bytes) was not written: {exc}") from None
        size = write_split(path, dest, part, offsets, lengths)
        sha = upload_file(ctx, dest, f"{name}.{fmt}")
        os.unlink(dest)  # uploaded: the next split needs the room
        artifacts.append(sha)
        summary[name] = {"items": count, "sha256": sha, "bytes": size}
        ctx.post(ctx.row(number, True, {"items": count, "size_mb": round(size / 2**20, 3)},
                         split=name, sha256=sha, artifacts=[sha]))
    metrics = {"items": len(order), "splits": len(splits)}
    return final(True, None, metrics, artifacts, splits=summary, source_sha256=source_sha)


# --- model-convert: llama.cpp's converter and quantizer, each result an artifact ---

QUANT_NAME = re.compile(r"^[A-Za-z0-9_]{1,24}$")
CONVERT_OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # what convert_hf_to_gguf.py writes itself
GGUF_MAGIC = b"GGUF"
MODEL_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def convert_plan(ctx: JobContext) -> dict:
    params = ctx.params
    if ctx.spec.get("backend") not in (None, "llama.cpp"):
        raise Refusal("refused: this agent converts models with llama.cpp's tools, not with "
                      f"the backend {shown(ctx.spec.get('backend'))}")
    formats = strings_param(params, "formats", 1, 10, "output formats") \
        if "formats" in params else ["gguf"]
    unknown = [f for f in formats if f.lower() != "gguf"]
    if unknown:
        raise Refusal("this agent converts to gguf only (with llama.cpp's tools); the job asks "
                      "for {}".format(", ".join(shown(f) for f in unknown)))
    quant = text_param(params, "quant", "f16", re.compile(r"^[A-Za-z0-9_, ]{1,200}$"),
                       "a quantization type such as Q4_K_M, or several separated by commas")
    types = [q.strip() for q in quant.split(",") if q.strip()]
    if not types or not all(QUANT_NAME.fullmatch(q) for q in types):
        raise Refusal(f"params.quant must name quantization types such as Q4_K_M; the job gave "
                      f"{shown(quant)}")
    return {"input_sha256": sha_param(params, "input_sha256"),
            "outputs": [f"gguf:{q}" for q in dict.fromkeys(types)]}


def hf_directory(ctx: JobContext, archive: str) -> str:
    """Unpack a Hugging Face checkpoint (a zip of its folder) and find the config.json."""
    unpacked = os.path.join(ctx.workdir, "hf")
    os.makedirs(unpacked, mode=0o700)
    if not zipfile.is_zipfile(archive):
        raise Refusal("params.input_sha256 must name a GGUF file or a zip of a Hugging Face "
                      "model folder")
    safe_unzip(archive, unpacked, check=ctx.check)
    refuse_model_code(unpacked)
    for current, dirs, files in os.walk(unpacked):
        dirs.sort()
        if "config.json" in files:
            return current
    raise Refusal("the model archive holds no config.json, so it is not a Hugging Face model")


# A model folder may carry its own Python, which transformers imports when a configuration's
# `auto_map` names it and the loader is asked with trust_remote_code, as llama.cpp's converter
# asks for some architectures (an auto_map may also name code to download). The zip is the
# job's, and anyone who can reach the collector may enqueue one, so a folder with code, or a
# configuration that points at code, is refused before the converter sees it.
MODEL_CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".pyw", ".so", ".dylib", ".dll")
AUTO_MAP = b'"auto_map"'


def refuse_model_code(folder: str) -> None:
    for current, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(current, name)
            shown_path = shown(os.path.relpath(path, folder))
            if name.lower().endswith(MODEL_CODE_SUFFIXES):
                raise Refusal(f"the model archive holds code ({shown_path}), which a conversion "
                              "could run; this agent converts folders of weights and "
                              "configuration only")
            if name.lower().endswith(".json") and file_holds(path, AUTO_MAP):
                raise Refusal(f"{shown_path} in the model archive names code to load "
                              "(auto_map), which a conversion would run or download; this "
                              "agent converts models that need no code of their own")


def file_holds(path: str, needle: bytes, chunk: int = 1 << 20) -> bool:
    """Whether the file's bytes hold `needle`, read a chunk at a time (a tokenizer's JSON may
    be tens of megabytes)."""
    tail = b""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                return False
            if needle in tail + block:
                return True
            tail = block[-(len(needle) - 1):]


def convert_argv(runtime: Runtime, source: str, outfile: str, outtype: str) -> list[str]:
    script = runtime.tools.get("llama-convert")
    if not script:
        raise Refusal("the input is a Hugging Face model and this agent has no "
                      "convert_hf_to_gguf.py (--llama-convert or FLEET_LLAMA_CONVERT)")
    head = [script] if os.access(script, os.X_OK) else [sys.executable, script]
    return [*head, source, "--outfile", outfile, "--outtype", outtype]


def base_gguf(runtime: Runtime, ctx: JobContext, plan: dict) -> tuple[str, dict | None]:
    """The GGUF to quantize from: the input itself, or the input converted (and its row)."""
    model = ctx.fetch(plan["input_sha256"])
    with open(model, "rb") as fh:
        if fh.read(4) == GGUF_MAGIC:
            return model, None
    outfile = os.path.join(ctx.workdir, "base-f16.gguf")
    argv = convert_argv(runtime, hf_directory(ctx, model), outfile, "f16")
    try:
        _, _, wall_ms = tool_output(ctx, argv, "convert", timeout=6 * 3600)
    except ItemError as exc:
        raise Refusal(f"the conversion to GGUF failed: {exc}") from None
    return outfile, {"duration_ms": round(wall_ms, 1),
                     "size_mb": round(os.path.getsize(outfile) / 2**20, 3)}


def quantize(runtime: Runtime, ctx: JobContext, base: str, quant: str) -> tuple[str, float]:
    """The model in `quant` (a path) and the ms it took; f16 from the converter is kept."""
    if quant.lower() == "f16" and base.endswith("base-f16.gguf"):
        return base, 0.0
    tool = runtime.tools.get("llama-quantize")
    if not tool:
        raise ItemError("this agent has no llama-quantize (--llama-quantize or "
                        "FLEET_LLAMA_QUANTIZE)")
    out = os.path.join(ctx.workdir, "out-" + quant.upper() + ".gguf")
    _, _, wall_ms = tool_output(ctx, [tool, base, out, quant.upper()], "quantize-" + quant,
                                timeout=6 * 3600)
    if not os.path.isfile(out):
        raise ItemError(f"llama-quantize wrote no {quant} file")
    return out, wall_ms


def wl_model_convert(runtime: Runtime, ctx: JobContext) -> dict:
    plan = convert_plan(ctx)
    model = ctx.spec.get("model") if isinstance(ctx.spec.get("model"), dict) else {}
    stem = MODEL_NAME.sub("-", str(model.get("name") or "model"))[:80].strip("-.") or "model"
    base, converted = base_gguf(runtime, ctx, plan)

    def work(number: int, output: str) -> dict:
        quant = output.split(":", 1)[1]
        try:
            path, wall_ms = quantize(runtime, ctx, base, quant)
        except ItemError as exc:
            return {"ok": False, "metrics": {}, "fields": {"quant": quant, "error": str(exc)}}
        size = os.path.getsize(path)
        sha = upload_file(ctx, path, f"{stem}-{quant.upper()}.gguf")
        if path != base:
            os.unlink(path)
        return {"ok": True, "metrics": {"duration_ms": round(wall_ms, 1), "bytes": size,
                                        "size_mb": round(size / 2**20, 3)},
                "fields": {"format": "gguf", "quant": quant, "sha256": sha, "artifacts": [sha]}}

    records, handback = run_items(ctx, plan, plan["outputs"], work)
    if handback is not None:
        return handback
    artifacts = [r["fields"]["sha256"] for r in records if r["ok"]]
    metrics = {"outputs": len(artifacts)}
    if converted:
        metrics.update(convert_ms=converted["duration_ms"], converted_mb=converted["size_mb"])
    outputs = {r["fields"]["quant"]: r["fields"]["sha256"] for r in records if r["ok"]}
    return items_final(records, metrics, artifacts, noun="outputs", outputs=outputs)


# --- serve: the backend's HTTP server on bind:port for as long as the lease is renewed ---

LLAMA_REQUEST = re.compile(rb"request:\s+(GET|POST|PUT|DELETE|OPTIONS|HEAD)\s+(\S+)\s+\S+\s+"
                           rb"(\d{3})")
QUIET_PATHS = (b"/health", b"/metrics", b"/slots", b"/props")  # probes, not requests served
SERVE_BODY_LIMIT = 1 << 20


def serve_address(ctx: JobContext) -> tuple[str, int]:
    """(bind, port) of a serve job. Any address but loopback opens a port on the owner's
    machine to its network, for as long as the job runs: only those the owner listed with
    --allow-serve-bind are taken."""
    bind = ctx.params.get("bind", "127.0.0.1")
    if bind == "localhost":
        bind = "127.0.0.1"
    try:
        address = ipaddress.ip_address(bind if isinstance(bind, str) else "")
    except ValueError:
        raise Refusal(f"params.bind must be an IP address such as 127.0.0.1 or 0.0.0.0; the job "
                      f"gave {shown(bind)}") from None
    allowed = getattr(ctx.runtime.cfg, "serve_binds", None) or []
    if not address.is_loopback and address not in allowed:
        raise Refusal(f"refused: params.bind {address} would let other machines reach this "
                      "one; this agent serves on loopback (127.0.0.1, ::1) only unless its "
                      "owner lists the address with --allow-serve-bind")
    return str(address), int_param(ctx.params, "port", 8080, 1, 65535)


def probe_host(bind: str) -> str:
    """Where this machine reaches a server bound to `bind` (every interface: the loopback)."""
    if bind == "0.0.0.0":
        return "127.0.0.1"
    if bind == "::":
        return "[::1]"
    return f"[{bind}]" if ":" in bind else bind


class ServeCounter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.errors = 0
        self.tokens = 0

    def add(self, ok: bool, tokens: int = 0) -> None:
        """A request answered (ok) or refused; served counts only the answered ones."""
        with self.lock:
            self.requests += 1 if ok else 0
            self.errors += 0 if ok else 1
            self.tokens += tokens

    def snapshot(self) -> dict:
        with self.lock:
            return {"requests_served": self.requests, "request_errors": self.errors,
                    "tokens_generated": self.tokens}


def synthetic_reply(path: str, body: object, max_tokens: int, check) -> tuple[dict, int]:
    """A llama.cpp-style /completion or an OpenAI-style /v1/completions answer, synthetic."""
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise ValueError("the body must be a JSON object with a prompt string")
    wanted = body.get("n_predict", body.get("max_tokens", 16))
    if isinstance(wanted, bool) or not isinstance(wanted, int) or not 1 <= wanted <= max_tokens:
        raise ValueError(f"n_predict or max_tokens must be 1 to {max_tokens}")
    result = synthetic_generate(body["prompt"], wanted, check)
    metrics = result["metrics"]
    if path == "/completion":
        return {"content": result["text"], "tokens_predicted": wanted,
                "timings": {"prompt_per_second": metrics.get("prefill_tok_s"),
                            "predicted_per_second": metrics.get("decode_tok_s")}}, wanted
    return {"object": "text_completion", "model": "synthetic",
            "choices": [{"index": 0, "text": result["text"], "finish_reason": "length"}],
            "usage": {"prompt_tokens": metrics["prompt_tokens"], "completion_tokens": wanted,
                      "total_tokens": metrics["prompt_tokens"] + wanted}}, wanted


def synthetic_post(path: str, length_header: str | None, read, max_tokens: int,
                   counter: ServeCounter, check) -> tuple[int, dict]:
    """(status, JSON body) answering one POST to the synthetic server."""
    if path not in ("/completion", "/v1/completions"):
        return 404, {"error": "unknown path"}
    length = _int_or_none(length_header) or 0
    if not 0 < length <= SERVE_BODY_LIMIT:
        counter.add(False)
        return (413 if length else 411), {"error": "send a JSON body up to 1 MiB"}
    try:
        reply, tokens = synthetic_reply(path, json.loads(read(length)), max_tokens, check)
    except (ValueError, RecursionError) as exc:
        counter.add(False)
        return 400, {"error": str(exc)}
    except Stopped:
        return 503, {"error": "the server is stopping"}
    counter.add(True, tokens)
    return 200, reply


def synthetic_server(bind: str, port: int, max_tokens: int, counter: ServeCounter, check):
    """A stdlib HTTP server answering completions with the synthetic loop."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "fleet-agent-synthetic/" + AGENT_VERSION

        def log_message(self, *args: object) -> None:
            pass

        def answer(self, status: int, value: object) -> None:
            data = json.dumps(value).encode("utf-8")
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            healthy = self.path.split("?", 1)[0] == "/health"
            self.answer(*((200, {"status": "ok"}) if healthy else (404, {"error": "unknown path"})))

        def do_POST(self) -> None:
            self.answer(*synthetic_post(self.path.split("?", 1)[0],
                                        self.headers.get("content-length"), self.rfile.read,
                                        max_tokens, counter, check))

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        daemon_threads = True

    return Server((bind, port), Handler)


def wait_ready(ctx: JobContext, url: str, proc: subprocess.Popen | None, startup_s: float,
               log_path: str | None) -> None:
    """Until GET url answers 200; a server process that exits first fails the job."""
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        ctx.check()
        if proc is not None and proc.poll() is not None:
            said = read_tail(log_path, 2000).decode("utf-8", "replace") if log_path else ""
            raise Refusal(f"the server exited with status {proc.returncode} before it was "
                          f"ready: {tail(said, 200)}")
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError), \
                _OPENER.open(url, timeout=2) as response:
            if response.status == 200:
                return
        ctx.stop.wait(0.2)
    raise Refusal(f"the server did not answer {url} within {startup_s:g} s")


def stop_process(proc: subprocess.Popen) -> None:
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(5)


class LlamaServerLog:
    """Requests served, counted from the `request: POST /completion ... 200` lines it logs."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.counter = ServeCounter()

    def snapshot(self) -> dict:
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        complete = data.rfind(b"\n") + 1  # a half-written line waits for the next look
        self.offset += complete
        for match in LLAMA_REQUEST.finditer(data[:complete]):
            if match.group(2).split(b"?")[0] not in QUIET_PATHS:
                self.counter.add(int(match.group(3)) < 400)
        return self.counter.snapshot()


def serve_loop(ctx: JobContext, snapshot, alive, report_s: float, duration: float | None,
               started: float) -> str:
    """Report rows every report_s until the duration ends, the server dies or the job stops."""
    number = 1
    next_report = started + report_s
    while not ctx.stop.wait(0.25):
        problem = alive()
        if problem:
            raise Refusal(problem)
        now = time.monotonic()
        if duration is not None and now - started >= duration:
            return "duration_s reached"
        if now >= next_report and number < MAX_ROWS:
            number += 1
            next_report += report_s
            ctx.post(ctx.row(number, True, dict(snapshot(), uptime_s=round(now - started, 1))))
    raise Stopped(ctx.reason)


def serve_options(ctx: JobContext) -> dict:
    params = ctx.params
    return {"report_s": number_param(params, "report_s", 60, 1, 3600),
            "startup_s": number_param(params, "startup_s", 300, 1, 3600),
            "duration_s": number_param(params, "duration_s", 0, 1, 30 * 86400)
            if "duration_s" in params else None,
            "max_tokens": int_param(params, "max_tokens", 512, 1, 8192)}


def wl_serve(runtime: Runtime, ctx: JobContext) -> dict:
    backend = job_backend(runtime, ctx)
    bind, port = serve_address(ctx)
    options = serve_options(ctx)
    if backend == "synthetic":
        return serve_synthetic(ctx, bind, port, options)
    return serve_llama(runtime, ctx, bind, port, options)


def served(ctx: JobContext, bind: str, port: int, started: float, figures: dict,
           ended: str) -> dict:
    metrics = dict(figures, uptime_s=round(time.monotonic() - started, 1))
    # Cancelling is how a person ends a server: what it served is still the outcome.
    return final(True, None, metrics, ended=ended, address=f"{bind}:{port}")


def serve_synthetic(ctx: JobContext, bind: str, port: int, options: dict) -> dict:
    counter = ServeCounter()
    try:
        server = synthetic_server(bind, port, options["max_tokens"], counter, ctx.check)
    except OSError as exc:
        raise Refusal(f"could not listen on {bind}:{port}: {exc.strerror or exc}") from None
    thread = threading.Thread(target=server.serve_forever, name="serve-" + ctx.job_id,
                              daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        ctx.post(ctx.row(1, True, {"load_ms": 0.0}, address=f"{bind}:{port}", phase="ready"))
        ended = serve_loop(ctx, counter.snapshot, lambda: None, options["report_s"],
                           options["duration_s"], started)
    except Stopped:
        if ctx.handback:
            raise
        ended = ctx.reason
    finally:
        server.shutdown()
        server.server_close()
    return served(ctx, bind, port, started, counter.snapshot(), ended)


def serve_llama(runtime: Runtime, ctx: JobContext, bind: str, port: int,
                options: dict) -> dict:
    model = model_file(ctx, "the llama.cpp server")
    log_path = os.path.join(ctx.workdir, "llama-server.log")
    argv = [runtime.tools["llama-server"], "-m", model, "--host", bind, "--port", str(port)]
    if "ctx_size" in ctx.params:
        argv += ["-c", str(int_param(ctx.params, "ctx_size", 4096, 128, 1 << 20))]
    started = time.monotonic()
    with open(log_path, "wb") as out:
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise Refusal(f"could not start llama-server: {exc}") from None
    requests = LlamaServerLog(log_path)
    try:
        wait_ready(ctx, f"http://{probe_host(bind)}:{port}/health", proc, options["startup_s"],
                   log_path)
        ctx.post(ctx.row(1, True, {"load_ms": round((time.monotonic() - started) * 1000, 1)},
                         address=f"{bind}:{port}", phase="ready"))

        def alive() -> str | None:
            code = proc.poll()
            return None if code is None else f"llama-server exited with status {code}: " + tail(
                read_tail(log_path, 2000).decode("utf-8", "replace"), 200)
        ended = serve_loop(ctx, requests.snapshot, alive, options["report_s"],
                           options["duration_s"], started)
    except Stopped:
        if ctx.handback:
            raise
        ended = ctx.reason
    finally:
        stop_process(proc)
    return served(ctx, bind, port, started, requests.snapshot(), ended)


# --- build: clone a repository at a ref, run a toolchain's task, publish the built app ---
#
# A build runs the repository's own code (a Makefile, a build.gradle), so, like a shell script,
# it needs its owner's consent: the agent builds only repositories listed in --build-repos
# (default STATE/build-repos; exact URLs, or prefixes ending in "/"). With none listed, or no
# git, no build capability is declared. The job's task is plain words (targets, subcommands)
# plus a few known flags per toolchain, so it cannot pass an option that runs a command. A
# toolchain with subcommands takes only those that compile or test the checkout (`go run`,
# `go install`, `cargo install` fetch and run code from elsewhere); no word names a module
# version (`@`) or a path outside the checkout (absolute, or with a `..` segment).

BUILD_TOOLCHAINS = {  # kind -> (tool key, default task, flags a task may use)
    "make": ("make", "", ()),
    "cmake": ("cmake", "", ("--target", "--config")),
    "gradle": ("gradle", "assemble", ("--offline", "--stacktrace", "--no-daemon")),
    "xcodebuild": ("xcodebuild", "build", ("-scheme", "-configuration", "-sdk", "-destination",
                                           "-project", "-workspace", "-target", "-arch")),
    "npm": ("npm", "build", ()),
    "cargo": ("cargo", "build --release", ("--release", "--locked", "--offline", "--workspace",
                                          "--all-features", "--features", "--bin", "--package",
                                          "--target", "--example", "-p")),
    "go": ("go", "build ./...", ("-trimpath", "-v", "-o", "-tags")),
}
# kind -> the subcommands (go, cargo) or actions (xcodebuild) a task may use: compile, test, check
BUILD_SUBCOMMANDS = {"go": ("build", "test", "vet"), "cargo": ("build", "test", "check"),
                     "xcodebuild": ("build", "build-for-testing", "test", "analyze")}
OUTPUT_FLAGS = ("-o", "--target-dir", "--out-dir")  # their value must stay inside the checkout
# A leading / or . passes these patterns so that build_task can say why such a path is refused.
TASK_WORD = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_.:/+,-]*$")
FLAG_VALUE = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_.:/+,= -]*$")
GIT_REF = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}$")
APP_PATH = re.compile(r"^[A-Za-z0-9_*?][A-Za-z0-9_.*?/+@ -]{0,299}$")
SCP_LIKE = re.compile(r"^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[A-Za-z0-9_~][^:\s]*$")
BUILD_LOG_TAIL = 2000


def check_repo(value: object) -> str:
    """https://, ssh://, git@host:path, file:// or an absolute path; never an option or a
    transport helper (ext::, fd::), never a '..' that could climb out of an allowed prefix."""
    if not isinstance(value, str) or not value or len(value) > 1000 or value.startswith("-") \
            or any(c.isspace() or ord(c) < 32 for c in value):
        raise Refusal(f"params.repo must be a repository URL or path; the job gave "
                      f"{shown(value)}")
    lowered = value.lower()
    if "::" in value or ".." in value or "%2e" in lowered:
        raise Refusal(f"params.repo {shown(value)} may not use a transport helper (::) or '..'")
    if not (lowered.startswith(("https://", "ssh://", "file:///")) or SCP_LIKE.fullmatch(value)
            or value.startswith("/")):
        raise Refusal(f"params.repo must be an https://, ssh://, git@host:path or file:// URL, "
                      f"or an absolute local path; the job gave {shown(value)}")
    return value


def build_repos_path(cfg: argparse.Namespace, state_dir: str) -> str:
    return getattr(cfg, "build_repos", None) or os.path.join(state_dir, "build-repos")


def load_build_repos(path: str) -> list[str]:
    """Repositories this machine's owner lets jobs build: one per line, # comments."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    allowed = []
    for number, line in enumerate(lines, 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            allowed.append(check_repo(entry))
        except Refusal:
            log.warning("%s line %d is not a repository URL or path; ignored", path, number)
    return allowed


def repo_allowed(repo: str, allowed: list[str]) -> bool:
    return any(repo == entry or (entry.endswith("/") and repo.startswith(entry))
               for entry in allowed)


def build_task(kind: str, task: object) -> list[str]:
    _, default, flags = BUILD_TOOLCHAINS[kind]
    if task is None:
        task = default
    if not isinstance(task, str):
        raise Refusal(f"params.task must be a string such as {default or 'all'}")
    try:
        words = shlex.split(task)
    except ValueError:
        raise Refusal(f"params.task {shown(task)} has an unbalanced quote") from None
    bare = []  # the words that are neither a flag nor a flag's value: subcommands, targets
    for index, word in enumerate(words):
        after_flag = index > 0 and words[index - 1] in flags and not word.startswith("-")
        if "@" in word:
            raise Refusal(f"params.task may not hold @ (a module@version is fetched from "
                          f"elsewhere and run); the job gave {shown(word)}")
        if word in flags:
            continue
        if after_flag and FLAG_VALUE.fullmatch(word):
            pass
        elif TASK_WORD.fullmatch(word):
            bare.append(word)
        else:
            raise Refusal(f"params.task may hold targets and the {kind} flags "
                          f"{', '.join(flags) or '(none)'}; {shown(word)} is neither")
        for piece in re.split(r"[\s=,:]", word):
            if piece.startswith("/") or ".." in piece.split("/"):
                raise Refusal(f"params.task may name paths only inside the checkout (relative, "
                              f"with no .. segment); the job gave {shown(word)}")
    allowed = BUILD_SUBCOMMANDS.get(kind, ())
    if kind == "xcodebuild":  # actions may stand anywhere among the flags
        others = [word for word in bare if word not in allowed]
        if others:
            raise Refusal(f"params.task may use the xcodebuild actions {', '.join(allowed)}; "
                          f"{shown(others[0])} is not one of them")
    elif allowed and (not words or words[0] not in allowed):
        raise Refusal(f"params.task must start with one of the {kind} subcommands "
                      f"{', '.join(allowed)} (others fetch or run code from elsewhere); the "
                      f"job gave {shown(words[0] if words else task)}")
    return words


def check_build_outputs(task: list[str], checkout: str) -> None:
    """An output flag's value (go's -o) names a place inside the checkout once links in the
    checked-out tree are followed: the build writes there."""
    root = os.path.realpath(checkout)
    for index, word in enumerate(task[1:], 1):
        if task[index - 1] in OUTPUT_FLAGS:
            place = os.path.realpath(os.path.join(root, word))
            if place != root and not place.startswith(root + os.sep):
                raise Refusal(f"params.task's {task[index - 1]} {shown(word)} leads outside "
                              "the checkout; the build must write inside it")


def build_commands(kind: str, tool: str, task: list[str], checkout: str) -> list[list[str]]:
    if kind == "cmake":
        return [[tool, "-S", ".", "-B", "build"], [tool, "--build", "build", *task]]
    if kind == "npm":
        install = "ci" if os.path.exists(os.path.join(checkout, "package-lock.json")) \
            else "install"
        return [[tool, install], [tool, "run", *task]]
    if kind == "gradle" and os.access(os.path.join(checkout, "gradlew"), os.X_OK):
        return [[os.path.join(checkout, "gradlew"), *task]]  # the project's pinned Gradle
    return [[tool, *task]]


def build_kind(runtime: Runtime, ctx: JobContext) -> str:
    """The toolchain: the job's backend (how the queue matched it) and params.kind agree."""
    backend, kind = ctx.spec.get("backend"), ctx.params.get("kind")
    kind = kind if kind is not None else backend
    if backend is not None and kind != backend:
        raise Refusal(f"params.kind {shown(kind)} and backend {shown(backend)} name different "
                      "toolchains")
    if kind not in BUILD_TOOLCHAINS:
        raise Refusal("params.kind must be one of {}; the job gave {}".format(
            ", ".join(BUILD_TOOLCHAINS), shown(kind)))
    if f"build:{kind}" not in runtime.capabilities():
        raise Refusal(f"refused: this agent does not declare build:{kind} (no {kind} on PATH, "
                      "no git, or no repository in its --build-repos list)")
    return str(kind)


def check_app_path(value: object) -> str:
    if not isinstance(value, str) or not APP_PATH.fullmatch(value) or ".." in value.split("/"):
        raise Refusal("params.app must be the path (a glob allowed) of the built app inside "
                      f"the repository, e.g. build/outputs/app.apk; the job gave {shown(value)}")
    return value


def publish_headers(runtime: Runtime, ctx: JobContext, commit: str) -> dict:
    """x-artifact-* headers from the job's app object; without app.name, no publish."""
    app = ctx.spec.get("app") if isinstance(ctx.spec.get("app"), dict) else {}
    if not app.get("name"):
        return {}
    values = {"x-artifact-app": app.get("name"), "x-artifact-build": app.get("build") or
              commit[:12], "x-artifact-platform": app.get("platform") or
              runtime.descriptor.get("platform")}
    headers = {}
    for header, value in values.items():
        if value is None:
            continue
        if not isinstance(value, str) or not (value.isascii() and value.isprintable()) \
                or len(value) > 200:
            raise Refusal(f"app fields must be printable ASCII of at most 200 characters for "
                          f"{header}; the job gave {shown(value)}")
        headers[header] = value
    return headers


def git_env() -> dict:
    # No prompts (a job must not hang on a password), and only these transports, submodules too.
    return dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ALLOW_PROTOCOL="https:ssh:file",
                GCM_INTERACTIVE="never")


def git(runtime: Runtime, ctx: JobContext, args: list[str], timeout: float) -> str:
    argv = [runtime.tools["git"], *args]
    result = run_cmd(argv, timeout=timeout, env=git_env(), cwd=ctx.workdir)
    ctx.check()
    if not result.ok:
        raise Refusal("git {} failed: {}".format(args[0] if args[0] != "-C" else args[2],
                                                 tail(result.err or result.out, 300)))
    return result.out.strip()


def checkout_ref(runtime: Runtime, ctx: JobContext, repo: str, ref: str, dest: str,
                 timeout: float) -> str:
    """Clone `repo` into dest and check out `ref` (branch, tag or commit); its commit hash."""
    git(runtime, ctx, ["clone", "--quiet", "--no-checkout", "--", repo, dest], timeout)
    for candidate in (ref, "origin/" + ref):
        result = run_cmd([runtime.tools["git"], "-C", dest, "rev-parse", "--verify", "--quiet",
                          candidate + "^{commit}"], timeout=60, env=git_env())
        if result.ok and re.match(r"^[0-9a-f]{40,64}$", result.out.strip()):
            commit = result.out.strip()
            git(runtime, ctx, ["-C", dest, "checkout", "--quiet", "--detach", commit], timeout)
            return commit
    raise Refusal(f"params.ref {shown(ref)} is not a branch, tag or commit of {repo}")


def find_build_output(ctx: JobContext, checkout: str, pattern: str) -> str:
    """The one file (or folder, zipped) params.app names inside the checkout."""
    root = os.path.realpath(checkout)
    matches = [m for m in sorted(glob.glob(os.path.join(root, pattern)))
               if os.path.realpath(m).startswith(root + os.sep)]
    if not matches:
        raise Refusal(f"the build produced nothing at params.app {shown(pattern)}")
    if len(matches) > 1:
        names = ", ".join(os.path.relpath(m, root) for m in matches[:5])
        raise Refusal(f"params.app {shown(pattern)} matches {len(matches)} paths ({names}); "
                      "name one")
    found = matches[0]
    if not os.path.isdir(found):
        return found
    archive = os.path.join(ctx.workdir, os.path.basename(found) + ".zip")
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as bundle:
        for current, dirs, files in os.walk(found):  # symlinks are left out: they could
            dirs.sort()                              # point at this machine's own files
            for name in sorted(files):
                path = os.path.join(current, name)
                if not os.path.islink(path):
                    bundle.write(path, os.path.relpath(path, os.path.dirname(found)))
    return archive


def run_build(ctx: JobContext, commands: list[list[str]], checkout: str, timeout: float
              ) -> tuple[int | None, float, str]:
    """Each command in turn, output into one log; (exit code of the last, wall ms, log path)."""
    log_path = os.path.join(ctx.workdir, "build.log")
    started, code = time.monotonic(), 0
    for argv in commands:
        part = log_path + ".part"
        left = timeout - (time.monotonic() - started)
        code, _, _ = run_watched(argv, ctx, max(left, 1.0), part, cwd=checkout)
        with open(log_path, "ab") as out, open(part, "rb") as src:
            out.write(("$ " + " ".join(shlex.quote(a) for a in argv) + "\n").encode())
            shutil.copyfileobj(src, out)
        ctx.check()
        if code != 0:
            break
    return code, (time.monotonic() - started) * 1000, log_path


def build_plan(runtime: Runtime, ctx: JobContext) -> dict:
    kind = build_kind(runtime, ctx)
    repo = check_repo(ctx.params.get("repo"))
    if not repo_allowed(repo, load_build_repos(build_repos_path(runtime.cfg, runtime.state_dir))):
        raise Refusal(f"refused: {repo} is not in this machine's --build-repos list; its owner "
                      "must add it there first")
    ref = ctx.params.get("ref", "HEAD")
    if not isinstance(ref, str) or not GIT_REF.fullmatch(ref) or ".." in ref:
        raise Refusal(f"params.ref must be a branch, tag or commit name; the job gave "
                      f"{shown(ref)}")
    return {"kind": kind, "repo": repo, "ref": ref,
            "task": build_task(kind, ctx.params.get("task")),
            "app": check_app_path(ctx.params.get("app")),
            "timeout_s": int_param(ctx.params, "timeout_s", 3600, 1, 86400)}


def wl_build(runtime: Runtime, ctx: JobContext) -> dict:
    plan = build_plan(runtime, ctx)
    checkout = os.path.join(ctx.workdir, "src")
    started = time.monotonic()
    commit = checkout_ref(runtime, ctx, plan["repo"], plan["ref"], checkout, plan["timeout_s"])
    check_build_outputs(plan["task"], checkout)
    clone_ms = round((time.monotonic() - started) * 1000, 1)
    headers = publish_headers(runtime, ctx, commit)
    ctx.post(ctx.row(1, True, {"duration_ms": clone_ms}, phase="clone", commit=commit))
    tool = runtime.tools[BUILD_TOOLCHAINS[plan["kind"]][0]]
    commands = build_commands(plan["kind"], tool, plan["task"], checkout)
    code, build_ms, log_path = run_build(ctx, commands, checkout, plan["timeout_s"])
    log_tail = tail(read_tail(log_path, 64 << 10).decode("utf-8", "replace"), BUILD_LOG_TAIL)
    log_sha = upload_file(ctx, log_path, f"build-{ctx.job_id}.log")
    error = None if code == 0 else (f"the {plan['kind']} build exited with status {code}"
                                    if code is not None else "the build was stopped after the "
                                    f"{plan['timeout_s']} s timeout")
    metrics = {"clone_ms": clone_ms, "build_ms": round(build_ms, 1)}
    ctx.post(ctx.row(2, code == 0, {"duration_ms": metrics["build_ms"]}, phase="build",
                     error=error, log_tail=log_tail, artifacts=[log_sha]))
    if error:
        return final(False, error, metrics, [log_sha], commit=commit, log_tail=log_tail)
    output = find_build_output(ctx, checkout, plan["app"])
    metrics["size_mb"] = round(os.path.getsize(output) / 2**20, 3)
    app_sha = upload_file(ctx, output, os.path.basename(output), headers)
    ctx.post(ctx.row(3, True, {"size_mb": metrics["size_mb"]}, phase="artifact",
                     sha256=app_sha, artifacts=[app_sha]))
    app = {"sha256": app_sha, **{k.split("-")[-1]: v for k, v in headers.items()}}
    return final(True, None, metrics, [app_sha, log_sha], commit=commit, app=app,
                 log_tail=log_tail)


# --- what this machine declares, and why ---


def workload_capabilities(tools: dict, build_repos: list[str]) -> list[tuple[str, str]]:
    """(capability, what makes it possible) for the workloads of this section."""
    found = []
    for workload, backends in WORKLOAD_BACKENDS.items():
        for backend, needs in backends.items():
            if all(tools.get(t) for t in needs):
                found.append((f"{workload}:{backend}",
                              ", ".join(tools[t] for t in needs) or "built in"))
    found += [(workload, "standard library") for workload in STDLIB_WORKLOADS]
    converters = [tools[t] for t in CONVERT_TOOLS if tools.get(t)]
    if converters:
        found.append(("model-convert", ", ".join(converters)))
    if tools.get("git") and build_repos:
        for kind, (key, _, _) in BUILD_TOOLCHAINS.items():
            if tools.get(key):
                found.append((f"build:{kind}", "{}, {}; {} allowed repositories".format(
                    tools["git"], tools[key], len(build_repos))))
    return found


def missing_capabilities(tools: dict, build_repos: list[str]) -> list[tuple[str, str]]:
    """(capability, what it would need) for what this machine does not declare."""
    missing = []
    for workload, backends in WORKLOAD_BACKENDS.items():
        for backend, needs in backends.items():
            absent = [t for t in needs if not tools.get(t)]
            if absent:
                missing.append((f"{workload}:{backend}", "needs " + ", ".join(
                    f"{t} (--{t})" for t in absent)))
    if not any(tools.get(t) for t in CONVERT_TOOLS):
        missing.append(("model-convert", "needs llama-quantize or convert_hf_to_gguf.py"))
    for kind, (key, _, _) in BUILD_TOOLCHAINS.items():
        absent = [t for t in ("git", key) if not tools.get(t)]
        if absent or not build_repos:
            missing.append((f"build:{kind}", "needs " + ", ".join(
                absent + ([] if build_repos else ["a repository in --build-repos"]))))
    return missing


def explicit_device_tools(cfg: argparse.Namespace) -> dict:
    """--llama-cli and friends, else FLEET_LLAMA_CLI and friends."""
    return {key: getattr(cfg, key.replace("-", "_"), None)
            or os.environ.get("FLEET_" + key.upper().replace("-", "_"))
            for key in DEVICE_TOOL_KEYS}


def capability_reasons(runtime: Runtime) -> list[tuple[str, str]]:
    """Runtime.capabilities(), each with what makes it possible on this machine."""
    if runtime.mode == "host":
        return host_capability_reasons(runtime.tools)
    why = {"self-check": "built in", "benchmark:synthetic": "built in",
           "benchmark:llama.cpp": str(runtime.tools.get("llama-bench")),
           "shell": f"scripts pinned in {runtime.allowlist_path}"}
    why.update(workload_capabilities(runtime.tools, load_build_repos(
        build_repos_path(runtime.cfg, runtime.state_dir))))
    return [(cap, why.get(cap, "")) for cap in runtime.capabilities()]


def describe(runtime: Runtime) -> str:
    """What `--describe` prints: the descriptor and the capabilities, each with its reason."""
    lines = [f"fleet_agent {AGENT_VERSION}, {runtime.mode} mode, id {runtime.reporter_id}", "",
             "descriptor:"]
    lines += [f"  {key:<10} {'(unknown)' if value is None else value}"
              for key, value in sorted(runtime.descriptor.items())] or [
        "  (none: an executor is not a device; the devices attached to it are registered)"]
    lines += ["", "capabilities it declares:"]
    lines += [f"  {cap:<28} {reason}" for cap, reason in capability_reasons(runtime)]
    if runtime.mode == "host":
        lines += ["", "not declared on this machine:"]
        lines += [f"  {cap:<28} {reason}" for cap, reason in host_missing(runtime.tools)]
        lines += ["", "attached devices:"]
        # A model is what the device calls itself: escaped, so it cannot move the terminal's
        # cursor or forge a line of this listing.
        lines += [f"  {t['device_id']:<28} {t['platform']}, "
                  f"{printable(t.get('model') or 'unknown model', 100)}"
                  for t in attached_targets(runtime)] or ["  (none)"]
    if runtime.mode == "device":
        missing = missing_capabilities(runtime.tools, load_build_repos(
            build_repos_path(runtime.cfg, runtime.state_dir)))
        if not runtime.tools.get("llama-bench"):
            missing.insert(0, ("benchmark:llama.cpp", "needs llama-bench (--llama-bench)"))
        if "shell" not in runtime.capabilities():
            missing.insert(1, ("shell", f"needs a SHA-256 pinned in {runtime.allowlist_path}"))
        lines += ["", "not declared on this machine:"]
        lines += [f"  {cap:<28} {reason}" for cap, reason in missing]
    return "\n".join(lines)


DEVICE_WORKLOADS = {"self-check": wl_self_check, "benchmark": wl_benchmark, "shell": wl_shell,
                    "thermal": wl_thermal, "batch": wl_batch, "pipeline": wl_pipeline,
                    "vision-eval": wl_vision_eval, "speech-eval": wl_speech_eval,
                    "embed-eval": wl_embed_eval, "vantage": wl_vantage,
                    "model-convert": wl_model_convert, "dataset-prep": wl_dataset_prep,
                    "serve": wl_serve, "build": wl_build, "llm-eval": wl_llm_eval}


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
        log.warning("adb devices -l failed: %s", printable(tail(result.err or result.out, 200)))
        return []
    targets = []
    for line in result.out.splitlines():
        words = line.split()
        if len(words) < 2 or words[1] != "device" or line.startswith("List of devices"):
            continue
        props = dict(w.split(":", 1) for w in words[2:] if ":" in w)
        if drivable(words[0], "adb"):
            targets.append({"device_id": words[0], "platform": "android",
                            "model": props.get("model", "").replace("_", " ") or None,
                            "emulator": words[0].startswith("emulator-")})
    return targets


def drivable(device_id: object, tool: str) -> bool:
    """Whether an id a device gave for itself can be driven: the device chose it, and it
    becomes an argument of adb, simctl and the flow runner (where a leading - is an option),
    the id its rows and registration are filed under, and part of artifact names and log
    lines; so it must be a device id the collector takes (letters, digits and . _ : @ -)."""
    problem = id_problem(device_id)
    if problem:
        shown_id = printable(device_id, 100)
        warn_once(f"{tool} id {shown_id}", "%s lists a device as '%s', which is not driven: %s",
                  tool, shown_id, problem)
    return problem is None


def simulator_list(xcrun: str) -> dict:
    """{runtime id: [device, ...]} from `xcrun simctl list -j devices`; {} when its output is
    not of that shape (too deep to read included), so no odd answer raises."""
    result = run_cmd([xcrun, "simctl", "list", "-j", "devices"], timeout=30)
    try:
        runtimes = json.loads(result.out).get("devices", {}) if result.ok else {}
    except (ValueError, AttributeError, RecursionError):
        return {}
    if not isinstance(runtimes, dict):
        return {}
    return {key: [d for d in devices if isinstance(d, dict)]
            for key, devices in runtimes.items() if isinstance(devices, list)}


def simulator_targets(xcrun: str | None) -> list[dict]:
    """Booted simulators from `xcrun simctl list -j devices`."""
    if not xcrun:
        return []
    targets = []
    for runtime_id, devices in sorted(simulator_list(xcrun).items()):
        platform_name = next((p for key, p in SIM_PLATFORMS if key in runtime_id), None)
        for device in devices:
            if platform_name and device.get("state") == "Booted" and drivable(
                    device.get("udid"), "simctl"):
                name = device.get("name")
                targets.append({"device_id": device["udid"], "platform": platform_name,
                                "model": name if isinstance(name, str) else None,
                                "emulator": True, "os": simulator_os(runtime_id)})
    return targets


def simulator_os(runtime_id: str) -> str | None:
    """'iOS 17.2' from com.apple.CoreSimulator.SimRuntime.iOS-17-2."""
    match = re.search(r"SimRuntime\.([A-Za-z]+)-(\d+(?:-\d+)*)$", runtime_id)
    return f"{match.group(1)} {match.group(2).replace('-', '.')}" if match else None


def attached_targets(runtime: Runtime) -> list[dict]:
    """Every device this executor drives right now: Android over adb, booted simulators.

    An id listed twice (two devices sharing a serial: `adb -s` refuses to choose, and their
    rows could not be told apart) and a device calling itself by the executor's own name (its
    rows would be filed as the executor's, and a drain pinned to that name drains this
    machine) are left out, with a warning."""
    found = android_targets(runtime.tools.get("adb")) + simulator_targets(
        runtime.tools.get("xcrun"))
    counts = collections.Counter(t["device_id"] for t in found)
    for device_id, count in counts.items():
        if count > 1:
            warn_once(f"twin {device_id}", "%d attached devices call themselves %s; none of "
                      "them is driven, as they cannot be told apart", count, device_id)
        if device_id == runtime.reporter_id:
            warn_once(f"own name {device_id}", "an attached device calls itself %s, this "
                      "executor's own name; it is not driven", device_id)
    return [t for t in found if counts[t["device_id"]] == 1
            and t["device_id"] != runtime.reporter_id]


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
    attached = attached_targets(runtime)
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


# A model folder or an .app bundle holds far fewer files; each member is a file made on the disk.
MAX_ZIP_MEMBERS = 100_000
# The most bytes of member list (the zip's central directory) read: a hundred thousand members
# with long paths take a fraction of it.
MAX_ZIP_DIRECTORY_BYTES = 64 << 20
_ZIP_END = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_END = b"PK\x06\x06"


def zip_directory_size(path: str) -> tuple[int, int] | None:
    """(members, bytes of member list) that a zip's end record declares, found as zipfile finds
    it (the last 22 bytes, else the last signature within a comment's reach, then the zip64
    record it points to); None when there is none (zipfile then refuses the file itself)."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        reach = min(size, 22 + 0xFFFF + 20)
        fh.seek(size - reach)
        tail = fh.read(reach)
        at = len(tail) - 22
        if not (at >= 0 and tail[at:at + 4] == _ZIP_END and tail[-2:] == b"\0\0"):
            at = tail.rfind(_ZIP_END)
        if at < 0 or len(tail) - at < 22:
            return None
        members, directory = struct.unpack("<HI", tail[at + 10:at + 16])
        locator = at - 20
        if (members == 0xFFFF or directory == 0xFFFFFFFF) and locator >= 0 \
                and tail[locator:locator + 4] == _ZIP64_LOCATOR:
            (record_at,) = struct.unpack("<Q", tail[locator + 8:locator + 16])
            fh.seek(min(record_at, size))
            record = fh.read(56)
            if record[:4] == _ZIP64_END and len(record) == 56:
                members, directory = struct.unpack("<QQ", record[32:48])
    return members, directory


def open_zip(path: str) -> zipfile.ZipFile:
    """zipfile.ZipFile(path), once its end record declares at most MAX_ZIP_MEMBERS members in
    a member list of at most MAX_ZIP_DIRECTORY_BYTES. ZipFile reads the whole list into memory
    before anything can count it: 235 MB of zip listing one empty member 5 million times took
    1.8 GB and 49 s of CPU, which no cancel could stop. ZipFile reads no more of the list than
    the end record declares, so a record that lies only makes the list look broken."""
    declared = zip_directory_size(path)
    if declared is not None:
        members, directory = declared
        if members > MAX_ZIP_MEMBERS:
            raise Refusal(f"the archive has {members} members; the agent unpacks at most "
                          f"{MAX_ZIP_MEMBERS}")
        if directory > MAX_ZIP_DIRECTORY_BYTES:
            raise Refusal(f"the archive's member list is {directory} bytes; the agent reads "
                          f"at most {MAX_ZIP_DIRECTORY_BYTES}")
    return zipfile.ZipFile(path)


def safe_unzip(archive: str, dest: str, limit: int = MAX_ARTIFACT_BYTES, check=None) -> None:
    """Unpack a zip into `dest`, refusing it before anything is written when a member's path
    leaves `dest`, when it has more than MAX_ZIP_MEMBERS members, or when the sizes its members
    declare add up past `limit` (the download limit of the artifact it came as) or into the
    disk's last DOWNLOAD_FREE_RESERVE bytes: a few MB of zip can declare terabytes of zeros.
    `check` (a job's) is called between chunks, so a cancel stops a long unpack."""
    with open_zip(archive) as bundle:
        members = bundle.infolist()
        if len(members) > MAX_ZIP_MEMBERS:
            raise Refusal(f"the archive has {len(members)} members; the agent unpacks at most "
                          f"{MAX_ZIP_MEMBERS}")
        root = os.path.realpath(dest)
        for member in members:
            resolved = os.path.realpath(os.path.join(root, member.filename))
            if not resolved.startswith(root + os.sep):
                raise Refusal(f"the archive contains an unsafe path ({member.filename})")
        declared = sum(member.file_size for member in members)
        try:
            download_room(root, declared, limit)
            unpack_members(bundle, members, root, limit, check)
        except NoRoom as exc:
            raise Refusal(f"the archive unpacks to {declared} bytes in {len(members)} files, "
                          f"so it was not unpacked: {exc}") from None
        except (zipfile.BadZipFile, OSError) as exc:
            raise Refusal(f"the archive could not be unpacked: {exc}") from None


def unpack_members(bundle: zipfile.ZipFile, members: list[zipfile.ZipInfo], root: str,
                   limit: int, check) -> None:
    """Write the members (their paths checked by safe_unzip) under root, keeping the disk's
    reserve free as a download does, as the disk may fill while the archive is unpacked."""
    written = 0
    for member in members:
        target = os.path.join(root, member.filename)
        if member.is_dir():
            os.makedirs(target, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as out:
            for chunk in member_chunks(bundle, member, check):
                written += len(chunk)
                download_room(root, written, limit, len(chunk))
                out.write(chunk)


def member_chunks(bundle: zipfile.ZipFile, member: zipfile.ZipInfo, check):
    """A member's bytes up to the size it declares and no further, so a header that lies cannot
    make the unpacking write more than the total safe_unzip checked: one that holds more is
    refused, not cut."""
    copied = 0
    with bundle.open(member) as source:
        while True:
            if check is not None:
                check()
            chunk = source.read(min(DOWNLOAD_CHUNK, member.file_size - copied + 1))
            if not chunk:
                return
            copied += len(chunk)
            if copied > member.file_size:
                raise Refusal(f"the archive's member {member.filename} holds more than the "
                              f"{member.file_size} bytes it declares")
            yield chunk


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
    if not HEX64.fullmatch(sha.lower()):
        raise Refusal(f"app.sha256 must be the SHA-256 of a build artifact; got {sha!r}")
    if platform_name == "android":
        return ctx.fetch(sha, ".apk")
    archive = ctx.fetch(sha, ".zip")
    unpacked = os.path.join(ctx.workdir, "app-" + sha[:12])
    if not os.path.isdir(unpacked):
        os.makedirs(unpacked, mode=0o700)
        try:
            safe_unzip(archive, unpacked, check=ctx.check)
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
    flows = suite.get("flows")  # none: the tool's own default
    flows = flow_inside(ctx, flows, "suite.flows") if flows not in (None, "") else ""
    argv = [tool, "--platform", target["platform"], "--device", target["device_id"],
            "--flows", flows, "--report", report]
    name = app_name_arg(ctx)
    if name:
        argv += ["--app-name", name]
    return argv


def app_name_arg(ctx: JobContext) -> str | None:
    """app.name as the flow runner's --app-name value, or None without one. A value that
    begins with '-' would be read by the tool as an option of its own, so it is refused."""
    app = ctx.spec.get("app") if isinstance(ctx.spec.get("app"), dict) else {}
    name = app.get("name")
    if name in (None, ""):
        return None
    if not isinstance(name, str) or name.startswith("-") or not name.isprintable():
        raise Refusal(f"app.name must be text that does not begin with '-'; the job gave "
                      f"{shown(name)}")
    return name


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
LAUNCH_TIMEOUT_S = 120  # for `am start -W`: no launch it measures can take longer


def device_count(digits: str, most: int) -> int | None:
    """A whole number a device printed (digits, as a pattern matched them), or None past
    `most`. The device chooses how many digits: int() of thousands of them raises, and float()
    of a few hundred is inf, which no JSON row carries (the collector refuses the row)."""
    return int(digits) if len(digits) <= len(str(most)) and int(digits) <= most else None


def android_component(adb: str, serial: str, app_id: str) -> str:
    result = run_cmd(adb_shell_argv(adb, serial, "cmd", "package", "resolve-activity",
                                    "--brief", app_id), timeout=30)
    lines = [line.strip() for line in result.out.splitlines() if "/" in line]
    if not result.ok or not lines:
        raise Refusal(f"{app_id} has no launchable activity on {serial}")
    return lines[-1]


def android_launch_ms(adb: str, serial: str, app_id: str, component: str, state: str) -> float:
    # cold: no process; warm: process alive, activity gone (back); hot: activity backgrounded.
    prepare = {"cold": ["am", "force-stop", app_id],
               "warm": ["input", "keyevent", "KEYCODE_BACK"],
               "hot": ["input", "keyevent", "KEYCODE_HOME"]}[state]
    run_cmd(adb_shell_argv(adb, serial, *prepare), timeout=30)
    result = run_cmd(adb_shell_argv(adb, serial, "am", "start", "-W", "-n", component),
                     timeout=LAUNCH_TIMEOUT_S)
    match = re.search(r"TotalTime:\s*(\d+)", result.out)
    if not result.ok or not match:
        said = tail(result.out + result.err, 200)
        raise Refusal(f"am start on {serial} printed no TotalTime: {said}")
    total = device_count(match.group(1), LAUNCH_TIMEOUT_S * 1000)
    if total is None:
        raise Refusal(f"am start on {serial} printed TotalTime {clip(match.group(1), 20)}, "
                      f"which is no launch time: it waits at most {LAUNCH_TIMEOUT_S} s")
    return float(total)


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
    if not isinstance(app_id, str) or not re.fullmatch(r"^[A-Za-z0-9._-]+$", app_id):
        raise Refusal("params.app_id must be an application id such as com.example.app")
    launches = int_param(ctx.params, "launches", 5, 1, 200)
    states = ctx.params.get("states") or ["cold"]
    if not isinstance(states, list) or not states or any(s not in LAUNCH_STATES for s in states):
        raise Refusal("params.states must be a list of cold, warm and hot")
    target = select_targets(runtime, ctx.spec)[0]
    serial = target["device_id"]
    if target["platform"] == "android":
        component = android_component(runtime.tools["adb"], serial, app_id)
        run_cmd(adb_shell_argv(runtime.tools["adb"], serial, "am", "start", "-W", "-n",
                               component), timeout=120)  # unmeasured: makes warm/hot possible

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


# What a web job's URL keeps as it is once checked: RFC 3986's unreserved and reserved characters
# and %. Anything else (quotes, backticks, <>, \\, ^, {|}, letters beyond ASCII) is percent-encoded,
# as a browser sends it anyway. A URL also reaches a phone's shell (android-device), where it is
# quoted as well: the encoding keeps what the browser is given plain, the quoting keeps sh out.
URL_KEPT = "-._~:/?#[]@!$&'()*+,;=%"
# A host spelled plainly: a browser decodes a percent-encoded one (127.0.0.%31 is 127.0.0.1) that
# this machine's resolver, which checks it first, would not.
URL_HOST = re.compile(r"^[A-Za-z0-9._:-]{1,253}$")


def web_url(spec: dict) -> str:
    targets = spec.get("targets") if isinstance(spec.get("targets"), dict) else {}
    url = targets.get("url") or (spec.get("params") or {}).get("url")
    # Only the web: file:// or chrome:// would let a job read this machine's files.
    if not isinstance(url, str) or not re.match(r"^https?://", url):
        raise Refusal("web jobs need targets.url starting with http:// or https://")
    url = check_url(url, "targets.url")
    host = urllib.parse.urlsplit(url).hostname or ""
    if not URL_HOST.fullmatch(host):
        raise Refusal(f"targets.url: the host {shown(host)} must be a DNS name (its xn-- form "
                      "for letters beyond ASCII) or an IP address")
    return urllib.parse.quote(url, safe=URL_KEPT)


BROWSER_LOOKUP_S = 10.0  # the look before a web job opens its page (the guard looks again)


def browser_may_open(runtime: Runtime, url: str, ctx: JobContext | None = None) -> None:
    """Refuse a web job whose host resolves here to an address address_allowed refuses, unless
    the owner passed --allow-private-urls: every address the name has must be allowed.

    A name this machine cannot resolve, or not within BROWSER_LOOKUP_S, is left to the
    browser: Chromium reaches nothing through its BrowserGuard that the guard cannot resolve
    and check, and a phone resolves on its own. The job's stop ends the look (see lookup)."""
    if getattr(runtime.cfg, "allow_private_urls", False):
        return
    parts = urllib.parse.urlsplit(url)
    try:
        infos = lookup(parts.hostname or "", parts.port or (
            443 if parts.scheme == "https" else 80),
            WebLimit(BROWSER_LOOKUP_S, BROWSER_LOOKUP_S, ctx))
    except (OSError, UnicodeError):
        return
    for info in infos:
        if not address_allowed(str(info[4][0]), False):
            raise Refusal(f"{parts.hostname} resolves to {info[4][0]}, a private or local "
                          "address; the agent's owner can allow those with "
                          "--allow-private-urls")


# --- what a job's browser may reach ---
#
# web-test, web-shots and web-audit load the page a job names in this machine's Chromium and
# send back what it showed, so what the page makes the browser fetch (redirects, frames, images,
# scripts' fetch() and WebSockets) must keep to the addresses vantage and web-unfurl may reach.
# Unless the owner passed --allow-private-urls, Chromium is started with a BrowserGuard as its
# proxy for every request, loopback too: the guard resolves each target itself, connects only to
# an address address_allowed admits (the address it checked, so a name cannot resolve elsewhere
# in between) and answers anything else 403. The browser itself then resolves no name.

GUARD_HEAD_BYTES = 256 << 10  # the most a request's or a response's line and headers may take
GUARD_CHUNK = 64 << 10
GUARD_CONNECT_S = 30.0
GUARD_IDLE_S = 120.0  # a connection with no bytes either way for this long is closed
GUARD_HOP_HEADERS = (b"connection", b"proxy-connection", b"keep-alive", b"proxy-authorization")
MAX_GUARD_REFUSED = 20


class BrowserGuard:
    """A forward HTTP proxy (plain requests and CONNECT) on 127.0.0.1 for one browser run."""

    def __init__(self) -> None:
        self.refused: list[str] = []  # the host:port of refused requests, each once
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        self.closed = False
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.bind(("127.0.0.1", 0))
            self.listener.listen(64)
            self.listener.setblocking(False)
            self.wake_read, self.wake_write = socket.socketpair()
        except OSError:
            self.listener.close()
            raise
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, name="browser-guard", daemon=True).start()

    def flags(self) -> list[str]:
        return [f"--proxy-server=http://127.0.0.1:{self.port}",
                # Chromium sends localhost, 127.0.0.1 and [::1] past any proxy unless told not to
                "--proxy-bypass-list=<-loopback>",
                # WebRTC's UDP and QUIC would go around the proxy
                "--force-webrtc-ip-handling-policy=disable_non_proxied_udp", "--disable-quic"]

    def close(self) -> None:
        with self.lock:
            self.closed = True
            left = list(self.open)
        with contextlib.suppress(OSError):
            self.wake_write.send(b"x")
        for sock in left:  # their threads close them; shutdown wakes their waits
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _keep(self, sock: socket.socket) -> bool:
        with self.lock:
            if not self.closed:
                self.open.add(sock)
            return not self.closed

    def _drop(self, sock: socket.socket | None) -> None:
        if sock is not None:
            with self.lock:
                self.open.discard(sock)
            sock.close()

    def _accept(self) -> None:
        with selectors.DefaultSelector() as watch:
            watch.register(self.listener, selectors.EVENT_READ)
            watch.register(self.wake_read, selectors.EVENT_READ)
            while not any(key.fileobj is self.wake_read for key, _ in watch.select()):
                try:
                    client, _ = self.listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as exc:  # out of descriptors: the browser gets no more answers
                    log.warning("the browser's guard stopped taking connections: %s", exc)
                    break
                if not self._keep(client):
                    client.close()
                    break
                threading.Thread(target=self._serve, args=(client,), daemon=True).start()
        for sock in (self.listener, self.wake_read, self.wake_write):
            sock.close()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            client.setblocking(True)
            client.settimeout(GUARD_IDLE_S)
            head, rest = guard_read_head(client)
            lines = head.split(b"\r\n")
            method, target, version = lines[0].decode("latin-1").split(" ")
            connect = method == "CONNECT"
            parts = urllib.parse.urlsplit(("//" if connect else "") + target)
            if not parts.hostname or (not connect and parts.scheme != "http"):
                guard_answer(client, "400 Bad Request", f"{target} is not a proxy request")
                return
            port = parts.port or (443 if connect else 80)
            upstream = self._connect(client, parts.hostname, port)
            if upstream is None:
                return
            if connect:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                upstream.sendall(rest)
            else:
                path = (parts.path or "/") + ("?" + parts.query if parts.query else "")
                kept = [line for line in lines[1:] if line and line.split(b":", 1)[0].strip()
                        .lower() not in GUARD_HOP_HEADERS]
                upstream.sendall(b"\r\n".join([
                    f"{method} {path} {version}".encode("latin-1"), *kept,
                    b"Connection: close", b"", b""]) + rest)
                # The answer says close too: a kept-alive proxy connection would carry the
                # browser's next request, for any host, to this upstream.
                head, rest = guard_read_head(upstream)
                lines = head.split(b"\r\n")
                kept = [line for line in lines[1:] if line.split(b":", 1)[0].strip()
                        .lower() not in GUARD_HOP_HEADERS]
                client.sendall(b"\r\n".join([lines[0], *kept, b"Connection: close",
                                             b"Proxy-Connection: close", b"", b""]) + rest)
            guard_relay(client, upstream)
        except (OSError, ValueError, UnicodeError):
            pass  # the browser sees the connection close, as it would a server's
        finally:
            self._drop(upstream)
            self._drop(client)

    def _connect(self, client: socket.socket, host: str, port: int) -> socket.socket | None:
        """A connection to an allowed address of host, or None with the browser answered."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            guard_answer(client, "502 Bad Gateway", f"{host} does not resolve")
            return None
        allowed = [info for info in infos if address_allowed(str(info[4][0]), False)]
        if not allowed:
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            with self.lock:
                if len(self.refused) < MAX_GUARD_REFUSED and target not in self.refused:
                    self.refused.append(target)
            log.info("the browser's guard refused %s:%s (%s)", host, port, infos[0][4][0])
            guard_answer(client, "403 Forbidden",
                         f"fleet_agent refused {host}:{port}: it resolves to {infos[0][4][0]}, "
                         "a private or local address (the agent's owner can allow those with "
                         "--allow-private-urls)")
            return None
        try:
            upstream = connect_first(allowed, GUARD_CONNECT_S)
        except OSError as exc:
            guard_answer(client, "502 Bad Gateway", f"{host}:{port} did not answer ({exc})")
            return None
        if not self._keep(upstream):
            upstream.close()
            return None
        upstream.settimeout(GUARD_IDLE_S)
        return upstream


def guard_read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """(request or status line with the headers, the bytes read past them)."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > GUARD_HEAD_BYTES:
            raise ValueError("the head is too large")
        chunk = sock.recv(GUARD_CHUNK)
        if not chunk:
            raise ValueError("closed before the end of its head")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    return head, rest


def guard_answer(sock: socket.socket, status: str, text: str) -> None:
    body = (text + "\n").encode("utf-8")
    sock.sendall(f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n"
                 "Proxy-Connection: close\r\n\r\n".encode("ascii") + body)


def guard_relay(one: socket.socket, other: socket.socket) -> None:
    """Bytes both ways until either side closes, or neither sends for GUARD_IDLE_S."""
    with selectors.DefaultSelector() as watch:
        watch.register(one, selectors.EVENT_READ, other)
        watch.register(other, selectors.EVENT_READ, one)
        while True:
            ready = watch.select(GUARD_IDLE_S)
            if not ready:
                return
            for key, _ in ready:
                data = key.fileobj.recv(GUARD_CHUNK)  # type: ignore[union-attr]
                if not data:
                    return
                key.data.sendall(data)


@contextlib.contextmanager
def browser_guard(runtime: Runtime):
    """The BrowserGuard of one browser run, or None when the owner allows private URLs."""
    if getattr(runtime.cfg, "allow_private_urls", False):
        yield None
        return
    guard = BrowserGuard()
    try:
        yield guard
    finally:
        guard.close()


def guard_note(guard: BrowserGuard | None) -> str:
    if guard is None or not guard.refused:
        return ""
    return ("the agent refused the page's requests to private or local addresses: "
            + ", ".join(guard.refused))


def requested_browsers(value: object, available: list[str]) -> list[str]:
    if value in (None, "all") or value == ["all"]:
        return list(available)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise Refusal("params.browser must be a browser name, a list of names, or all")


def chromium_argv(runtime: Runtime, ctx: JobContext, profile: str,
                  guard: BrowserGuard | None = None) -> list[str]:
    argv = [runtime.tools["chromium"], "--headless=new", "--disable-gpu", "--no-first-run",
            "--no-default-browser-check", "--hide-scrollbars",
            "--user-data-dir=" + os.path.join(ctx.workdir, "profile-" + profile),
            *(guard.flags() if guard is not None else [])]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--no-sandbox")  # Chromium refuses to start as root otherwise
    return argv


def chromium_page(runtime: Runtime, ctx: JobContext, url: str) -> tuple[str | None, dict, bytes]:
    """(error, metrics, DOM bytes) for one load of `url`."""
    with browser_guard(runtime) as guard:
        result = run_cmd([*chromium_argv(runtime, ctx, "test", guard), "--dump-dom", url],
                         timeout=120)
    metrics = {"load_ms": round(result.ms, 1)}
    if guard is not None:
        metrics["refused_requests"] = len(guard.refused)
    if not result.ok:
        return f"Chromium could not load {url}: {tail(result.err, 200)}", metrics, b""
    if guard_note(guard):  # what the page showed may be the guard's refusal
        return f"{url}: {guard_note(guard)}", metrics, result.raw
    if "<html" not in result.out.lower():
        return f"Chromium loaded {url} but printed no HTML document", metrics, result.raw
    expected = ctx.params.get("expect_text")
    if isinstance(expected, str) and expected not in result.out:
        return f"the page at {url} does not contain {expected!r}", metrics, result.raw
    return None, metrics, result.raw


def wl_web_test(runtime: Runtime, ctx: JobContext) -> dict:
    url = web_url(ctx.spec)
    browser_may_open(runtime, url, ctx)
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
    if not re.fullmatch(r"^\d{2,5}x\d{2,5}$", size):
        raise Refusal("params.viewport must look like 1280x800")
    with browser_guard(runtime) as guard:
        argv = [*chromium_argv(runtime, ctx, "shots", guard), "--screenshot=" + path,
                "--window-size=" + size.replace("x", ","), url]
        result = run_cmd(argv, timeout=120)
    if not result.ok or not os.path.exists(path):
        return f"Chromium could not screenshot {url}: {tail(result.err, 200)}", b""
    with open(path, "rb") as fh:
        return (f"{url}: {guard_note(guard)}" if guard_note(guard) else None), fh.read()


def android_shot(runtime: Runtime, ctx: JobContext, serial: str, url: str, settle_s: float):
    adb = runtime.tools["adb"]
    run_cmd(adb_shell_argv(adb, serial, "am", "start", "-a", "android.intent.action.VIEW",
                           "-d", url), timeout=60)
    # The page renders on the device; there is no load event to wait on. A cancel ends the
    # wait (up to 60 s) rather than waiting it out.
    ctx.stop.wait(settle_s)
    ctx.check()
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
    browser_may_open(runtime, url, ctx)
    available = ["chromium"] if runtime.tools.get("chromium") else []
    browsers = requested_browsers(ctx.params.get("browser"), available)
    settle = float(int_param(ctx.params, "settle_s", 3, 0, 60))
    failures, artifacts = [], []
    for number, (profile, serial) in enumerate(shot_profiles(runtime, browsers), 1):
        ctx.check()
        if profile == "android-device":
            error, png = ("no Android device is attached for the android-device profile", b"") \
                if serial is None else android_shot(runtime, ctx, serial, url, settle)
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


# --- what the longer host workloads share: the app, its flows, launches and screenshots ---
#
# Everything sent to a device through `adb shell` is joined by adb into a command line the
# device's shell reads, so every word is quoted for that shell (adb_shell_argv) and every value
# that goes there (app ids, locales, numbers) is also checked against a narrow pattern first.
# Settings a workload changes on a device (font scale, locale, charging) are put back in a
# `finally`, so a cancel or a failure restores them too.

APP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
# A flow is a file relative to the job's scratch directory, the runner's working directory:
# never an option (-), never absolute (/), no control character (NUL included), and (checked
# apart) no `..` segment; flow_inside then follows links to keep it inside that directory.
FLOW_NAME = re.compile(r"^[A-Za-z0-9_.][^\x00-\x1f\x7f]{0,499}$")
SETTLE_S = 2.0  # after a launch or a flow, before a reading or a screenshot


def app_id_param(ctx: JobContext, required: bool = True) -> str | None:
    value = ctx.params.get("app_id")
    if value is None and not required:
        return None
    if not isinstance(value, str) or not APP_ID.fullmatch(value):
        raise Refusal("params.app_id must be an application id such as com.example.app; the "
                      f"job gave {shown(value)}")
    return value


def flow_name(value: object, field: str) -> str:
    """A flow file (or folder) for the flow runner, as its argument: a relative path that
    stays in the job's directory and is never an option."""
    if not isinstance(value, str) or not FLOW_NAME.fullmatch(value) or ".." in value.split("/"):
        raise Refusal(f"{field} must be a flow file inside the job's directory: a relative "
                      f"path with no .. segment, not starting with - or /; the job gave "
                      f"{shown(value)}")
    return value


def flow_inside(ctx: JobContext, flow: str, field: str) -> str:
    """The flow, once it is sure to resolve (links followed) inside the job's directory."""
    root = os.path.realpath(ctx.workdir)
    place = os.path.realpath(os.path.join(root, flow_name(flow, field)))
    if place != root and not place.startswith(root + os.sep):
        raise Refusal(f"{field} {shown(flow)} leads outside the job's directory")
    return flow


def flow_param(params: dict, name: str = "flow") -> str | None:
    """A flow file for the flow runner, as its argument (see flow_name)."""
    value = params.get(name)
    if value is None:
        return None
    return flow_name(value, f"params.{name}")


def flow_runner(runtime: Runtime, what: str) -> str:
    tool = runtime.tools.get("flow_runner")
    if not tool:
        raise Refusal(f"{what} needs the flow_runner tool, which this executor does not have "
                      "(--flow-runner or FLEET_FLOW_RUNNER)")
    return tool


def run_flow(runtime: Runtime, ctx: JobContext, target: dict, flow: str, name: str
             ) -> str | None:
    """Run one flow on one target with the flow runner (docs/agent.md's suite contract);
    None when every flow in its report passed, else the sentence saying what failed."""
    report = os.path.join(ctx.workdir, name + ".report")
    argv = [flow_runner(runtime, "a flow"), "--platform", target["platform"], "--device",
            target["device_id"], "--flows", flow_inside(ctx, flow, "params.flow"), "--report",
            report]
    app_name = app_name_arg(ctx)
    if app_name:
        argv += ["--app-name", app_name]
    timeout = float(int_param(ctx.params, "flow_timeout_s", 900, 1, 86400))
    code, _, _ = run_watched(argv, ctx, timeout, os.path.join(ctx.workdir, name + ".log"),
                             cwd=ctx.workdir)
    ctx.check()
    if code is None:
        return f"the flow {flow} was stopped after the {timeout:g} s timeout"
    try:
        flows = parse_suite_report(report)
    except (OSError, ValueError) as exc:
        return f"the flow runner exited with status {code} and left no readable report ({exc})"
    failed = [f for f in flows if not f["ok"]]
    if failed:
        return "flow {} failed: {}".format(failed[0]["name"], failed[0]["error"] or "no reason")
    return None if flows else f"the flow runner reported no flows for {flow}"


def launch_app(runtime: Runtime, target: dict, app_id: str) -> str | None:
    """Start the app on a target; None when it started, else why not."""
    serial = target["device_id"]
    if target["platform"] == "android":
        component = android_component(runtime.tools["adb"], serial, app_id)
        result = run_cmd(adb_shell_argv(runtime.tools["adb"], serial, "am", "start", "-W",
                                        "-n", component), timeout=120)
        problem = "Error" in result.out or not result.ok
    else:
        result = run_cmd([runtime.tools["xcrun"], "simctl", "launch", serial, app_id],
                         timeout=120)
        problem = not result.ok
    if problem:
        return f"{app_id} did not start on {serial}: {tail(result.out + result.err, 200)}"
    return None


def drive(runtime: Runtime, ctx: JobContext, target: dict, flow: str | None,
          app_id: str | None, name: str) -> str | None:
    """One pass of the app on a target: the flow when the job names one, else a launch."""
    if flow:
        return run_flow(runtime, ctx, target, flow, name)
    if app_id:
        return launch_app(runtime, target, app_id)
    return None


def screenshot(runtime: Runtime, ctx: JobContext, target: dict) -> bytes:
    """A PNG of the target's screen (a Refusal when it gives none)."""
    serial = target["device_id"]
    if target["platform"] == "android":
        result = run_cmd([runtime.tools["adb"], "-s", serial, "exec-out", "screencap", "-p"],
                         timeout=60)
        data = result.raw
    else:
        path = os.path.join(ctx.workdir, "screen.png")
        result = run_cmd([runtime.tools["xcrun"], "simctl", "io", serial, "screenshot", path],
                         timeout=60)
        data = b""
        if result.ok and os.path.isfile(path):
            with open(path, "rb") as fh:
                data = fh.read(64 << 20)
            os.unlink(path)
    if not data.startswith(b"\x89PNG"):
        raise Refusal(f"the screenshot of {serial} came back without a PNG image")
    return data


def settle(ctx: JobContext, seconds: float) -> None:
    """Wait for the screen to settle, or less when the job is stopped meanwhile."""
    if ctx.stop.wait(seconds):
        ctx.check()


def adb_shell_argv(adb: str, serial: str, *command: str) -> list[str]:
    """`adb -s serial shell` with each word of `command` quoted for the device's sh.

    adb joins the words after `shell` with spaces, unquoted, into the one line the device's sh
    runs, so a word holding ; | & $ ` ( or a space (a URL's query, a `$` in an activity's class
    name) would split the line or run a command of its own on the phone. Quoted, each word
    reaches the command as itself; a plain word (com.example.app, 1.3) is left as it is.
    """
    return [adb, "-s", serial, "shell", *(shlex.quote(word) for word in command)]


def adb_shell(runtime: Runtime, serial: str, *command: str, timeout: float = 30) -> CmdResult:
    return run_cmd(adb_shell_argv(runtime.tools["adb"], serial, *command), timeout=timeout)


def device_targets(runtime: Runtime, ctx: JobContext, what: str,
                   platforms: tuple[str, ...] = ("android", "ios")) -> list[dict]:
    """The attached targets the job selects, each of a platform this workload can drive."""
    chosen = select_targets(runtime, ctx.spec)
    wrong = [t for t in chosen if t["platform"] not in platforms]
    if wrong:
        raise Refusal("{} runs on {} targets; {} is {}".format(
            what, " and ".join(platforms), wrong[0]["device_id"], wrong[0]["platform"]))
    return chosen


# --- app-soak / soak: the app again and again, its memory, crashes and ANRs each pass ---

MEMINFO_PSS = re.compile(r"TOTAL PSS:\s+(\d+)|^\s*TOTAL\s+(\d+)", re.M)
FATAL = re.compile(r"FATAL EXCEPTION: (.*)")
MAX_SOAK_PASSES = 10_000


def soak_plan(ctx: JobContext) -> dict:
    duration = number_param(ctx.params, "duration_s", 3600, 0, 30 * 86400)
    interval = number_param(ctx.params, "interval_s", 60, 1, 86400)
    passes = max(1, int(-(-duration // interval)))
    if passes > MAX_SOAK_PASSES:
        raise Refusal(f"duration_s / interval_s makes {passes} passes; at most "
                      f"{MAX_SOAK_PASSES} are run in one job")
    return {"duration_s": duration, "interval_s": interval, "passes": passes,
            "flow": flow_param(ctx.params), "app_id": app_id_param(ctx)}


def android_memory_mb(runtime: Runtime, serial: str, app_id: str) -> float | None:
    """The app's total PSS from `dumpsys meminfo <package>`, in MB (None: not running)."""
    result = adb_shell(runtime, serial, "dumpsys", "meminfo", app_id)
    match = MEMINFO_PSS.search(result.out) if result.ok else None
    if not match:
        return None
    digits = match.group(1) or match.group(2)
    kilobytes = device_count(digits, 10**12)  # a petabyte
    if kilobytes is None:
        raise Refusal(f"dumpsys meminfo on {serial} printed a total PSS of "
                      f"{clip(digits, 20)} KB, which is no memory reading")
    return round(kilobytes / 1024, 1)


def android_faults(runtime: Runtime, serial: str, app_id: str) -> tuple[list[str], int]:
    """(crash headlines, ANR count) of the app in the device's log since it was last cleared."""
    result = run_cmd([runtime.tools["adb"], "-s", serial, "logcat", "-d", "-b",
                      "main,system,crash", "-v", "brief"], timeout=60)
    lines = result.out.splitlines() if result.ok else []
    crashes = []
    for number, line in enumerate(lines):
        fatal = FATAL.search(line)
        if not fatal:
            continue
        near = " ".join(lines[number + 1:number + 4])
        process = re.search(r"Process: ([^,\s]+)", near)
        if process is None or process.group(1) == app_id:
            detail = re.search(r"(\w+(?:\.\w+)*(?:Exception|Error)[^\n]*)", near)
            crashes.append(clip("FATAL EXCEPTION: " + fatal.group(1).strip() + (
                " (" + detail.group(1).strip() + ")" if detail else ""), 200))
    anrs = sum(1 for line in lines if re.search(r"ANR in " + re.escape(app_id) + r"\b", line))
    return crashes, anrs


def simulator_app_pid(runtime: Runtime, udid: str, app_id: str) -> int | None:
    """The app's process id from the simulator's launchd (UIKitApplication:<id>[...])."""
    result = run_cmd([runtime.tools["xcrun"], "simctl", "spawn", udid, "launchctl", "list"],
                     timeout=30)
    for line in result.out.splitlines() if result.ok else []:
        words = line.split()
        if len(words) >= 3 and words[2].startswith(f"UIKitApplication:{app_id}[") \
                and words[0].isdigit():
            return int(words[0])
    return None


def simulator_memory_mb(pid: int | None) -> float | None:
    """A simulator app is a process of this Mac: its resident set from ps, in MB."""
    if pid is None:
        return None
    result = run_cmd(["ps", "-o", "rss=", "-p", str(pid)], timeout=10)
    value = result.out.strip()
    return round(int(value) / 1024, 1) if result.ok and value.isdigit() else None


def soak_reading(runtime: Runtime, target: dict, app_id: str, pid_after: int | None) -> dict:
    """Memory, crashes and ANRs of the app on one target after a pass. A simulator keeps no
    crash log we can read, so a simulator app that is not running when the pass settles, or
    runs as another process than right after it was driven, counts as a crash."""
    serial = target["device_id"]
    if target["platform"] == "android":
        crashes, anrs = android_faults(runtime, serial, app_id)
        return {"mem_mb": android_memory_mb(runtime, serial, app_id),
                "mem_method": "dumpsys-meminfo-pss", "crash": crashes, "anrs": anrs}
    pid = simulator_app_pid(runtime, serial, app_id)
    crash = []
    if pid is None:
        crash = [f"{app_id} was not running on {serial} after the pass"]
    elif pid_after is not None and pid != pid_after:
        crash = [f"{app_id} on {serial} ran as process {pid_after}, then as {pid}"]
    return {"mem_mb": simulator_memory_mb(pid), "mem_method": "simctl-ps-rss",
            "crash": crash, "anrs": 0}


def soak_pass(runtime: Runtime, ctx: JobContext, plan: dict, target: dict, number: int
              ) -> dict:
    """One pass on one target: clear the log, drive the app, read it; the row's fields."""
    serial, app_id = target["device_id"], plan["app_id"]
    android = target["platform"] == "android"
    if android:
        run_cmd([runtime.tools["adb"], "-s", serial, "logcat", "-c"], timeout=30)
    problem = drive(runtime, ctx, target, plan["flow"], app_id, f"soak-{number}-{serial}")
    pid = None if android else simulator_app_pid(runtime, serial, app_id)
    settle(ctx, min(SETTLE_S, plan["interval_s"] / 4))
    reading = soak_reading(runtime, target, app_id, pid)
    crashes = reading.pop("crash")
    error = "; ".join(crashes) or problem
    metrics = drop_none({"mem_mb": reading["mem_mb"], "mem_method": reading["mem_method"],
                         "crashes": len(crashes), "anrs": reading["anrs"],
                         "errors": len(crashes) + reading["anrs"] + (1 if problem else 0)})
    return {"ok": not crashes and not problem, "metrics": metrics, "error": error,
            "crashed": bool(crashes), "flow_failed": bool(problem)}


def wl_soak(runtime: Runtime, ctx: JobContext) -> dict:
    plan = soak_plan(ctx)
    if plan["flow"]:
        flow_runner(runtime, "a soak with params.flow")
    targets = device_targets(runtime, ctx, "a soak", ("android", "ios"))
    started, rows = time.monotonic(), {t["device_id"]: [] for t in targets}
    crash = None
    for number in range(1, plan["passes"] + 1):
        settle(ctx, max(0.0, started + (number - 1) * plan["interval_s"] - time.monotonic()))
        for index, target in enumerate(targets):
            ctx.check()
            record = soak_pass(runtime, ctx, plan, target, number)
            rows[target["device_id"]].append(record)
            ctx.post(ctx.row((number - 1) * len(targets) + index + 1, record["ok"],
                             record["metrics"], error=record["error"], **{"pass": number},
                             **target_fields(target)))
            if record["crashed"] and crash is None:
                crash = f"the app crashed on pass {number} of {plan['passes']} on " \
                        f"{target['device_id']}: {record['error']}"
        if crash:
            break
    return soak_summary(plan, rows, crash, targets)


def soak_figures(records: list[dict]) -> dict:
    memory = [r["metrics"]["mem_mb"] for r in records if "mem_mb" in r["metrics"]]
    figures = {"passes": len(records),
               "crashes": sum(r["metrics"]["crashes"] for r in records),
               "anrs": sum(r["metrics"]["anrs"] for r in records),
               "flow_failures": sum(1 for r in records if r["flow_failed"])}
    if memory:
        figures.update(mem_first_mb=memory[0], mem_last_mb=memory[-1],
                       mem_peak_mb=max(memory),
                       mem_growth_mb=round(memory[-1] - memory[0], 1))
    return figures


def soak_summary(plan: dict, rows: dict, crash: str | None, targets: list[dict]) -> dict:
    per_device = {serial: soak_figures(records) for serial, records in rows.items()}
    first = per_device[targets[0]["device_id"]]
    metrics = dict(first, passes_planned=plan["passes"])
    metrics["crashes"] = sum(d["crashes"] for d in per_device.values())
    metrics["anrs"] = sum(d["anrs"] for d in per_device.values())
    extra = {"devices": per_device} if len(targets) > 1 else target_fields(targets[0])
    return final(crash is None, crash, metrics, **extra)


# --- a11y-audit: the app's screens under each font variant, small targets and missing labels ---

A11Y_VARIANTS = ("default", "largest")
LARGEST_IOS_SIZE = "accessibility-extra-extra-extra-large"
A11Y_DUMP = "/sdcard/fleet-a11y.xml"
# At most 9 digits a coordinate: the device's XML chooses them, and int() of thousands raises.
BOUNDS = re.compile(r"\[(-?\d{1,9}),(-?\d{1,9})\]\[(-?\d{1,9}),(-?\d{1,9})\]")
MAX_UI_NODES = 20_000
MAX_FINDINGS = 200  # per screen; the count says how many there were
MAX_STEPS = 50


def a11y_steps(params: dict) -> list[dict]:
    """params.steps: flow files (strings) or {"name", "flow"} objects; a step without a flow
    audits the screen as it is. No steps: the app's first screen."""
    steps = params.get("steps")
    if steps is None:
        return [{"name": "launch", "flow": None}]
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_STEPS:
        raise Refusal(f"params.steps must be a list of 1 to {MAX_STEPS} flow files or "
                      f"{{name, flow}} objects; the job gave {shown(steps)}")
    plan = []
    for number, step in enumerate(steps, 1):
        if isinstance(step, str):
            step = {"name": step, "flow": step}
        if not isinstance(step, dict):
            raise Refusal(f"params.steps[{number}] must be a flow file or an object")
        flow = flow_param(step, "flow")
        name = step.get("name", flow or f"step {number}")
        if not isinstance(name, str) or not name or len(name) > 200:
            raise Refusal(f"params.steps[{number}].name must be a short text")
        plan.append({"name": name, "flow": flow})
    return plan


def a11y_plan(ctx: JobContext) -> dict:
    variants = ctx.params.get("variants", ["default"])
    if not isinstance(variants, list) or not variants or \
            any(v not in A11Y_VARIANTS for v in variants):
        raise Refusal("params.variants must be a list of default and largest; the job gave "
                      f"{shown(variants)}")
    return {"steps": a11y_steps(ctx.params), "variants": list(dict.fromkeys(variants)),
            "min_target": number_param(ctx.params, "min_target_pt", 48, 1, 500),
            "font_scale": number_param(ctx.params, "font_scale", 2.0, 0.5, 4.0),
            "app_id": app_id_param(ctx, required=False)}


def android_density(runtime: Runtime, serial: str) -> float:
    """Pixels per inch the UI is laid out for (`wm density`; an override wins)."""
    result = adb_shell(runtime, serial, "wm", "density")
    values = dict(re.findall(r"(Physical|Override) density: (\d+)", result.out))
    density = values.get("Override") or values.get("Physical")
    if not density:
        raise Refusal(f"`wm density` on {serial} printed no density: {tail(result.out, 100)}")
    dpi = device_count(density, 10_000)  # screens are laid out for 120 to 640
    if not dpi:
        raise Refusal(f"`wm density` on {serial} printed {clip(density, 20)}, which is no "
                      "density")
    return float(dpi)


def android_ui_nodes(runtime: Runtime, serial: str) -> list[dict]:
    """The screen's UI tree from uiautomator, flattened (see ui_node)."""
    import xml.etree.ElementTree as ElementTree

    dumped = adb_shell(runtime, serial, "uiautomator", "dump", A11Y_DUMP, timeout=60)
    result = run_cmd([runtime.tools["adb"], "-s", serial, "exec-out", "cat", A11Y_DUMP],
                     timeout=60)
    try:
        # The XML is the device's own uiautomator output, read with a size cap.
        root = ElementTree.fromstring(result.raw[:16 << 20])  # noqa: S314
    except ElementTree.ParseError:
        raise Refusal(f"uiautomator on {serial} gave no readable UI tree: "
                      f"{tail(dumped.out + dumped.err, 200)}") from None
    nodes: list[dict] = []
    stack = [(child, -1) for child in reversed(list(root))]
    while stack and len(nodes) < MAX_UI_NODES:  # depth-first, iteratively: parents first
        element, parent = stack.pop()
        attrs = element.attrib
        nodes.append(ui_node(parent, attrs.get("bounds", ""), attrs.get("class", ""),
                             attrs.get("resource-id", ""),
                             attrs.get("text") or attrs.get("content-desc") or
                             attrs.get("hint") or "",
                             "true" in (attrs.get("clickable"), attrs.get("long-clickable"),
                                        attrs.get("checkable")),
                             "EditText" in attrs.get("class", "")))
        stack += [(child, len(nodes) - 1) for child in reversed(list(element))]
    return nodes


def ui_node(parent: int, bounds: str, kind: str, ident: str, label: str, control: bool,
            editable: bool) -> dict:
    match = BOUNDS.search(bounds or "")
    box = tuple(int(v) for v in match.groups()) if match else (0, 0, 0, 0)
    return {"parent": parent, "bounds": box, "class": kind, "id": ident,
            "label": label.strip(), "control": control or editable, "editable": editable}


def hierarchy_nodes(tree: object) -> list[dict]:
    """The flow runner's --hierarchy JSON ({"attributes", "children"}, Maestro's shape),
    flattened iteratively like the Android tree."""
    nodes: list[dict] = []
    stack = [(tree, -1)]
    while stack and len(nodes) < MAX_UI_NODES:
        node, parent = stack.pop()
        if not isinstance(node, dict):
            continue
        attrs = node.get("attributes") if isinstance(node.get("attributes"), dict) else {}
        text = {k: str(attrs.get(k) or "") for k in ("accessibilityText", "text", "title",
                                                     "hintText", "bounds", "class",
                                                     "resource-id", "clickable")}
        nodes.append(ui_node(parent, text["bounds"], text["class"], text["resource-id"],
                             text["accessibilityText"] or text["text"] or text["title"] or
                             text["hintText"], text["clickable"] == "true",
                             "TextField" in text["class"]))
        children = node.get("children") if isinstance(node.get("children"), list) else []
        stack += [(child, len(nodes) - 1) for child in reversed(children)]
    return nodes


def simulator_ui_nodes(runtime: Runtime, ctx: JobContext, target: dict) -> list[dict]:
    path = os.path.join(ctx.workdir, "hierarchy.json")
    result = run_cmd([flow_runner(runtime, "an accessibility audit on a simulator"),
                      "--platform", target["platform"], "--device", target["device_id"],
                      "--hierarchy", path], timeout=120)
    try:
        with open(path, "rb") as fh:
            tree = json.loads(fh.read(16 << 20).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        raise Refusal(f"the flow runner gave no readable UI hierarchy of "
                      f"{target['device_id']}: {tail(result.err, 200)}") from None
    return hierarchy_nodes(tree)


def a11y_findings(nodes: list[dict], scale: float, minimum: float) -> dict:
    """Touch targets smaller than `minimum` (dp or pt: px / scale) and controls that nothing
    labels, neither they nor anything inside them."""
    labelled = [bool(n["label"]) for n in nodes]
    for index in range(len(nodes) - 1, -1, -1):  # children come after their parent
        parent = nodes[index]["parent"]
        if parent >= 0 and labelled[index] and not nodes[parent]["editable"]:
            labelled[parent] = True
    small, unlabeled = [], []
    for index, node in enumerate(nodes):
        x1, y1, x2, y2 = node["bounds"]
        width, height = (x2 - x1) / scale, (y2 - y1) / scale
        if not node["control"] or width <= 0 or height <= 0:
            continue
        where = {"class": node["class"], "id": node["id"], "label": node["label"],
                 "bounds": list(node["bounds"]), "size": [round(width, 1), round(height, 1)]}
        if width < minimum or height < minimum:
            small.append(where)
        if not labelled[index]:
            unlabeled.append(where)
    return {"small_targets": small, "unlabeled": unlabeled,
            "controls": sum(1 for n in nodes if n["control"]), "nodes": len(nodes)}


def set_font_variant(runtime: Runtime, target: dict, variant: str, scale: float,
                     ) -> str | None:
    """Apply a font variant; the setting it replaced (None: nothing changed)."""
    serial = target["device_id"]
    if variant == "default":
        return None
    if target["platform"] == "android":
        before = adb_shell(runtime, serial, "settings", "get", "system", "font_scale").out
        adb_shell(runtime, serial, "settings", "put", "system", "font_scale", f"{scale:g}")
        return before.strip() or "null"
    before = run_cmd([runtime.tools["xcrun"], "simctl", "ui", serial, "content_size"]).out
    run_cmd([runtime.tools["xcrun"], "simctl", "ui", serial, "content_size", LARGEST_IOS_SIZE])
    return before.strip() or "large"


def restore_font(runtime: Runtime, target: dict, before: str) -> None:
    serial = target["device_id"]
    if target["platform"] == "android":
        if re.match(r"^\d+(\.\d+)?$", before):
            adb_shell(runtime, serial, "settings", "put", "system", "font_scale", before)
        else:  # it was never set: take the setting away again
            adb_shell(runtime, serial, "settings", "delete", "system", "font_scale")
    elif re.match(r"^[a-z-]{1,60}$", before):
        run_cmd([runtime.tools["xcrun"], "simctl", "ui", serial, "content_size", before])


def restart_app(runtime: Runtime, target: dict, app_id: str) -> str | None:
    """Stop and start the app, so it lays out again with the current font size."""
    if target["platform"] == "android":
        adb_shell(runtime, target["device_id"], "am", "force-stop", app_id)
    else:
        run_cmd([runtime.tools["xcrun"], "simctl", "terminate", target["device_id"], app_id])
    return launch_app(runtime, target, app_id)


def audit_screen(runtime: Runtime, ctx: JobContext, plan: dict, target: dict) -> dict:
    if target["platform"] == "android":
        nodes = android_ui_nodes(runtime, target["device_id"])
        scale = android_density(runtime, target["device_id"]) / 160.0
    else:
        nodes, scale = simulator_ui_nodes(runtime, ctx, target), 1.0  # already in points
    return a11y_findings(nodes, scale, plan["min_target"])


def a11y_variant(runtime: Runtime, ctx: JobContext, plan: dict, target: dict, variant: str,
                 first_iter: int) -> list[dict]:
    """Every step of the app under one font variant, the setting put back afterwards."""
    before = set_font_variant(runtime, target, variant, plan["font_scale"])
    screens = []
    try:
        problem = restart_app(runtime, target, plan["app_id"]) if plan["app_id"] else None
        for number, step in enumerate(plan["steps"]):
            ctx.check()
            problem = problem or (run_flow(runtime, ctx, target, step["flow"],
                                           f"a11y-{variant}-{number}") if step["flow"] else None)
            settle(ctx, SETTLE_S)
            screen = audit_screen(runtime, ctx, plan, target) if not problem else {}
            screen.update(variant=variant, step=step["name"], error=problem)
            png = screenshot(runtime, ctx, target)
            screen["artifacts"] = [upload_bytes(ctx, png, f"a11y-{variant}-{number + 1}.png")]
            a11y_row(ctx, plan, target, screen, first_iter + number)
            screens.append(screen)
            problem = None
    finally:
        if before is not None:
            restore_font(runtime, target, before)
    return screens


def a11y_row(ctx: JobContext, plan: dict, target: dict, screen: dict, number: int) -> None:
    small, unlabeled = screen.get("small_targets", []), screen.get("unlabeled", [])
    error = screen["error"] or a11y_sentence(len(small), len(unlabeled), plan["min_target"])
    ctx.post(ctx.row(number, error is None,
                     {"small_targets": len(small), "unlabeled": len(unlabeled),
                      "controls": screen.get("controls", 0)},
                     error=error, variant=screen["variant"], step=screen["step"],
                     small_targets=small[:MAX_FINDINGS], unlabeled=unlabeled[:MAX_FINDINGS],
                     artifacts=screen["artifacts"], **target_fields(target)))


def a11y_sentence(small: int, unlabeled: int, minimum: float) -> str | None:
    parts = []
    if small:
        parts.append(f"{small} touch target{'s' if small != 1 else ''} under {minimum:g} dp/pt")
    if unlabeled:
        parts.append(f"{unlabeled} unlabeled control{'s' if unlabeled != 1 else ''}")
    return " and ".join(parts) or None


def wl_a11y_audit(runtime: Runtime, ctx: JobContext) -> dict:
    plan = a11y_plan(ctx)
    if any(s["flow"] for s in plan["steps"]):
        flow_runner(runtime, "an audit with flow steps")
    target = device_targets(runtime, ctx, "an accessibility audit", ("android", "ios"))[0]
    screens: list[dict] = []
    for variant in plan["variants"]:
        screens += a11y_variant(runtime, ctx, plan, target, variant, len(screens) + 1)
    report = json.dumps({"job_id": ctx.job_id, "device": target["device_id"],
                         "min_target": plan["min_target"], "screens": screens},
                        indent=1, sort_keys=True).encode("utf-8")
    artifacts = [upload_bytes(ctx, report, f"a11y-{ctx.job_id}.json")]
    artifacts += [sha for s in screens for sha in s["artifacts"]]
    small = sum(len(s.get("small_targets", [])) for s in screens)
    unlabeled = sum(len(s.get("unlabeled", [])) for s in screens)
    failed = [s for s in screens if s["error"]]
    error = "; ".join(f"{s['variant']}/{s['step']}: {s['error']}" for s in failed[:3]) or \
        a11y_sentence(small, unlabeled, plan["min_target"])
    metrics = {"screens": len(screens), "small_targets": small, "unlabeled": unlabeled}
    return final(error is None, error, metrics, artifacts, **target_fields(target))


# --- locale-shots: the app's screens in each locale, the device's own locale put back ---
#
# Android 13 and later switch one app's language without root or a restart (`cmd locale
# set-app-locales`), which is what a job naming params.app_id gets there. Otherwise the system
# locale changes (persist.sys.locale and a restart of the Android framework), which needs a root
# shell: an emulator, or a userdebug build after `adb root`. Simulators take AppleLanguages.

LOCALE_TAG = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8}){0,3}$")
RESTART_WAIT_S = 120.0
PER_APP_LOCALES_SDK = 33


def locales_param(params: dict) -> list[str]:
    locales = strings_param(params, "locales", 1, 50, "locale tags")
    bad = [tag for tag in locales if not LOCALE_TAG.fullmatch(tag)]
    if bad:
        raise Refusal(f"params.locales holds {shown(bad[0])}, which is not a locale tag such "
                      "as en-US or pt-BR")
    return locales


def device_prop(runtime: Runtime, serial: str, name: str) -> str:
    return adb_shell(runtime, serial, "getprop", name).out.strip()


def android_locale_way(runtime: Runtime, serial: str, app_id: str | None) -> str:
    """'app' (per-app language, Android 13+) when the job names its app, else 'system'."""
    sdk = device_prop(runtime, serial, "ro.build.version.sdk")
    return "app" if app_id and sdk.isdigit() and int(sdk) >= PER_APP_LOCALES_SDK else "system"


def android_locale(runtime: Runtime, serial: str, way: str, app_id: str | None) -> str:
    """The locale to put back: the app's own list (may be empty), or the system's."""
    if way == "app":
        out = adb_shell(runtime, serial, "cmd", "locale", "get-app-locales", str(app_id)).out
        found = re.search(r"\[([A-Za-z0-9,-]*)\]", out)
        return found.group(1) if found else ""
    for prop in ("persist.sys.locale", "ro.product.locale"):
        value = device_prop(runtime, serial, prop)
        if LOCALE_TAG.fullmatch(value):
            return value
    return ""


def framework_up(runtime: Runtime, serial: str, old_pid: str) -> bool:
    """After a framework restart: a new system_server whose package manager answers."""
    pid = adb_shell(runtime, serial, "pidof", "system_server").out.strip()
    return bool(pid) and pid != old_pid and \
        adb_shell(runtime, serial, "pm", "path", "android").out.startswith("package:")


def set_system_locale(runtime: Runtime, serial: str, tag: str, pause) -> None:
    """persist.sys.locale and a framework restart, so every app reads it. `pause` waits
    between looks (a stoppable wait, except when the device's locale is put back)."""
    adb_shell(runtime, serial, "setprop", "persist.sys.locale", tag)
    if device_prop(runtime, serial, "persist.sys.locale") != tag:
        raise Refusal(f"{serial} did not take the locale {tag}: setting persist.sys.locale "
                      "needs a root shell (an emulator or a userdebug build after adb root); "
                      "on Android 13 and later, name params.app_id to switch the app alone")
    old_pid = adb_shell(runtime, serial, "pidof", "system_server").out.strip()
    adb_shell(runtime, serial, "setprop", "ctl.restart", "zygote")
    deadline = time.monotonic() + RESTART_WAIT_S
    while not framework_up(runtime, serial, old_pid):
        if time.monotonic() > deadline:
            raise Refusal(f"{serial} did not finish restarting within {RESTART_WAIT_S:g} s "
                          f"after the switch to {tag}")
        pause(0.5)


def set_android_locale(runtime: Runtime, serial: str, way: str, app_id: str | None, tag: str,
                       pause) -> None:
    if way == "app":
        # An empty list (the app follows the system again) is an empty word, which
        # adb_shell_argv spells as the shell's '' like any other word it quotes.
        adb_shell(runtime, serial, "cmd", "locale", "set-app-locales", str(app_id),
                  "--locales", tag)
    elif tag:
        set_system_locale(runtime, serial, tag, pause)


def simulator_defaults(runtime: Runtime, udid: str, *args: str) -> CmdResult:
    return run_cmd([runtime.tools["xcrun"], "simctl", "spawn", udid, "defaults", *args],
                   timeout=30)


def simulator_locale(runtime: Runtime, udid: str) -> str:
    """The first of the simulator's AppleLanguages ('' when it has none of its own)."""
    out = simulator_defaults(runtime, udid, "read", "-g", "AppleLanguages").out
    found = re.findall(r'"?([A-Za-z]{2,3}(?:-[A-Za-z0-9]{2,8})*)"?\s*,?\s*$', out, re.M)
    return found[0] if found else ""


def set_simulator_locale(runtime: Runtime, udid: str, tag: str) -> None:
    if not tag:
        simulator_defaults(runtime, udid, "delete", "-g", "AppleLanguages")
        simulator_defaults(runtime, udid, "delete", "-g", "AppleLocale")
        return
    simulator_defaults(runtime, udid, "write", "-g", "AppleLanguages", "-array", tag)
    simulator_defaults(runtime, udid, "write", "-g", "AppleLocale", "-string",
                       tag.replace("-", "_"))


class LocaleSwitch:
    """How one target changes locale, and the locale it had before the job."""

    def __init__(self, runtime: Runtime, target: dict, app_id: str | None):
        self.runtime, self.target, self.app_id = runtime, target, app_id
        serial = target["device_id"]
        if target["platform"] == "android":
            self.way = android_locale_way(runtime, serial, app_id)
            self.original = android_locale(runtime, serial, self.way, app_id)
        else:
            self.way, self.original = "simulator", simulator_locale(runtime, serial)

    def to(self, tag: str, pause) -> None:
        if self.way == "simulator":
            set_simulator_locale(self.runtime, self.target["device_id"], tag)
        else:
            set_android_locale(self.runtime, self.target["device_id"], self.way, self.app_id,
                               tag, pause)

    def restore(self) -> None:
        """Put the original back; told in the log (not raised) when the device refuses, so
        the job's own outcome is what its row says."""
        try:
            self.to(self.original, time.sleep)
        except Refusal as exc:
            log.warning("could not put the locale of %s back to %s: %s",
                        printable(self.target["device_id"]),
                        printable(self.original or "its default"), printable(exc, 500))


def locale_shot(runtime: Runtime, ctx: JobContext, plan: dict, switch: LocaleSwitch, tag: str,
                number: int) -> dict:
    """Switch to one locale, drive the app, take the screenshot; the row's record."""
    target = switch.target
    switch.to(tag, lambda seconds: settle(ctx, seconds))
    problem = restart_app(runtime, target, plan["app_id"]) if plan["app_id"] else None
    problem = problem or drive(runtime, ctx, target, plan["flow"], None, f"locale-{number}")
    settle(ctx, plan["settle_s"])
    png = screenshot(runtime, ctx, target)
    name = f"{ctx.job_id}-{tag}-{target['device_id']}.png"
    return {"locale": tag, "error": problem, "artifacts": [upload_bytes(ctx, png, name)]}


def wl_locale_shots(runtime: Runtime, ctx: JobContext) -> dict:
    plan = {"locales": locales_param(ctx.params), "flow": flow_param(ctx.params),
            "app_id": app_id_param(ctx, required=False),
            "settle_s": number_param(ctx.params, "settle_s", SETTLE_S, 0, 120)}
    if plan["flow"]:
        flow_runner(runtime, "locale-shots with params.flow")
    shots: list[dict] = []
    for target in device_targets(runtime, ctx, "locale-shots", ("android", "ios")):
        switch = LocaleSwitch(runtime, target, plan["app_id"])
        try:
            for tag in plan["locales"]:
                ctx.check()
                shot = locale_shot(runtime, ctx, plan, switch, tag, len(shots) + 1)
                ctx.post(ctx.row(len(shots) + 1, shot["error"] is None, {},
                                 error=shot["error"], locale=tag, locale_way=switch.way,
                                 artifacts=shot["artifacts"], **target_fields(target)))
                shots.append(shot)
        finally:  # the device's own locale goes back, also after a cancel or a failure
            switch.restore()
    failed = [s for s in shots if s["error"]]
    error = "; ".join(f"{s['locale']}: {s['error']}" for s in failed[:3]) or None
    return final(not failed, error, {"shots": len(shots), "locales": len(plan["locales"])},
                 [sha for s in shots for sha in s["artifacts"]])


# --- drain: the battery of one attached device (or of this Mac) over time, off the charger ---

TRACK = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
IOREG_FIELD = re.compile(r'"(\w+)" = (-?\d+|Yes|No)\b')


def drain_plan(ctx: JobContext) -> dict:
    return {"duration_s": number_param(ctx.params, "duration_s", 3600, 1, 7 * 86400),
            "interval_s": number_param(ctx.params, "interval_s", 60, 1, 3600),
            "track": text_param(ctx.params, "track", "level", TRACK,
                                "a battery figure such as level, temperature or current_now")}


def android_battery(runtime: Runtime, serial: str, track: str) -> dict:
    """`dumpsys battery` as figures (level, temperature in tenths of a degree, voltage ...);
    current_now (µA) comes from the power supply's sysfs file when it is the tracked one."""
    result = adb_shell(runtime, serial, "dumpsys", "battery")
    figures: dict = {}
    for key, value in re.findall(r"(?m)^\s+([A-Za-z][A-Za-z ]*): (-?\d+(?:\.\d+)?|true|false)$",
                                 result.out):
        name = key.strip().lower().replace(" ", "_")
        number = None if value in ("true", "false") else float(value)
        if number is not None and not math.isfinite(number):
            continue  # hundreds of digits: inf, which no row carries; no reading
        figures[name] = value == "true" if number is None else number
    if track == "current_now" and "current_now" not in figures:
        raw = adb_shell(runtime, serial, "cat",
                        "/sys/class/power_supply/battery/current_now").out.strip()
        if re.match(r"^-?\d{1,18}$", raw):
            figures["current_now"] = float(raw)
    if isinstance(figures.get("level"), float) and isinstance(figures.get("scale"), float) \
            and figures["scale"] > 0:
        figures["level"] = round(figures["level"] * 100 / figures["scale"], 2)
    return figures


def mac_battery(runtime: Runtime) -> dict:
    """This Mac's battery from `ioreg -rn AppleSmartBattery` (level in %, temperature in °C,
    current_now in mA, external_connected)."""
    result = run_cmd([runtime.tools["ioreg"], "-rn", "AppleSmartBattery"], timeout=20)
    raw = dict(IOREG_FIELD.findall(result.out))
    figures: dict = {}
    if raw.get("CurrentCapacity") and raw.get("MaxCapacity") not in (None, "0"):
        figures["level"] = round(int(raw["CurrentCapacity"]) * 100 / int(raw["MaxCapacity"]), 2)
    if raw.get("Temperature", "").lstrip("-").isdigit():
        figures["temperature"] = int(raw["Temperature"]) / 100
    if raw.get("Amperage", "").lstrip("-").isdigit():
        figures["current_now"] = float(raw["Amperage"])
    for key in ("ExternalConnected", "IsCharging"):
        if key in raw:
            figures[re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()] = raw[key] == "Yes"
    return figures


def drain_subject(runtime: Runtime, ctx: JobContext) -> dict | None:
    """The attached device to drain, or None for this Mac itself (a job whose platform is
    macos, or that pins targets.device_id to this executor's name)."""
    targets = ctx.spec.get("targets") if isinstance(ctx.spec.get("targets"), dict) else {}
    if job_platform(ctx.spec) == "macos" or targets.get("device_id") == runtime.reporter_id:
        if not runtime.tools.get("ioreg"):
            raise Refusal("this executor cannot read its own battery (no ioreg: not a Mac)")
        return None
    target = device_targets(runtime, ctx, "a drain", ("android",))[0]
    return target


def drain_reader(runtime: Runtime, target: dict | None, track: str):
    if target is None:
        return lambda: mac_battery(runtime)
    return lambda: android_battery(runtime, target["device_id"], track)


def start_unplugged(runtime: Runtime, target: dict | None, reading: dict) -> None:
    """Take the device off its charger for the drain (Android's battery service can pretend
    it is unplugged; a Mac's power cannot be switched by software, so it must be unplugged)."""
    if target is None:
        if reading.get("external_connected"):
            raise Refusal("this Mac is on mains power; a drain needs it unplugged, which "
                          "software cannot do")
        return
    adb_shell(runtime, target["device_id"], "dumpsys", "battery", "unplug")


def drain_sample(ctx: JobContext, plan: dict, reading: dict, number: int, elapsed: float,
                 target: dict | None) -> dict:
    value = reading.get(plan["track"])
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Refusal("the battery reading has no figure {!r} (it has: {})".format(
            plan["track"], ", ".join(sorted(k for k, v in reading.items()
                                            if not isinstance(v, bool)))))
    metrics = drop_none({plan["track"]: value, "battery_pct": reading.get("level"),
                         "elapsed_s": round(elapsed, 1)})
    charging = any(reading.get(k) is True for k in ("ac_powered", "usb_powered",
                                                    "wireless_powered", "external_connected"))
    ctx.post(ctx.row(number, True, metrics, track=plan["track"], charging=charging,
                     **(target_fields(target) if target else {})))
    return metrics


def wl_drain(runtime: Runtime, ctx: JobContext) -> dict:
    plan = drain_plan(ctx)
    target = drain_subject(runtime, ctx)
    read = drain_reader(runtime, target, plan["track"])
    samples: list[dict] = []
    started = time.monotonic()
    try:
        start_unplugged(runtime, target, read())
        count = int(plan["duration_s"] // plan["interval_s"]) + 1
        for number in range(1, count + 1):
            settle(ctx, max(0.0, started + (number - 1) * plan["interval_s"] - time.monotonic()))
            samples.append(drain_sample(ctx, plan, read(), number, time.monotonic() - started,
                                        target))
    finally:  # the charger is given back also after a cancel or a failure
        if target is not None:
            adb_shell(runtime, target["device_id"], "dumpsys", "battery", "reset")
    return final(True, None, drain_summary(plan, samples),
                 **(target_fields(target) if target else {}))


def drain_summary(plan: dict, samples: list[dict]) -> dict:
    first, last = samples[0], samples[-1]
    track = [s[plan["track"]] for s in samples]
    metrics = {"samples": len(samples), "elapsed_s": last["elapsed_s"],
               f"{plan['track']}_first": track[0], f"{plan['track']}_last": track[-1],
               f"{plan['track']}_min": min(track), f"{plan['track']}_max": max(track)}
    if "battery_pct" in first:
        metrics.update(battery_start_pct=first["battery_pct"],
                       battery_end_pct=last["battery_pct"])
        hours = last["elapsed_s"] / 3600
        if hours > 0:
            metrics["drain_pct_per_h"] = round(
                (first["battery_pct"] - last["battery_pct"]) / hours, 3)
    return metrics


# --- web-unfurl: how a link unfurls in a chat or a feed, standard library only ---
#
# The same rule as vantage: a URL (or a redirect, or the image it names) that reaches a private,
# loopback or link-local address is refused unless the owner passed --allow-private-urls.

UNFURL_MAX_BYTES = 2 << 20
UNFURL_HOPS = 10
REDIRECTS = (301, 302, 303, 307, 308)
UNFURL_CARD_FIELDS = ("og:title", "og:description", "og:image", "twitter:card")


class HeadParser(html.parser.HTMLParser):
    """The parts of a page an unfurler reads: <title>, <meta> and <link rel=canonical>."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title: str | None = None
        self.meta: dict[str, str] = {}
        self.canonical: str | None = None
        self._in_title = False
        self._title_parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        found = {k.lower(): v or "" for k, v in attrs if isinstance(k, str)}
        if tag == "title" and self.title is None:
            self._in_title = True
        elif tag == "meta" and len(self.meta) < 500:
            key = (found.get("property") or found.get("name") or "").strip().lower()
            if key and "content" in found and key not in self.meta:
                self.meta[key] = found["content"].strip()[:2000]
        elif tag == "link" and "canonical" in found.get("rel", "").lower().split():
            self.canonical = self.canonical or found.get("href")

    def handle_data(self, data: str) -> None:
        if self._in_title and sum(map(len, self._title_parts)) < 2000:
            self._title_parts.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "title" and self._in_title:
            self._in_title = False
            self.title = " ".join("".join(self._title_parts).split())[:500]


def fetch_chain(url: str, timeout: float, allow_private: bool, method: str = "GET",
                max_bytes: int = UNFURL_MAX_BYTES, ctx: JobContext | None = None
                ) -> tuple[list[dict], bytes, dict]:
    """Follow redirects by hand, each hop checked like the first, all of them within `timeout`
    s; (hops, body, headers)."""
    hops: list[dict] = []
    limit = WebLimit(timeout, timeout, ctx)
    for _ in range(UNFURL_HOPS + 1):
        with web_exchange(url, limit, allow_private, method) as (response, phases):
            hop = {"url": url, "status": response.status,
                   "ms": round((time.perf_counter() - phases["started"]) * 1000, 1)}
            headers = {k.lower(): v for k, v in response.getheaders()}
            location = headers.get("location")
            if response.status in REDIRECTS and location:
                hop["location"] = location
                hops.append(hop)
                url = check_url(urllib.parse.urljoin(url, location), "a redirect")
                continue
            body = b"".join(web_body(response, limit, max_bytes)) if method == "GET" else b""
        hops.append(hop)
        return hops, body, headers
    raise Refusal(f"{hops[0]['url']} redirects more than {UNFURL_HOPS} times")


# The encodings web pages are written in (the WHATWG Encoding Standard's, by the names Python
# knows them by). A page names its own: any other codec Python has could be asked for, and some
# cost time with the square of the page (punycode: a 2 MiB page held a core for minutes, past
# a cancel), or are no text encoding at all.
WEB_CHARSETS = ("utf-8", "utf-16-le", "utf-16-be", "utf-16", "ascii", "latin-1", "cp866",
                "iso8859-2", "iso8859-3", "iso8859-4", "iso8859-5", "iso8859-6", "iso8859-7",
                "iso8859-8", "iso8859-10", "iso8859-13", "iso8859-14", "iso8859-15",
                "iso8859-16", "koi8-r", "koi8-u", "mac-roman", "mac-cyrillic", "cp874",
                "cp1250", "cp1251", "cp1252", "cp1253", "cp1254", "cp1255", "cp1256", "cp1257",
                "cp1258", "gbk", "gb2312", "gb18030", "big5", "big5hkscs", "euc_jp",
                "iso2022_jp", "shift_jis", "euc_kr", "cp949")
_web_codecs: set = set()


def web_codec(name: str | None) -> str | None:
    """`name` when it names one of WEB_CHARSETS (by any of Python's spellings), else None."""
    if not name:
        return None
    if not _web_codecs:
        _web_codecs.update(codecs.lookup(known).name for known in WEB_CHARSETS)
    try:
        found = codecs.lookup(name).name
    except LookupError:
        return None
    return found if found in _web_codecs else None


def page_text(body: bytes, content_type: str) -> str:
    charset = re.search(r"charset=([\w-]+)", content_type or "", re.I)
    sniffed = re.search(rb"<meta[^>]+charset=[\"']?([\w-]+)", body[:4096], re.I)
    for name in (charset.group(1) if charset else None,
                 sniffed.group(1).decode("ascii") if sniffed else None, "utf-8"):
        codec = web_codec(name)
        if codec:
            with contextlib.suppress(UnicodeError):
                return body.decode(codec)
    return body.decode("utf-8", "replace")


def image_check(image: str, base: str, timeout: float, allow_private: bool,
                ctx: JobContext | None = None) -> dict:
    """Can a card's image be fetched? HEAD, else a GET of its first bytes (some servers refuse
    HEAD); ok for a 2xx image/* answer."""
    try:
        url = check_url(urllib.parse.urljoin(base, image), "og:image")
        hops, _, headers = fetch_chain(url, timeout, allow_private, "HEAD", ctx=ctx)
        if hops[-1]["status"] in (403, 405, 501):
            hops, _, headers = fetch_chain(url, timeout, allow_private, "GET", 1024, ctx)
    except Refusal as exc:
        return {"url": image, "ok": False, "error": str(exc)}
    except (OSError, ssl.SSLError, http.client.HTTPException, ValueError) as exc:
        return {"url": image, "ok": False, "error": network_error(exc)}
    kind = headers.get("content-type", "")
    record = {"url": url, "status": hops[-1]["status"], "content_type": kind,
              "bytes": _int_or_none(headers.get("content-length")), "hops": len(hops)}
    record["ok"] = 200 <= record["status"] < 300 and kind.lower().startswith("image/")
    if not record["ok"]:
        record["error"] = f"the image answers {record['status']} {kind or 'with no type'}"
    return record


def unfurl_card(parser: HeadParser, final_url: str) -> dict:
    meta = parser.meta
    return {"title": meta.get("og:title") or meta.get("twitter:title") or parser.title,
            "description": meta.get("og:description") or meta.get("twitter:description")
            or meta.get("description"),
            "site_name": meta.get("og:site_name"),
            "image": meta.get("og:image") or meta.get("og:image:url")
            or meta.get("twitter:image"),
            "canonical": urllib.parse.urljoin(final_url, parser.canonical)
            if parser.canonical else None,
            "html_title": parser.title,
            "opengraph": {k: v for k, v in meta.items() if k.startswith("og:")},
            "twitter": {k: v for k, v in meta.items() if k.startswith("twitter:")}}


def wl_web_unfurl(runtime: Runtime, ctx: JobContext) -> dict:
    url = check_url(web_url(ctx.spec), "targets.url")
    timeout = number_param(ctx.params, "timeout_s", 10, 0.1, 120)
    allow_private = bool(getattr(runtime.cfg, "allow_private_urls", False))
    try:
        hops, body, headers = fetch_chain(url, timeout, allow_private, ctx=ctx)
    except (OSError, ssl.SSLError, http.client.HTTPException, ValueError) as exc:
        return final(False, f"{url}: {network_error(exc)}")
    status = hops[-1]["status"]
    parser = HeadParser()
    parser.feed(page_text(body, headers.get("content-type", "")))
    card = unfurl_card(parser, hops[-1]["url"])
    metrics = {"status": status, "hops": len(hops), "bytes": len(body),
               "total_ms": round(sum(h["ms"] for h in hops), 1)}
    ctx.post(ctx.row(1, 200 <= status < 300, dict(metrics), url=url, chain=hops))
    ctx.check()
    image = image_check(card["image"], hops[-1]["url"], timeout, allow_private, ctx) \
        if card["image"] else None
    if image is not None:
        metrics["image_status"] = image.get("status")
        ctx.post(ctx.row(2, image["ok"], {"image_status": image.get("status")}, image=image,
                         error=image.get("error")))
    missing = [f for f in UNFURL_CARD_FIELDS if f not in parser.meta]
    error = f"{hops[-1]['url']} answered {status}" if not 200 <= status < 300 else \
        (f"the card's image {image['url']}: {image['error']}" if image and not image["ok"]
         else None)
    return final(error is None, error, metrics, card=card, chain=hops, image=image,
                 missing=missing, final_url=hops[-1]["url"])


# --- web-audit: a page as headless Chromium loads it, through the DevTools protocol ---
#
# Chromium is driven over --remote-debugging-pipe: DevTools messages (JSON, each ended by a NUL
# byte) go to the browser's file descriptor 3 and come back on 4. The standard library drives
# that with two pipes and no websocket code, no port is opened that another local process could
# connect to (a debugging port drives the browser for anyone on the machine), and the protocol
# gives what --dump-dom cannot: every response's size, the console, the accessibility tree.
# A short Python trampoline puts the pipes on 3 and 4 before it becomes Chromium (subprocess
# has no portable way to choose a child's descriptor numbers, and preexec_fn is unsafe in a
# process with threads).

PIPE_TRAMPOLINE = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4);"
                   " os.execv(sys.argv[3], sys.argv[3:])")
DEVTOOLS_MAX_MESSAGE = 64 << 20  # a screenshot of a tall page is the largest message
DEVTOOLS_MAX_EVENTS = 50_000
IMAGE_ROLES = ("image", "img")
INPUT_ROLES = ("textbox", "searchbox", "combobox", "checkbox", "radio", "slider", "spinbutton",
               "switch", "listbox")
ACTION_ROLES = ("button", "link")
MAX_AUDIT_FINDINGS = 100

TIMING_JS = """(() => {
  const nav = performance.getEntriesByType('navigation')[0];
  const paint = {};
  for (const p of performance.getEntriesByType('paint')) paint[p.name] = p.startTime;
  if (!nav) return null;
  return {ttfb_ms: nav.responseStart, dom_content_loaded_ms: nav.domContentLoadedEventEnd,
          load_ms: nav.loadEventEnd, first_paint_ms: paint['first-paint'] || null,
          fcp_ms: paint['first-contentful-paint'] || null};
})()"""

# WCAG 2 contrast of each element's own text against the first opaque background behind it;
# text over an image or a translucent layer is skipped (not computable from styles alone).
CONTRAST_JS = """(() => {
  const parse = c => { const m = /rgba?\\(([^)]+)\\)/.exec(c || ''); if (!m) return null;
    const p = m[1].split(',').map(parseFloat); return {r: p[0], g: p[1], b: p[2],
    a: p.length > 3 ? p[3] : 1}; };
  const lum = c => { const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92
    : Math.pow((v + 0.055) / 1.055, 2.4); }; return 0.2126 * f(c.r) + 0.7152 * f(c.g)
    + 0.0722 * f(c.b); };
  const behind = el => { for (let e = el; e; e = e.parentElement) {
      const s = getComputedStyle(e); if (s.backgroundImage && s.backgroundImage !== 'none')
        return null;
      const c = parse(s.backgroundColor); if (c && c.a >= 1) return c; if (c && c.a > 0)
        return null; }
    return {r: 255, g: 255, b: 255, a: 1}; };
  const found = []; let checked = 0;
  for (const el of document.body ? document.body.querySelectorAll('*') : []) {
    if (found.length >= 100 || checked >= 5000) break;
    if (!Array.from(el.childNodes).some(n => n.nodeType === 3 && n.textContent.trim())) continue;
    const s = getComputedStyle(el);
    if (s.visibility === 'hidden' || s.display === 'none') continue;
    checked++;
    const fg = parse(s.color), bg = behind(el);
    if (!fg || !bg || fg.a < 1) continue;
    const [hi, lo] = [lum(fg), lum(bg)].sort((a, b) => b - a);
    const ratio = (hi + 0.05) / (lo + 0.05), size = parseFloat(s.fontSize);
    const large = size >= 24 || (parseInt(s.fontWeight, 10) >= 700 && size >= 18.66);
    const needed = large ? 3 : 4.5;
    if (ratio < needed) found.push({text: el.textContent.trim().slice(0, 80),
      tag: el.tagName.toLowerCase(), id: el.id || null, ratio: Math.round(ratio * 100) / 100,
      needed: needed, color: s.color, background: s.backgroundColor});
  }
  return found;
})()"""


class DevToolsError(Exception):
    pass


class DevTools:
    """One headless Chromium and its DevTools pipe: commands, their replies, and the events
    kept in arrival order for the audit to read afterwards."""

    def __init__(self, argv: list[str], log_path: str):
        to_browser, commands = os.pipe()
        replies, from_browser = os.pipe()
        trampoline = [sys.executable or "python3", "-c", PIPE_TRAMPOLINE, str(to_browser),
                      str(from_browser)]
        try:
            with open(log_path, "wb") as log_file:
                self.proc = subprocess.Popen(
                    [*trampoline, *argv], pass_fds=(to_browser, from_browser),
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    start_new_session=True)
        except OSError as exc:
            os.close(commands)
            os.close(replies)
            raise DevToolsError(f"Chromium could not be started ({exc})") from exc
        finally:  # the browser's ends: only the child keeps them (each closed exactly once)
            os.close(to_browser)
            os.close(from_browser)
        self.writer = os.fdopen(commands, "wb", buffering=0)
        self.inbox: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self.last_id = 0
        threading.Thread(target=self._read, args=(replies,), daemon=True).start()

    def _read(self, fd: int) -> None:
        parts: list[bytes] = []  # of the message still arriving
        size = 0
        with os.fdopen(fd, "rb", buffering=0) as reader:
            while size <= DEVTOOLS_MAX_MESSAGE:
                chunk = reader.read(1 << 16)
                if not chunk:
                    break
                while b"\0" in chunk:
                    end, chunk = chunk.split(b"\0", 1)
                    message, parts, size = b"".join(parts) + end, [], 0
                    with contextlib.suppress(ValueError, RecursionError):
                        self.inbox.put(json.loads(message.decode("utf-8")))
                parts.append(chunk)
                size += len(chunk)
        self.inbox.put(None)  # the browser went away

    def _next(self, deadline: float) -> dict:
        try:
            message = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise DevToolsError("Chromium did not answer in time") from None
        if message is None:
            self.inbox.put(None)
            raise DevToolsError("Chromium closed its DevTools pipe")
        return message if isinstance(message, dict) else {}

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        self.last_id += 1
        message: dict = {"id": self.last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            self.writer.write(json.dumps(message).encode("utf-8") + b"\0")
        except OSError as exc:
            raise DevToolsError(f"Chromium stopped reading DevTools commands ({exc})") from exc
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next(deadline)
            if reply.get("id") == self.last_id:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result") or {}
            self.keep(reply)

    def keep(self, event: dict) -> None:
        if len(self.events) < DEVTOOLS_MAX_EVENTS:
            kept = audit_event(event)
            if kept is not None:
                self.events.append(kept)

    def wait_for(self, method: str | None, deadline: float, stop: threading.Event) -> bool:
        """Collect events until `method` arrives (True) or the deadline passes (False); with
        no method, collect until the deadline."""
        while time.monotonic() < deadline and not stop.is_set():
            try:
                event = self._next(min(deadline, time.monotonic() + 0.5))
            except DevToolsError as exc:
                if "in time" in str(exc):
                    continue
                raise
            self.keep(event)
            if event.get("method") == method:
                return True
        return False

    def close(self) -> None:
        with contextlib.suppress(DevToolsError, OSError):
            self.send("Browser.close", timeout=5)
        with contextlib.suppress(OSError):
            self.writer.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def devtools_session(tools: DevTools, url: str, viewport: tuple[int, int]) -> str:
    """A fresh tab with the domains the audit reads, sized, then sent to `url`."""
    target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = tools.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
        "sessionId"]
    for domain in ("Page", "Network", "Runtime", "Log"):
        tools.send(domain + ".enable", session=session)
    tools.send("Emulation.setDeviceMetricsOverride", {"width": viewport[0], "height": viewport[1],
                                                      "deviceScaleFactor": 1, "mobile": False},
               session=session)
    navigated = tools.send("Page.navigate", {"url": url}, session=session, timeout=60)
    if navigated.get("errorText"):
        raise Refusal(f"Chromium could not load {url}: {navigated['errorText']}")
    return session


def audit_event(event: dict) -> dict | None:
    """What the audit reads of an event (page_weight, console_errors, browser_own), its text
    clipped, or None for an event it never reads. Events were kept whole for the job's
    timeout: a page logging a megabyte twenty times a second took the agent past 450 MB in
    30 s, and each console message may be 64 MiB."""
    method = event.get("method")
    params = event.get("params")
    params = params if isinstance(params, dict) else {}
    kept: dict = {}
    if method in ("Network.requestWillBeSent", "Network.responseReceived"):
        part = "request" if method == "Network.requestWillBeSent" else "response"
        message = params.get(part)
        message = message if isinstance(message, dict) else {}
        kept = {"requestId": params.get("requestId"), "type": _short(params.get("type")),
                part: {"url": _short(message.get("url"), 2000)}}
        if part == "response":
            kept[part]["status"] = message.get("status")
    elif method == "Network.loadingFinished":
        kept = {"requestId": params.get("requestId"),
                "encodedDataLength": params.get("encodedDataLength")}
    elif method == "Network.loadingFailed":
        kept = {"requestId": params.get("requestId"), "canceled": params.get("canceled"),
                "errorText": _short(params.get("errorText"))}
    elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
        args = params.get("args") if isinstance(params.get("args"), list) else []
        kept = {"type": "error", "args": [
            {"value": _short(a.get("value", a.get("description", "")))}
            for a in args[:20] if isinstance(a, dict)]}
    elif method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails")
        details = details if isinstance(details, dict) else {}
        thrown = details.get("exception")
        thrown = thrown if isinstance(thrown, dict) else {}
        kept = {"exceptionDetails": {"text": _short(details.get("text")),
                                     "exception": {"description": _short(
                                         thrown.get("description"))}}}
    elif method == "Log.entryAdded":
        entry = params.get("entry")
        entry = entry if isinstance(entry, dict) else {}
        if entry.get("level") != "error":
            return None
        kept = {"entry": {"level": "error", "source": _short(entry.get("source")),
                          "text": _short(entry.get("text")), "url": _short(entry.get("url"))}}
    else:
        return None
    return {"method": method, "params": kept}


def _short(value: object, limit: int = 400) -> object:
    """Text clipped past what a finding shows (clip to 300, which then marks the cut as it
    would have on the whole text); other values as they are."""
    return value[:limit] if isinstance(value, str) else value


def browser_own(event: dict) -> bool:
    """The icon request Chromium makes by itself when a page names none: not the page's."""
    params = event.get("params") or {}
    url = (params.get("request") or params.get("response") or {}).get("url", "")
    return params.get("type") == "Other" and urllib.parse.urlsplit(url).path == "/favicon.ico"


def page_weight(events: list[dict]) -> dict:
    """Bytes on the wire by resource type, request count, and the requests that failed."""
    kinds: dict[str, str] = {}
    urls: dict[str, str] = {}
    failed: list[dict] = []
    by_type: dict[str, int] = {}
    skipped = {(e.get("params") or {}).get("requestId") for e in events if browser_own(e)}
    for event in events:
        params, method = event.get("params") or {}, event.get("method")
        request_id = params.get("requestId")
        response = params.get("response") or {}
        if request_id in skipped:
            continue
        if method in ("Network.requestWillBeSent", "Network.responseReceived"):
            kinds[request_id] = str(params.get("type") or kinds.get(request_id) or "Other")
            urls.setdefault(request_id, str((params.get("request") or response).get("url")))
        if method == "Network.responseReceived" and int(response.get("status") or 0) >= 400:
            failed.append({"url": clip(urls[request_id], 300), "status": response["status"]})
        elif method == "Network.loadingFinished":
            kind = kinds.get(request_id, "Other")
            by_type[kind] = by_type.get(kind, 0) + int(params.get("encodedDataLength") or 0)
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            failed.append({"url": clip(urls.get(request_id, ""), 300),
                           "error": params.get("errorText")})
    return {"bytes_by_type": by_type, "total_bytes": sum(by_type.values()),
            "requests": len(kinds), "failed_requests": failed[:MAX_AUDIT_FINDINGS]}


def console_errors(events: list[dict]) -> list[str]:
    """console.error calls, uncaught exceptions and the browser's error log entries (those
    about a failed request are left out: failed_requests reports each of those once)."""
    found = []
    for event in events:
        params, method = event.get("params") or {}, event.get("method")
        if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            found.append(" ".join(str(a.get("value", a.get("description", "")))
                                  for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails") or {}
            found.append(str((details.get("exception") or {}).get("description")
                             or details.get("text")))
        elif method == "Log.entryAdded" and (params.get("entry") or {}).get("level") == "error" \
                and params["entry"].get("source") != "network":
            entry = params["entry"]
            found.append(f"{entry.get('text')} ({entry.get('url')})" if entry.get("url")
                         else str(entry.get("text")))
    return [clip(text, 300) for text in found[:MAX_AUDIT_FINDINGS]]


def ax_findings(tools: DevTools, session: str) -> dict:
    """Images without a text alternative, form fields and buttons or links without a name,
    read from the browser's accessibility tree (what a screen reader is given)."""
    nodes = tools.send("Accessibility.getFullAXTree", session=session, timeout=60).get(
        "nodes", [])
    found: dict[str, list[dict]] = {"missing_alt": [], "unlabeled_inputs": [],
                                    "unnamed_controls": []}
    for node in nodes:
        role = str((node.get("role") or {}).get("value") or "")
        named = str((node.get("name") or {}).get("value") or "").strip()
        if node.get("ignored") or named:
            continue
        key = ("missing_alt" if role in IMAGE_ROLES else "unlabeled_inputs"
               if role in INPUT_ROLES else "unnamed_controls" if role in ACTION_ROLES else None)
        if key and len(found[key]) < MAX_AUDIT_FINDINGS:
            found[key].append(dict(role=role, **dom_summary(tools, session,
                                                            node.get("backendDOMNodeId"))))
    return found


def dom_summary(tools: DevTools, session: str, backend_id: object) -> dict:
    """The element behind an accessibility node: its tag and identifying attributes."""
    if not isinstance(backend_id, int):
        return {}
    try:
        node = tools.send("DOM.describeNode", {"backendNodeId": backend_id},
                          session=session).get("node", {})
    except DevToolsError:
        return {}
    raw = node.get("attributes") or []
    attrs = {raw[i]: raw[i + 1] for i in range(0, len(raw) - 1, 2)}  # [name, value, ...]
    return {"tag": str(node.get("nodeName", "")).lower(),
            **{k: clip(str(attrs[k]), 200) for k in ("id", "name", "type", "src", "href")
               if k in attrs}}


def evaluate(tools: DevTools, session: str, expression: str) -> object:
    reply = tools.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                       session=session, timeout=60)
    return (reply.get("result") or {}).get("value")


def audit_page(runtime: Runtime, ctx: JobContext, url: str, plan: dict) -> dict:
    with browser_guard(runtime) as guard:
        found = audit_with(runtime, ctx, url, plan, guard)
    found["refused_requests"] = list(guard.refused) if guard is not None else []
    return found


def audit_with(runtime: Runtime, ctx: JobContext, url: str, plan: dict,
               guard: BrowserGuard | None) -> dict:
    try:
        tools = DevTools([*chromium_argv(runtime, ctx, "audit", guard),
                          "--remote-debugging-pipe", "about:blank"],
                         os.path.join(ctx.workdir, "chromium.log"))
    except DevToolsError as exc:
        raise Refusal(f"the audit of {url} failed: {exc}") from exc
    try:
        session = devtools_session(tools, url, plan["viewport"])
        deadline = time.monotonic() + plan["timeout_s"]
        loaded = tools.wait_for("Page.loadEventFired", deadline, ctx.stop)
        ctx.check()
        tools.wait_for(None, time.monotonic() + plan["settle_s"], ctx.stop)  # late requests
        ctx.check()
        timing = evaluate(tools, session, TIMING_JS)
        found = {"timing": timing if isinstance(timing, dict) else {}, "loaded": loaded,
                 "console_errors": console_errors(tools.events), **page_weight(tools.events),
                 **ax_findings(tools, session)}
        contrast = evaluate(tools, session, CONTRAST_JS)
        found["low_contrast"] = contrast if isinstance(contrast, list) else []
        shot = tools.send("Page.captureScreenshot", {"format": "png"}, session=session,
                          timeout=60)
        found["screenshot"] = base64.b64decode(shot.get("data") or "")
        return found
    except DevToolsError as exc:
        said = read_tail(os.path.join(ctx.workdir, "chromium.log"), 2000).decode(
            "utf-8", "replace")
        raise Refusal(f"the audit of {url} failed: {exc}" + (
            f" (Chromium said: {tail(said, 200)})" if said.strip() else "")) from exc
    finally:
        tools.close()


AUDIT_COUNTS = (("console_errors", "console error"), ("failed_requests", "failed request"),
                ("refused_requests", "refused request"),
                ("missing_alt", "image without a text alternative"),
                ("unlabeled_inputs", "unlabeled form field"),
                ("unnamed_controls", "button or link without a name"),
                ("low_contrast", "low-contrast text"))


def audit_verdict(found: dict) -> str | None:
    parts = [f"{len(found[key])} {noun}{'s' if len(found[key]) != 1 else ''}"
             for key, noun in AUDIT_COUNTS if found.get(key)]
    if not found["loaded"]:
        parts.insert(0, "the page did not finish loading")
    return ", ".join(parts) or None


def wl_web_audit(runtime: Runtime, ctx: JobContext) -> dict:
    url = web_url(ctx.spec)
    browser_may_open(runtime, url, ctx)
    size = str(ctx.params.get("viewport") or "1280x800")
    if not re.fullmatch(r"^\d{2,5}x\d{2,5}$", size):
        raise Refusal("params.viewport must look like 1280x800")
    width, height = (int(v) for v in size.split("x"))
    plan = {"viewport": (width, height),
            "timeout_s": number_param(ctx.params, "timeout_s", 60, 1, 600),
            "settle_s": number_param(ctx.params, "settle_s", 1, 0, 60)}
    found = audit_page(runtime, ctx, url, plan)
    png = found.pop("screenshot")
    artifacts = [upload_bytes(ctx, png, f"audit-{ctx.job_id}.png")] if png else []
    report = json.dumps(dict(found, url=url), indent=1, sort_keys=True).encode("utf-8")
    artifacts.append(upload_bytes(ctx, report, f"audit-{ctx.job_id}.json"))
    timing = {k: round(v, 1) for k, v in found["timing"].items() if isinstance(v, (int, float))}
    metrics = dict(timing, total_bytes=found["total_bytes"], requests=found["requests"],
                   **{key: len(found[key]) for key, _ in AUDIT_COUNTS})
    error = audit_verdict(found)
    ctx.post(ctx.row(1, error is None, dict(metrics), url=url, error=error,
                     bytes_by_type=found["bytes_by_type"], artifacts=artifacts))
    details = {key: found[key] for key, _ in AUDIT_COUNTS}
    return final(error is None, error and f"{url}: {error}", metrics, artifacts,
                 bytes_by_type=found["bytes_by_type"], findings=details)


# --- digest: an app's results over the last days, read back from the collector ---

DIGEST_MAX_PAGES = 40  # 50 records a page: 2,000 jobs or result rows per query at most
# What a page and a view may add to memory, whatever a collector puts in its answers: a page
# holds 50 records, and a view keeps every page until the digest is written.
DIGEST_PAGE_RECORDS = 50
DIGEST_VIEW_RECORDS = DIGEST_MAX_PAGES * DIGEST_PAGE_RECORDS
APP_NAME = re.compile(r"^[^\x00-\x1f\x7f]{1,200}$")


def digest_plan(ctx: JobContext) -> dict:
    app = text_param(ctx.params, "app", None, APP_NAME, "the app's name (app.name of its jobs)")
    days = int_param(ctx.params, "days", 7, 1, 366)
    model = ctx.params.get("model")
    if model is not None and (not isinstance(model, str) or not APP_NAME.fullmatch(model)):
        raise Refusal(f"params.model must be a model name; the job gave {shown(model)}")
    end = time.time()
    # Whole seconds on the wire: the end rounds up, so a row stored in the second the digest
    # started (a job that closed just before it) is inside the window.
    return {"app": app, "days": days, "model": model,
            "from": iso_utc(end - days * 86400), "to": iso_utc(math.ceil(end))}


def iso_utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def api_get(ctx: JobContext, path: str, query: dict) -> dict | None:
    """One read of the job's collector; None when it has no such view (an older one)."""
    ctx.check()
    try:
        _, reply = ctx.collector.call_json("GET", path + "?" + urllib.parse.urlencode(query),
                                           timeout=60)
    except HttpError as exc:
        if exc.status == 404:
            return None
        raise Refusal(f"the collector refused {path}: {exc.message}") from exc
    except Unreachable as exc:
        raise Refusal(f"the collector could not be read ({exc})") from exc
    return reply if isinstance(reply, dict) else {}


def api_pages(ctx: JobContext, path: str, query: dict, key: str) -> list | None:
    """Every record of a paged collector view, up to DIGEST_MAX_PAGES pages of
    DIGEST_PAGE_RECORDS; what a collector sends beyond that is dropped."""
    records: list = []
    for page in range(1, DIGEST_MAX_PAGES + 1):
        reply = api_get(ctx, path, dict(query, page=page))
        if reply is None:
            return None if page == 1 else records
        found = reply.get(key)
        kept = [r for r in found[:DIGEST_PAGE_RECORDS] if isinstance(r, dict)] \
            if isinstance(found, list) else []
        pages = _int_or_none(reply.get("pages")) or 1
        del reply, found  # a page's answer may be 8 MiB: not held while the next is read
        records += kept[:DIGEST_VIEW_RECORDS - len(records)]
        if len(records) >= DIGEST_VIEW_RECORDS or page >= pages:
            break
    return records


def job_app(job: dict) -> str | None:
    """The app a job is about: app.name, else the application id a cold-start names."""
    spec = job.get("spec") if isinstance(job.get("spec"), dict) else {}
    app = spec.get("app") if isinstance(spec.get("app"), dict) else {}
    params = spec.get("params") if isinstance(spec.get("params"), dict) else {}
    for value in (app.get("name"), params.get("app"), params.get("app_id")):
        if isinstance(value, str) and value:
            return value
    return None


def workload_rates(jobs: list[dict]) -> list[dict]:
    table: dict[str, dict] = {}
    for job in jobs:
        row = table.setdefault(str(job.get("workload")), {
            "workload": str(job.get("workload")), "jobs": 0, "done": 0, "failed": 0,
            "cancelled": 0, "open": 0})
        row["jobs"] += 1
        status = job.get("status")
        row[status if status in ("done", "failed", "cancelled") else "open"] += 1
    for row in table.values():
        closed = row["done"] + row["failed"]
        row["pass_rate"] = round(row["done"] / closed, 3) if closed else None
    return [table[name] for name in sorted(table)]


def flow_rates(ui_jobs: list[dict], app: str) -> list[dict]:
    """Each ui-test flow of the app: runs, passes, failures; flaky when it did both."""
    flows: dict[str, dict] = {}
    for job in ui_jobs:
        if job.get("app") != app:
            continue
        for flow in job.get("flows") or []:
            row = flows.setdefault(str(flow.get("flow")), {"flow": str(flow.get("flow")),
                                                           "runs": 0, "pass": 0, "fail": 0})
            for key in ("runs", "pass", "fail"):
                row[key] += int(flow.get(key) or 0)
    for row in flows.values():
        decided = row["pass"] + row["fail"]
        row["pass_rate"] = round(row["pass"] / decided, 3) if decided else None
        row["flaky"] = row["pass"] > 0 and row["fail"] > 0
    return [flows[name] for name in sorted(flows)]


def trend(values: list[float]) -> dict:
    first, last = values[0], values[-1]
    return {"samples": len(values), "first": first, "last": last,
            "median": round(statistics.median(values), 1), "min": min(values),
            "max": max(values),
            "change_pct": round((last - first) / first * 100, 1) if first else None}


def cold_start_trends(rows: list[dict], job_ids: set[str]) -> list[dict]:
    """p50 launch time per (device, launch state), oldest first."""
    series: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for row in rows:
        p50 = (row.get("metrics") or {}).get("p50_ms")
        if row.get("job_id") in job_ids and row.get("iter", 0) >= 1 and \
                isinstance(p50, (int, float)) and not isinstance(p50, bool):
            key = (str(row.get("device_id")), str(row.get("state") or "cold"))
            series.setdefault(key, []).append((str(row.get("created_at")), float(p50)))
    return [dict(device_id=device, state=state, **trend([v for _, v in sorted(points)]))
            for (device, state), points in sorted(series.items())]


def soak_trends(views: list[dict], job_ids: set[str]) -> list[dict]:
    """Memory and errors of the app's soak passes per device, oldest first."""
    out = []
    for series in views:
        points = [p for p in series.get("points") or [] if p.get("job_id") in job_ids]
        memory = [float(p["mem_mb"]) for p in points
                  if isinstance(p.get("mem_mb"), (int, float))]
        if points:
            out.append({"device_id": series.get("device_id"), "passes": len(points),
                        "jobs": len({p.get("job_id") for p in points}),
                        "errors": sum(int(p.get("errors") or 0) for p in points),
                        "memory": trend(memory) if memory else None})
    return out


def collect_digest(ctx: JobContext, plan: dict) -> dict:
    window = {"from": plan["from"], "to": plan["to"]}
    jobs = [j for j in api_pages(ctx, "/api/jobs", window, "jobs") or []
            if job_app(j) == plan["app"] and not j.get("fanout_parent")
            and j.get("workload") != "digest"]
    job_ids = {str(j.get("job_id")) for j in jobs}
    ui = api_pages(ctx, "/api/results/ui", window, "jobs")
    cold = api_pages(ctx, "/api/results", dict(window, workload="cold-start"), "results")
    digest: dict = {"app": plan["app"], "days": plan["days"], **window,
                    "workloads": workload_rates(jobs),
                    "flows": flow_rates(ui or [], plan["app"]),
                    "cold_start": cold_start_trends(cold or [], job_ids),
                    "failures": [{"job_id": j.get("job_id"), "workload": j.get("workload"),
                                  "error": j.get("last_error")} for j in jobs
                                 if j.get("status") == "failed"][:20]}
    digest["flaky"] = [f["flow"] for f in digest["flows"] if f["flaky"]]
    soak = api_get(ctx, "/api/results/soak", dict(window, limit=10000)) or {}
    digest["soak"] = soak_trends(soak.get("series") or [], job_ids)
    if plan["model"]:
        bench = api_get(ctx, "/api/results/bench", dict(window, model=plan["model"])) or {}
        rows = bench.get("rows")
        digest["bench"] = rows[:DIGEST_VIEW_RECORDS] if isinstance(rows, list) else []
    return digest


def digest_tables(digest: dict) -> list[tuple[str, list[str], list[list[object]]]]:
    """(heading, columns, rows) of each section; the Markdown and the HTML both come from it."""
    def rate(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 100:.0f}%"

    def trend_cells(t: dict | None) -> list[object]:
        if not t:
            return ["", "", "", ""]
        change = "" if t["change_pct"] is None else f"{t['change_pct']:+.1f}%"
        return [t["first"], t["last"], t["median"], change]

    sections = [
        ("Jobs by workload", ["workload", "jobs", "done", "failed", "cancelled", "pass rate"],
         [[w["workload"], w["jobs"], w["done"], w["failed"], w["cancelled"],
           rate(w["pass_rate"])] for w in digest["workloads"]]),
        ("UI flows", ["flow", "runs", "passed", "failed", "pass rate", "flaky"],
         [[f["flow"], f["runs"], f["pass"], f["fail"], rate(f["pass_rate"]),
           "yes" if f["flaky"] else ""] for f in digest["flows"]]),
        ("Cold start (p50 ms)", ["device", "state", "samples", "first", "last", "median",
                                 "change"],
         [[c["device_id"], c["state"], c["samples"], *trend_cells(c)]
          for c in digest["cold_start"]]),
        ("Soak (memory MB)", ["device", "jobs", "passes", "errors", "first", "last", "median",
                              "change"],
         [[s["device_id"], s["jobs"], s["passes"], s["errors"], *trend_cells(s["memory"])]
          for s in digest["soak"]]),
        ("Failed jobs", ["job", "workload", "error"],
         [[f["job_id"], f["workload"], f["error"] or ""] for f in digest["failures"]]),
    ]
    if "bench" in digest:
        sections.append(("Benchmarks", ["device", "model", "runs", "decode tok/s (median)"],
                         [[b.get("device_id"), b.get("model"), b.get("runs"),
                           (b.get("decode_tok_s") or {}).get("median")]
                          for b in digest["bench"]]))
    return sections


def digest_period(days: int) -> str:
    return "the last day" if days == 1 else f"the last {days} days"


def digest_markdown(digest: dict) -> str:
    def cell(value: object) -> str:
        return " ".join(str(value).split()).replace("|", "\\|")

    lines = [f"# {cell(digest['app'])}: {digest_period(digest['days'])}", "",
             f"{digest['from']} to {digest['to']}.", ""]
    if digest["flaky"]:
        lines += ["Flaky flows (passed and failed in this window): " +
                  ", ".join(cell(f) for f in digest["flaky"]) + ".", ""]
    for heading, columns, rows in digest_tables(digest):
        lines += [f"## {heading}", ""]
        if not rows:
            lines += ["None in this window.", ""]
            continue
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def digest_html(digest: dict) -> str:
    def esc(value: object) -> str:
        return html.escape("" if value is None else str(value))

    title = f"{esc(digest['app'])}: {digest_period(digest['days'])}"
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{title}</title>",
             "<style>body{font:15px system-ui,sans-serif;margin:2em;max-width:70em}"
             "table{border-collapse:collapse;margin-bottom:1.5em}"
             "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}</style>",
             "</head><body>", f"<h1>{title}</h1>",
             f"<p>{esc(digest['from'])} to {esc(digest['to'])}.</p>"]
    if digest["flaky"]:
        parts.append("<p>Flaky flows (passed and failed in this window): " +
                     ", ".join(esc(f) for f in digest["flaky"]) + ".</p>")
    for heading, columns, rows in digest_tables(digest):
        parts.append(f"<h2>{esc(heading)}</h2>")
        if not rows:
            parts.append("<p>None in this window.</p>")
            continue
        parts.append("<table><tr>" + "".join(f"<th>{esc(c)}</th>" for c in columns) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>"
                  for row in rows]
        parts.append("</table>")
    return "\n".join([*parts, "</body></html>", ""])


def wl_digest(runtime: Runtime, ctx: JobContext) -> dict:
    plan = digest_plan(ctx)
    digest = collect_digest(ctx, plan)
    ctx.post(ctx.row(1, True, {"jobs": sum(w["jobs"] for w in digest["workloads"]),
                               "flows": len(digest["flows"])}, step="read the collector"))
    stem = "digest-" + re.sub(r"[^A-Za-z0-9._-]+", "_", plan["app"])[:60]
    artifacts = [upload_bytes(ctx, digest_markdown(digest).encode("utf-8"), stem + ".md"),
                 upload_bytes(ctx, digest_html(digest).encode("utf-8"), stem + ".html")]
    closed = sum(w["done"] + w["failed"] for w in digest["workloads"])
    done = sum(w["done"] for w in digest["workloads"])
    metrics = drop_none({"jobs": sum(w["jobs"] for w in digest["workloads"]),
                         "pass_rate": round(done / closed, 3) if closed else None,
                         "flows": len(digest["flows"]), "flaky_flows": len(digest["flaky"]),
                         "failed_jobs": len(digest["failures"])})
    return final(True, None, metrics, artifacts, digest=digest)


# --- archive: sign and package a build with this machine's own tools and credentials ---
#
# A job names a credential item (`account`); the secret lives only on this machine:
# STATE/credentials/<account>.json (mode 0600, like an ssh key), or on macOS a Keychain generic
# password with service "fleet-agent" and that account holding the same JSON. Secrets reach the
# tools in 0600 files in the job's scratch directory (passwords as bundletool's and apksigner's
# file: form), never on a command line another user could read with ps. An item signs only for
# the apps its owner lists in its "apps" field (the job's params.app / app.name, what the result
# is published under): whoever can enqueue a job picks the bytes and the app, so an item with no
# list signs nothing.

ACCOUNT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
KEYCHAIN_SERVICE = "fleet-agent"
EXPORT_METHODS = ("app-store", "app-store-connect", "ad-hoc", "development", "enterprise",
                  "release-testing", "debugging")
BUILD_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
PUBLISH_TEXT = re.compile(r"^[\x20-\x7e]{1,200}$")  # what an HTTP header can carry


def credentials_path(runtime: Runtime, account: str) -> str:
    return os.path.join(runtime.state_dir, "credentials", account + ".json")


def credential_item(runtime: Runtime, account: str, app: str) -> dict:
    """The credential item named `account` from this machine's store (a Refusal naming where
    to put it when there is none), when its owner bound it to `app`.

    Anyone who can enqueue a job chooses the bytes to sign and the app to publish them under,
    so an item signs only for the apps its owner listed in its "apps" field; an item without
    that list signs nothing. The Refusals name the field and where the item lives, never a
    value the item holds."""
    path = credentials_path(runtime, account)
    text = None
    where = path
    if os.path.isfile(path):
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            raise Refusal(f"the credential file {path} can be read by others (mode "
                          f"{mode:o}); make it private with chmod 600")
        with open(path, encoding="utf-8") as fh:
            text = fh.read(1 << 20)
    elif runtime.tools.get("security"):
        found = run_cmd([runtime.tools["security"], "find-generic-password", "-s",
                         KEYCHAIN_SERVICE, "-a", account, "-w"], timeout=30)
        text = found.out if found.ok else None
        where = (f"the Keychain item with service {KEYCHAIN_SERVICE} and account {account} "
                 "(its JSON)")
    if text is None:
        raise Refusal(f"this executor has no credential item {account!r}: put it in {path} "
                      "(mode 0600)" + (", or in the Keychain as a generic password with "
                                       f"service {KEYCHAIN_SERVICE} and account {account}"
                                       if runtime.tools.get("security") else ""))
    try:
        item = json.loads(text)
    except ValueError:
        raise Refusal(f"the credential item {account!r} is not a JSON object") from None
    if not isinstance(item, dict):
        raise Refusal(f"the credential item {account!r} is not a JSON object")
    apps = item.get("apps")
    if apps is None:
        raise Refusal(f"refused: the credential item {account!r} lists no apps, so it signs "
                      f"nothing; its owner opts an app in by naming it in an \"apps\" list in "
                      f"{where}, e.g. \"apps\": [\"shop\"]")
    if not isinstance(apps, list) or not all(isinstance(a, str) and a for a in apps):
        raise Refusal(f"refused: the \"apps\" field of the credential item {account!r} must "
                      f"be a list of app names; its owner fixes it in {where}")
    if app not in apps:
        raise Refusal(f"refused: the credential item {account!r} signs only the apps its "
                      f"\"apps\" list names, and this job's app {shown(app)} is not one of them; "
                      f"its owner adds the app to \"apps\" in {where} to allow it")
    return item


def secret_file(ctx: JobContext, name: str, data: bytes) -> str:
    path = os.path.join(ctx.workdir, "secret-" + name)
    atomic_write(path, data, 0o600)
    return path


def source_kind(path: str) -> str:
    """aab, apk or xcarchive, from what the archive holds."""
    try:
        with open_zip(path) as bundle:
            names = bundle.namelist()
    except zipfile.BadZipFile:
        raise Refusal("params.source is not an .aab, an .apk or a zipped .xcarchive") from None
    if "BundleConfig.pb" in names or any(n.startswith("base/manifest/") for n in names):
        return "aab"
    if "AndroidManifest.xml" in names:
        return "apk"
    if any(".xcarchive/" in n for n in names):
        return "xcarchive"
    raise Refusal("params.source is not an .aab, an .apk or a zipped .xcarchive")


def item_field(item: dict, account: str, name: str, default: str | None = None) -> str:
    value = item.get(name, default)
    if not isinstance(value, str) or not value:
        raise Refusal(f"the credential item {account!r} has no {name}")
    return value


def keystore_files(ctx: JobContext, item: dict, account: str) -> dict:
    """The signing key's files: the keystore (a path on this machine, or keystore_b64) and the
    two passwords, each in a private file."""
    if isinstance(item.get("keystore_b64"), str):
        try:
            keystore = secret_file(ctx, "keystore", base64.b64decode(item["keystore_b64"]))
        except (binascii.Error, ValueError):
            raise Refusal(f"the credential item {account!r} has a keystore_b64 that is not "
                          "base64") from None
    else:
        keystore = item_field(item, account, "keystore")
        if not os.path.isabs(keystore) or not os.path.isfile(keystore):
            raise Refusal(f"the keystore of the credential item {account!r} ({keystore}) is "
                          "not a file on this machine")
    store_pass = item_field(item, account, "keystore_password")
    return {"keystore": keystore, "alias": item_field(item, account, "key_alias"),
            "store_pass": secret_file(ctx, "ks-pass", store_pass.encode("utf-8")),
            "key_pass": secret_file(ctx, "key-pass", item_field(
                item, account, "key_password", store_pass).encode("utf-8"))}


def bundletool_argv(runtime: Runtime) -> list[str]:
    tool = tool_ready(runtime.tools, "bundletool")
    if not tool:
        raise Refusal("an .aab needs bundletool on this executor (--bundletool, or java with "
                      "--bundletool pointing at bundletool's .jar)")
    return [runtime.tools["java"], "-jar", tool] if tool.endswith(".jar") else [tool]


def android_archive_argv(runtime: Runtime, ctx: JobContext, kind: str, source: str,
                         keys: dict, out: str) -> list[str]:
    if kind == "aab":
        mode = text_param(ctx.params, "mode", "default", re.compile(r"^(default|universal)$"),
                          "default or universal")
        return [*bundletool_argv(runtime), "build-apks", "--bundle=" + source,
                "--output=" + out, "--ks=" + keys["keystore"],
                "--ks-pass=file:" + keys["store_pass"], "--ks-key-alias=" + keys["alias"],
                "--key-pass=file:" + keys["key_pass"], "--mode=" + mode]
    if not runtime.tools.get("apksigner"):
        raise Refusal("an .apk is signed with apksigner (Android's build-tools), which this "
                      "executor does not have on PATH")
    return [runtime.tools["apksigner"], "sign", "--ks", keys["keystore"], "--ks-pass",
            "file:" + keys["store_pass"], "--ks-key-alias", keys["alias"], "--key-pass",
            "file:" + keys["key_pass"], "--out", out, source]


def export_options(ctx: JobContext, item: dict, account: str) -> str:
    """ExportOptions.plist for xcodebuild -exportArchive (values checked: they go into XML)."""
    method = text_param(ctx.params, "method", item.get("method") or "app-store",
                        re.compile("^(" + "|".join(EXPORT_METHODS) + ")$"),
                        "one of " + ", ".join(EXPORT_METHODS))
    team = item_field(item, account, "team_id")
    if not re.fullmatch(r"^[A-Z0-9]{10}$", team):
        raise Refusal(f"the team_id of the credential item {account!r} is not a team id")
    plist = ('<?xml version="1.0" encoding="UTF-8"?>\n<plist version="1.0"><dict>'
             f"<key>method</key><string>{method}</string>"
             f"<key>teamID</key><string>{team}</string>"
             "<key>destination</key><string>export</string></dict></plist>\n")
    path = os.path.join(ctx.workdir, "ExportOptions.plist")
    atomic_write(path, plist.encode("utf-8"))
    return path


def ios_archive_argv(runtime: Runtime, ctx: JobContext, source: str, item: dict,
                     account: str, out_dir: str) -> list[str]:
    if not runtime.tools.get("xcodebuild"):
        raise Refusal("an .xcarchive is exported with xcodebuild, which this executor does "
                      "not have (a Mac with Xcode)")
    unpacked = os.path.join(ctx.workdir, "xcarchive")
    os.makedirs(unpacked, mode=0o700)
    safe_unzip(source, unpacked, check=ctx.check)
    archive = next((os.path.join(d, n) for d, dirs, _ in os.walk(unpacked) for n in dirs
                    if n.endswith(".xcarchive")), None)
    if archive is None:
        raise Refusal("the source zip holds no .xcarchive folder")
    if isinstance(item.get("api_key_p8"), str):
        key_path = secret_file(ctx, "AuthKey.p8", item["api_key_p8"].encode("utf-8"))
    else:
        key_path = item_field(item, account, "api_key_path")
    return [runtime.tools["xcodebuild"], "-exportArchive", "-archivePath", archive,
            "-exportPath", out_dir, "-exportOptionsPlist", export_options(ctx, item, account),
            "-allowProvisioningUpdates", "-authenticationKeyPath", key_path,
            "-authenticationKeyID", item_field(item, account, "api_key_id"),
            "-authenticationKeyIssuerID", item_field(item, account, "api_issuer_id")]


def archive_plan(ctx: JobContext) -> dict:
    app_spec = ctx.spec.get("app") if isinstance(ctx.spec.get("app"), dict) else {}
    build = ctx.params.get("build", app_spec.get("build"))
    if build is not None and (not isinstance(build, str) or not BUILD_LABEL.fullmatch(build)):
        raise Refusal(f"params.build must be a build label such as 1.4.2+57; the job gave "
                      f"{shown(build)}")
    return {"source": sha_param(ctx.params, "source"),
            "app": text_param(ctx.params, "app", app_spec.get("name"), PUBLISH_TEXT,
                              "the app's name in printable ASCII (what the archive is "
                              "published under)"),
            "account": text_param(ctx.params, "account", None, ACCOUNT,
                                  "the name of a credential item on this executor "
                                  "(letters, digits, . _ -)"),
            "build": build, "timeout_s": number_param(ctx.params, "timeout_s", 1800, 1, 86400)}


def run_archive_tool(ctx: JobContext, argv: list[str], timeout: float) -> float:
    log_path = os.path.join(ctx.workdir, "archive.log")
    code, wall_ms, _ = run_watched(argv, ctx, timeout, log_path, cwd=ctx.workdir)
    ctx.check()
    said = read_tail(log_path, 2000).decode("utf-8", "replace")
    tool = os.path.basename(argv[0])
    if code is None:
        raise Refusal(f"{tool} was stopped after the {timeout:g} s timeout")
    if code != 0:
        raise Refusal(f"{tool} exited with status {code}: {tail(said, 300) or 'no message'}")
    return wall_ms


def wl_archive(runtime: Runtime, ctx: JobContext) -> dict:
    plan = archive_plan(ctx)
    item = credential_item(runtime, plan["account"], plan["app"])  # before a byte is fetched
    source = ctx.fetch(plan["source"], ".zip")
    kind = source_kind(source)
    out = os.path.join(ctx.workdir, "out")
    os.makedirs(out, mode=0o700)
    try:
        if kind == "xcarchive":
            argv = ios_archive_argv(runtime, ctx, source, item, plan["account"], out)
        else:
            copy = os.path.join(ctx.workdir, "source." + kind)  # the tools read the extension
            shutil.copyfile(source, copy)
            target = os.path.join(out, "app." + ("apks" if kind == "aab" else "apk"))
            argv = android_archive_argv(runtime, ctx, kind, copy,
                                        keystore_files(ctx, item, plan["account"]), target)
        ctx.post(ctx.row(1, True, {}, step=f"signing the {kind} with {os.path.basename(argv[0])}"))
        wall_ms = run_archive_tool(ctx, argv, plan["timeout_s"])
    finally:
        for name in os.listdir(ctx.workdir):
            if name.startswith("secret-"):
                os.unlink(os.path.join(ctx.workdir, name))
    return publish_archive(ctx, plan, kind, out, wall_ms)


def publish_archive(ctx: JobContext, plan: dict, kind: str, out: str, wall_ms: float) -> dict:
    built = sorted(glob.glob(os.path.join(out, "*.ipa" if kind == "xcarchive" else "*.ap*")))
    if not built:
        raise Refusal(f"the {kind} tool finished but left nothing to publish in its output")
    headers = {"x-artifact-app": plan["app"],
               "x-artifact-build": plan["build"] or plan["source"][:12],
               "x-artifact-platform": "ios" if kind == "xcarchive" else "android"}
    name = f"{plan['app']}-{headers['x-artifact-build']}{os.path.splitext(built[0])[1]}"
    sha = upload_file(ctx, built[0], name, headers)
    return final(True, None, {"archive_ms": round(wall_ms, 1),
                              "bytes": os.path.getsize(built[0])}, [sha], source_kind=kind,
                 published=headers)


HOST_WORKLOADS = {"install": wl_install, "ui-test": wl_ui_test, "cold-start": wl_cold_start,
                  "web-test": wl_web_test, "web-shots": wl_web_shots, "app-soak": wl_soak,
                  "soak": wl_soak, "a11y-audit": wl_a11y_audit,
                  "locale-shots": wl_locale_shots, "drain": wl_drain,
                  "web-audit": wl_web_audit, "web-unfurl": wl_web_unfurl,
                  "digest": wl_digest, "archive": wl_archive}


# --------------------------------------------------------------------------------------------
# Host executor: what it declares, and the devices attached to it
# --------------------------------------------------------------------------------------------
#
# An executor tells each collector what it can run (POST /executors/register) so the queue can
# offer it only those host jobs, and registers each attached device (POST /devices/register,
# with no capabilities: nothing polls for them) so the shelf shows them and rows filed under
# their ids have a device to belong to. Both at start and every --beacon-s (60 s) after.

DRIVES_DEVICES = (("adb",), ("xcrun",))
# Each host capability and what it needs: alternatives, any one of which is enough, each a set
# of tools (keys of TOOL_NAMES) all needed; () means the standard library is enough.
HOST_NEEDS = (
    ("install", DRIVES_DEVICES),
    ("cold-start", DRIVES_DEVICES),
    ("ui-test:flow_runner", (("adb", "flow_runner"), ("xcrun", "flow_runner"))),
    ("ui-test:native_bundle", (("adb", "native_bundle"), ("xcrun", "native_bundle"))),
    ("app-soak", DRIVES_DEVICES),
    ("soak", DRIVES_DEVICES),
    # Android's UI tree comes from uiautomator; a simulator's from the flow runner.
    ("a11y-audit", (("adb",), ("xcrun", "flow_runner"))),
    ("locale-shots", DRIVES_DEVICES),
    ("drain", (("adb",), ("ioreg",))),  # an Android device's battery, or this Mac's own
    ("web-test", (("chromium",),)),
    ("web-shots", (("chromium",), ("adb",))),
    ("web-audit", (("chromium",),)),
    ("web-unfurl", ((),)),
    ("digest", ((),)),
    ("archive", (("bundletool",), ("xcodebuild",), ("apksigner",))),
)
TOOL_FLAGS = {"adb": "--adb", "xcrun": "--xcrun", "chromium": "--chromium",
              "flow_runner": "--flow-runner", "native_bundle": "--native-bundle",
              "bundletool": "--bundletool"}


def tool_ready(tools: dict, key: str) -> str | None:
    """The tool's path when it can run here: a bundletool .jar also needs java."""
    path = tools.get(key)
    if path and key in JAR_TOOLS and path.endswith(".jar") and not tools.get("java"):
        return None
    return path


def host_capability_reasons(tools: dict) -> list[tuple[str, str]]:
    """(capability, the tools that make it possible) for what this executor declares."""
    found = []
    for capability, alternatives in HOST_NEEDS:
        for needs in alternatives:
            if all(tool_ready(tools, key) for key in needs):
                found.append((capability, ", ".join(str(tools[k]) for k in needs)
                              or "standard library"))
                break
    return found


def tool_wanted(key: str) -> str:
    return f"{key} ({TOOL_FLAGS.get(key, 'on PATH')})"


def host_missing(tools: dict) -> list[tuple[str, str]]:
    """(capability, what it would need) for the host workloads this executor does not declare."""
    declared = {cap for cap, _ in host_capability_reasons(tools)}
    return [(capability, "needs " + ", or ".join(
        " and ".join(tool_wanted(key) for key in needs) for needs in alternatives))
        for capability, alternatives in HOST_NEEDS if capability not in declared]


def executor_registration(runtime: Runtime) -> dict:
    return {"name": runtime.reporter_id, "capabilities": runtime.capabilities(), "slots": 1,
            "agent": "fleet_agent " + AGENT_VERSION}


def register_executor(runtime: Runtime, collector: Collector) -> None:
    """POST /executors/register; a collector that answers 404 has no such route, which is
    remembered (and said once) so it is not asked again. Unreachable is the caller's."""
    with runtime.presence_lock:
        asking = runtime.registering.setdefault(collector.url, threading.Lock())
    # The claim loop and the presence round both register at start: one at a time to a
    # collector, so one without the route is asked once.
    with asking:
        with runtime.presence_lock:
            if collector.url in runtime.no_executor_route:
                return
        try:
            collector.call_json("POST", "/executors/register", executor_registration(runtime),
                                limit=MAX_REPLY_BYTES)
        except HttpError as exc:
            if exc.status != 404:
                log.warning("collector %s refused this executor's registration: %s",
                            collector.url, printable(exc.message))
                return
            with runtime.presence_lock:
                runtime.no_executor_route.add(collector.url)
            log.info("collector %s does not take executor registrations; it will offer this "
                     "executor every host job", collector.url)


ANDROID_KINDS = {"tablet": "tablet", "tv": "tv", "watch": "watch", "automotive": "car"}
SIM_KINDS = (("iPad", "tablet"), ("Apple TV", "tv"), ("Watch", "watch"), ("Vision", "headset"))


def android_props(adb: str, serial: str) -> dict[str, str]:
    """`getprop` of one device as a dict ([ro.product.model]: [Pixel 8] lines)."""
    result = run_cmd(adb_shell_argv(adb, serial, "getprop"), timeout=20)
    found = re.findall(r"(?m)^\[([^\]]+)\]: \[([^\]]*)\]", result.out if result.ok else "")
    return dict(found)


def attached_descriptor(runtime: Runtime, target: dict) -> dict:
    """The descriptor an attached device is registered with (what a match can select on)."""
    descriptor = {"model": target.get("model"), "os": target.get("os"),
                  "platform": target["platform"], "kind": None, "serial": target["device_id"],
                  "attached_to": runtime.reporter_id, "simulator": False,
                  "emulator": bool(target.get("emulator"))}
    if target["platform"] == "android":
        props = android_props(runtime.tools["adb"], target["device_id"])
        release = props.get("ro.build.version.release")
        character = props.get("ro.build.characteristics", "")
        descriptor.update(
            model=props.get("ro.product.model") or target.get("model"),
            os=f"Android {release}" if release else None,
            kind=next((k for word, k in ANDROID_KINDS.items() if word in character), "phone"))
    else:
        name = str(target.get("model") or "")
        descriptor.update(simulator=True, kind=next(
            (k for word, k in SIM_KINDS if word in name), "phone" if "iPhone" in name else None))
    return descriptor


def register_attached(runtime: Runtime, collector: Collector, targets: list[dict]) -> int:
    """Register each attached device (best effort: a failure never stops the executor);
    returns how many the collector took."""
    taken = 0
    for target in targets:
        body = {"device_id": target["device_id"], "descriptor": target["descriptor"],
                "capabilities": []}
        try:
            collector.register(body)
            taken += 1
        except HttpError as exc:
            log.warning("collector %s refused attached device %s: %s", collector.url,
                        printable(target["device_id"]), printable(exc.message))
        except Unreachable as exc:
            log.debug("attached device %s not registered with %s: %s", target["device_id"],
                      collector.url, exc)
    return taken


# Attached devices one presence round describes and registers: each is asked for its
# properties, so thousands listed (or a tool that lists them) made every round take hours.
MAX_ATTACHED = 256


class Presence(threading.Thread):
    """Host mode: every --beacon-s, the executor's registration and its attached devices to
    every collector. Its failures are told like other outages and never stop a claim."""

    def __init__(self, runtime: Runtime, collectors: list[Collector]):
        super().__init__(name="presence", daemon=True)
        self.rt = runtime
        self.collectors = collectors

    def run(self) -> None:
        while True:
            try:
                self.round()
            except Exception:  # a surprise must not end the thread that keeps presence
                log.exception("the executor's registration round failed")
            if self.rt.stopping.wait(self.rt.cfg.beacon_s):
                return

    def round(self) -> None:
        # The executor first: describing the attached devices asks each of them (getprop may
        # take its whole 20 s on a device that hangs), and that must not hold up the
        # registration that keeps the executor itself seen.
        reached = []
        for collector in self.collectors:
            try:
                register_executor(self.rt, collector)
            except Unreachable as exc:
                self.rt.outage(collector.url).failed(exc, self.rt.cfg.beacon_s)
                continue
            reached.append(collector)
        if not reached:
            return
        attached = attached_targets(self.rt)
        if len(attached) > MAX_ATTACHED:
            warn_once("attached past the bound", "%d devices are attached; the first %d are "
                      "registered (a USB bus holds at most 127)", len(attached), MAX_ATTACHED)
        targets = [dict(t, descriptor=attached_descriptor(self.rt, t))
                   for t in attached[:MAX_ATTACHED]]
        for collector in reached:
            register_attached(self.rt, collector, targets)


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
    # llama.cpp renamed its completion tool llama-completion when llama-cli became a chat UI.
    "llama-cli": ("llama-completion", "llama-cli"),
    "llama-embedding": ("llama-embedding",),
    "llama-server": ("llama-server",),
    "llama-quantize": ("llama-quantize",),
    "llama-convert": ("convert_hf_to_gguf.py",),
    "llama-mtmd-cli": ("llama-mtmd-cli",),
    "whisper-cli": ("whisper-cli",),
    "git": ("git",),
    **{key: (key,) for key, _, _ in BUILD_TOOLCHAINS.values()},
    # archive and drain on the executor host
    "bundletool": ("bundletool",),
    "apksigner": ("apksigner",),
    "java": ("java",),
    "ioreg": ("ioreg",),
    "security": ("security",),
}
JAR_TOOLS = ("bundletool",)  # may be given as a .jar: then java runs it


def find_tools(explicit: dict, probe: Probe) -> dict:
    """Path of each tool the agent can drive: the configured one, else the first on PATH."""
    found = {}
    for key, names in TOOL_NAMES.items():
        for candidate in ([explicit[key]] if explicit.get(key) else []) + list(names):
            path = candidate if os.path.isabs(candidate) else probe.which(candidate)
            # A .py script (llama.cpp's converter) need not be executable: Python runs it;
            # nor a .jar (bundletool): java does.
            if path and os.path.isfile(path) and (os.access(path, os.X_OK) or (
                    key in SCRIPT_TOOLS and path.endswith(".py")) or (
                    key in JAR_TOOLS and path.endswith(".jar"))):
                found[key] = path
                break
    return found


def job_ceiling(ctx: JobContext, seconds: float | None) -> threading.Timer | None:
    """Stop the job once it has run `seconds` (the owner's --max-job-seconds; 0 or None: never),
    as a cancel stops it, with the reason its final row gives. Lease beacons would otherwise
    keep a job that never ends claimed and running for as long as the agent lives."""
    if not seconds or seconds <= 0:
        return None
    reason = (f"stopped: the job ran for the {seconds:g} s this agent allows a job (its owner's "
              "--max-job-seconds)")
    timer = threading.Timer(seconds, ctx.request_stop, args=(reason,))
    timer.daemon = True
    timer.start()
    return timer


class Runtime:
    """State shared by every collector link: identity, tools, the job gate, the outbox.

    A `diagnostic` runtime (--describe, --print-descriptor) only reads: it creates, changes and
    removes nothing, so it can run beside the agent that owns the state directory. It has no
    outbox, cache or work root."""

    outbox: Outbox
    cache: ArtifactCache
    work_root: str
    state_lock: int | None = None  # the descriptor of the state directory's lock (main)

    def __init__(self, cfg: argparse.Namespace, probe: Probe, diagnostic: bool = False):
        self.cfg = cfg
        self.probe = probe
        self.mode = cfg.executor
        self.state_dir = cfg.state_dir
        if not diagnostic:
            private_dirs(self.state_dir)
        if self.mode == "host":
            self.reporter_id = checked_id(cfg.name, "--name", device=False)
        else:
            self.reporter_id = load_device_id(self.state_dir, cfg.device_id, probe,
                                              remember=not diagnostic)
        if not diagnostic:
            self.outbox = Outbox(os.path.join(self.state_dir, "spool"))
            self.cache = ArtifactCache(os.path.join(self.state_dir, "cache"), int(
                getattr(cfg, "cache_max_gb", CACHE_MAX_BYTES / 1e9) * 1e9))
            self.work_root = work_root(self.state_dir, self.reporter_id)
            # Leftovers of a crashed run; main() holds the state directory's lock by now, so
            # they are no running agent's.
            shutil.rmtree(self.work_root, ignore_errors=True)
            private_dirs(self.work_root)
        self.allowlist_path = cfg.allowlist or os.path.join(self.state_dir, "shell-allowlist")
        self.tools = find_tools(self.explicit_tools(cfg), probe)
        self.descriptor = detect_descriptor(probe) if self.mode == "device" else {}
        self.descriptor.update(cfg.descriptor_overrides or {})
        self.gate = Gate()
        self.stopping = threading.Event()
        self.current: JobContext | None = None
        self._outages: dict[str, Outage] = {}
        self._outages_lock = threading.Lock()
        self.presence_lock = threading.Lock()
        self.no_executor_route: set[str] = set()  # collectors that answered 404 to register
        self.registering: dict[str, threading.Lock] = {}  # by collector: one registration at once

    def outage(self, url: str) -> Outage:
        """The reachability record of one collector, shared by its link and the job's lease
        keeper so an outage is told once whichever of them notices."""
        with self._outages_lock:
            if url not in self._outages:
                self._outages[url] = Outage(url, self.outbox)
            return self._outages[url]

    @staticmethod
    def explicit_tools(cfg: argparse.Namespace) -> dict:
        return {"llama-bench": cfg.llama_bench, "adb": cfg.adb, "xcrun": cfg.xcrun,
                "chromium": cfg.chromium, "bundletool": cfg.bundletool,
                "flow_runner": cfg.flow_runner, "native_bundle": cfg.native_bundle,
                **explicit_device_tools(cfg)}

    def benchmark_backends(self) -> list[str]:
        return ["synthetic"] + (["llama.cpp"] if self.tools.get("llama-bench") else [])

    def capabilities(self) -> list[str]:
        """Only what this agent really implements on this machine, right now."""
        if self.mode == "host":
            return self.host_capabilities()
        caps = ["self-check"] + ["benchmark:" + b for b in self.benchmark_backends()]
        if load_allowlist(self.allowlist_path):
            caps.append("shell")
        build_repos = load_build_repos(build_repos_path(self.cfg, self.state_dir))
        return caps + [cap for cap, _ in workload_capabilities(self.tools, build_repos)]

    def host_capabilities(self) -> list[str]:
        return [cap for cap, _ in host_capability_reasons(self.tools)]

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

    def beacon_body(self, job_id: str | None = None, busy: dict | None = None,
                    attempt: int | None = None) -> dict:
        fields = self.vitals()
        if busy:
            fields["busy"] = busy
        body = {"schema": WIRE_SCHEMA, "kind": "beacon", "device_id": self.reporter_id,
                "beacon": fields, "at": now_iso()}
        if job_id:
            body["job_id"] = job_id
            if attempt is not None:
                body["attempt"] = attempt
        return body

    # --- running one job ---

    def run_job(self, collector: Collector, spec: dict) -> None:
        ctx = JobContext(self, collector, spec, self.reporter_id)
        self.current = ctx
        if self.stopping.is_set():
            ctx.request_stop("the agent is shutting down", handback=True)
        log.info("job %s started: %s from %s", printable(ctx.job_id),
                 printable(spec.get("workload")), collector.url)
        started = time.monotonic()
        ceiling = job_ceiling(ctx, getattr(self.cfg, "max_job_seconds", 0))
        try:
            row = final_row(ctx, self.leased(ctx))
            # The job's files go before its final row is spooled: a job that filled the disk
            # left its row no room in the spool (Outbox.check_room), and the job stayed
            # claimed until its lease lapsed, to be run again.
            shutil.rmtree(ctx.workdir, ignore_errors=True)
            try:
                ctx.post(row)
            except Exception:  # a row that reached the spool goes later, with the flusher
                log.exception("job %s: its final row could not be posted",
                              printable(ctx.job_id))
            log.info("job %s ended: %s in %.1f s%s", printable(ctx.job_id), outcome(row),
                     time.monotonic() - started,
                     ": " + printable(row["error"], MAX_ERROR_CHARS) if row.get("error")
                     else "")
        finally:
            if ceiling is not None:
                ceiling.cancel()
            shutil.rmtree(ctx.workdir, ignore_errors=True)

    def leased(self, ctx: JobContext) -> dict:
        """The job's result, run while its lease keeper beacons; never an exception."""
        try:
            keeper = LeaseKeeper(ctx, beacon_interval(ctx.lease_ttl(), self.cfg.beacon_s))
            keeper.start()
            try:
                return self.execute(ctx)
            finally:
                keeper.stop()
        except Exception as exc:  # whatever happened, the job still ends with a final row
            log.exception("job %s failed unexpectedly", printable(ctx.job_id))
            return unexpected(exc)
        finally:
            self.current = None

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
            log.exception("job %s failed unexpectedly", printable(ctx.job_id))
            return unexpected(exc)


# --------------------------------------------------------------------------------------------
# One thread per collector: register, beacon, long-poll, claim
# --------------------------------------------------------------------------------------------


class Outage:
    """One collector's reachability, as the log tells it: one line when it is lost, a reminder
    every REMIND_S while it stays lost (each retry in between at DEBUG), and one line when it
    answers again, with the result rows that waited on disk and were delivered."""

    REMIND_S = 60.0

    def __init__(self, url: str, outbox: Outbox):
        self.url = url
        self.outbox = outbox
        self.since: float | None = None  # monotonic time of the first failure
        self.reminded = 0.0
        self.delivered_before = 0
        self.lock = threading.Lock()  # a link and a lease keeper may both report

    def failed(self, exc: Exception, delay: float) -> None:
        with self.lock:
            self._failed(exc, delay)

    def _failed(self, exc: Exception, delay: float) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = self.reminded = now
            self.delivered_before = self.outbox.delivered.get(self.url, 0)
            log.warning("collector %s unreachable (%s), retrying in %.0f s", self.url,
                        printable(exc, 500), delay)
        elif now - self.reminded >= self.REMIND_S:
            self.reminded = now
            log.warning("collector %s still unreachable after %.0f s (%s), retrying in %.0f s",
                        self.url, now - self.since, printable(exc, 500), delay)
        else:
            log.debug("collector %s: %s; retrying in %.1f s", self.url, printable(exc, 500),
                      delay)

    def recovered(self) -> None:
        with self.lock:
            if self.since is None:
                return
            down_s = time.monotonic() - self.since
            self.since = None
        self.outbox.flush(self.url)  # what waited for this collector goes now, in order
        rows = self.outbox.delivered.get(self.url, 0) - self.delivered_before
        log.info("reconnected to %s after %.0f s, delivered %d queued rows", self.url, down_s,
                 rows)


class Link(threading.Thread):
    def __init__(self, runtime: Runtime, collector: Collector):
        super().__init__(name="link-" + collector.url, daemon=True)
        self.rt = runtime
        self.collector = collector
        # An executor is not a device: it registers as an executor (register_executor).
        self.registered = False
        self.last_beacon = 0.0
        self.last_busy: tuple[str, str] | None = None
        self.running_job = False
        self.told_bad = False  # a bad answer was logged (once per link)
        self.outage = runtime.outage(collector.url)
        # Claims slow down while this collector refuses or cannot take the rows of its jobs.
        self.pace = Backoff(runtime.cfg.retry_base_s, runtime.cfg.retry_cap_s)

    def run(self) -> None:
        backoff = Backoff(self.rt.cfg.retry_base_s, self.rt.cfg.retry_cap_s)
        while not self.rt.stopping.is_set():
            try:
                self.step()
                backoff.reset()
                continue
            except (Unreachable, HttpError) as exc:
                delay = backoff.next_delay()
                self.failed(exc, delay)
                self.told_bad = self.told_bad or isinstance(exc, BadAnswer)
            except Exception:  # a surprise must not end the link: told with its traceback
                delay = backoff.next_delay()
                log.exception("%s: unexpected failure; retrying in %.1f s", self.collector.url,
                              delay)
            self.rt.stopping.wait(delay)

    def failed(self, exc: Unreachable | HttpError, delay: float) -> None:
        if isinstance(exc, HttpError) and exc.status == 404 and self.rt.mode != "host":
            log.info("%s does not know this device (%s); registering again",
                     self.collector.url, printable(exc.message))
            self.registered = False
        elif isinstance(exc, (Misdirected, Redirected)) or (
                isinstance(exc, BadAnswer) and self.told_bad):
            # Logged once, with its remedy; each retry says it quietly.
            log.debug("%s: %s; retrying in %.1f s", self.collector.url, printable(exc, 500),
                      delay)
        elif isinstance(exc, BadAnswer):
            log.warning("%s; retrying with backoff (said once)", printable(exc, 500))
        else:
            self.outage.failed(exc, delay)

    def step(self) -> None:
        if self.outage.since is not None:
            # Learn that the collector is back before a long poll that may be held for its
            # whole length: a beacon (it also tells the collector the device is back), or for
            # an executor, which does not beacon, its health.
            if self.rt.mode == "host":
                self.collector.call_json("GET", "/api/health", limit=MAX_REPLY_BYTES)
                self.outage.recovered()
            elif self.registered:
                self.beacon_if_due(force=True)
                self.outage.recovered()
        held = self.rt.gate.holder()
        if held is not None and held[0] != self.collector.url:
            self.beacon_if_due(busy=held)  # tell this collector why the device is quiet
            self.rt.stopping.wait(0.5)
            return
        if not self.registered:
            self.register()
        self.beacon_if_due()
        timeout = self.rt.cfg.poll_timeout_s
        started = time.monotonic()
        if self.rt.mode == "host":
            spec = self.collector.next_host_job(self.rt.reporter_id, timeout)
        else:
            spec = self.collector.next_device_job(self.rt.reporter_id, timeout)
        self.outage.recovered()  # the poll answered (a no-op unless it was the first call)
        if not (spec and self.take(spec)):
            # A collector (or a proxy) that answers at once instead of holding the poll must
            # not make the agent poll it thousands of times a second.
            self.rt.stopping.wait(max(0.0, POLL_FLOOR_S - (time.monotonic() - started)))
        elif self.collector.url in self.rt.outbox.troubled:
            # A collector that offers job after job but refuses their rows (or cannot take
            # them) would have them claimed as fast as they fail, each row kept on disk and
            # logged. Only then: a queue of short jobs whose rows land runs at full speed.
            delay = self.pace.next_delay()
            log.debug("%s: the last job's rows were not delivered; next claim in %.1f s",
                      self.collector.url, delay)
            self.rt.stopping.wait(delay)
        else:
            self.pace.reset()

    def register(self) -> None:
        """Before the first poll, so the collector knows what this agent can run."""
        if self.rt.mode == "host":
            register_executor(self.rt, self.collector)
            log.info("executor %s polling %s (capabilities %s)", self.rt.reporter_id,
                     self.collector.url, ", ".join(self.rt.capabilities()) or "none")
        else:
            reply = self.collector.register(self.rt.registration())
            log.info("registered with %s as %s (capabilities %s)", self.collector.url,
                     self.rt.reporter_id,
                     printable(reply.get("capabilities", self.rt.capabilities()), 1000))
        self.registered = True
        self.outage.recovered()

    def beacon_if_due(self, busy: tuple[str, str] | None = None, force: bool = False) -> None:
        if self.rt.mode == "host":
            return  # an executor beacons only for the job it runs
        changed = busy != self.last_busy
        if not (changed or force) and time.monotonic() - self.last_beacon < self.rt.cfg.beacon_s:
            return
        note = {"job_id": busy[1], "collector": busy[0]} if busy else None
        self.collector.beacon(self.rt.beacon_body(busy=note))
        self.last_beacon, self.last_busy = time.monotonic(), busy

    def take(self, spec: dict) -> bool:
        """Run the job offered; False when it was not run (no id, or another link's job)."""
        job_id = spec.get("job_id")
        if not job_id:
            log.error("%s offered a job without a job_id; ignored", self.collector.url)
            return False
        # A collector keeps to the id rule; an id that breaks it (8 MB of it, from something
        # answering as the collector) would ride in every row, and a final row is spooled past
        # the spool's bound rather than lost: 16 MB a file, a gigabyte in a few minutes.
        if not isinstance(job_id, str) or not ID_PATTERN.fullmatch(job_id):
            log.error("%s offered a job whose job_id %s breaks the collector's id rule; ignored",
                      self.collector.url, printable(job_id, 60))
            return False
        # The check-and-set happens under one lock: two links can never both hold a job.
        if self.rt.stopping.is_set() or not self.rt.gate.try_take(self.collector.url, job_id):
            outcome = self.collector.release(job_id, self.rt.reporter_id)
            log.info("job %s from %s lost the race for this device; release: %s",
                     printable(job_id), self.collector.url, outcome)
            return False
        self.running_job = True
        try:
            self.rt.run_job(self.collector, spec)
        finally:
            self.running_job = False
            self.rt.gate.free(job_id)
            self.last_beacon = 0.0  # beacon idle right away so constraints see fresh vitals
        return True


class Flusher(threading.Thread):
    """Re-posts spooled rows (from a collector outage or an earlier run) with backoff."""

    def __init__(self, runtime: Runtime):
        super().__init__(name="outbox", daemon=True)
        self.rt = runtime

    def run(self) -> None:
        backoff = Backoff(self.rt.cfg.retry_base_s, self.rt.cfg.retry_cap_s)
        delay = 0.0
        while not self.rt.stopping.wait(delay):
            try:
                if not self.rt.outbox.pending():
                    delay = 1.0
                    backoff.reset()
                elif self.rt.outbox.flush():
                    delay = 0.0
                    backoff.reset()
                else:
                    delay = backoff.next_delay()
            except Exception:  # nothing may end the only thread that re-posts spooled rows
                delay = backoff.next_delay()
                log.exception("re-posting spooled rows failed unexpectedly; retrying in %.1f s",
                              delay)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def split_list(values: list[str] | None) -> list[str]:
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


class Option:
    """One command-line option with its environment variable and its default: the table the
    parser, `--help` and docs/configuration.md (scripts/gen_config_docs.py) are all made from.

    `shown` is the default as a person reads it when the value itself is not the whole story
    (a path under the home directory, a tool found on PATH).
    """

    def __init__(self, flag: str, env: str | None, default: object, help: str,
                 shown: str | None = None, **kwargs: object):
        self.flag = flag
        self.env = env
        self.default = default
        self.help = help
        self.shown = shown if shown is not None else _shown(default)
        self.literal = shown is None and default is not None  # a value, not words about one
        self.kwargs = kwargs

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _shown(default: object) -> str:
    if default is None or default == []:
        return "none"
    return str(default)


def cache_gb(raw: str) -> float:
    """--cache-max-gb: a size in GB (10^9 bytes), from 0 (keep only the running job's) to a
    petabyte."""
    value = float(raw)
    if not 0 <= value <= 1e6:
        raise ValueError(f"{raw!r} is not a size from 0 to 1000000 GB")
    return value


def job_seconds(raw: str) -> float:
    """--max-job-seconds: a number of seconds, 0 for no ceiling."""
    value = float(raw)
    if not 0 <= value <= 366 * 86400:
        raise ValueError(f"{raw!r} is not from 0 to a year of seconds")
    return value


TOOL_HELP = {"llama-bench": "llama.cpp's benchmark tool (benchmark:llama.cpp, thermal:llama.cpp)",
             "adb": "Android's adb (the host workloads on Android devices)",
             "xcrun": "Xcode's xcrun (iOS simulators)",
             "chromium": "a Chromium or Chrome for web-test, web-shots and web-audit",
             "flow-runner": "the flow_runner suite tool (ui-test)",
             "native-bundle": "the native_bundle suite tool (ui-test)",
             "llama-cli": "llama.cpp's llama-completion or llama-cli (batch, pipeline, llm-eval)",
             "llama-embedding": "llama.cpp's llama-embedding (embed-eval)",
             "llama-server": "llama.cpp's llama-server (serve)",
             "llama-quantize": "llama.cpp's llama-quantize (model-convert)",
             "llama-convert": "llama.cpp's convert_hf_to_gguf.py (model-convert)",
             "llama-mtmd-cli": "llama.cpp's llama-mtmd-cli (vision-eval)",
             "whisper-cli": "whisper.cpp's whisper-cli (speech-eval)",
             "bundletool": "Android's bundletool, an executable or a .jar run with java "
                           "(archive of an .aab)"}

OPTIONS = (
    Option("--collector", "FLEET_AGENT_COLLECTOR", None,
           "Collector URL (http:// or https://); repeat or comma-separate for several.",
           shown="required", action="append", metavar="URL"),
    Option("--executor", "FLEET_AGENT_EXECUTOR", "device",
           "device: run jobs on this machine; host: drive attached devices from outside.",
           choices=("device", "host")),
    Option("--name", "FLEET_AGENT_NAME", None,
           "Executor name (host mode); what a job's targets.executor pins.", metavar="NAME"),
    Option("--device-id", "FLEET_AGENT_DEVICE_ID", None,
           "Device id to register; remembered in the state file.",
           shown="from the host name and machine id", metavar="ID"),
    Option("--pool", "FLEET_AGENT_POOL", None, "Pool label; repeat or comma-separate.",
           action="append", metavar="LABEL"),
    Option("--ttl-s", "FLEET_AGENT_TTL_S", None,
           "Register as a temporary device that leaves the shelf after this many seconds of "
           "silence.", type=int, metavar="N"),
    Option("--state-dir", "FLEET_AGENT_STATE", os.path.join("~", ".fleet-agent"),
           "State, spool, cache and work directory (mode 0700).", metavar="DIR"),
    Option("--allowlist", "FLEET_AGENT_ALLOWLIST", None,
           "File of pinned SHA-256s of the shell scripts this machine may run.",
           shown="STATE/shell-allowlist", metavar="FILE"),
    Option("--sysroot", "FLEET_AGENT_SYSROOT", "/",
           "Read /proc, /sys and /etc below this root (tests use fake trees).", metavar="DIR"),
    Option("--beacon-s", "FLEET_AGENT_BEACON_S", IDLE_BEACON_S,
           "Idle beacon period in seconds; also the cap of the in-job beacon period.",
           type=float, metavar="S"),
    Option("--poll-timeout-s", "FLEET_AGENT_POLL_TIMEOUT_S", 45.0,
           "Client timeout of a long poll; longer than the collector's hold (25 s).",
           type=float, metavar="S"),
    Option("--retry-base-s", "FLEET_AGENT_RETRY_BASE_S", 1.0,
           "First retry delay after a failure; it doubles up to --retry-cap-s (with jitter).",
           type=float, metavar="S"),
    Option("--retry-cap-s", "FLEET_AGENT_RETRY_CAP_S", 60.0, "Longest retry delay.",
           type=float, metavar="S"),
    Option("--grace-s", "FLEET_AGENT_GRACE_S", 30.0,
           "On SIGTERM or SIGINT, how long the running job gets to hand back and post.",
           type=float, metavar="S"),
    Option("--cache-max-gb", "FLEET_AGENT_CACHE_MAX_GB", CACHE_MAX_BYTES / 1e9,
           "Most the artifact cache keeps between jobs, in GB; past it the least recently used "
           "artifacts are removed, never one the running job uses. 0 keeps only those.",
           type=cache_gb, metavar="GB"),
    Option("--max-job-seconds", "FLEET_AGENT_MAX_JOB_SECONDS", 0.0,
           "Longest a job may run here; one past it is stopped as a cancel stops it, its final "
           "row saying why (a serve job too). 0 (the default): no ceiling but the job's own.",
           type=job_seconds, metavar="S"),
    Option("--allow-serve-bind", "FLEET_AGENT_ALLOW_SERVE_BIND", None,
           "Addresses besides loopback a serve job may listen on (0.0.0.0 or :: for every "
           "interface, or one of this machine's); repeat or comma-separate. With none a job "
           "asking for another address is refused.", action="append", metavar="ADDRESS"),
    Option("--set", "FLEET_AGENT_SET", None,
           "Override a descriptor field (kind=tablet); an empty value means null. Repeat the "
           "flag, or comma-separate in the variable.", action="append",
           metavar="FIELD=VALUE"),
    *(Option("--" + tool, "FLEET_" + tool.upper().replace("-", "_"), None,
             f"Path of {TOOL_HELP[tool]}.", shown="found on PATH", metavar="PATH")
      for tool in TOOL_HELP),
    Option("--build-repos", "FLEET_AGENT_BUILD_REPOS", None,
           "File of the repositories build jobs may clone, one a line; with none listed no "
           "build capability is declared.", shown="STATE/build-repos", metavar="FILE"),
    Option("--log-level", "FLEET_AGENT_LOG_LEVEL", "INFO",
           "Log level: DEBUG (every retry, every row), INFO (connections, jobs), WARNING.",
           choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser, built from OPTIONS. Every option's default is None here so that parse_args
    can tell a flag given from one left out (then the environment, then the default apply);
    each action carries its `env` and `shown` default for the documentation generator."""
    parser = argparse.ArgumentParser(
        prog="fleet_agent.py", description=__doc__.split("\n")[0],
        epilog="A flag wins over its environment variable, which wins over the default.")
    for option in OPTIONS:
        action = parser.add_argument(
            option.flag, dest=option.dest, default=None,
            help=f"{option.help} (default: {option.shown}; env {option.env})",
            **option.kwargs)
        action.env, action.shown, action.meaning = option.env, option.shown, option.help
        action.literal = option.literal
    for flag, help_text in (
            ("--allow-private-urls", "Let vantage, dataset-prep, web-unfurl and the browser of "
                                     "web-test, web-shots and web-audit reach private, loopback "
                                     "and link-local addresses (refused by default: a job could "
                                     "otherwise probe this machine's LAN)."),
            ("--print-descriptor", "Print the device id, descriptor, capabilities, vitals and "
                                   "tools as JSON and exit."),
            ("--describe", "Print the descriptor and the capabilities this machine would declare "
                           "(and what each missing one needs), and exit.")):
        action = parser.add_argument(flag, action="store_true", help=help_text)
        action.env, action.shown, action.meaning = None, "off", help_text
    action = parser.add_argument("--version", action="version",
                                 version="fleet_agent " + AGENT_VERSION,
                                 help="Print the agent's version and exit.")
    action.env, action.shown, action.meaning = None, "", "Print the agent's version and exit."
    return parser


def _from_env(parser: argparse.ArgumentParser, option: Option, raw: str) -> object:
    """An option's value from its environment variable, checked like the flag would be."""
    kind = option.kwargs.get("type")
    if option.kwargs.get("action") == "append":  # several values, comma-separated
        return [part.strip() for part in raw.split(",") if part.strip()]
    try:
        value = kind(raw) if callable(kind) else raw
    except ValueError:
        parser.error(f"{option.env}={raw!r} is not a valid value for {option.flag}")
    choices = option.kwargs.get("choices")
    if isinstance(choices, tuple) and value not in choices:
        parser.error(f"{option.env} must be one of {', '.join(choices)}, not {raw!r}")
    return value


def parse_args(argv: list[str] | None, environ: dict | None = None) -> argparse.Namespace:
    env = os.environ if environ is None else environ
    parser = build_parser()
    cfg = parser.parse_args(argv)
    for option in OPTIONS:
        if getattr(cfg, option.dest) is not None:
            continue  # given on the command line
        raw = env.get(option.env) if option.env else None
        setattr(cfg, option.dest, _from_env(parser, option, raw) if raw else option.default)
    cfg.state_dir = os.path.expanduser(cfg.state_dir)
    cfg.collectors = split_list(cfg.collector)
    cfg.pools = split_list(cfg.pool)
    cfg.descriptor_overrides = parse_overrides(parser, cfg.set or [])
    cfg.serve_binds = serve_binds(parser, split_list(cfg.allow_serve_bind))
    if cfg.executor == "host" and not cfg.name:
        parser.error("--executor host needs --name")
    if not cfg.collectors and not cfg.print_descriptor and not cfg.describe:
        parser.error("give at least one --collector URL")
    for url in cfg.collectors:
        if not url.startswith(("http://", "https://")):
            parser.error(f"collector address {url!r} must start with http:// or https://")
        if "@" in url:
            # The agent never sends a URL's user and password, and a collector URL is logged
            # and told to the other collectors (a busy beacon names it): refused, not leaked.
            # The sentence leaves them out too, as it may land in a service's journal. Any "@"
            # counts: a password holding "/", "?" or "#" ends urlsplit's netloc before its "@"
            # (http://admin:pass/x@host reads as the host "admin" on port "pass/x...").
            scheme = url.partition("://")[0]
            shown = f"{scheme}://...@{url.rpartition('@')[2]}"
            parser.error(f"collector address {shown} carries a user name or password; the "
                         "agent does not send credentials from a URL, so give the address "
                         "without them")
        try:  # a lone bracket, a host NFKC folds into '/': every request would fail on it
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a port out of range
        except ValueError:
            parser.error(f"collector address {url!r} is not a URL such as "
                         "http://collector:8788")
        if not parts.hostname:
            parser.error(f"collector address {url!r} names no host")
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


def serve_binds(parser: argparse.ArgumentParser, items: list[str]) -> list:
    """The addresses --allow-serve-bind lets serve jobs listen on, besides loopback."""
    addresses = []
    for item in items:
        try:
            addresses.append(ipaddress.ip_address(item))
        except ValueError:
            parser.error(f"--allow-serve-bind wants IP addresses (0.0.0.0, ::, or one of this "
                         f"machine's), not {item!r}")
    return addresses


def serve(runtime: Runtime) -> int:
    links = [Link(runtime, Collector(url)) for url in runtime.cfg.collectors]
    log.info("fleet_agent %s as %s (%s mode), capabilities: %s", AGENT_VERSION,
             runtime.reporter_id, runtime.mode, ", ".join(runtime.capabilities()) or "none")
    Flusher(runtime).start()
    if runtime.mode == "host":
        Presence(runtime, [link.collector for link in links]).start()
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
    logging.basicConfig(level=getattr(logging, cfg.log_level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(message)s")
    probe = Probe(root=cfg.sysroot)
    if cfg.describe:
        print(describe(Runtime(cfg, probe, diagnostic=True)))
        return 0
    if cfg.print_descriptor:
        cfg.collectors = cfg.collectors or []
        runtime = Runtime(cfg, probe, diagnostic=True)
        print(json.dumps({"device_id": runtime.reporter_id, "descriptor": runtime.descriptor,
                          "capabilities": runtime.capabilities(), "vitals": runtime.vitals(),
                          "tools": runtime.tools}, indent=2, sort_keys=True))
        return 0
    try:
        cfg.state_dir, lock = claim_state_dir(cfg.state_dir)
    except UnsafeState as exc:
        print(exc, file=sys.stderr)
        return 2
    runtime = Runtime(cfg, probe)
    runtime.state_lock = lock  # open, so held, until the process exits

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        runtime.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return serve(runtime)


if __name__ == "__main__":
    sys.exit(main())
