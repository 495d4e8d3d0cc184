"""Unit tests of the agent's pure parts: probing fake machines, the synthetic reference loop,
constraints, the allowlist, the state file, backoff, the outbox and artifact verification."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.agent import AGENT_FILE, make_tool, python38, wait_for, write_tree

PI5 = {
    "/proc/device-tree/model": "Raspberry Pi 5 Model B Rev 1.0\x00",
    "/proc/device-tree/compatible": "raspberrypi,5-model-b\x00brcm,bcm2712\x00",
    "/proc/meminfo": "MemTotal:        8245676 kB\nMemFree: 100 kB\nMemAvailable:    4194304 kB\n",
    "/proc/cpuinfo": "".join(f"processor\t: {n}\nBogoMIPS\t: 108.00\n\n" for n in range(4)),
    "/etc/os-release": 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian"\n',
    "/proc/loadavg": "0.42 0.30 0.20 1/200 999\n",
}


def probe(fa, root: Path, bin_dir: Path | None = None, system="Linux", machine="aarch64",
          **env):
    path = str(bin_dir) if bin_dir else str(root / "no-bin")
    return fa.Probe(root=str(root), env={"PATH": path, **env}, system=system, machine=machine)


# --- descriptor ---


def test_raspberry_pi_descriptor_from_a_fake_root(fa, tmp_path):
    found = fa.detect_descriptor(probe(fa, write_tree(tmp_path, PI5)))
    assert found["model"] == "Raspberry Pi 5 Model B Rev 1.0"
    assert found["soc"] == "bcm2712"
    assert found["ram_mb"] == 8245676 // 1024
    assert found["os"] == "Debian GNU/Linux 12 (bookworm)"
    assert (found["platform"], found["kind"], found["arch"]) == ("linux", "sbc", "aarch64")
    assert found["cpu_cores"] == 4
    assert found["gpu"] is None and found["vram_mb"] is None


def test_laptop_from_dmi_and_placeholders_become_null(fa, tmp_path):
    root = write_tree(tmp_path / "laptop", {
        "/sys/class/dmi/id/sys_vendor": "LENOVO\n",
        "/sys/class/dmi/id/product_name": "ThinkPad X1 Carbon Gen 11\n",
        "/sys/class/dmi/id/chassis_type": "10\n",
        "/proc/cpuinfo": "processor\t: 0\nmodel name\t: 13th Gen Intel(R) Core(TM) i7-1365U\n",
    })
    found = fa.detect_descriptor(probe(fa, root, machine="x86_64"))
    assert found["model"] == "LENOVO ThinkPad X1 Carbon Gen 11"
    assert found["kind"] == "laptop"
    assert found["soc"] == "13th Gen Intel(R) Core(TM) i7-1365U"
    desktop = write_tree(tmp_path / "box", {
        "/sys/class/dmi/id/product_name": "To Be Filled By O.E.M.\n",
        "/sys/class/dmi/id/chassis_type": "3\n"})
    found = fa.detect_descriptor(probe(fa, desktop, machine="x86_64"))
    assert found["model"] is None and found["kind"] == "desktop"


def test_an_unknown_machine_says_null_rather_than_guessing(fa, tmp_path):
    found = fa.detect_descriptor(probe(fa, tmp_path, machine="riscv64"))
    for field in ("model", "soc", "ram_mb", "os", "kind", "cpu_cores", "gpu", "vram_mb"):
        assert found[field] is None, field
    assert found["platform"] == "linux" and found["arch"] == "riscv64"


def test_nvidia_gpu_and_vram(fa, tmp_path):
    root = write_tree(tmp_path, {
        "/proc/driver/nvidia/gpus/0000:01:00.0/information": "Model: \t NVIDIA GeForce RTX 4090\n"
                                                             "IRQ: 1\n"})
    bin_dir = tmp_path / "bin"
    make_tool(bin_dir, "nvidia-smi", "print('24564')\n")
    found = fa.detect_descriptor(probe(fa, root, bin_dir, machine="x86_64"))
    assert (found["gpu"], found["vram_mb"]) == ("NVIDIA GeForce RTX 4090", 24564)


GETPROP = """
props = {
    "ro.product.model": "Pixel 8", "ro.soc.manufacturer": "Google", "ro.soc.model": "Tensor G3",
    "ro.build.version.release": "14",
    "ro.build.characteristics": os.environ.get("CHAR", "nosdcard"),
}
print(props.get(sys.argv[1], ""))
"""


def test_termux_phone_descriptor(fa, tmp_path):
    bin_dir = tmp_path / "bin"
    make_tool(bin_dir, "getprop", GETPROP)
    root = write_tree(tmp_path / "root", {"/proc/meminfo": "MemTotal: 7864320 kB\n",
                                          "/sys/class/kgsl/kgsl-3d0/gpu_model": "Adreno740v2\n"})
    phone = probe(fa, root, bin_dir, ANDROID_ROOT="/system",
                  PREFIX="/data/data/com.termux/files/usr")
    found = fa.detect_descriptor(phone)
    assert found["model"] == "Pixel 8"
    assert found["soc"] == "Google Tensor G3"
    assert found["os"] == "Android 14"
    assert (found["platform"], found["kind"]) == ("android", "phone")
    assert found["ram_mb"] == 7680 and found["gpu"] == "Adreno740v2"
    tablet = probe(fa, root, bin_dir, ANDROID_ROOT="/system", CHAR="tablet")
    assert fa.detect_descriptor(tablet)["kind"] == "tablet"


SYSCTL = """
values = {"hw.model": "MacBookPro18,3", "machdep.cpu.brand_string": "Apple M1 Pro",
          "hw.memsize": str(16 * 1024 ** 3), "hw.ncpu": "10"}
