"""The control plane's state directory is the owner's alone: the directory 0700 and every file in
it 0600 (database, -wal, -shm, tokens, anything else), made so by a real daemon process at start,
also over a state directory an older version left looser, and still so after a write. A state
directory it cannot make private is refused, so is a link planted where its own files go, and
the token command says in one line why it cannot use a state directory."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_min.controlplane.tokens import host_token
from tests.support import pyz as pyzs
from tests.support.controlplane import Host
from tests.support.life import HANG_S, fleet_min, lines
from tests.support.planted import assert_refused_untouched, plant_link

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
    from tests.support.controlplane import REPO_ROOT

    subprocess.run([sys.executable, "-m", "fleet_min", "controlplane", "token", "--state",
                    str(host.state)], env={**host.full_env(), "PYTHONPATH": str(REPO_ROOT)},
                   check=True, capture_output=True, timeout=60)
    assert_owner_only(host.state)


# -- a state directory someone else could write before the start -----------------------------


def start_refused(host: Host) -> str:
    """A real daemon start that must end at once with one sentence (one that is not refused
    runs until the hang detector ends it, failing the test)."""
    result = fleet_min("controlplane", "--root", str(host.root), "--state", str(host.state),
                       "--port", "0", env=host.env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


def token_command(state: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return fleet_min("controlplane", "token", "--state", str(state), env=env)


def loose_state(host: Host) -> Path:
    host.state.mkdir()
    host.state.chmod(0o777)  # anyone could have planted a link in it before this start
    return host.state


@pytest.mark.parametrize("name, dangling", [
    ("controlplane.lock", False),  # truncated and written with the pid
    ("controlplane.db", True),  # the database, and the audit it keeps, made where it points
    ("controlplane.db-wal", True),
])
def test_a_link_planted_in_a_loose_state_directory_is_refused_not_followed(
        host: Host, name: str, dangling: bool) -> None:
    state = loose_state(host)
    victim = plant_link(state, name, host.tmp / "elsewhere", "id_ed25519", dangling)
    assert_refused_untouched(start_refused(host), name, victim, dangling)
    assert not (state / "control-token").exists()


def test_a_control_token_linked_to_a_file_someone_else_wrote_is_refused(host: Host) -> None:
    state = loose_state(host)
    known = host.tmp / "planted-token"
    known.write_text("ab" * 32 + "\n")  # a token its planter knows
    (state / "control-token").symlink_to(known)
    stderr = start_refused(host)
    assert "control-token is a symbolic link" in stderr, stderr
    result = token_command(state, host.env)
    assert result.returncode == 1 and "ab" * 32 not in result.stdout
    assert lines(result) == [f"fleet-min controlplane token: cannot use the state directory "
                             f"{state}: control-token is a symbolic link, and this file is never "
                             "opened through one (a link planted in a loose directory would "
                             "redirect it); remove the link"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="a file of another user's needs root to make")
def test_a_token_file_another_user_wrote_is_replaced_not_trusted(host: Host) -> None:
    """A regular file planted while the state directory was loose is a token its planter
    knows, just as a link to one is."""
    state = loose_state(host)
    planted = "ab" * 32
    for name in ("control-token", "agent-token"):
        (state / name).write_text(planted + "\n")
        os.chown(state / name, 65534, 65534)
    result = token_command(state, host.env)
    assert result.returncode == 0, result.stderr
    assert planted not in result.stdout and len(result.stdout.strip()) == 64
    assert (state / "control-token").stat().st_uid == os.geteuid()
    agent = fleet_min("controlplane", "token", "--agent-host", "h1", "--state", str(state),
                      env=host.env)  # the planted agent token is not the one it is made from
    assert agent.returncode == 0 and agent.stdout.strip() != host_token(planted, "h1"), agent


def test_a_token_file_with_a_second_name_is_replaced(host: Host) -> None:
    """A hard link is a second name the token could still be read by, after a rotation or from
    a folder its linker can read."""
    first = token_command(host.state if host.state.exists() else loose_state(host), host.env)
    assert first.returncode == 0, first.stderr
    os.link(host.state / "control-token", host.tmp / "kept-copy")
    again = token_command(host.state, host.env)
    assert again.returncode == 0 and again.stdout != first.stdout
    assert (host.tmp / "kept-copy").read_text().strip() == first.stdout.strip()


def test_an_agent_token_link_is_never_read(host: Host) -> None:
    before = fleet_min("controlplane", "token", "--agent-host", "h1", "--state", str(host.state),
                       env=host.env)
    assert before.returncode == 0, before.stderr  # made from the control token: no agent token
    known = host.tmp / "planted-token"
    known.write_text("cd" * 32 + "\n")
    (host.state / "agent-token").symlink_to(known)
    after = fleet_min("controlplane", "token", "--agent-host", "h1", "--state", str(host.state),
                      env=host.env)
    assert after.returncode == 0 and after.stdout == before.stdout, after
    refused = fleet_min("controlplane", "token", "--agent", "--state", str(host.state),
                        env=host.env)
    assert refused.returncode == 1 and "cd" * 32 not in refused.stdout
    assert "agent-token is a symbolic link" in refused.stderr, refused.stderr
    assert known.read_text() == "cd" * 32 + "\n"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a directory to another user needs root")
def test_a_state_directory_another_user_owns_is_refused(host: Host) -> None:
    state = loose_state(host)
    os.chown(state, 65534, 65534)  # its owner could loosen it, or plant links, at any time
    why = "it belongs to uid 65534"
    assert f"cannot use the state directory {state}: {why}" in start_refused(host)
    result = token_command(state, host.env)
    assert result.returncode == 1 and result.stdout == ""
    assert lines(result)[0].startswith(
        f"fleet-min controlplane token: cannot use the state directory {state}: {why}")
    assert list(state.iterdir()) == [] and mode(state) == 0o777  # nothing made or changed


def test_the_token_command_says_in_one_line_why_a_state_path_is_unusable(host: Host) -> None:
    a_file = host.tmp / "a-file"
    a_file.write_text("not a directory\n")
    for state, why in ((a_file, "it is a file, not a directory"),
                       (a_file / "state", "a file stands where a directory on its path should "
                                          "be")):
        result = token_command(state, host.env)
        assert result.returncode == 1, result
        assert lines(result) == [
            f"fleet-min controlplane token: cannot use the state directory {state}: {why}"]


@pytest.fixture
def other_user(tmp_path: Path) -> Iterator[tuple[Callable[..., Any], Path]]:
    """Run fleet.pyz as another user (uid 65534) on a Python that user may run; the folder it
    gets (under /tmp: pytest's own is its owner's alone) is handed back and removed after."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("running as another user needs root and setpriv")
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    check = "import sys; sys.exit(sys.version_info < (3, 11))"
    python = next((p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
                   if os.path.exists(p) and subprocess.run(
                       [*prefix, p, "-c", check], capture_output=True).returncode == 0), None)
    if python is None:
        pytest.skip("no Python 3.11+ that another user may run")
    home = Path(tempfile.mkdtemp(prefix="fleet-other-user-"))
    try:
        home.chmod(0o755)
        pyz = pyzs.build(home / "fleet.pyz")
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home),
               "XDG_CACHE_HOME": str(home / "cache")}

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*prefix, python, "-I", str(pyz), *args], env=env,
                                  capture_output=True, text=True, timeout=HANG_S, cwd=home)
        yield run, home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_token_command_says_why_its_user_cannot_write_the_state_directory(
        other_user: tuple[Callable[..., Any], Path]) -> None:
    run, home = other_user
    read_only = home / "read-only"
    read_only.mkdir()
    os.chown(read_only, 65534, 65534)
    read_only.chmod(0o500)  # its own, and it may look in, not write
    for state in (read_only, read_only / "state"):
        result = run("controlplane", "token", "--state", str(state))
        assert result.returncode == 1, result
        assert len(lines(result)) == 1, result.stderr
        assert lines(result)[0].startswith(
            f"fleet-min controlplane token: cannot use the state directory {state}: "
            "permission denied"), result.stderr
