"""The collector as a process a person leaves running: it refuses a taken port or a data
directory in use with one line, says where it listens once it does, and stops on SIGTERM or
SIGINT in every state without losing an acknowledged write; a second signal ends it at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from fleet_min import dirlock
from tests.support.collector import ROOT, CollectorProcess, free_port, job
from tests.support.life import (
    HANG_S,
    acknowledged_until_stopped,
    fleet_min,
    half_sent,
    lines,
    open_stream,
    signal_and_wait,
    taken_port,
    wait_text,
)

pytestmark = pytest.mark.slow
STOPS = [signal.SIGTERM, signal.SIGINT]


def second_loopback_address() -> str | None:
    """127.0.0.2 where the loopback interface answers it (Linux), else None."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.2", 0))
        except OSError:
            return None
    return "127.0.0.2"


def stop_with(proc: CollectorProcess, sig: int) -> int:
    assert proc.proc is not None
    code = signal_and_wait(proc.proc, sig)
    proc.proc = None
    return code


# -- start ---------------------------------------------------------------------------------


def test_a_taken_port_ends_it_at_once_with_one_line(tmp_path: Path) -> None:
    with taken_port() as port:
        result = fleet_min("collector", "--port", str(port), "--bind", "127.0.0.1",
                           "--data", str(tmp_path / "data"))
    assert result.returncode == 1
    assert lines(result) == [
        f"fleet-min collector: cannot listen on 127.0.0.1:{port}: address already in use"]


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def test_one_taken_address_of_several_is_named(tmp_path: Path) -> None:
    other = second_loopback_address()
    if other is None:
        pytest.skip("this machine's loopback answers 127.0.0.1 only")
    for _ in range(50):  # a port taken on the other address but free on 127.0.0.1
        with taken_port(other) as port:
            if not port_free("127.0.0.1", port):
                continue
            result = fleet_min("collector", "--port", str(port), "--bind",
                               f"127.0.0.1,{other}", "--data", str(tmp_path / "data"))
            break
    assert result.returncode == 1
    assert lines(result) == [
        f"fleet-min collector: cannot listen on {other}:{port}: address already in use"]
    with socket.socket() as sock:  # the address that did bind was given back
        sock.bind(("127.0.0.1", port))


def test_it_says_where_it_listens_once_every_address_is_bound(tmp_path: Path) -> None:
    other = second_loopback_address()
    binds = ["127.0.0.1", *([other] if other else [])]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet_min", "collector", "--port", "0", "--bind",
         ",".join(binds), "--data", str(tmp_path / "data")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stderr is not None
        seen = [proc.stderr.readline()]
        while seen[-1] and "listening on" not in seen[-1]:
            seen.append(proc.stderr.readline())
        line = seen[-1]
        assert "collector listening on http://127.0.0.1:" in line, seen
        port = int(line.split("http://127.0.0.1:")[1].split()[0].rstrip(","))
        assert port != 0
        for host in binds:  # port 0 found one free port, and every address uses it
            assert f"http://{host}:{port}" in line
            with urllib.request.urlopen(f"http://{host}:{port}/api/health", timeout=10) as r:
                assert r.status == 200
        assert f"(dashboard http://127.0.0.1:{port}/dash)" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/dash", timeout=10) as page:
            assert page.status == 200
        assert signal_and_wait(proc, signal.SIGTERM) == 0
        assert "collector stopped (SIGTERM)" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- one collector per data directory ------------------------------------------------------


