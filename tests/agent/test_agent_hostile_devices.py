"""Attached devices that lie, against the host executor's device listing and readings.

A phone (or a USB gadget posing as one) chooses everything adb prints about it: its serial, the
fields of `adb devices -l`, getprop, dumpsys, `am start -W`, the screencap bytes; `xcrun simctl
list -j` is JSON a tool prints. Each fake here is a real executable on PATH that prints such
output; the agent's own functions (or the agent as a process) read it."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.agent import AGENT_FILE, host_runtime, make_tool

LISTED = b"List of devices attached\n"


def listing_adb(tmp_path, listing: bytes, shell: str = "") -> str:
    """A fake adb whose `devices -l` prints `listing` as it is (bytes, control characters and
    all) and whose `-s SERIAL shell ...` runs `shell` (Python, with `cmd` the shell words)."""
    (tmp_path / "listing.bin").write_bytes(listing)
    body = f"""
        args = sys.argv[1:]
        if args[:2] == ["devices", "-l"]:
            sys.stdout.buffer.write(open({str(tmp_path / "listing.bin")!r}, "rb").read())
            sys.exit(0)
        cmd = args[3:] if args[2:3] == ["shell"] else args[2:]
    """ + "\n".join("        " + line for line in shell.splitlines())
    return str(make_tool(tmp_path / "bin", "adb", body))


def listing_xcrun(tmp_path, listing: bytes) -> str:
    (tmp_path / "simctl.bin").write_bytes(listing)
    return str(make_tool(tmp_path / "bin", "xcrun", f"""
        if sys.argv[1:5] == ["simctl", "list", "-j", "devices"]:
            sys.stdout.buffer.write(open({str(tmp_path / "simctl.bin")!r}, "rb").read())
    """))


def device_lines(*serials: bytes) -> bytes:
    return LISTED + b"".join(s + b"    device product:x model:Pixel_8 transport_id:1\n"
                             for s in serials) + b"\n"


# --- serials: what a device calls itself reaches argv, row fields, file names and logs ---

HOSTILE_SERIALS = [
    b"-oProxyCommand=touch",  # an option to whatever takes the serial as an argument
    b"--stdout=/tmp/owned",
    b"../../etc",  # a path, were a name ever built from it
    b"a/b",
    b"\x1b[2J\x1b[31mred",  # ANSI escapes for the terminal of --describe
    b"\xff\xfe\xfd",  # not UTF-8
    b"nul\x00byte",
    b"A" * 100_000,
]


def test_serials_that_are_no_device_ids_are_left_out_with_a_warning(fa, tmp_path, caplog):
    adb = listing_adb(tmp_path, device_lines(b"R5CT1234ABC", *HOSTILE_SERIALS,
                                             b"emulator-5554", b"192.168.1.7:5555"))
    with caplog.at_level(logging.WARNING):
        targets = fa.android_targets(adb)
    assert [t["device_id"] for t in targets] == ["R5CT1234ABC", "emulator-5554",
                                                 "192.168.1.7:5555"]
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "is not driven" in said and "\x1b" not in said and "\x00" not in said
    assert len(said) < 20_000  # the 100 KB serial is clipped in the log


def test_a_serial_listed_twice_or_named_like_the_executor_is_not_driven(fa, tmp_path):
    """Two devices that share a serial cannot be told apart by `adb -s` (nor their rows by the
    collector); a device calling itself by the executor's name would have its rows filed as the
    executor's own, and a drain pinned to that name drains this machine instead."""
    listing_adb(tmp_path, device_lines(b"twin", b"R5CT1234ABC", b"twin", b"bench-host"))
    runtime = host_runtime(fa, tmp_path, tmp_path / "bin")
    assert [t["device_id"] for t in fa.attached_targets(runtime)] == ["R5CT1234ABC"]


def test_a_failing_adb_cannot_forge_a_log_line(fa, tmp_path, caplog):
    adb = str(make_tool(tmp_path / "bin", "adb", """
        print("error: no\\n2030-01-01 00:00:00 INFO fleet_agent: job x ended: done",
              file=sys.stderr)
        sys.exit(1)
    """))
    with caplog.at_level(logging.WARNING):
        assert fa.android_targets(adb) == []
    assert caplog.records and all("\n" not in r.getMessage() for r in caplog.records)


