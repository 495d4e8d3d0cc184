"""The control plane's state directory is the owner's alone: the directory 0700 and every file in
it 0600 (database, -wal, -shm, tokens, anything else), made so by a real daemon process at start,
also over a state directory an older version left looser, and still so after a write."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.controlplane import Host

pytestmark = pytest.mark.slow


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def modes(state: Path) -> dict[str, int]:
    """Every directory and file under the state directory, by relative path."""
    out = {".": mode(state)}
    for folder, dirs, files in os.walk(state):
        for name in dirs + files:
            path = Path(folder) / name
            out[str(path.relative_to(state))] = mode(path)
    return out


def assert_owner_only(state: Path) -> None:
    found = modes(state)
    loose = {name: oct(bits) for name, bits in found.items()
             if bits & ~(0o700 if (state / name).is_dir() else 0o600)}
    assert not loose, f"looser than 0700/0600: {loose}"
    assert found["."] == 0o700


def change_a_setting(daemon: Any) -> None:
    """A write through the API: the setting is stored in the database (and its WAL)."""
    request = urllib.request.Request(
        daemon.url + "/api/settings", data=json.dumps({"key": "tick_s", "value": 7}).encode(),
        method="POST", headers={**daemon.headers(), "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200


def test_a_new_state_directory_is_owner_only(host: Host, daemon_factory: Any) -> None:
    assert not host.state.exists()
    old = os.umask(0o022)  # the usual umask: what a 0755 directory and 0644 files came from
    try:
        daemon = daemon_factory()
    finally:
        os.umask(old)
    for name in ("controlplane.db", "controlplane.db-wal", "controlplane.db-shm",
                 "control-token"):
        assert (host.state / name).exists(), name
    assert_owner_only(host.state)
    change_a_setting(daemon)
    assert_owner_only(host.state)


def test_a_looser_state_directory_is_tightened_and_each_change_logged(
        host: Host, daemon_factory: Any) -> None:
    # What an older version (or a copy, or a restore) left: everything readable by others.
    host.state.mkdir(mode=0o755)
    host.state.chmod(0o755)
    conn = sqlite3.connect(host.state / "controlplane.db")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE left_over (x)")
    conn.commit()
    conn.close()
    (host.state / "control-token").write_text("ab" * 32 + "\n")
    (host.state / "admission.log").write_text("")
    (host.state / "notes").mkdir()
    (host.state / "notes" / "todo.txt").write_text("rotate the token\n")
    loose = {"controlplane.db": 0o644, "control-token": 0o644, "admission.log": 0o664,
             "notes": 0o775, "notes/todo.txt": 0o666}
    for name, bits in loose.items():
        (host.state / name).chmod(bits)
    daemon = daemon_factory()
    assert_owner_only(host.state)
    assert daemon.token == "ab" * 32  # tightened, not replaced
    log = (host.tmp / "daemon.log").read_text()
    changed = [line for line in log.splitlines() if "tightened the mode of" in line]
    for name in [".", *loose]:
        path = str(host.state / name) if name != "." else str(host.state)
        assert sum(line.rstrip().endswith(("to 0700", "to 0600")) and f" {path} from " in line
                   for line in changed) == 1, (name, changed)
    assert len(changed) == len(loose) + 1, changed
    change_a_setting(daemon)
    assert_owner_only(host.state)


def test_the_token_command_makes_an_owner_only_directory(host: Host) -> None:
    import subprocess
    import sys

    from tests.support.controlplane import REPO_ROOT

    subprocess.run([sys.executable, "-m", "fleet_min", "controlplane", "token", "--state",
                    str(host.state)], env={**host.full_env(), "PYTHONPATH": str(REPO_ROOT)},
                   check=True, capture_output=True, timeout=60)
    assert_owner_only(host.state)
