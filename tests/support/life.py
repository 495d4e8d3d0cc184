"""Helpers for the tests of how the service processes start and stop: a port taken by another
socket, a request left half sent, an open stream, the service's own output."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support.collector import ROOT

HANG_S = 20  # a hang detector, never a timing assertion


@contextlib.contextmanager
def taken_port(host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """A port held by another listening socket for the duration (what a second service, or any
    other program, does to ours)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, port))
        sock.listen()
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


def fleet_min(*args: str, env: dict[str, str] | None = None, timeout: float = HANG_S
              ) -> subprocess.CompletedProcess[str]:
    """`python -m fleet_min ARGS` to completion (a hang fails the test through the timeout)."""
    return subprocess.run([sys.executable, "-m", "fleet_min", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """Every line the process wrote, stdout then stderr."""
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


def half_sent(port: int, method: str, path: str, total: int, sent: int,
              headers: dict[str, str] | None = None) -> socket.socket:
    """A client that announced `total` body bytes, sent `sent` of them and keeps the connection
    open without sending more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}",
            f"Content-Length: {total}",
            *(f"{name}: {value}" for name, value in (headers or {}).items())]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + b"x" * sent)
    return sock


def open_stream(port: int, path: str) -> socket.socket:
    """A GET whose answer never ends (SSE), with its status line read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    assert sock.recv(12).startswith(b"HTTP/1.1 200")
    return sock


def wait_text(read: Callable[[], str], text: str, timeout: float = HANG_S) -> str:
    """Until `text` shows up in what read() returns; all of it."""
    deadline = time.monotonic() + timeout
    while True:
        seen = read()
        if text in seen:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never appeared in:\n{seen[-3000:]}")
        time.sleep(0.05)


def signal_and_wait(proc: subprocess.Popen[Any], sig: int, timeout: float = HANG_S) -> int:
    """Send sig and wait for the process to end; a process still running after `timeout` is
    killed and the test fails."""
    os.kill(proc.pid, sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running {timeout} s after {signal.Signals(sig).name}"
                             ) from None


def read_text(path: Path) -> Callable[[], str]:
    return lambda: path.read_text(errors="replace") if path.exists() else ""


def acknowledged_until_stopped(write: Callable[[int, int], Any | None], workers: int,
                               enough: int, stop: Callable[[], int]) -> tuple[list[Any], int]:
    """Writers in `workers` threads call write(worker, n) for n = 0, 1, ... and keep what each
    call returns (an acknowledged write) until a call returns None or raises OSError (the server
    stopped listening). Once `enough` writes are acknowledged, stop() is called (it signals the
    server and waits for its exit code); the threads are joined and the acknowledged writes and
    the exit code returned. The caller checks that every acknowledged write was kept."""
    acked: list[Any] = []
    reached = threading.Event()

    def writer(worker: int) -> None:
        for n in range(1_000_000):
            try:
                done = write(worker, n)
            except OSError:
                return
            if done is None:
                return
            acked.append(done)
            if len(acked) >= enough:
                reached.set()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(workers)]
    for thread in threads:
        thread.start()
    assert reached.wait(HANG_S * 3), f"only {len(acked)} of {enough} writes acknowledged"
    code = stop()
    for thread in threads:
        thread.join(HANG_S)
    return acked, code