def test_a_second_collector_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    first = CollectorProcess(tmp_path / "fleet-data").start()
    try:
        assert first.proc is not None
        # The second runs in the same folder on the default data directory, ./fleet-data.
        result = subprocess.run(
            [sys.executable, "-m", "fleet_min", "collector", "--port", str(free_port()),
             "--bind", "127.0.0.1"], cwd=tmp_path, capture_output=True, text=True,
            timeout=HANG_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert result.returncode == 1
        assert lines(result) == [f"fleet-min collector: another collector (pid {first.proc.pid})"
                                 " is using ./fleet-data"]
        assert first.client.get("/api/health")[0] == 200  # the first one goes on
        first.kill9()
        # The kernel dropped the lock with the process: the file left behind blocks nothing.
        assert (tmp_path / "fleet-data" / "collector.lock").exists()
        again = CollectorProcess(tmp_path / "fleet-data").start()
        assert again.stop() == 0
    finally:
        first.stop()


def test_a_restore_in_progress_keeps_a_collector_from_starting(tmp_path: Path) -> None:
    data = tmp_path / "data"
    held = dirlock.hold(data, "collector restore")  # what `collector restore` holds meanwhile
    try:
        result = fleet_min("collector", "--port", str(free_port()), "--bind", "127.0.0.1",
                           "--data", str(data))
    finally:
        held.release()
    assert result.returncode == 1
    assert lines(result) == [
        f"fleet-min collector: another collector restore (pid {os.getpid()}) "
        f"is using {data}"]


def test_backup_runs_beside_a_live_collector_and_restore_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = CollectorProcess(data).start()
    try:
        assert proc.proc is not None
        assert proc.client.post("/jobs", job("kept"))[0] == 201
        backup = fleet_min("collector", "backup", str(tmp_path / "b"), "--data", str(data))
        assert backup.returncode == 0, backup.stderr  # an online backup takes no lock
        refused = fleet_min("collector", "restore", str(tmp_path / "b"), "--data", str(data),
                            "--force")
        assert refused.returncode == 1
        assert lines(refused) == [f"fleet-min collector restore: another collector (pid "
                                  f"{proc.proc.pid}) is using {data}; stop it first"]
    finally:
        assert proc.stop() == 0
    done = fleet_min("collector", "restore", str(tmp_path / "b"), "--data", str(data), "--force")
    assert done.returncode == 0, done.stderr
    again = CollectorProcess(data).start()
    try:
        assert again.client.get("/jobs/kept")[0] == 200
    finally:
        again.stop()


# -- stop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
def test_a_signal_stops_it_with_streams_and_long_polls_open(tmp_path: Path, sig: int) -> None:
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_LONG_POLL_S": "60"}).start()
    assert proc.client.post("/devices/register", {
        "device_id": "d1", "descriptor": {"platform": "linux"}})[0] in (200, 201)
    streams = [open_stream(proc.port, "/api/stream") for _ in range(3)]
    poll = socket.create_connection(("127.0.0.1", proc.port), timeout=HANG_S)
    poll.sendall(b"GET /devices/d1/next-job HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    wait_text(lambda: json.dumps(proc.client.get("/api/health")[1]), '"waiting_polls": 1')
    assert stop_with(proc, sig) == 0
    assert poll.recv(12) == b"HTTP/1.1 204"  # the poll was answered, not dropped
    assert f"collector stopped ({sig.name})" in proc.log()
    for sock in [*streams, poll]:
        sock.close()


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
def test_a_signal_cuts_a_half_sent_upload_and_keeps_no_part_of_it(tmp_path: Path,
                                                                   sig: int) -> None:
    proc = CollectorProcess(tmp_path / "data").start()
    upload = half_sent(proc.port, "POST", "/artifacts", total=200 << 20, sent=4 << 20,
                       headers={"Content-Type": "application/octet-stream"})
    parts = tmp_path / "data" / "artifacts" / "tmp"
    wait_text(lambda: " ".join(p.name for p in parts.glob("*.part")), ".part")
    assert stop_with(proc, sig) == 0
    assert f"collector stopped ({sig.name})" in proc.log()
    upload.close()
    assert not list(parts.glob("*.part"))
    again = CollectorProcess(tmp_path / "data").start()
    try:
        assert again.client.get("/api/artifacts")[1]["artifacts"] == []
    finally:
        again.stop()


def test_a_signal_during_many_posts_keeps_every_acknowledged_job(tmp_path: Path) -> None:
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_SQLITE_SYNCHRONOUS": "FULL"}).start()

    def post(worker: int, n: int) -> str | None:
        job_id = f"w{worker}-{n}"
        status, _ = proc.client.post("/jobs", job(job_id), timeout=HANG_S)
        return job_id if status == 201 else None

    acked, code = acknowledged_until_stopped(post, workers=12, enough=300,
                                             stop=lambda: stop_with(proc, signal.SIGTERM))
    assert code == 0
    assert "collector stopped (SIGTERM)" in proc.log()
    conn = sqlite3.connect(tmp_path / "data" / "fleet.sqlite3")
    try:
        stored = {row[0] for row in conn.execute("SELECT job_id FROM jobs")}
    finally:
        conn.close()
    assert len(acked) >= 300
    assert set(acked) <= stored


def test_a_second_signal_exits_at_once_and_says_it_did_not_wait(tmp_path: Path) -> None:
    # A long grace: the first signal alone would wait for the half-sent upload for minutes.
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_STOP_GRACE_S": "600"}).start()
    assert proc.proc is not None
    assert proc.client.post("/jobs", job("before"))[0] == 201
    upload = half_sent(proc.port, "POST", "/artifacts", total=200 << 20, sent=1 << 20,
                       headers={"Content-Type": "application/octet-stream"})
    proc.proc.send_signal(signal.SIGTERM)
    wait_text(proc.log, "collector stopping (SIGTERM)")
    assert stop_with(proc, signal.SIGINT) == 128 + signal.SIGINT
    assert "second signal (SIGINT), exiting now without waiting" in proc.log()
    upload.close()
    again = CollectorProcess(tmp_path / "data").start()  # and the data is sound
    try:
        assert again.client.get("/jobs/before")[0] == 200
    finally:
        again.stop()
