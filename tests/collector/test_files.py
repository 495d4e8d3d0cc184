"""Nothing in the collector's data directory is for other users: a real collector process makes
the directory 0750 and its files 0640 (database, -wal, -shm, collector id, artifacts), takes the
'other' bits away from what an older version left, and keeps it so after writes. A directory it
cannot make private (another user's, a mode that will not change) is refused, and so is a link
planted where its own files go while the directory was loose."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.collector import ROOT, CollectorProcess, job
from tests.support.life import HANG_S
from tests.support.planted import assert_refused_untouched, plant_link

pytestmark = pytest.mark.slow


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def loose_entries(data: Path) -> dict[str, str]:
    """Every directory or file under the data directory with a bit beyond 0750/0640."""
    found = {".": mode(data)} if mode(data) & ~0o750 else {}
    for folder, dirs, files in os.walk(data):
        for name in dirs + files:
            path = Path(folder) / name
            if mode(path) & ~(0o750 if path.is_dir() else 0o640):
                found[str(path.relative_to(data))] = mode(path)
    return {name: oct(bits) for name, bits in found.items()}


def upload(proc: CollectorProcess, data: bytes) -> str:
    request = urllib.request.Request(proc.url + "/artifacts", data=data, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 201
    return hashlib.sha256(data).hexdigest()


def test_a_new_data_directory_has_nothing_for_others(tmp_path: Path) -> None:
    data = tmp_path / "data"
    old = os.umask(0o022)  # the usual umask: what 0755 directories and 0644 files came from
    try:
        proc = CollectorProcess(data).start()
    finally:
        os.umask(old)
    try:
        for name in ("fleet.sqlite3", "fleet.sqlite3-wal", "fleet.sqlite3-shm", "collector-id"):
            assert (data / name).exists(), name
        assert mode(data) == 0o750 and mode(data / "fleet.sqlite3") == 0o640
        assert loose_entries(data) == {}
        # made with its mode, not made loose and then tightened with a warning on a first start
        assert "tightened" not in proc.log(), proc.log()
        assert proc.client.post("/jobs", job("j1"))[0] == 201
        sha = upload(proc, b"an unreleased build")
        assert (data / "artifacts" / sha[:2] / sha).exists()
        assert loose_entries(data) == {}
    finally:
        proc.stop()


def test_a_looser_data_directory_is_tightened_at_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o777)
    conn = sqlite3.connect(data / "fleet.sqlite3")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.close()
    (data / "collector-id").write_text("col-0123456789abcdef\n")
    sha = hashlib.sha256(b"old build").hexdigest()
    shard = data / "artifacts" / sha[:2]
    shard.mkdir(parents=True)
    (shard / sha).write_bytes(b"old build")
    for path, bits in ((data / "fleet.sqlite3", 0o666), (data / "collector-id", 0o644),
                       (data / "artifacts", 0o755), (shard, 0o757), (shard / sha, 0o644)):
        path.chmod(bits)
    proc = CollectorProcess(data).start()
    try:
        assert loose_entries(data) == {}
        assert proc.client.get("/api/health")[1]["collector"] == "col-0123456789abcdef"
        for _ in range(200):  # the store adopts the row-less file soon after start
            if proc.client.get(f"/api/artifacts/{sha}")[0] == 200:
                break
            time.sleep(0.05)
        with urllib.request.urlopen(f"{proc.url}/artifacts/{sha}", timeout=30) as reply:
            assert reply.read() == b"old build"  # still served after the change
        assert proc.client.post("/jobs", job("j1"))[0] == 201
        assert loose_entries(data) == {}
    finally:
        proc.stop()
    changed = [line for line in proc.log().splitlines() if "tightened the mode of" in line]
    assert len(changed) == 6, changed  # the directory, the database, the id and the store's 3


# -- a data directory someone else could write before the start ------------------------------


def start_refused(data: Path, prefix: tuple[str, ...] = ()) -> str:
    """A real collector start that must end at once with one sentence (a start that is not
    refused runs until the hang detector ends it, failing the test)."""
    result = subprocess.run(
        [*prefix, sys.executable, "-m", "fleet_min", "collector", "--bind", "127.0.0.1",
         "--port", "0", "--data", str(data)], capture_output=True, text=True, timeout=HANG_S,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


@pytest.mark.parametrize("held", [
    b"\xff\xfe not UTF-8", b"col-1\nFLEET_X=1\n", b"x" * 10_000, b"col-\x1b[31mred",
    "col-\u202eevil".encode()])
def test_a_collector_id_file_that_holds_no_id_is_refused_and_kept(tmp_path: Path,
                                                                  held: bytes) -> None:
    """Peers pin the id, mDNS advertises it and /api/health shows it: a file that holds
    something else (edited by hand, damaged) stops the start with a sentence rather than
    reaching them, or being replaced by a new id that every peer would see as a changed
    collector."""
    data = tmp_path / "data"
    data.mkdir(mode=0o750)
    (data / "collector-id").write_bytes(held)
    sentence = start_refused(data)
    assert "does not hold a collector id" in sentence and "backup" in sentence, sentence
    assert (data / "collector-id").read_bytes() == held


@pytest.mark.parametrize("kind, words", [("fifo", "is not a regular file"),
                                         ("huge", "is larger than 802 bytes")])
def test_a_collector_id_that_is_a_fifo_or_huge_is_refused_without_reading_it(
        tmp_path: Path, kind: str, words: str) -> None:
    """The id is read from a regular file only, and at most as many bytes as an id can hold: a
    FIFO in its place does not block the start, a gigabyte (sparse) does not fill memory."""
    data = tmp_path / "data"
    data.mkdir(mode=0o750)
    held = data / "collector-id"
    if kind == "fifo":
        os.mkfifo(held, 0o640)
    else:
        with open(held, "wb") as handle:
            handle.truncate(1 << 30)
    sentence = start_refused(data)
    assert "does not hold a collector id" in sentence and words in sentence, sentence
    assert stat.S_ISFIFO(held.lstat().st_mode) if kind == "fifo" else \
        held.stat().st_size == 1 << 30


@pytest.mark.parametrize("name, dangling", [
    ("collector.lock", False),  # truncated and written with the pid
    ("collector-id", False),  # read as the id /api/health shows anyone
    ("fleet.sqlite3", True),  # the whole database made where the link points
    ("fleet.sqlite3-wal", True),
])
def test_a_link_planted_in_a_loose_data_directory_is_refused_not_followed(
        tmp_path: Path, name: str, dangling: bool) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)  # anyone could have planted the link before this start
    victim = plant_link(data, name, tmp_path / "elsewhere", "notes.txt", dangling)
    assert_refused_untouched(start_refused(data), name, victim, dangling)
    assert (data / name).is_symlink()
    assert not (data / "fleet.sqlite3").exists()  # refused before the database was opened


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a directory to another user needs root")
def test_a_data_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    os.chown(data, 65534, 65534)  # its owner could loosen it, or plant links, at any time
    stderr = start_refused(data)
    assert f"cannot use the data directory {data}: it belongs to uid 65534" in stderr, stderr
    assert list(data.iterdir()) == [] and mode(data) == 0o777  # nothing made, nothing changed


def test_a_data_directory_below_a_folder_anyone_may_write_is_refused(tmp_path: Path) -> None:
    """Below a folder every user may write to, without the sticky bit, any user could rename
    the data directory and put one of their own in its place, as the service uses it by its
    path. With the sticky bit (as /tmp has it), the same place serves."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    data = shared / "fleet-data"
    stderr = start_refused(data)
    assert (f"cannot use the data directory {data}: its parent {shared} has mode 0777: any "
            "user may rename this directory") in stderr, stderr
    assert "chmod +t" in stderr and list(data.iterdir()) == []  # nothing made in it
    shared.chmod(0o1777)
    proc = CollectorProcess(data).start()
    try:
        assert proc.client.get("/api/health")[0] == 200
    finally:
        proc.stop()


