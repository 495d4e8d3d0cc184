"""The control plane as a process a person leaves running: a taken port or a state directory in
use ends it at once with one line (it used to hang: its database threads kept it alive and it
ignored SIGTERM and SIGINT), and it stops on either signal in every state without losing an
acknowledged change; a second signal ends it at once."""

from __future__ import annotations

import os
import signal
import sqlite3
from typing import Any

import pytest

from tests.support.collector import HttpClient, free_port
from tests.support.controlplane import Daemon, Host
from tests.support.life import (
    HANG_S,
    acknowledged_until_stopped,
    fleet_min,
    half_sent,
    lines,
    open_stream,
    read_text,
    signal_and_wait,
    taken_port,
    wait_text,
)

pytestmark = pytest.mark.slow
STOPS = [signal.SIGTERM, signal.SIGINT]


def run(host: Host, *args: str, env: dict[str, str] | None = None) -> Any:
    return fleet_min("controlplane", "--root", str(host.root), "--state", str(host.state),
                     *args, env={**host.env, **(env or {})})


def port_of(daemon: Daemon) -> int:
    return int(daemon.url.rsplit(":", 1)[1])


def in_progress(daemon: Daemon) -> None:
    """Let the daemon take up what was sent before: a request answered on another connection
    means the loop has read the earlier connection's headers and started its handler."""
    assert HttpClient(daemon.url).get("/api/settings")[0] == 200


def stop_with(daemon: Daemon, sig: int) -> int:
    return signal_and_wait(daemon.proc, sig)


# -- start ---------------------------------------------------------------------------------


def test_a_taken_port_ends_it_at_once_with_one_line(host: Host) -> None:
    with taken_port() as port:
        result = run(host, "--port", str(port))
    assert result.returncode == 1
    assert lines(result) == [
        f"fleet-min controlplane: cannot listen on 127.0.0.1:{port}: address already in use"]


def test_a_start_that_fails_after_the_database_opened_still_ends(host: Host) -> None:
    (host.state / "control-token").mkdir(parents=True)  # the token file cannot be written
    result = run(host, "--port", str(free_port()))
    assert result.returncode == 1
    assert "fleet-min controlplane: cannot start: " in result.stderr
    assert "control-token" in result.stderr and "Traceback" not in result.stderr


def test_a_second_controlplane_on_the_same_state_dir_is_refused(host: Host) -> None:
    first = Daemon(host)
    try:
        result = run(host, "--port", str(free_port()))
        assert result.returncode == 1
        assert lines(result) == [f"fleet-min controlplane: another controlplane (pid "
                                 f"{first.proc.pid}) is using {host.state}"]
        assert HttpClient(first.url).get("/api/settings")[0] == 200
    finally:
        assert first.stop() == 0
    again = Daemon(host)  # the lock went with the process
    assert again.stop() == 0


# -- stop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
def test_a_signal_stops_it_with_streams_and_a_half_sent_request(host: Host, sig: int) -> None:
    daemon = Daemon(host)
    streams = [open_stream(port_of(daemon), "/api/stream") for _ in range(3)]
    body = half_sent(port_of(daemon), "POST", "/api/simulate", total=500_000, sent=100_000,
                     headers={"Content-Type": "application/json"})
    in_progress(daemon)
    assert stop_with(daemon, sig) == 0
    log = (host.tmp / "daemon.log").read_text()
    assert f"controlplane stopped ({sig.name})" in log and "Traceback" not in log
    for sock in [*streams, body]:
        sock.close()


def test_a_signal_during_many_changes_keeps_every_acknowledged_one(host: Host) -> None:
    daemon = Daemon(host)
    client, headers = HttpClient(daemon.url), daemon.headers()

    def change(worker: int, n: int) -> int | None:
        value = 30 + worker * 10_000 + n
        status, _ = client.post("/api/settings", {"key": "stuck_queue_s", "value": value},
                                headers=headers, timeout=HANG_S)
        return value if status == 200 else None

    acked, code = acknowledged_until_stopped(change, workers=6, enough=100,
                                             stop=lambda: stop_with(daemon, signal.SIGTERM))
    assert code == 0
    conn = sqlite3.connect(host.state / "controlplane.db")
    try:
        # Each acknowledged change wrote its audit row in a transaction of its own. (The row
        # names the value in effect when the answer was built, under concurrent changes not
        # always the one sent, so the rows are counted rather than matched.)
        audited = conn.execute("SELECT count(*) FROM audit WHERE action = 'settings'"
                               ).fetchone()[0]
    finally:
        conn.close()
    assert audited >= len(acked) >= 100
    assert "controlplane stopped (SIGTERM)" in (host.tmp / "daemon.log").read_text()


def test_a_second_signal_exits_at_once_and_says_it_did_not_wait(host: Host) -> None:
    daemon = Daemon(host, extra_env={"FLEET_STOP_GRACE_S": "600"})
    body = half_sent(port_of(daemon), "POST", "/api/simulate", total=500_000, sent=1000,
                     headers={"Content-Type": "application/json"})
    in_progress(daemon)
    os.kill(daemon.proc.pid, signal.SIGINT)
    wait_text(read_text(host.tmp / "daemon.log"), "controlplane stopping (SIGINT)")
    assert stop_with(daemon, signal.SIGTERM) == 128 + signal.SIGTERM
    log = (host.tmp / "daemon.log").read_text()
    assert "second signal (SIGTERM), exiting now without waiting" in log
    body.close()
    again = Daemon(host)  # the state is sound and the lock is free
    assert again.stop() == 0


def test_the_token_command_works_beside_the_running_daemon(host: Host) -> None:
    # `controlplane token` takes no lock: it works beside the running daemon.
    daemon = Daemon(host)
    try:
        result = fleet_min("controlplane", "token", "--state", str(host.state))
        assert result.returncode == 0 and result.stdout.strip() == daemon.token
    finally:
        daemon.stop()