print(values[sys.argv[2]])
"""


def test_macos_descriptor(fa, tmp_path):
    bin_dir = tmp_path / "bin"
    make_tool(bin_dir, "sysctl", SYSCTL)
    make_tool(bin_dir, "sw_vers", "print('14.5')\n")
    found = fa.detect_descriptor(probe(fa, tmp_path, bin_dir, system="Darwin", machine="arm64"))
    assert found == {**found, "model": "MacBookPro18,3", "soc": "Apple M1 Pro", "ram_mb": 16384,
                     "os": "macOS 14.5", "platform": "macos", "kind": "laptop", "cpu_cores": 10,
                     "gpu": "Apple M1 Pro", "vram_mb": None}
    assert fa.mac_kind("Mac14,3") is None and fa.mac_kind("Macmini9,1") == "desktop"


# --- vitals ---


def test_termux_battery_and_phone_vitals(fa, tmp_path):
    bin_dir = tmp_path / "bin"
    make_tool(bin_dir, "termux-battery-status", """
        print(json.dumps({"health": "GOOD", "percentage": int(os.environ["PCT"]),
                          "plugged": os.environ["PLUG"], "status": os.environ["STATUS"],
                          "temperature": 31.5}))
    """)
    root = write_tree(tmp_path / "root", {"/proc/meminfo": "MemTotal: 8000000 kB\n"
                                                           "MemAvailable: 400000 kB\n"})
    charging = probe(fa, root, bin_dir, ANDROID_ROOT="/system", PCT="80", PLUG="PLUGGED_AC",
                     STATUS="CHARGING")
    vitals = fa.read_vitals(charging)
    assert vitals["battery_pct"] == 80 and vitals["charging"] is True and vitals["ac"] is True
    assert vitals["thermal"] == "nominal" and vitals["temp_c"] == 31.5
    assert vitals["mem_mb"] == 390 and vitals["mem_pressure"] == "high"
    draining = probe(fa, root, bin_dir, ANDROID_ROOT="/system", PCT="12", PLUG="UNPLUGGED",
                     STATUS="DISCHARGING")
    vitals = fa.read_vitals(draining)
    assert (vitals["battery_pct"], vitals["charging"], vitals["ac"]) == (12, False, False)


def test_sysfs_power_supply(fa, tmp_path):
    laptop = write_tree(tmp_path / "laptop", {
        "/sys/class/power_supply/AC/type": "Mains\n",
        "/sys/class/power_supply/AC/online": "0\n",
        "/sys/class/power_supply/BAT0/type": "Battery\n",
        "/sys/class/power_supply/BAT0/capacity": "55\n",
        "/sys/class/power_supply/BAT0/status": "Discharging\n",
        "/sys/class/thermal/thermal_zone0/temp": "83000\n",
        "/sys/class/thermal/thermal_zone1/temp": "-274000\n",  # junk sensor, ignored
    })
    vitals = fa.read_vitals(probe(fa, laptop))
    assert vitals == {**vitals, "battery_pct": 55, "charging": False, "ac": False,
                      "thermal": "serious", "temp_c": 83.0, "on_ac": False}
    (laptop / "sys/class/power_supply/AC/online").write_text("1\n")
    (laptop / "sys/class/power_supply/BAT0/status").write_text("Full\n")
    assert fa.read_vitals(probe(fa, laptop))["charging"] is True
    pi = write_tree(tmp_path / "pi", PI5)
    vitals = fa.read_vitals(probe(fa, pi))
    assert "battery_pct" not in vitals and "charging" not in vitals
    assert vitals["load"] == 0.42 and vitals["mem_mb"] == 4096
    # The field names of decisions.md, beside the earlier ac and load: a reading the machine
    # cannot give is null there (no power supply to ask here), and left out under the old name.
    assert vitals["load_1m"] == 0.42 and vitals["on_ac"] is None and "ac" not in vitals
    assert isinstance(vitals["disk_free_gb"], float) and vitals["disk_free_gb"] >= 0
    assert "idle_s" not in vitals  # no xprintidle: unknown, and older collectors refuse null


def test_pmset_battery(fa, tmp_path):
    bin_dir = tmp_path / "bin"
    make_tool(bin_dir, "pmset", """
        print("Now drawing from 'AC Power'")
        print(" -InternalBattery-0 (id=123)\\t85%; charging; 0:40 remaining present: true")
    """)
    mac = probe(fa, tmp_path, bin_dir, system="Darwin", machine="arm64")
    assert fa.read_power(mac) == {"battery_pct": 85, "charging": True, "ac": True}


# --- the synthetic reference benchmark ---


# decisions.md's attestation digest: a fresh block after 1,000 rounds.
ATTESTATION = "d7e8b70dfb48593edebc84967a969e78429f9ac6da8d0c681a4b57a2fe078a84"


def reference_block(rounds: int) -> bytearray:
    """Written from decisions.md, independently of the agent's code: a 4,096-byte block whose
    byte i is (i * 31) & 0xff; a round hashes the whole block and writes the digest over its
    first 32 bytes."""
    block = bytearray((i * 31) & 0xFF for i in range(4096))
    for _ in range(rounds):
        block[:32] = hashlib.sha256(block).digest()
    return block


def test_the_attestation_is_the_reference_and_the_constant(fa):
    assert hashlib.sha256(reference_block(1000)).hexdigest() == ATTESTATION
    assert fa.synthetic_attestation() == ATTESTATION == fa.SYNTHETIC_ATTESTATION
    assert fa.SYNTHETIC_ATTESTATION_ROUNDS == fa.SYNTHETIC_ROUNDS_PER_TOKEN == 1000
    assert fa.synthetic_block() == reference_block(0)


@pytest.mark.parametrize(("prompt", "gen"), [(3, 2), (1, 1), (0, 1), (2, 3)])
def test_an_iteration_advances_the_job_block_by_its_tokens(fa, prompt, gen):
    block = fa.synthetic_block()
    metrics = fa.synthetic_iteration(block, prompt, gen, lambda: None)
    assert block == reference_block((prompt + gen) * 1000)
    assert set(metrics) == {"prefill_tok_s", "decode_tok_s", "ttft_ms"}
    # Rates from milliseconds floored at 1 (decisions.md), so never a division by zero.
    assert metrics["prefill_tok_s"] <= prompt * 1000 and metrics["decode_tok_s"] <= gen * 1000
    assert metrics["decode_tok_s"] > 0 and metrics["ttft_ms"] > 0
    # The block keeps its state across iterations: the next one goes on from here.
    fa.synthetic_iteration(block, prompt, gen, lambda: None)
    assert block == reference_block(2 * (prompt + gen) * 1000)


def test_synthetic_stops_between_tokens(fa):
    calls = []

    def check():
        calls.append(1)
        if len(calls) > 3:
            raise fa.Stopped("stop")

    with pytest.raises(fa.Stopped):
        fa.synthetic_iteration(fa.synthetic_block(), 100, 100, check)
    assert len(calls) == 4


def test_benchmark_params_are_checked(fa):
    assert fa.benchmark_params({}) == {"prompt_tokens": 512, "gen_tokens": 128,
                                       "warmup_iters": 1, "measure_iters": 3}
    with pytest.raises(fa.Refusal, match=r"params\.measure_iters must be a whole number"):
        fa.benchmark_params({"measure_iters": "3"})
    with pytest.raises(fa.Refusal, match="prompt_tokens"):
        fa.benchmark_params({"prompt_tokens": 10**9})
    with pytest.raises(fa.Refusal):
        fa.benchmark_params({"gen_tokens": True})


# --- constraints ---


def test_power_constraints(fa):
    fa.check_power_constraints({"require_charging": True, "min_battery_pct": 50},
                               {"charging": True, "battery_pct": 60})
    fa.check_power_constraints(None, {})
    with pytest.raises(fa.Refusal, match="requires charging and this device is not charging"):
        fa.check_power_constraints({"require_charging": True}, {"charging": False})
    with pytest.raises(fa.Refusal, match="cannot tell whether it is charging"):
        fa.check_power_constraints({"require_charging": True}, {})
    with pytest.raises(fa.Refusal, match="battery is at 20% and the job needs at least 50%"):
        fa.check_power_constraints({"min_battery_pct": 50}, {"battery_pct": 20})
    with pytest.raises(fa.Refusal, match="cannot read its battery level"):
        fa.check_power_constraints({"min_battery_pct": 50}, {})


# --- allowlist, state, backoff ---


def test_allowlist(fa, tmp_path):
    good = "a" * 64
    path = tmp_path / "allow"
    path.write_text(f"# pinned by the owner\n{good.upper()}  backup.sh\n\nnot-a-hash\n"
                    f"{'b' * 63}\n")
    assert fa.load_allowlist(str(path)) == {good}
    assert fa.load_allowlist(str(tmp_path / "missing")) == set()
    assert fa.load_allowlist(None) == set()


def test_state_file_keeps_the_device_id(fa, tmp_path):
    here = fa.Probe(root=str(write_tree(tmp_path / "root", {"/etc/machine-id": "abc123\n"})))
    state = tmp_path / "state"
    first = fa.load_device_id(str(state), None, here)
    assert first == fa.load_device_id(str(state), None, here)
    assert first.endswith("-" + hashlib.sha256(b"abc123").hexdigest()[:6])
    mode = stat.S_IMODE(os.stat(state / "state.json").st_mode)
    assert mode == 0o600
    assert fa.load_device_id(str(state), "pixel-8", here) == "pixel-8"
    assert fa.load_device_id(str(state), None, here) == "pixel-8"  # the flag is remembered
    assert json.loads((state / "state.json").read_text())["device_id"] == "pixel-8"
    assert [p.name for p in state.iterdir()] == ["state.json"]  # no temporary files left


def test_backoff_grows_with_jitter_and_resets(fa):
    backoff = fa.Backoff(base=1, cap=8, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(8)]
    ceilings = [1, 2, 4, 8, 8, 8, 8, 8]
    for delay, ceiling in zip(delays, ceilings):  # noqa: B905 - same length by construction
        assert ceiling / 2 <= delay <= ceiling
    assert len(set(delays)) == len(delays)  # jittered, not lockstep
    backoff.reset()
    assert backoff.next_delay() <= 1


def test_percentile_is_nearest_rank(fa):
    values = [120.0, 100.0, 110.0, 300.0, 105.0]
    assert fa.percentile(values, 50) == 110.0
    assert fa.percentile(values, 95) == 300.0
    assert fa.percentile([7.0], 95) == 7.0


# --- outbox (the final-row spool) ---


def test_outbox_keeps_rows_while_the_collector_is_away(fa, tmp_path, http_stub):
    outbox = fa.Outbox(str(tmp_path / "spool"))
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    for number in (1, 2, 0):
        outbox.put(dead, {"job_id": "j", "device_id": "d", "iter": number,
                          "final": number == 0})
    files = outbox.pending()
    assert len(files) == 3
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    assert outbox.flush() is False and len(outbox.pending()) == 3
    # the collector comes back (here: at another address, by rewriting the spooled entries)
    for path in files:
        entry = json.loads(Path(path).read_text())
        entry["collector"] = http_stub.url
        Path(path).write_text(json.dumps(entry))
    assert outbox.flush() is True
    # What piled up goes in one request, in the order it was written: the final row last.
    assert [[row["iter"] for row in body] for body in http_stub.posts] == [[1, 2, 0]]
    assert outbox.pending() == []


def test_outbox_posts_one_at_a_time_to_a_collector_without_arrays(fa, tmp_path, http_stub):
    outbox = fa.Outbox(str(tmp_path / "spool"))
    http_stub.refuse_arrays = True
    for number in (1, 2, 0):
        outbox.put(http_stub.url, {"job_id": "j", "device_id": "d", "iter": number})
    assert outbox.flush() is True
    assert [row["iter"] for row in http_stub.posts] == [1, 2, 0]
    assert outbox.pending() == []
    assert list((tmp_path / "spool" / "rejected").iterdir()) == []


def test_outbox_batches_stop_at_the_batch_size(fa, tmp_path, http_stub):
    outbox = fa.Outbox(str(tmp_path / "spool"))
    for number in range(fa.BATCH_ROWS + 1):
        outbox.put(http_stub.url, {"job_id": "j", "device_id": "d", "iter": number + 1})
    assert outbox.flush() is True
    assert [len(body) if isinstance(body, list) else 1 for body in http_stub.posts] == [
        fa.BATCH_ROWS, 1]


def test_a_refused_row_in_a_batch_is_set_aside_and_the_rest_delivered(fa, tmp_path, procs):
    collector = procs.collector()
    collector.post("/devices/register", {"device_id": "d", "descriptor": {},
                                         "capabilities": ["benchmark"]})
    collector.enqueue({"schema": 1, "job_id": "kept", "workload": "benchmark",
                       "executor": "device", "backend": "synthetic",
                       "targets": {"device_id": "d"}})
    assert collector.get("/devices/d/next-job")[1]["job_id"] == "kept"  # rows need the claim
    outbox = fa.Outbox(str(tmp_path / "spool"))
    for job_id, number in (("kept", 1), ("forgotten", 1), ("kept", 2)):
        outbox.put(collector.url, {"schema": 1, "kind": "result", "job_id": job_id,
                                   "device_id": "d", "iter": number, "metrics": {}})
    assert outbox.flush() is True
    assert sorted(r["iter"] for r in collector.results("kept")) == [1, 2]
    rejected = list((tmp_path / "spool" / "rejected").iterdir())
    assert [json.loads(p.read_text())["row"]["job_id"] for p in rejected] == ["forgotten"]
    assert outbox.pending() == []


def test_outbox_sets_aside_rows_the_collector_refuses(fa, tmp_path, http_stub):
    outbox = fa.Outbox(str(tmp_path / "spool"))
    http_stub.status = 404
    outbox.put(http_stub.url, {"job_id": "gone", "device_id": "d", "iter": 0})
    assert outbox.flush() is True
    assert outbox.pending() == []
    assert len(list((tmp_path / "spool" / "rejected").iterdir())) == 1


def test_rejected_rows_are_bounded_and_the_oldest_go_first(fa, tmp_path, http_stub):
    outbox = fa.Outbox(str(tmp_path / "spool"))
    rejected = tmp_path / "spool" / "rejected"
    for number in range(fa.REJECTED_KEEP_FILES + 5):  # left by earlier refusals
        (rejected / f"{number:020d}-000001.json").write_text("{}")
    http_stub.status = 400
    outbox.put(http_stub.url, {"job_id": "newest", "device_id": "d", "iter": 0})
    assert outbox.flush() is True
    names = sorted(p.name for p in rejected.iterdir())
    assert len(names) == fa.REJECTED_KEEP_FILES
    assert names[0] == f"{6:020d}-000001.json"
    assert json.loads((rejected / names[-1]).read_text())["row"]["job_id"] == "newest"
    # and in bytes: two large rows do not both stay beside a new one
    for path in rejected.iterdir():
        path.unlink()
    for number in (1, 2):
        (rejected / f"{number:020d}-000001.json").write_bytes(b" " * (fa.REJECTED_KEEP_BYTES // 2))
    outbox.put(http_stub.url, {"job_id": "newer", "device_id": "d", "iter": 0})
    assert outbox.flush() is True
    names = sorted(p.name for p in rejected.iterdir())
    assert len(names) == 2 and names[0] == f"{2:020d}-000001.json"


def _posted_rows(stub):
    """Every body the stub collector took, arrays flattened, in arrival order."""
    return [row for body in stub.posts for row in (body if isinstance(body, list) else [body])]


def test_rows_and_beacons_echo_the_claimed_attempt_and_spooled_rows_keep_theirs(
        fa, tmp_path, http_stub):
    runtime = make_runtime(fa, tmp_path)
    spec = {"schema": 1, "job_id": "j", "workload": "benchmark", "backend": "synthetic",
            "params": {"prompt_tokens": 1, "gen_tokens": 1, "warmup_iters": 0,
                       "measure_iters": 2}}
    # attempt 1 reports while its collector is away: the row waits in the spool
    away = fa.JobContext(runtime, fa.Collector("http://127.0.0.1:9"), {**spec, "attempt": 1},
                         "unit-1")
    away.post(away.row(1, True, {"n": 1}))
    for path in runtime.outbox.pending():  # the collector comes back (at the stub's address)
        entry = json.loads(Path(path).read_text())
        entry["collector"] = http_stub.url
        Path(path).write_text(json.dumps(entry))
    # the job was claimed again: attempt 2 runs, and its first post delivers the spool first
    runtime.run_job(fa.Collector(http_stub.url), {**spec, "attempt": 2})
    assert [(r["iter"], r["attempt"], r["final"]) for r in _posted_rows(http_stub)] == [
        (1, 1, False), (1, 2, False), (2, 2, False), (0, 2, True)]
    # beacons for the job name the attempt too; idle beacons name none
    assert runtime.beacon_body("j", attempt=2)["attempt"] == 2
    assert "attempt" not in runtime.beacon_body()
    ctx = fa.JobContext(runtime, fa.Collector(http_stub.url), {**spec, "attempt": 3}, "unit-1")
    keeper = fa.LeaseKeeper(ctx, 0.05)
    keeper.start()
    try:
        beacons = wait_for(lambda: [b for b in http_stub.posts if isinstance(b, dict)
                                    and b.get("kind") == "beacon"], 10, what="a beacon")
    finally:
        keeper.stop()
    assert (beacons[0]["job_id"], beacons[0]["attempt"]) == ("j", 3)


@pytest.mark.parametrize("value", [None, "2", True, 0, 2.5, 10**7])
def test_a_claim_without_a_usable_attempt_number_sends_rows_without_one(fa, tmp_path, value):
    runtime = make_runtime(fa, tmp_path)
    spec = {"schema": 1, "job_id": "j", "workload": "self-check", "attempt": value}
    ctx = fa.JobContext(runtime, fa.Collector("http://127.0.0.1:9"), spec, "unit-1")
    assert ctx.attempt is None and "attempt" not in ctx.row(0, True)


def test_atomic_write_is_private_and_leaves_no_temporary(fa, tmp_path):
    target = tmp_path / "d" / "f.json"
    fa.atomic_write_json(str(target), {"a": 1})
    fa.atomic_write_json(str(target), {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["f.json"]


# --- artifacts ---


def test_download_verifies_the_sha256(fa, tmp_path, http_stub):
    payload = b"model weights"
    sha = hashlib.sha256(payload).hexdigest()
    http_stub.blobs[sha] = payload
    collector = fa.Collector(http_stub.url)
    dest = tmp_path / "model"
    assert collector.download_artifact(sha, str(dest)) == str(dest)
    assert dest.read_bytes() == payload
    forged = hashlib.sha256(b"other").hexdigest()
    http_stub.blobs[forged] = b"tampered bytes"
    with pytest.raises(fa.ArtifactError, match="altered or corrupted"):
        collector.download_artifact(forged, str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no partial download left
    with pytest.raises(fa.ArtifactError, match="answered 404"):
        collector.download_artifact("c" * 64, str(tmp_path / "missing"))
    with pytest.raises(fa.ArtifactError, match="not a SHA-256"):
        collector.download_artifact("../../etc/passwd", str(tmp_path / "x"))
    # A regular expression's "$" also matches before a final newline: a hash is checked whole.
    with pytest.raises(fa.ArtifactError, match="not a SHA-256"):
        collector.download_artifact(sha + "\n", str(tmp_path / "newline"))


class ArtifactSite:
    """A collector whose artifact answers stream zeros (64 MiB, here as good as endless): with
    no length, or with a declared one."""

    def __init__(self, declared: int | None) -> None:
        class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: the body ends when the socket does
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200)
                if declared is not None:
                    self.send_header("content-length", str(declared))
                self.end_headers()
                with contextlib.suppress(OSError):  # the agent hung up
                    for _ in range(1024):
                        self.wfile.write(b"\0" * 65536)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def artifact_site():
    started: list[ArtifactSite] = []

    def start(declared: int | None = None) -> ArtifactSite:
        started.append(ArtifactSite(declared))
        return started[-1]

    yield start
    for site in started:
        site.close()


def test_an_endless_download_stops_at_its_limit_and_leaves_no_partial_file(fa, tmp_path,
                                                                           artifact_site):
    site = artifact_site()
    folder = tmp_path / "cache"
    folder.mkdir()
    with pytest.raises(fa.ArtifactError, match="larger than the 1048576 bytes the agent takes"):
        fa.Collector(site.url).download_artifact("a" * 64, str(folder / "x"), limit=1 << 20)
    assert list(folder.iterdir()) == []


def test_a_download_declared_too_large_is_refused_before_its_first_byte(fa, tmp_path,
                                                                        artifact_site):
    folder = tmp_path / "cache"
    folder.mkdir()
    site = artifact_site(fa.MAX_ARTIFACT_BYTES + 1)
    with pytest.raises(fa.ArtifactError, match=f"larger than the {fa.MAX_ARTIFACT_BYTES} bytes"):
        fa.Collector(site.url).download_artifact("a" * 64, str(folder / "x"))
    free = shutil.disk_usage(folder).free
    if free <= fa.MAX_ARTIFACT_BYTES:  # one that fits the limit but not this disk
        site = artifact_site(free)
        with pytest.raises(fa.ArtifactError, match="does not fit: .* the agent keeps "
                                                   f"{fa.DOWNLOAD_FREE_RESERVE} of them free"):
            fa.Collector(site.url).download_artifact("a" * 64, str(folder / "x"))
    assert list(folder.iterdir()) == []


def test_partial_downloads_a_killed_agent_left_are_removed_at_start(fa, tmp_path):
    cache = tmp_path / "state" / "cache"
    cache.mkdir(parents=True)
    (cache / ("b" * 64)).write_bytes(b"verified")
    old = cache / ".dl-killed"
    old.write_bytes(b"half of a model")
    long_ago = time.time() - fa.DOWNLOAD_STALL_S - 60
    os.utime(old, (long_ago, long_ago))
    (cache / ".dl-busy").write_bytes(b"another agent's download, still coming")
    make_runtime(fa, tmp_path)
    assert sorted(p.name for p in cache.iterdir()) == [".dl-busy", "b" * 64]


# --- host-side parsing ---


def test_adb_and_simctl_listings(fa, tmp_path):
    bin_dir = tmp_path / "bin"
    adb = make_tool(bin_dir, "adb", """
        print("List of devices attached")
        print("R5CT1234ABC            device usb:1-1 product:dm1q model:SM_S911B device:dm1q "
              "transport_id:3")
        print("emulator-5554          device product:sdk_gphone64 model:sdk_gphone64_x86_64 "
              "device:emu64x transport_id:1")
        print("0123456789             unauthorized usb:1-2 transport_id:4")
        print()
    """)
    targets = fa.android_targets(str(adb))
    assert [t["device_id"] for t in targets] == ["R5CT1234ABC", "emulator-5554"]
    assert targets[0]["model"] == "SM S911B" and targets[1]["emulator"] is True
    xcrun = make_tool(bin_dir, "xcrun", """
        print(json.dumps({"devices": {
            "com.apple.CoreSimulator.SimRuntime.iOS-17-2": [
                {"udid": "AAA", "name": "iPhone 15", "state": "Booted", "isAvailable": True},
                {"udid": "BBB", "name": "iPhone SE", "state": "Shutdown", "isAvailable": True}],
            "com.apple.CoreSimulator.SimRuntime.tvOS-17-2": [
                {"udid": "CCC", "name": "Apple TV", "state": "Booted", "isAvailable": True}]}}))
    """)
    sims = fa.simulator_targets(str(xcrun))
    assert [(t["device_id"], t["platform"]) for t in sims] == [("AAA", "ios"), ("CCC", "tvos")]
    assert fa.android_targets(None) == [] and fa.simulator_targets(None) == []


def test_suite_reports_json_and_junit(fa, tmp_path):
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"flows": [
        {"name": "login", "ok": True, "duration_ms": 1200},
        {"name": "checkout", "ok": False, "duration_ms": 800, "error": "button not found"}]}))
    flows = fa.parse_suite_report(str(report))
    assert [(f["name"], f["ok"]) for f in flows] == [("login", True), ("checkout", False)]
    junit = tmp_path / "r.xml"
    junit.write_text('<testsuite><testcase name="a" time="1.5"/>'
                     '<testcase name="b" time="0.2"><failure message="boom"/></testcase>'
                     "</testsuite>")
    flows = fa.parse_suite_report(str(junit))
    assert flows == [{"name": "a", "ok": True, "duration_ms": 1500.0, "error": None},
                     {"name": "b", "ok": False, "duration_ms": 200.0, "error": "boom"}]


def test_llama_bench_json(fa):
    output = "warming up...\n" + json.dumps([
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 100.0, "samples_ts": [99.0, 101.0]},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 20.0, "samples_ts": [19.0, 21.0]}])
    prefill, decode = fa.llama_records(output)
    assert prefill["avg_ts"] == 100.0 and decode["avg_ts"] == 20.0
    assert fa.llama_ttft_ms(512, 100.0, 20.0) == 5170.0
    with pytest.raises(fa.Refusal):
        fa.llama_records("no json here")


def test_run_watched_stops_when_the_job_stops(fa, tmp_path):
    ctx = SimpleNamespace(stop=SimpleNamespace(is_set=lambda: True))
    code, wall_ms, _ = fa.run_watched(["sleep", "30"], ctx, 60, str(tmp_path / "log"))
    assert code is None and wall_ms < 10_000
    ctx = SimpleNamespace(stop=SimpleNamespace(is_set=lambda: False))
    code, _, peak_mb = fa.run_watched([sys.executable, "-c", "print('hi')"], ctx, 60,
                                      str(tmp_path / "log"))
    assert code == 0 and peak_mb > 1 and (tmp_path / "log").read_text() == "hi\n"


def test_web_urls_are_http_only(fa):
    assert fa.web_url({"targets": {"url": "https://example.test/"}}) == "https://example.test/"
    for bad in ("file:///etc/passwd", "chrome://settings", None, "javascript:alert(1)"):
        with pytest.raises(fa.Refusal):
            fa.web_url({"targets": {"url": bad}})


# --- the command line, on the oldest Python the agent supports ---


@pytest.mark.parametrize("python", [sys.executable, "py38"])
def test_print_descriptor_runs_standalone(tmp_path, python):
    if python == "py38":
        python = python38()
        if python is None:
            pytest.skip("no Python 3.8 here")
    root = write_tree(tmp_path / "root", PI5)
    (tmp_path / "state").mkdir()
    allow = tmp_path / "allow"
    allow.write_text("d" * 64 + "\n")
    out = subprocess.run([python, str(AGENT_FILE), "--print-descriptor", "--sysroot", str(root),
                          "--state-dir", str(tmp_path / "state"), "--allowlist", str(allow),
                          "--device-id", "pi-1", "--set", "kind=", "--set", "vram_mb=512"],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["device_id"] == "pi-1"
    assert report["descriptor"]["model"] == "Raspberry Pi 5 Model B Rev 1.0"
    assert report["descriptor"]["kind"] is None and report["descriptor"]["vram_mb"] == 512
    assert report["capabilities"][:3] == ["self-check", "benchmark:synthetic", "shell"]


def test_the_agent_imports_only_the_standard_library():
    tree = ast.parse(AGENT_FILE.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported - {"__future__"} <= sys.stdlib_module_names, imported
    assert "fleet_min" not in imported


# --- whole workloads through Runtime.execute, rows going to a stub collector ---

FAKE_LLAMA_BENCH = """
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert open(args["-m"], "rb").read() == b"GGUF fake model"
reps = int(args["-r"])
ballast = bytearray(30 * 1024 * 1024)  # so peak memory is visible
print("llama-bench: warming up", file=sys.stderr)
print(json.dumps([
    {"build_commit": "abc123", "model_type": "llama 1B Q4_0", "n_prompt": int(args["-p"]),
     "n_gen": 0, "avg_ts": 200.0, "samples_ts": [190.0 + 10 * i for i in range(reps)]},
    {"build_commit": "abc123", "model_type": "llama 1B Q4_0", "n_prompt": 0,
     "n_gen": int(args["-n"]), "avg_ts": 25.0, "samples_ts": [24.0 + i for i in range(reps)]},
], indent=2))
"""


def make_runtime(fa, tmp_path, *flags, root=None):
    cfg = fa.parse_args(["--collector", "http://127.0.0.1:9", "--state-dir",
                         str(tmp_path / "state"), "--device-id", "unit-1", *flags])
    here = fa.Probe(root=str(root or tmp_path / "empty-root"),
                    env={"PATH": str(tmp_path / "bin")}, system="Linux", machine="aarch64")
    return fa.Runtime(cfg, here)


def test_a_job_whose_final_row_cannot_be_posted_still_ends_and_cleans_up(fa, tmp_path,
                                                                          http_stub, caplog):
    runtime = make_runtime(fa, tmp_path)
    spool = Path(runtime.outbox.directory)
    shutil.rmtree(spool)
    spool.write_text("in the way")  # so spooling the final row fails
    caplog.set_level(logging.INFO, logger="fleet_agent")
    runtime.run_job(fa.Collector(http_stub.url), {"schema": 1, "job_id": "lost",
                                                  "workload": "nope"})
    assert list(Path(runtime.work_root).iterdir()) == []
    assert "job lost: its final row could not be posted" in caplog.text
    assert "job lost ended: failed in" in caplog.text
    assert runtime.current is None


def run_spec(fa, runtime, stub, spec):
    ctx = fa.JobContext(runtime, fa.Collector(stub.url), {"schema": 1, **spec}, "unit-1")
    return ctx, runtime.execute(ctx)


def test_llama_cpp_backend_runs_llama_bench(fa, tmp_path, http_stub):
    make_tool(tmp_path / "bin", "llama-bench", FAKE_LLAMA_BENCH)
    model = b"GGUF fake model"
    sha = hashlib.sha256(model).hexdigest()
    http_stub.blobs[sha] = model
    runtime = make_runtime(fa, tmp_path)
    assert "benchmark:llama.cpp" in runtime.capabilities()
    _, result = run_spec(fa, runtime, http_stub, {
        "job_id": "llm", "workload": "benchmark", "backend": "llama.cpp",
        "model": {"name": "tiny", "format": "gguf", "sha256": sha},
        "params": {"prompt_tokens": 64, "gen_tokens": 16, "measure_iters": 2}})
    assert result["ok"] is True, result
    metrics = result["metrics"]
    assert (metrics["prefill_tok_s"], metrics["decode_tok_s"]) == (200.0, 25.0)
    assert metrics["ttft_ms"] == round(64 / 200 * 1000 + 1000 / 25, 3)
    assert metrics["peak_mem_mb"] > 30 and metrics["mem_method"].startswith("wait4-maxrss")
    rows = sorted(http_stub.posts, key=lambda r: r["iter"])
    assert [r["metrics"]["prefill_tok_s"] for r in rows] == [190.0, 200.0]


def test_an_unimplemented_backend_is_refused_with_a_sentence(fa, tmp_path, http_stub):
    runtime = make_runtime(fa, tmp_path)
    assert [c for c in runtime.capabilities() if c.startswith(("benchmark", "shell"))] == [
        "benchmark:synthetic"]
    _, result = run_spec(fa, runtime, http_stub, {"job_id": "mlx", "workload": "benchmark",
                                                  "backend": "mlx", "params": {}})
    assert result["ok"] is False
    assert "does not implement the benchmark backend 'mlx'" in result["error"]
    assert http_stub.posts == []  # no numbers from another backend under that name
    _, result = run_spec(fa, runtime, http_stub, {"job_id": "sh", "workload": "shell",
                                                  "params": {"script_sha256": "a" * 64}})
    assert "does not implement the workload 'shell'" in result["error"]


def test_power_refusal_before_any_work(fa, tmp_path, http_stub):
    root = write_tree(tmp_path / "root", {
        "/sys/class/power_supply/BAT0/type": "Battery\n",
        "/sys/class/power_supply/BAT0/capacity": "35\n",
        "/sys/class/power_supply/BAT0/status": "Discharging\n"})
    runtime = make_runtime(fa, tmp_path, root=root)
    spec = {"job_id": "b", "workload": "benchmark", "backend": "synthetic",
            "params": {"measure_iters": 1}}
    _, result = run_spec(fa, runtime, http_stub, {**spec, "constraints":
                                                  {"require_charging": True}})
    assert result == {"ok": False, "metrics": {}, "artifacts": [], "error":
                      "refused: the job requires charging and this device is not charging"}
    _, result = run_spec(fa, runtime, http_stub, {**spec, "constraints":
                                                  {"min_battery_pct": 50}})
    assert result["error"] == "refused: the battery is at 35% and the job needs at least 50%"
    assert http_stub.posts == []
    _, result = run_spec(fa, runtime, http_stub, {**spec, "constraints":
                                                  {"min_battery_pct": 30}})
    assert result["ok"] is True and result["metrics"]["battery_start_pct"] == 35


def test_a_shell_script_must_be_pinned(fa, tmp_path, http_stub):
    script = b"#!/bin/sh\necho hello \"$1\"\nexit 3\n"
    sha = hashlib.sha256(script).hexdigest()
    http_stub.blobs[sha] = script
    allow = tmp_path / "allow"
    allow.write_text("b" * 64 + "\n")
    runtime = make_runtime(fa, tmp_path, "--allowlist", str(allow))
    assert "shell" in runtime.capabilities()
    spec = {"job_id": "s", "workload": "shell", "params": {"script_sha256": sha,
                                                           "args": ["shelf"]}}
    _, result = run_spec(fa, runtime, http_stub, spec)
    assert "is not pinned in this machine's shell allowlist" in result["error"]
    allow.write_text(sha + "\n")
    _, result = run_spec(fa, runtime, http_stub, spec)
    # the output upload goes to a stub without /artifacts; the verdict still comes through
    assert result["ok"] is False and result["error"] == "the script exited with status 3"
    assert result["metrics"]["exit_code"] == 3


# --- the shipped service definitions start the agent with flags it accepts ---

DEPLOY = AGENT_FILE.parents[1] / "deploy" / "agent"


def test_systemd_unit_runs_the_agent_with_valid_flags(fa):
    unit = (DEPLOY / "fleet-agent.service").read_text()
    exec_lines = unit.split("ExecStart=", 1)[1].split("\n")
    command = []
    for line in exec_lines:
        command += line.strip().rstrip("\\").split()
        if not line.rstrip().endswith("\\"):
            break
    assert command[:2] == ["/usr/bin/python3", "/opt/fleet-agent/fleet_agent.py"]
    values = {"${FLEET_COLLECTOR}": "http://collector.lan:8788", "$FLEET_AGENT_ARGS": "--pool=lab"}
    cfg = fa.parse_args([values.get(word, word) for word in command[2:]])
    assert cfg.collectors == ["http://collector.lan:8788"] and cfg.pools == ["lab"]
    assert cfg.state_dir == "/var/lib/fleet-agent"
    assert "StateDirectory=fleet-agent" in unit and "TimeoutStopSec=45" in unit
    assert "KillSignal=SIGTERM" in unit


def test_launchd_plist_runs_the_agent_with_valid_flags(fa):
    import plistlib

    plist = plistlib.loads((DEPLOY / "com.fleet-min.agent.plist").read_bytes())
    assert plist["Label"] == "com.fleet-min.agent"
    argv = plist["ProgramArguments"]
    assert argv[0] == "/usr/bin/python3" and argv[1].endswith("/fleet_agent.py")
    cfg = fa.parse_args(argv[2:])
    assert cfg.collectors == ["http://collector.lan:8788"]
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True


def test_host_workloads_through_execute(fa, tmp_path, http_stub, monkeypatch):
    from tests.support.agent import FAKE_ADB, FAKE_CHROMIUM, FAKE_FLOW_RUNNER

    bin_dir = tmp_path / "bin"
    make_tool(bin_dir, "adb", FAKE_ADB)
    make_tool(bin_dir, "fleet-flow-runner", FAKE_FLOW_RUNNER)
    make_tool(bin_dir, "chromium", FAKE_CHROMIUM)
    (tmp_path / "adb").mkdir()
    monkeypatch.setenv("FAKE_ADB_DIR", str(tmp_path / "adb"))
    cfg = fa.parse_args(["--collector", http_stub.url, "--state-dir", str(tmp_path / "state"),
                         "--executor", "host", "--name", "bench-host"])
    runtime = fa.Runtime(cfg, fa.Probe(env={"PATH": str(bin_dir)}))
    assert runtime.capabilities() == [
        "install", "cold-start", "ui-test:flow_runner", "app-soak", "soak", "a11y-audit",
        "locale-shots", "drain", "web-test", "web-shots", "web-audit", "web-unfurl", "digest"]
    apk = b"PK fake apk"
    sha = hashlib.sha256(apk).hexdigest()
    http_stub.blobs[sha] = apk
    _, result = run_spec(fa, runtime, http_stub, {
        "job_id": "i", "workload": "install", "executor": "host",
        "app": {"name": "a", "sha256": sha, "platform": "android"}})
    assert result["ok"] is True, result
    _, result = run_spec(fa, runtime, http_stub, {
        "job_id": "c", "workload": "cold-start", "executor": "host",
        "targets": {"device_id": "R5CT1234ABC"},
        "params": {"app_id": "com.example.shop", "launches": 5, "states": ["cold", "warm"]}})
    assert result["ok"] is True, result
    assert result["states"]["cold"]["p50_ms"] == 820
    assert result["states"]["warm"]["p95_ms"] == 440
    _, result = run_spec(fa, runtime, http_stub, {
        "job_id": "u", "workload": "ui-test", "executor": "host",
        "suite": {"kind": "flow_runner", "flows": "flows/"}, "app": {"platform": "android"}})
    assert result["error"] == "1 of 3 flows failed: checkout", result
    _, result = run_spec(fa, runtime, http_stub, {
        "job_id": "w", "workload": "web-shots", "executor": "host",
        "targets": {"url": "http://x.test/"},
        "params": {"browser": ["chromium", "android-device", "firefox"], "settle_s": 0}})
    assert result["ok"] is False and result["error"] == "firefox is not installed on this executor"
    assert len(result["artifacts"]) == 3


def test_a_workloads_fields_cannot_change_what_a_row_is(fa, tmp_path):
    """A workload may name the device a row is about and add fields of its own; schema, kind,
    job_id and iter stay the row's (a field called kind once made the collector refuse the
    final row, and the job stayed claimed)."""
    runtime = make_runtime(fa, tmp_path)
    ctx = fa.JobContext(runtime, fa.Collector("http://127.0.0.1:9"),
                        {"schema": 1, "job_id": "j", "workload": "self-check"}, "unit-1")
    row = ctx.row(3, True, {"n": 1}, kind="apk", job_id="other", iter=7, schema=2,
                  device_id="R5CT", source_kind="apk")
    assert (row["schema"], row["kind"], row["job_id"], row["iter"]) == (1, "result", "j", 3)
    assert row["device_id"] == "R5CT" and row["source_kind"] == "apk"


def test_an_android_screenshot_waits_for_its_page_only_until_the_job_stops(fa, tmp_path,
                                                                           monkeypatch):
    """web-shots gives the device's browser `settle_s` (up to 60 s) to draw the page: a sleep,
    which a cancel did not end."""
    from tests.support.agent import FAKE_ADB

    bin_dir = tmp_path / "bin"
    make_tool(bin_dir, "adb", FAKE_ADB)
    (tmp_path / "adb").mkdir()
    monkeypatch.setenv("FAKE_ADB_DIR", str(tmp_path / "adb"))
    cfg = fa.parse_args(["--collector", "http://127.0.0.1:9", "--state-dir",
                         str(tmp_path / "state"), "--executor", "host", "--name", "bench-host"])
    runtime = fa.Runtime(cfg, fa.Probe(env={"PATH": str(bin_dir)}))
    ctx = fa.JobContext(runtime, fa.Collector("http://127.0.0.1:9"),
                        {"schema": 1, "job_id": "w", "workload": "web-shots"}, "bench-host")
    threading.Timer(0.2, ctx.request_stop, ("cancelled by an operator",)).start()
    started = time.monotonic()
    with pytest.raises(fa.Stopped, match="cancelled by an operator"):
        fa.android_shot(runtime, ctx, "R5CT1234ABC", "http://x.test/", 60.0)
    assert time.monotonic() - started < 30  # not a speed bound: the 60 s wait was cut


def test_an_audit_keeps_of_each_event_what_it_reads_and_clips_its_text(fa):
    """DevTools events were kept whole for a web-audit's whole timeout: a page that logs a
    megabyte twenty times a second took the agent past 450 MB in 30 s. Only the events the
    audit reads are kept, with the fields it reads and their text clipped, and the audit
    reads the same findings from them."""
    huge = "x" * (1 << 20)
    events = [
        {"method": "Network.requestWillBeSent", "params": {
            "requestId": "1", "type": "Document", "request": {"url": "http://a.test/",
                                                              "headers": {"h": huge}}}},
        {"method": "Network.responseReceived", "params": {
            "requestId": "1", "type": "Document",
            "response": {"url": "http://a.test/", "status": 200, "headers": {"h": huge}}}},
        {"method": "Network.loadingFinished", "params": {"requestId": "1",
                                                         "encodedDataLength": 900}},
        {"method": "Network.requestWillBeSent", "params": {
            "requestId": "2", "type": "Image", "request": {"url": "http://a.test/gone.png"}}},
        {"method": "Network.responseReceived", "params": {
            "requestId": "2", "type": "Image",
            "response": {"url": "http://a.test/gone.png", "status": 404}}},
        {"method": "Network.requestWillBeSent", "params": {
            "requestId": "3", "type": "Script", "request": {"url": "http://b.test/s.js"}}},
        {"method": "Network.loadingFailed", "params": {"requestId": "3", "canceled": False,
                                                       "errorText": "net::ERR_FAILED"}},
        {"method": "Runtime.consoleAPICalled", "params": {"type": "log",
                                                          "args": [{"value": huge}]}},
        {"method": "Runtime.consoleAPICalled", "params": {
            "type": "error", "args": [{"value": "widget failed:"}, {"description": huge},
                                      {"value": None}]}},
        {"method": "Runtime.exceptionThrown", "params": {"exceptionDetails": {
            "text": "Uncaught", "exception": {"description": "ReferenceError: " + huge}}}},
        {"method": "Log.entryAdded", "params": {"entry": {"level": "error", "source": "other",
                                                          "text": huge, "url": "http://a.test/"}}},
        {"method": "Log.entryAdded", "params": {"entry": {"level": "info", "text": huge}}},
        {"method": "Page.frameNavigated", "params": {"frame": {"url": huge}}},
    ]
    kept = [k for k in map(fa.audit_event, events) if k is not None]
    assert len(kept) == 10 and len(json.dumps(kept)) < 5000
    assert fa.audit_event({"method": "Runtime.exceptionThrown", "params": "not an object"}) == {
        "method": "Runtime.exceptionThrown",
        "params": {"exceptionDetails": {"text": None, "exception": {"description": None}}}}
    assert fa.console_errors(kept) == fa.console_errors(events)
    assert fa.page_weight(kept) == fa.page_weight(events)
    assert fa.console_errors(kept)[0].startswith("widget failed: xxx")