def test_describe_shows_a_devices_model_without_its_escapes(fa, tmp_path):
    listing_adb(tmp_path, LISTED + b"R5CT1234ABC device model:\x1b]0;owned\x07Pixel\n")
    listing_xcrun(tmp_path, json.dumps({"devices": {
        "com.apple.CoreSimulator.SimRuntime.iOS-17-2": [
            {"udid": "5A1B-SIM", "state": "Booted",
             "name": "iPhone\n  forged-device                ios, iPhone"}]}}).encode())
    text = fa.describe(host_runtime(fa, tmp_path, tmp_path / "bin"))
    devices = text.split("attached devices:\n", 1)[1].splitlines()
    assert len(devices) == 2 and "\x1b" not in text and "\x07" not in text


# --- simctl list -j: JSON of any shape ---

SIM_RUNTIME = "com.apple.CoreSimulator.SimRuntime.iOS-17-2"
GOOD_SIM = {"udid": "5A1B-SIM", "state": "Booted", "name": "iPhone 15"}
SIM_LISTS = {
    "deep": b"[" * 200_000,
    "deep-object": b'{"devices": ' + b'{"a": ' * 100_000,
    "devices-a-list": json.dumps({"devices": [GOOD_SIM]}).encode(),
    "devices-a-string": json.dumps({"devices": "none"}).encode(),
    "top-level-list": json.dumps([GOOD_SIM]).encode(),
    "odd-entries": json.dumps({"devices": {SIM_RUNTIME: [
        "iPhone", 5, None, [], {"udid": 7, "state": "Booted"},
        {"udid": "../../x", "state": "Booted"}, {"udid": "--stdout=/tmp/x", "state": "Booted"},
        {"udid": "a\nb", "state": "Booted"}, {"udid": "x" * 5000, "state": "Booted"},
        {"udid": "NAMELESS-SIM", "state": "Booted", "name": {"not": "text"}},
        GOOD_SIM]}}).encode(),
}


@pytest.mark.parametrize("shape", sorted(SIM_LISTS))
def test_a_simulator_list_of_any_shape_gives_only_the_simulators_it_can_drive(fa, tmp_path,
                                                                              shape):
    xcrun = listing_xcrun(tmp_path, SIM_LISTS[shape])
    targets = fa.simulator_targets(xcrun)
    if shape == "odd-entries":
        assert [(t["device_id"], t["model"]) for t in targets] == [
            ("NAMELESS-SIM", None), ("5A1B-SIM", "iPhone 15")]
    else:
        assert targets == []


def test_a_hostile_simulator_list_does_not_hide_the_android_devices(fa, tmp_path):
    """attached_targets is every host job's choice of devices: before, simctl's odd JSON raised
    out of it and every job (Android ones too) failed unexpectedly."""
    listing_adb(tmp_path, device_lines(b"R5CT1234ABC"))
    listing_xcrun(tmp_path, json.dumps({"devices": {SIM_RUNTIME: ["iPhone"]}}).encode())
    runtime = host_runtime(fa, tmp_path, tmp_path / "bin")
    assert [t["device_id"] for t in fa.attached_targets(runtime)] == ["R5CT1234ABC"]


# --- output without end: memory and time stay bounded ---

ENDLESS = """
    out = sys.stdout.buffer
    out.write(b"List of devices attached\\n")
    chunk = b"R5CT1234ABC device " + b"x" * (1 << 20) + b"\\n"
    for _ in range(400):  # 400 MB, then it hangs
        out.write(chunk)
    out.flush()
    time.sleep(120)
"""


