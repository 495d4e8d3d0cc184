"""The collector as a real process: clean shutdown, crash durability, the zipapp."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.collector import (
    ROOT,
    CollectorProcess,
    beacon,
    job,
    registration,
    result_row,
    running_collector,
)

pytestmark = pytest.mark.slow


def test_sigterm_answers_open_long_polls_and_exits_zero(tmp_path):
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_LONG_POLL_S": "60"}).start()
    client = proc.client
    client.post("/devices/register", registration("d"))
    answers: list[int] = []

    def poll() -> None:
        status, _ = client.get("/devices/d/next-job", timeout=90)
        answers.append(status)

    threads = [threading.Thread(target=poll) for _ in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if client.get("/api/health")[1]["waiting_polls"] == 3:
            break
        time.sleep(0.05)
    started = time.monotonic()
    code = proc.stop(signal.SIGTERM)
    for thread in threads:
        thread.join(30)
    assert code == 0, proc.log()
    assert answers == [204, 204, 204]
    assert time.monotonic() - started < 30  # not the 60 s hold
    assert "collector stopped (SIGTERM)" in proc.log()


def test_sigint_also_exits_zero(tmp_path):
    proc = CollectorProcess(tmp_path / "data").start()
    assert proc.stop(signal.SIGINT) == 0


def test_collector_id_is_stable_and_instance_is_not(tmp_path):
    with running_collector(tmp_path / "data") as proc:
        first = proc.client.get("/api/health")[1]
    with running_collector(tmp_path / "data") as proc:
        second = proc.client.get("/api/health")[1]
    assert first["collector"] == second["collector"]
    assert first["instance"] != second["instance"]


def test_bad_settings_are_refused_with_a_sentence(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "fleet_min", "collector", "--port", "99999", "--data",
         str(tmp_path)], capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2
    assert "--port" in result.stderr and "65535" in result.stderr


def test_kill_9_loses_no_acknowledged_write(tmp_path):
    """Agents claim and report while the collector is killed; every acknowledged write is
    still there after a restart and no closed job is offered again."""
    data = tmp_path / "data"
    proc = CollectorProcess(data, env={"FLEET_LONG_POLL_S": "1"}).start()
    client = proc.client
    devices = [f"d{i}" for i in range(4)]
    for device in devices:
        client.post("/devices/register", registration(device))
    status, _ = client.post("/jobs", [job(f"j{i}") for i in range(200)])
    assert status == 201
    acknowledged_done: set[str] = set()
    acknowledged_rows: set[tuple[str, str, int]] = set()
    stop = threading.Event()

    def agent(device: str) -> None:
        while not stop.is_set():
            try:
                status, spec = client.get(f"/devices/{device}/next-job", timeout=5)
                if status != 200:
                    continue
                job_id = spec["job_id"]
                status, _ = client.post("/results", result_row(job_id, device, 1,
                                                               metrics={"n": 1}))
                if status == 200:
                    acknowledged_rows.add((job_id, device, 1))
                status, reply = client.post("/results", result_row(job_id, device, 0,
                                                                   final=True, ok=True))
                if status == 200 and reply["status"] == "done":
                    acknowledged_done.add(job_id)
            except OSError:
                return

    threads = [threading.Thread(target=agent, args=(d,)) for d in devices]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(acknowledged_done) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill9()
    stop.set()
    for thread in threads:
        thread.join(10)
    assert len(acknowledged_done) >= 40

    proc = CollectorProcess(data, port=proc.port).start()
    client = proc.client
    try:
        for job_id in acknowledged_done:
            assert client.get(f"/jobs/{job_id}")[1]["status"] == "done", job_id
        for job_id, device, iteration in acknowledged_rows:
            rows = client.get(f"/api/results?job={job_id}&device={device}")[1]["results"]
            assert iteration in [r["iter"] for r in rows]
        # Drain the rest: nothing already done may be offered again. (A new device: d0 may
        # still hold the job it had when the collector died, and a device holds one at a time.)
        client.post("/devices/register", registration("drain"))
        offered: list[str] = []
        for _ in range(400):
            status, spec = client.get("/devices/drain/next-job", timeout=10)
            if status == 204:
                break
            offered.append(spec["job_id"])
            client.post("/results", result_row(spec["job_id"], "drain", 0, final=True, ok=True))
        assert not set(offered) & acknowledged_done
        # Jobs claimed when the collector died are still claimed (their lease runs) or done.
        listing = client.get("/api/jobs?status=queued")[1]
        assert listing["total"] == 0
    finally:
        proc.stop()


def test_zipapp_runs_with_no_checkout_on_the_path(tmp_path):
    pyz = tmp_path / "build" / "fleet.pyz"
    subprocess.run([sys.executable, str(ROOT / "zipapp.py"), "-o", str(pyz)], check=True,
                   capture_output=True, timeout=120)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(pyz, elsewhere / "fleet.pyz")
    # -S: no site-packages at all, -I: no PYTHONPATH, no user site, no current directory.
    proc = CollectorProcess(tmp_path / "data", argv=[sys.executable, "-I", "-S",
                                                     str(elsewhere / "fleet.pyz"), "collector"],
                            cwd=elsewhere, env={"PYTHONPATH": "",
                                                "XDG_CACHE_HOME": str(tmp_path / "cache")}
                            ).start()
    try:
        client = proc.client
        health = client.get("/api/health")[1]
        assert health["ok"] is True
        client.post("/devices/register", registration("pi"))
        assert client.post("/jobs", job("z"))[0] == 201
        status, spec = client.get("/devices/pi/next-job")
        assert status == 200 and spec["job_id"] == "z"
        assert client.post("/results", beacon("pi", "z"))[1]["lease_renewed"] is True
    finally:
        assert proc.stop() == 0


def test_zipapp_build_is_reproducible(tmp_path):
    outputs = []
    for name in ("a.pyz", "b.pyz"):
        subprocess.run([sys.executable, str(ROOT / "zipapp.py"), "-o", str(tmp_path / name)],
                       check=True, capture_output=True, timeout=120)
        outputs.append((tmp_path / name).read_bytes())
    assert outputs[0] == outputs[1]


def test_version_flag():
    result = subprocess.run([sys.executable, "-m", "fleet_min", "--version"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("fleet-min ")