def read_only_mount(folder: Path) -> tuple[str, ...]:
    """A prefix that runs a command with `folder` on a read-only bind mount (root, in a private
    mount namespace): a mode there cannot be changed, as on a foreign file system."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("root here cannot make a private mount namespace (no unshare -m)")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    return ("unshare", "-m", "sh", "-c", script, str(folder))


def test_a_data_directory_whose_mode_cannot_be_tightened_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    stderr = start_refused(data, read_only_mount(data))
    assert "its mode stays 0777 (it could not be tightened to 0750)" in stderr, stderr


@pytest.mark.parametrize("where", ["shard", "file", "tmp"])
def test_a_link_planted_in_the_artifact_store_is_refused_not_followed(
        tmp_path: Path, where: str) -> None:
    """The store's shard folders, its files and its tmp folder are its own: a link among them
    would have had the start chmod its target, adopt what it holds as artifacts and serve it."""
    data = tmp_path / "data"
    store = data / "artifacts"
    store.mkdir(parents=True)
    data.chmod(0o777)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    secret = b"someone else's file"
    sha = hashlib.sha256(secret).hexdigest()
    (elsewhere / sha).write_bytes(secret)
    elsewhere.chmod(0o777)
    (elsewhere / sha).chmod(0o644)
    name = {"shard": sha[:2], "file": sha, "tmp": "tmp"}[where]
    if where == "shard":
        (store / sha[:2]).symlink_to(elsewhere)
    elif where == "file":
        (store / sha[:2]).mkdir()
        (store / sha[:2] / sha).symlink_to(elsewhere / sha)
    else:
        (store / "tmp").symlink_to(elsewhere)
    stderr = start_refused(data)
    assert f"{name} is a symbolic link" in stderr and "remove the link" in stderr, stderr
    assert mode(elsewhere) == 0o777 and mode(elsewhere / sha) == 0o644
    assert (elsewhere / sha).read_bytes() == secret and [*elsewhere.iterdir()] == [elsewhere / sha]