@pytest.mark.slow
def test_a_device_list_without_end_is_cut_off_and_memory_stays_bounded(tmp_path):
    """The agent's own process reads a tool that prints 400 MB and then hangs: it stops the tool
    once its output passes the cap, before its timeout, and holds no more than it."""
    adb = make_tool(tmp_path / "bin", "adb", ENDLESS)
    probe = (
        "import importlib.util, json, resource, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('fleet_agent', {str(AGENT_FILE)!r})\n"
        "fa = importlib.util.module_from_spec(spec); spec.loader.exec_module(fa)\n"
        "targets = fa.android_targets(sys.argv[1])\n"
        "said = fa.run_cmd([sys.argv[1], 'devices', '-l'], timeout=60).err\n"
        "rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "print(json.dumps({'targets': targets, 'said': said, 'rss_mb': rss_mb}))\n")
    done = subprocess.run([sys.executable, "-c", probe, str(adb)], capture_output=True,
                          timeout=90, check=True)
    found = json.loads(done.stdout)
    assert found["targets"] == []
    # Stopped by the cap, not by the timeout (which the tool's sleep would reach).
    assert found["said"] == "printed more than 32 MB, so it was stopped", found
    assert found["rss_mb"] < 300, found


def test_run_cmd_keeps_an_honest_tools_output_and_stops_a_late_one(fa, tmp_path):
    tool = make_tool(tmp_path / "bin", "tool", """
        if sys.argv[1] == "late":
            print("started", flush=True)
            time.sleep(30)
        sys.stdout.write("out " * 1000)
        sys.stderr.write("err")
        sys.exit(3)
    """)
    result = fa.run_cmd([str(tool), "honest"], timeout=20)
    assert (result.code, result.out, result.err) == (3, "out " * 1000, "err")
    started = time.monotonic()
    result = fa.run_cmd([str(tool), "late"], timeout=1)
    assert result.code is None and result.err == "timed out after 1 s"
    # Killed at its timeout, not waited for: the tool sleeps 30 s.
    assert result.out == "started\n" and time.monotonic() - started < 25


# --- readings that parse to absurd numbers ---

LAUNCH = """
if cmd[:2] == ["am", "start"]:
    print("Status: ok\\nTotalTime: " + os.environ["FAKE_TOTAL"] + "\\nComplete")
"""


@pytest.mark.parametrize("total", ["9" * 400, "9" * 5000, "99999999999", "120001"],
                         ids=["400-digits", "5000-digits", "11-digits", "past-the-wait"])
def test_an_absurd_launch_time_is_refused_with_a_sentence(fa, tmp_path, monkeypatch, total):
    """float('9' * 400) is inf: the cold-start row's p50 became Infinity, which no JSON
    carries; the collector refuses such a row, so the job's result was lost."""
    adb = listing_adb(tmp_path, device_lines(b"R5"), LAUNCH)
    monkeypatch.setenv("FAKE_TOTAL", total)
    with pytest.raises(fa.Refusal, match="is no launch time"):
        fa.android_launch_ms(adb, "R5", "com.example.shop", "com.example.shop/.Main", "cold")


def test_an_honest_launch_time_is_read(fa, tmp_path, monkeypatch):
    adb = listing_adb(tmp_path, device_lines(b"R5"), LAUNCH)
    monkeypatch.setenv("FAKE_TOTAL", "812")
    assert fa.android_launch_ms(adb, "R5", "com.example.shop", "c/.Main", "cold") == 812.0


READINGS = """
huge = "9" * int(os.environ["FAKE_DIGITS"])
if cmd[:2] == ["dumpsys", "meminfo"]:
    print("** MEMINFO in pid 4242 [com.example.shop] **")
    print("           TOTAL PSS:    " + huge + "     TOTAL RSS:   120000")
elif cmd[:2] == ["dumpsys", "battery"]:
    print("Current Battery Service state:\\n  AC powered: false\\n  level: " + huge +
          "\\n  scale: 100\\n  voltage: 4100\\n  temperature: " + huge + ".5")
elif cmd[:2] == ["wm", "density"]:
    print("Physical density: " + huge)
elif cmd[:1] == ["uiautomator"]:
    print("UI hierchary dumped to: /sdcard/fleet-a11y.xml")
elif cmd[:2] == ["exec-out", "cat"]:
    print('<hierarchy><node class="android.widget.Button" clickable="true" text="Pay" '
          'bounds="[0,0][' + huge + ',200]" /><node class="android.widget.Button" '
          'clickable="true" text="Back" bounds="[0,0][100,200]" /></hierarchy>')
"""


@pytest.mark.parametrize("digits", [400, 5000])
def test_absurd_readings_never_become_numbers_no_json_carries(fa, tmp_path, monkeypatch,
                                                              digits):
    """Before: inf (battery, density), OverflowError or ValueError (memory, UI bounds: int()
    of 5000 digits raises) out of the readings, so a soak or an audit failed unexpectedly or
    posted a row the collector refuses."""
    listing_adb(tmp_path, device_lines(b"R5"), READINGS)
    monkeypatch.setenv("FAKE_DIGITS", str(digits))
    runtime = host_runtime(fa, tmp_path, tmp_path / "bin")
    with pytest.raises(fa.Refusal, match="is no memory reading"):
        fa.android_memory_mb(runtime, "R5", "com.example.shop")
    with pytest.raises(fa.Refusal, match="is no density"):
        fa.android_density(runtime, "R5")
    figures = fa.android_battery(runtime, "R5", "level")
    assert figures["voltage"] == 4100.0
    assert all(math.isfinite(v) for v in figures.values() if not isinstance(v, bool))
    nodes = fa.android_ui_nodes(runtime, "R5")
    assert [n["label"] for n in nodes] == ["Pay", "Back"]
    assert nodes[1]["bounds"] == (0, 0, 100, 200)
    assert all(abs(v) < 10**9 for n in nodes for v in n["bounds"])


def test_honest_readings_are_read_as_before(fa, tmp_path, monkeypatch):
    listing_adb(tmp_path, device_lines(b"R5"), READINGS)
    monkeypatch.setenv("FAKE_DIGITS", "3")
    runtime = host_runtime(fa, tmp_path, tmp_path / "bin")
    assert fa.android_memory_mb(runtime, "R5", "com.example.shop") == 1.0  # 999 KB
    assert fa.android_density(runtime, "R5") == 999.0
    assert fa.android_battery(runtime, "R5", "level")["temperature"] == 999.5
    assert fa.android_ui_nodes(runtime, "R5")[0]["bounds"] == (0, 0, 999, 200)


# --- presence: how much a round asks of the devices ---

def shell_adb(bin_dir, serials: int) -> str:
    """A fast fake adb (sh, so hundreds of calls take seconds): `devices -l` lists `serials`
    devices; getprop answers at once."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    adb = bin_dir / "adb"
    adb.write_text(f"""#!/bin/sh
if [ "$1" = devices ]; then
  echo "List of devices attached"
  i=0
  while [ $i -lt {serials} ]; do echo "dev-$i	device model:Pixel_8"; i=$((i+1)); done
  exit 0
fi
echo "[ro.build.version.release]: [14]"
""")
    adb.chmod(0o755)
    return str(adb)


def test_devices_are_asked_only_once_the_executor_is_registered(fa, tmp_path):
    """Describing each device runs getprop on it (up to 20 s on one that hangs): a round first
    registers the executor, and with no collector reached asks no device at all."""
    adb = shell_adb(tmp_path / "bin", 3)
    asked = tmp_path / "asked"
    script = Path(adb).read_text()
    logged = f'echo "$2" >> {asked}\necho "[ro.build'
    Path(adb).write_text(script.replace('echo "[ro.build', logged))
    runtime = host_runtime(fa, tmp_path, tmp_path / "bin")
    fa.Presence(runtime, [fa.Collector("http://127.0.0.1:9")]).round()  # nothing listens there
    assert not asked.exists(), asked.read_text()


def test_a_round_registers_at_most_max_attached_devices(fa, procs, tmp_path, caplog):
    collector = procs.collector()
    shell_adb(tmp_path / "bin", fa.MAX_ATTACHED + 20)
    runtime = host_runtime(fa, tmp_path, tmp_path / "bin")
    with caplog.at_level(logging.WARNING):
        fa.Presence(runtime, [fa.Collector(collector.url)]).round()
    devices = collector.get("/api/devices?limit=1000")[1]
    assert devices["devices_total"] == fa.MAX_ATTACHED
    assert f"{fa.MAX_ATTACHED + 20} devices are attached; the first {fa.MAX_ATTACHED} are " \
           "registered" in caplog.text
