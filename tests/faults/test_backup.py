"""`fleet-min collector backup` while agents write, `restore`, and a collector started on the
restored data: everything acknowledged before the backup began is there, and the copy is one
consistent moment (no job closed without its final row). A backup and a restore leave the data
directory's modes whatever the umask, a restore writes through no link planted in the data
directory, and a damaged backup is refused in one line before anything is touched."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.collector import (
    ROOT,
    CollectorProcess,
    HttpClient,
    registration,
    running_collector,
)
from tests.support.faults import (
    LeanAgent,
    Ledger,
    Producer,
    invariants,
    losses,
    read_db,
    upload,
)
from tests.support.life import HANG_S

pytestmark = pytest.mark.slow


def child(*argv: str, env: dict[str, str] | None = None, timeout: float = 120
          ) -> subprocess.CompletedProcess[str]:
    """A child process run from the repository; `timeout` is a hang detector. Its address
    space is capped at 1 GiB: a restore that reads a hostile file whole fails with MemoryError
    instead of taking the machine's memory."""
    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          preexec_fn=cap_memory)


def fleet(*args: str, env: dict[str, str] | None = None, timeout: float = 120
          ) -> subprocess.CompletedProcess[str]:
    return child(sys.executable, "-m", "fleet_min", "collector", *args, env=env,
                 timeout=timeout)


def start_refused(data: Path) -> str:
    """A collector start on data that must end at once (rc 1) with a sentence on stderr."""
    result = child(sys.executable, "-m", "fleet_min", "collector", "--bind", "127.0.0.1",
                   "--port", "0", "--data", str(data), timeout=HANG_S)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def consistent(db: Path) -> list[str]:
    """What one moment of the database must show: closes with their final rows, rows with
    their jobs, claims with their attempts."""
    conn = read_db(db)
    try:
        return [f"{name}: {rows[:3]}" for name, sql in (
            ("done without a final row",
             "SELECT job_id FROM jobs j WHERE status = 'done' AND is_group = 0 AND NOT EXISTS "
             "(SELECT 1 FROM results r WHERE r.job_id = j.job_id AND r.final = 1)"),
            ("rows of unknown jobs",
             "SELECT DISTINCT job_id FROM results WHERE job_id NOT IN (SELECT job_id FROM jobs)"),
            ("claims without an open attempt",
             "SELECT job_id FROM jobs j WHERE status = 'claimed' AND NOT EXISTS (SELECT 1 FROM "
             "job_attempts a WHERE a.job_id = j.job_id AND a.ended_at IS NULL)"),
        ) if (rows := [r[0] for r in conn.execute(sql)])]
    finally:
        conn.close()


def counts(client: HttpClient) -> tuple[int, int]:
    jobs = client.get("/api/jobs?limit=1")[1]["total"]
    artifacts = client.get("/api/artifacts")[1]
    return jobs, artifacts.get("total", len(artifacts.get("artifacts", [])))


@pytest.mark.timeout(180)
def test_online_backup_under_load_restores_and_starts(tmp_path: Path, figures: Any) -> None:
    data = tmp_path / "data"
    proc = CollectorProcess(data, env={"FLEET_LONG_POLL_S": "1"}).start()
    ledger, stop = Ledger(), threading.Event()
    workers = [*(LeanAgent(proc.url, f"b{i}", ledger, stop) for i in range(4)),
               Producer(proc.url, ledger, stop, "bk", {"ttl_s": 30}, pause_s=0.05)]
    for worker in workers:
        worker.start()
    backup_dir = tmp_path / "backups" / "one"
    try:
        while len(ledger.snapshot()["closed"]) < 60:
            time.sleep(0.1)
        before = ledger.snapshot()
        started = time.monotonic()
        result = fleet("backup", str(backup_dir), "--data", str(data), "--with-artifacts")
        took = time.monotonic() - started
        assert result.returncode == 0, result.stderr
        during = len(ledger.snapshot()["rows"]) - len(before["rows"])
        # the running collector's data cannot be restored over
        refused = fleet("restore", str(backup_dir), "--data", str(data), "--force")
        assert refused.returncode == 1
        assert f"another collector (pid {proc.proc.pid}) is using" in refused.stderr
        assert "Traceback" not in refused.stderr
    finally:
        stop.set()
        for worker in workers:
            worker.join(15)
        proc.stop()
    assert "backup written to" in result.stdout
    manifest = json.loads((backup_dir / "manifest.json").read_text())
    copy = backup_dir / "fleet.sqlite3"
    assert not invariants(copy, full=True)
    assert not consistent(copy)
    assert not losses(copy, backup_dir, before)  # every acknowledgement before the backup
    assert manifest["collector_id"] == (data / "collector-id").read_text().strip()
    assert all(a["included"] for a in manifest["artifacts"])

    # restore into a new directory and start a collector on it
    fresh = tmp_path / "restored"
    result = fleet("restore", str(backup_dir), "--data", str(fresh))
    assert result.returncode == 0, result.stderr
    restored = CollectorProcess(fresh).start()
    try:
        client = restored.client
        assert client.get("/api/health")[1]["collector"] == manifest["collector_id"]
        jobs, _ = counts(client)
        assert jobs == manifest["counts"]["jobs"]
        for sha in list(before["artifacts"])[:20]:
            status, _ = client.request("GET", f"/api/artifacts/{sha}")
            assert status == 200
            assert (fresh / "artifacts" / sha[:2] / sha).read_bytes() == before["artifacts"][sha]
    finally:
        assert restored.stop() == 0
    assert not losses(fresh / "fleet.sqlite3", fresh, before)

    # over the stopped original: refused without --force, moved aside with it
    again = fleet("restore", str(backup_dir), "--data", str(data))
    assert again.returncode == 1 and "--force" in again.stderr
    forced = fleet("restore", str(backup_dir), "--data", str(data), "--force")
    assert forced.returncode == 0, forced.stderr
    aside = [p for p in data.iterdir() if p.name.startswith("pre-restore-")]
    assert len(aside) == 1 and (aside[0] / "fleet.sqlite3").exists()
    back = CollectorProcess(data, port=proc.port).start()
    try:
        assert counts(back.client)[0] == manifest["counts"]["jobs"]
    finally:
        back.stop()
    figures.record("backup_under_load", backup_s=round(took, 3), jobs=manifest["counts"]["jobs"],
                   result_rows=manifest["counts"]["results"],
                   artifacts=len(manifest["artifacts"]),
                   rows_acknowledged_while_backing_up=during, consistent=True)


def test_backup_and_restore_refuse_with_a_sentence(tmp_path: Path) -> None:
    missing = fleet("backup", str(tmp_path / "b"), "--data", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "no collector database" in missing.stderr
    proc = CollectorProcess(tmp_path / "data").start()
    proc.client.post("/jobs", {"schema": 1, "job_id": "x", "workload": "benchmark",
                               "executor": "device", "backend": "synthetic"})
    proc.stop()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    taken = fleet("backup", str(tmp_path / "taken"), "--data", str(tmp_path / "data"))
    assert taken.returncode == 1 and "already exists" in taken.stderr
    not_backup = fleet("restore", str(tmp_path / "taken"), "--data", str(tmp_path / "new"))
    assert not_backup.returncode == 1 and "not a fleet-min collector backup" in not_backup.stderr
    no_data = fleet("restore", str(tmp_path / "taken"), env={"FLEET_DATA_DIR": ""})
    assert no_data.returncode == 1 and "--data" in no_data.stderr
    for result in (missing, taken, not_backup, no_data):
        assert "Traceback" not in result.stderr
    # A link, to an empty directory or to nothing: the backup was made whole, then refused as
    # "Not a directory" (or named its hidden work directory); now refused before it starts.
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for link in ("to-empty", "dangling"):
        linked = fleet("backup", str(tmp_path / link), "--data", str(tmp_path / "data"))
        assert linked.returncode == 1, linked.stderr
        assert f"{tmp_path / link} is a symbolic link; give the directory it leads to, or a " \
               "new path" in linked.stderr
        assert "Traceback" not in linked.stderr and ".partial-" not in linked.stderr
    ok = fleet("backup", str(tmp_path / "b"), "--data", str(tmp_path / "data"))
    assert ok.returncode == 0, ok.stderr
    assert not (tmp_path / "b" / "artifacts").exists()  # bytes only with --with-artifacts
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


# -- what a backup and a restore leave on disk, and what they refuse ----------------------------


def stopped_collector(tmp_path: Path) -> tuple[Path, str]:
    """A data directory with a job and an artifact, its collector stopped; the artifact's hash."""
    data = tmp_path / "data"
    proc = CollectorProcess(data).start()
    try:
        assert proc.client.post("/jobs", {"schema": 1, "job_id": "x", "workload": "benchmark",
                                          "executor": "device", "backend": "synthetic"})[0] == 201
        status, reply = upload(proc.url, b"an unreleased build")
        assert status == 201, reply
    finally:
        proc.stop()
    return data, reply["sha256"]


def backed_up(tmp_path: Path, artifacts: bool = True) -> tuple[Path, str, Path]:
    """stopped_collector's data directory and artifact hash, and its backup in tmp_path/bk
    (with the artifact's bytes unless `artifacts` is False)."""
    data, sha = stopped_collector(tmp_path)
    backup_dir = tmp_path / "bk"
    result = fleet("backup", str(backup_dir), "--data", str(data),
                   *(["--with-artifacts"] if artifacts else []))
    assert result.returncode == 0, result.stderr
    return data, sha, backup_dir


def under_umask(mask: int, *args: str) -> subprocess.CompletedProcess[str]:
    old = os.umask(mask)  # the child inherits it
    try:
        return fleet(*args)
    finally:
        os.umask(old)


def looser_than(root: Path, dir_most: int, file_most: int) -> dict[str, str]:
    """Every directory or file under root (root included) with a bit beyond the given modes."""
    found = {}
    for path in [root, *root.rglob("*")]:
        bits = stat.S_IMODE(path.lstat().st_mode)
        if bits & ~(dir_most if path.is_dir() else file_most):
            found[str(path.relative_to(root))] = oct(bits)
    return found


def test_a_backup_keeps_the_data_directory_modes_whatever_the_umask(tmp_path: Path) -> None:
    data, sha = stopped_collector(tmp_path)
    backup_dir = tmp_path / "backups" / "one"
    result = under_umask(0o022, "backup", str(backup_dir), "--data", str(data),
                         "--with-artifacts")
    assert result.returncode == 0, result.stderr
    for name in ("fleet.sqlite3", "collector-id", "manifest.json", f"artifacts/{sha[:2]}/{sha}"):
        assert (backup_dir / name).is_file(), name
    assert looser_than(backup_dir, 0o750, 0o640) == {}


def test_a_restore_leaves_the_collector_modes_whatever_the_umask(tmp_path: Path) -> None:
    _, sha, backup_dir = backed_up(tmp_path)
    fresh, loose = tmp_path / "fresh", tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)  # what a careless operator made
    for target in (fresh, loose):
        result = under_umask(0o022, "restore", str(backup_dir), "--data", str(target))
        assert result.returncode == 0, result.stderr
        assert (target / "artifacts" / sha[:2] / sha).read_bytes() == b"an unreleased build"
        assert looser_than(target, 0o750, 0o640) == {}, target


@pytest.mark.parametrize("name", ["collector-id", "fleet.sqlite3.restoring", "artifacts/SHARD"])
def test_a_restore_writes_nothing_through_a_link_in_the_data_directory(
        tmp_path: Path, name: str) -> None:
    _, sha, backup_dir = backed_up(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    target.chmod(0o777)  # anyone could have planted the link before the restore
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "profile"
    victim.write_text("precious\n")
    link = target / name.replace("SHARD", sha[:2])
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(elsewhere if name.endswith("SHARD") else victim)
    result = fleet("restore", str(backup_dir), "--data", str(target))
    assert result.returncode == 1, result.stdout
    # before it: one warning per mode it tightened, as the collector logs at start
    said = [line for line in result.stderr.splitlines() if "tightened the mode" not in line]
    assert "Traceback" not in result.stderr and len(said) == 1, result.stderr
    assert said[0].startswith("fleet-min collector restore: cannot use ")
    assert f"{link.name} is a symbolic link" in said[0], result.stderr
    assert victim.read_text() == "precious\n" and sorted(elsewhere.iterdir()) == [victim]
    assert not (target / "fleet.sqlite3").exists()  # refused before anything was written


def damage(backup_dir: Path, how: str) -> None:
    manifest_path = backup_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if how == "no database":
        (backup_dir / "fleet.sqlite3").unlink()
    elif how == "not a database":
        (backup_dir / "fleet.sqlite3").write_bytes(b"these bytes are no SQLite file\n" * 100)
    elif how == "an id of two lines":
        (backup_dir / "collector-id").write_text("col-1\nFLEET_X=1\n")
    else:
        key, value = how.split("=", 1)
        manifest[key] = json.loads(value)
        manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("how, words", [
    ("no database", "fleet.sqlite3 is missing"),
    ("not a database", "is not a readable SQLite database"),
    ("an id of two lines", "is not a collector id"),
    ('artifacts=["oops"]', "artifacts[0] is not an object"),
    ('artifacts=[{"sha256": 5, "included": true}]', "artifacts[0].sha256 is not a SHA-256"),
    ('artifacts=[{"sha256": "' + "a" * 64 + '", "included": "yes"}]',
     "artifacts[0].included is not true or false"),
    ('artifacts={"a": 1}', "artifacts is not a list"),
    ('counts={"jobs": "many"}', "counts.jobs is not an integer"),
    ('schema_version="7"', "schema_version is not an integer"),
    ("format=true", "a backup format this program does not know"),
])
def test_a_damaged_backup_is_refused_in_one_line_and_changes_nothing(
        tmp_path: Path, how: str, words: str) -> None:
    data, _, backup_dir = backed_up(tmp_path)
    damage(backup_dir, how)
    refused_unchanged(backup_dir, data, tmp_path / "fresh", words)


def files_of(data: Path) -> dict[Path, bytes]:
    """Every file under data with its bytes; the lock file only names its last holder."""
    return {p: p.read_bytes() for p in data.rglob("*") if p.is_file()
            and p.name != "collector.lock"}


def refused_unchanged(backup_dir: Path, data: Path, fresh: Path, words: str,
                      timeout: float = 120) -> None:
    """A restore of backup_dir into a new directory and over data (--force), and its --check,
    are refused in one line saying `words`, without a traceback, leaving no new directory,
    data as it was and nothing of the check's under its TMPDIR."""
    before, names = files_of(data), sorted(p.name for p in data.iterdir())
    scratch = fresh.with_name(fresh.name + "-tmp")
    scratch.mkdir()
    for args in (("--data", str(fresh)), ("--data", str(data), "--force"), ("--check",)):
        result = fleet("restore", str(backup_dir), *args, timeout=timeout,
                       env={"TMPDIR": str(scratch)})
        assert result.returncode == 1, result.stdout
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1, \
            result.stderr
        assert words in result.stderr, result.stderr
    assert not fresh.exists() and not list(scratch.iterdir())
    assert files_of(data) == before
    assert sorted(p.name for p in data.iterdir()) == names


def test_backup_and_restore_take_a_path_a_uri_would_misread(tmp_path: Path) -> None:
    """Backup and restore open databases read-only through a `file:` URI: a `?`, `#` or `%`
    in a folder's name is encoded, not read as the URI's query, fragment or an escape."""
    odd = tmp_path / "shelf?mode=rw#lab %41"
    odd.mkdir()
    data, sha = stopped_collector(odd)
    backup_dir = odd / "bk?1#2"
    result = fleet("backup", str(backup_dir), "--data", str(data), "--with-artifacts")
    assert result.returncode == 0, result.stderr
    target = odd / "restored#%20"
    result = fleet("restore", str(backup_dir), "--data", str(target))
    assert result.returncode == 0, result.stderr
    assert (target / "artifacts" / sha[:2] / sha).read_bytes() == b"an unreleased build"
    proc = CollectorProcess(target).start()
    try:
        assert proc.client.get("/api/jobs/x")[0] == 200
    finally:
        proc.stop()


# -- a restore interrupted at any step, a backup changed while it is read, hostile backups ------

# `python -c KILL_AT N ARGS...`: run fleet-min with ARGS and SIGKILL it just before its Nth
# os.replace (every step of a restore that moves or installs a file is one).
KILL_AT = """
import os, signal, sys
n, calls, real = int(sys.argv[1]), [0], os.replace
def replace(*args, **kw):
    calls[0] += 1
    if calls[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kw)
os.replace = replace
from fleet_min.cli import main
sys.exit(main(sys.argv[2:]))
"""

# `python -c SWAP_AFTER_OPEN BACKUP PAYLOAD ARGS...`: run fleet-min with ARGS; the first time it
# opens an SQLite database, PAYLOAD is renamed over BACKUP/fleet.sqlite3 (what someone who can
# write the backup could do between restore's check and its install).
SWAP_AFTER_OPEN = """
import os, sqlite3, sys
backup, payload, real = sys.argv[1], sys.argv[2], sqlite3.connect
def connect(*args, **kw):
    conn = real(*args, **kw)
    if os.path.exists(payload):
        os.replace(payload, os.path.join(backup, "fleet.sqlite3"))
    return conn
sqlite3.connect = connect
from fleet_min.cli import main
sys.exit(main(sys.argv[3:]))
"""


def jobs_in(folder: Path, scratch: Path) -> list[str] | None:
    """The job ids of the database in folder (with its -wal), read from a copy so that reading
    changes nothing there; None when folder holds no database."""
    if not (folder / "fleet.sqlite3").exists():
        return None
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    for name in ("fleet.sqlite3", "fleet.sqlite3-wal"):
        if (folder / name).exists():
            shutil.copyfile(folder / name, scratch / name)
    conn = sqlite3.connect(scratch / "fleet.sqlite3")
    try:
        return [row[0] for row in conn.execute("SELECT job_id FROM jobs ORDER BY job_id")]
    finally:
        conn.close()


def crashed_collector(tmp_path: Path) -> tuple[Path, list[str]]:
    """A data directory whose collector took jobs and was killed (-9): the jobs are in the
    database's write-ahead log, not yet in the database file."""
    data = tmp_path / "live"
    proc = CollectorProcess(data).start()
    ids = [f"live{i}" for i in range(7)]
    try:
        for job_id in ids:
            assert proc.client.post("/jobs", {"schema": 1, "job_id": job_id,
                                              "workload": "benchmark", "executor": "device",
                                              "backend": "synthetic"})[0] == 201
    finally:
        proc.kill9()
    assert (data / "fleet.sqlite3-wal").stat().st_size > 0
    return data, ids


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "collector.lock"}


@pytest.mark.timeout(900)
def test_a_restore_killed_at_any_step_loses_nothing_and_blocks_the_start(
        tmp_path: Path) -> None:
    """`restore --force` over a crashed collector's data, killed (-9) before each step that
    moves or installs a file: a collector start on what it left is refused with a sentence
    (nothing made, nothing changed), and the restore run again finishes, with the previous
    database and id kept, readable, in one pre-restore folder."""
    src, _ = stopped_collector(tmp_path)
    backup_dir = tmp_path / "bk"
    assert fleet("backup", str(backup_dir), "--data", str(src), "--with-artifacts"
                 ).returncode == 0
    backup_id = (backup_dir / "collector-id").read_text().strip()
    live, ids = crashed_collector(tmp_path)
    live_id = (live / "collector-id").read_text().strip()
    refused_starts = 0
    for n in range(1, 20):
        data = tmp_path / f"killed-{n}"
        shutil.copytree(live, data, symlinks=True)
        killed = child(sys.executable, "-c", KILL_AT, str(n), "collector", "restore",
                       str(backup_dir), "--data", str(data), "--force")
        if killed.returncode == 0:
            break
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        if (data / "restore-in-progress").exists():
            if refused_starts < 2:
                left = tree(data)
                sentence = start_refused(data)
                assert "was interrupted" in sentence and "run the restore again" in sentence
                assert tree(data) == left, sentence
                refused_starts += 1
        else:  # killed before the marker: nothing was moved
            assert jobs_in(data, tmp_path / "probe") == ids
        again = fleet("restore", str(backup_dir), "--data", str(data), "--force")
        assert again.returncode == 0, (n, again.stderr)
        aside = [p for p in data.iterdir() if p.name.startswith("pre-restore-")]
        assert len(aside) == 1, (n, aside)
        assert jobs_in(aside[0], tmp_path / "probe") == ids, n
        assert (aside[0] / "collector-id").read_text().strip() == live_id
        assert jobs_in(data, tmp_path / "probe") == ["x"], n
        assert (data / "collector-id").read_text().strip() == backup_id
        assert not (data / "restore-in-progress").exists() and not (data / "restore-work").exists()
    else:
        pytest.fail("the restore never ran to its end")
    assert n > 3 and refused_starts == 2, (n, refused_starts)
    with running_collector(data) as proc:
        assert proc.client.get("/api/health")[1]["collector"] == backup_id
        assert proc.client.get("/api/jobs/x")[0] == 200


def test_undoing_an_interrupted_restore_keeps_what_was_put_there_since(
        tmp_path: Path) -> None:
    """A restore killed right after its marker moved nothing; the operator then put data of
    their own in the directory. Run again, the restore moves that data into a
    restore-undone-<time>/ folder, never deleting or overwriting it."""
    src, _ = stopped_collector(tmp_path)
    backup_dir = tmp_path / "bk"
    assert fleet("backup", str(backup_dir), "--data", str(src)).returncode == 0
    live, ids = crashed_collector(tmp_path)
    (live / "restore-in-progress").write_text(json.dumps(
        {"backup": str(backup_dir), "aside": None, "moved": [],
         "started_at": "2026-11-27T00:00:00Z"}) + "\n")
    assert "was interrupted" in start_refused(live)
    done = fleet("restore", str(backup_dir), "--data", str(live), "--force")
    assert done.returncode == 0, done.stderr
    kept = [p for p in live.iterdir() if p.name.startswith("restore-undone-")]
    assert len(kept) == 1 and kept[0].name in done.stdout, done.stdout
    assert jobs_in(kept[0], tmp_path / "probe") == ids
    assert jobs_in(live, tmp_path / "probe") == ["x"]


def test_a_restore_interrupted_while_it_staged_keeps_a_collector_from_starting(
        tmp_path: Path) -> None:
    """Killed while it copied and checked the backup, a restore into a new directory left only
    its work folder: a collector start there would make an empty database and a new id where
    the operator meant to restore."""
    data = tmp_path / "new"
    data.mkdir(mode=0o750)
    (data / "restore-work").mkdir(mode=0o700)
    sentence = start_refused(data)
    assert "interrupted while it copied and checked the backup" in sentence, sentence
    assert sorted(p.name for p in data.iterdir()) == ["collector.lock", "restore-work"]
    (data / "restore-work").rmdir()
    with running_collector(data) as proc:
        assert proc.client.get("/api/health")[0] == 200


def test_a_value_an_older_version_let_in_is_named_and_a_corrected_copy_restores(
        tmp_path: Path) -> None:
    """Before the door refused them, a result's metrics could hold an integer of 400 digits,
    which the listings cannot serve (SQLite's JSON functions make it Inf). Restore names the row
    and says how to correct it; corrected with an UPDATE in a copy, the backup restores."""
    _, _, backup_dir = backed_up(tmp_path, artifacts=False)
    conn = sqlite3.connect(backup_dir / "fleet.sqlite3", isolation_level=None)
    conn.execute("INSERT INTO results (job_id, device_id, iter, attempt, metrics, created_at) "
                 "VALUES ('x', 'd', 0, 1, ?, 1764000000)", ('{"n": 1' + "0" * 400 + "}",))
    conn.close()
    manifest = json.loads((backup_dir / "manifest.json").read_text())
    manifest["counts"]["results"] = 1
    (backup_dir / "manifest.json").write_text(json.dumps(manifest))
    refused = fleet("restore", str(backup_dir), "--data", str(tmp_path / "new"))
    assert refused.returncode == 1, refused.stdout
    assert "table 'results', rowid 1, column 'metrics'" in refused.stderr, refused.stderr
    assert "an older version let that value in" in refused.stderr, refused.stderr
    conn = sqlite3.connect(backup_dir / "fleet.sqlite3", isolation_level=None)
    conn.execute("UPDATE results SET metrics = json_remove(metrics, '$.n') WHERE rowid = 1")
    conn.close()
    done = fleet("restore", str(backup_dir), "--data", str(tmp_path / "new"))
    assert done.returncode == 0, done.stderr
    assert jobs_in(tmp_path / "new", tmp_path / "probe") == ["x"]


def test_records_the_readers_cannot_take_are_left_out_when_asked_and_each_is_listed(
        tmp_path: Path) -> None:
    """A backup whose results hold rows no reader can take (a number past a float's range,
    bytes that are not UTF-8, text where a time is kept) is refused, and the refusal names the
    way out; restore --leave-out-bad-rows then restores the rest, lists each row it left out,
    and a collector started on it serves the good rows. A bad job row is still refused with
    the option, since other rows name it, and nothing is installed."""
    _, _, backup_dir = backed_up(tmp_path, artifacts=False)
    conn = sqlite3.connect(backup_dir / "fleet.sqlite3", isolation_level=None)
    rows = [('{"fps": 60}', 1764000000), ('{"n": 1' + "0" * 400 + "}", 1764000001),
            (b'{"t": "\xff"}', 1764000002), ('{"fps": 1}', "yesterday"),
            ('{"fps": 61}', 1764000004)]
    for n, (metrics, at) in enumerate(rows):
        conn.execute("INSERT INTO results (job_id, device_id, iter, attempt, metrics, "
                     "created_at) VALUES ('x', 'd', ?, 1, CAST(? AS TEXT), ?)", (n, metrics, at))
    conn.close()
    manifest = json.loads((backup_dir / "manifest.json").read_text())
    manifest["counts"]["results"] = len(rows)
    (backup_dir / "manifest.json").write_text(json.dumps(manifest))
    target = tmp_path / "new"
    refused = fleet("restore", str(backup_dir), "--data", str(target))
    assert refused.returncode == 1, refused.stdout
    assert "run restore again with --leave-out-bad-rows" in refused.stderr, refused.stderr
    assert not target.exists()

    done = fleet("restore", str(backup_dir), "--data", str(target), "--leave-out-bad-rows")
    assert done.returncode == 0, done.stderr
    assert "2 results" in done.stdout and "left out 3 rows" in done.stdout, done.stdout
    listed = [line for line in done.stdout.splitlines() if line.startswith("  left out: ")]
    assert [line.split(", column")[0] for line in listed] == [
        "  left out: table 'results', rowid 2", "  left out: table 'results', rowid 3",
        "  left out: table 'results', rowid 4"], done.stdout
    assert "past a float's range" in listed[0] and "not UTF-8" in listed[1] \
        and "'yesterday'" in listed[2], listed
    with running_collector(target) as proc:
        status, reply = proc.client.get("/api/results?job_id=x")
        assert status == 200, reply
        assert sorted(row["iter"] for row in reply["results"]) == [0, 4], reply

    conn = sqlite3.connect(backup_dir / "fleet.sqlite3", isolation_level=None)
    conn.execute("UPDATE jobs SET updated_at = 'later' WHERE job_id = 'x'")
    conn.close()
    still = fleet("restore", str(backup_dir), "--data", str(tmp_path / "other"),
                  "--leave-out-bad-rows")
    assert still.returncode == 1, still.stdout
    assert "table 'jobs'" in still.stderr and "leaves out only records" in still.stderr, \
        still.stderr
    assert not (tmp_path / "other").exists()


def test_a_hundred_thousand_bad_records_are_left_out_and_counted_past_the_first_named(
        tmp_path: Path) -> None:
    """Many bad rows (a hostile backup's) are left out within the child's 1 GiB and the hang
    detector: the first 20 named, the rest counted, the good rows kept."""
    _, _, backup_dir = backed_up(tmp_path, artifacts=False)
    conn = sqlite3.connect(backup_dir / "fleet.sqlite3", isolation_level=None)
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO results (job_id, device_id, iter, attempt, metrics, "
                     "created_at) VALUES ('x', 'd', ?, 1, '{}', ?)",
                     ((n, "yesterday" if n % 1000 else 1764000000) for n in range(100_000)))
    conn.execute("COMMIT")
    conn.close()
    manifest = json.loads((backup_dir / "manifest.json").read_text())
    manifest["counts"]["results"] = 100_000
    (backup_dir / "manifest.json").write_text(json.dumps(manifest))
    done = fleet("restore", str(backup_dir), "--data", str(tmp_path / "new"),
                 "--leave-out-bad-rows", timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert "100 results" in done.stdout and "left out 99900 rows" in done.stdout, done.stdout
    named = [line for line in done.stdout.splitlines() if line.startswith("  left out: ")]
    assert len(named) == 20 and "holds 'yesterday' where a time" in named[0], named
    assert "does not hold" not in named[-1], named  # each named row shows its value
    assert done.stdout.rstrip().endswith("and 99880 more rows like them"), done.stdout


def test_restore_check_makes_every_check_and_installs_nothing(tmp_path: Path) -> None:
    """restore --check needs no data directory: it checks the manifest, the database, every
    row and each artifact's bytes as a restore would, in a folder under TMPDIR that it removes,
    and changes nothing in the backup. It passes a good backup, refuses a damaged artifact
    with restore's sentence, and with --leave-out-bad-rows says which rows a restore would
    leave out."""
    _, sha, backup_dir = backed_up(tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    before = tree(backup_dir)
    good = fleet("restore", str(backup_dir), "--check", env=env)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith(f"checked {backup_dir}: 1 jobs"), good.stdout
    assert "1 artifact files (0.0 MiB) whose bytes match their hashes" in good.stdout, good.stdout
    assert "nothing was installed" in good.stdout, good.stdout
    assert tree(backup_dir) == before and not list(scratch.iterdir())

    artifact = backup_dir / "artifacts" / sha[:2] / sha
    artifact.chmod(0o600)
    artifact.write_bytes(b"an unreleased bilud")  # the same size, other bytes
    damaged = fleet("restore", str(backup_dir), "--check", env=env)
    assert damaged.returncode == 1, damaged.stdout
    assert f"artifact file {artifact} does not match its SHA-256 name or size" in damaged.stderr
    assert not list(scratch.iterdir())

    artifact.write_bytes(b"an unreleased build")
    conn = sqlite3.connect(backup_dir / "fleet.sqlite3", isolation_level=None)
    conn.execute("INSERT INTO results (job_id, device_id, iter, attempt, metrics, created_at) "
                 "VALUES ('x', 'd', 0, 1, '{}', 'yesterday')")
    conn.close()
    manifest = json.loads((backup_dir / "manifest.json").read_text())
    manifest["counts"]["results"] = 1
    (backup_dir / "manifest.json").write_text(json.dumps(manifest))
    refused = fleet("restore", str(backup_dir), "--check", env=env)
    assert refused.returncode == 1 and "--leave-out-bad-rows" in refused.stderr, refused.stderr
    would = fleet("restore", str(backup_dir), "--check", "--leave-out-bad-rows", env=env)
    assert would.returncode == 0, would.stderr
    assert "0 results" in would.stdout and "would leave out 1 rows" in would.stdout, would.stdout
    assert "  would leave out: table 'results', rowid 1, column 'created_at'" in would.stdout
    assert not list(scratch.iterdir())


def test_a_restore_killed_before_it_moved_anything_names_no_folder_that_is_not_there(
        tmp_path: Path) -> None:
    """Killed between writing its marker and making its pre-restore folder, a restore left a
    marker that names a folder which does not exist: the start's sentence does not send the
    operator to it, and says the previous files are still in place."""
    live, ids = crashed_collector(tmp_path)
    (live / "restore-in-progress").write_text(json.dumps(
        {"backup": "/media/usb/bk", "aside": "pre-restore-20261127T101500Z",
         "moved": ["fleet.sqlite3"], "started_at": "2026-11-27T10:15:00Z"}) + "\n")
    sentence = start_refused(live)
    assert "pre-restore-20261127T101500Z" not in sentence, sentence
    assert "it had moved nothing yet" in sentence and "/media/usb/bk" in sentence, sentence
    assert jobs_in(live, tmp_path / "probe") == ids


def test_a_damaged_marker_names_the_pre_restore_folders_as_they_are(tmp_path: Path) -> None:
    """A marker damaged by hand cannot say which folder its restore made. With none there, the
    sentence says nothing was moved aside; with a finished restore's older folder and a newer
    one, it names the newest as the one to check and the older as older, never as this
    restore's own."""
    live, ids = crashed_collector(tmp_path)
    (live / "restore-in-progress").write_text("{not json")
    sentence = start_refused(live)
    assert "is damaged" in sentence and "no pre-restore folder" in sentence, sentence
    for name in ("pre-restore-20261101T080000Z", "pre-restore-20261127T101500Z-9",
                 "pre-restore-20261127T101500Z-10"):
        (live / name).mkdir(mode=0o750)
    sentence = start_refused(live)
    assert "if the interrupted restore made pre-restore-20261127T101500Z-10/" in sentence, \
        sentence
    assert ("older: pre-restore-20261127T101500Z-9, pre-restore-20261101T080000Z"
            in sentence), sentence
    backup_dir = tmp_path / "bk"
    src, _ = stopped_collector(tmp_path / "src")
    assert fleet("backup", str(backup_dir), "--data", str(src)).returncode == 0
    refused = fleet("restore", str(backup_dir), "--data", str(live), "--force")
    assert refused.returncode == 1 and "is damaged" in refused.stderr, refused.stderr
    assert "pre-restore-20261127T101500Z-10/" in refused.stderr, refused.stderr
    assert jobs_in(live, tmp_path / "probe") == ids


def test_a_restore_beside_a_sqlite3_shell_says_what_holds_the_database(tmp_path: Path) -> None:
    """The data directory's lock keeps a collector of this version out, so a database still
    open after restore took that lock is held by something else (a sqlite3 shell, a copy
    tool): the refusal says so instead of naming a collector, and changes nothing."""
    data, _, backup_dir = backed_up(tmp_path, artifacts=False)
    shell = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
         "c.execute('SELECT count(*) FROM jobs').fetchone(); print('open', flush=True); "
         "sys.stdin.read()", str(data / "fleet.sqlite3")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout is not None and shell.stdout.readline().strip() == "open"
        before = files_of(data)
        refused = fleet("restore", str(backup_dir), "--data", str(data), "--force")
        assert refused.returncode == 1, refused.stdout
        assert "open in another process (a sqlite3 shell" in refused.stderr, refused.stderr
        assert "a collector is running" not in refused.stderr
        assert files_of(data) == before
    finally:
        shell.communicate("", timeout=30)


def test_a_backup_database_swapped_after_restore_opened_it_is_not_installed(
        tmp_path: Path) -> None:
    _, _, backup_dir = backed_up(tmp_path, artifacts=False)
    checked = (backup_dir / "fleet.sqlite3").read_bytes()
    payload = tmp_path / "payload"
    payload.write_bytes(b"this is not a database, it is whatever the attacker wants\n")
    target = tmp_path / "restored"
    result = child(sys.executable, "-c", SWAP_AFTER_OPEN, str(backup_dir), str(payload),
                   "collector", "restore", str(backup_dir), "--data", str(target))
    assert result.returncode == 0, result.stderr
    assert not payload.exists()  # the swap happened
    assert dump(target / "fleet.sqlite3") == dump_bytes(checked, tmp_path / "checked")


def dump(db: Path) -> list[tuple[Any, ...]]:
    """Every row of every table of the database at db with its rowid (when it has one),
    AUTOINCREMENT sequences included, and its schema version."""
    conn = sqlite3.connect(db)
    try:
        found: list[tuple[Any, ...]] = [
            ("user_version", conn.execute("PRAGMA user_version").fetchone()[0])]
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND "
                                     "name NOT LIKE 'sqlite_stat%' ORDER BY name").fetchall():
            try:
                rows = conn.execute(
                    "SELECT name, seq FROM sqlite_sequence ORDER BY name" if table
                    == "sqlite_sequence" else f"SELECT rowid, * FROM {table} ORDER BY rowid"
                ).fetchall()
            except sqlite3.OperationalError:  # WITHOUT ROWID
                rows = conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            found += [(table, *row) for row in rows]
        return found
    finally:
        conn.close()


def dump_bytes(data: bytes, scratch: Path) -> list[tuple[Any, ...]]:
    scratch.write_bytes(data)
    return dump(scratch)


def hostile(backup_dir: Path, how: str) -> None:
    db = backup_dir / "fleet.sqlite3"
    if how in ("fifo id", "fifo manifest"):
        name = "collector-id" if how == "fifo id" else "manifest.json"
        (backup_dir / name).unlink()
        os.mkfifo(backup_dir / name)
    elif how in ("huge id", "huge manifest"):
        with open(backup_dir / ("collector-id" if how == "huge id" else "manifest.json"),
                  "r+b") as handle:
            handle.truncate(1 << 30)  # sparse: a gigabyte read, no disk used
    elif how.startswith("/dev/zero as "):
        name = how.removeprefix("/dev/zero as ")
        (backup_dir / name).unlink()
        (backup_dir / name).symlink_to("/dev/zero")
    else:
        conn = sqlite3.connect(db, isolation_level=None)
        try:
            if how == "recursive view":
                conn.execute("ALTER TABLE jobs RENAME TO jobs_old")
                conn.execute("CREATE VIEW jobs AS WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL "
                             "SELECT x + 1 FROM c) SELECT x FROM c")
            elif how == "no jobs table":
                conn.execute("DROP TABLE jobs")
            elif how == "a trigger":
                conn.execute("CREATE TRIGGER t AFTER INSERT ON jobs BEGIN DELETE FROM devices; "
                             "END")
            elif how == "a column missing":
                conn.execute("ALTER TABLE devices DROP COLUMN notes")
            elif how == "a sequence near 2**63":
                conn.execute("UPDATE sqlite_sequence SET seq = 9223372036854775806 "
                             "WHERE name = 'jobs'")
            elif how == "a row numbered near 2**63":
                conn.execute("UPDATE jobs SET seq = 9223372036854775806")
            elif how == "a spec that is not JSON":
                conn.execute("UPDATE jobs SET spec = 'not json'")
            elif how == "a time kept as text":
                conn.execute("UPDATE jobs SET created_at = 'yesterday'")
            elif how == "a job id that is not UTF-8":
                conn.execute("UPDATE jobs SET job_id = CAST(X'FFFE41' AS TEXT)")
            elif how == "a template with no workload":
                conn.execute("INSERT INTO schedules (id, cron, enabled, template, created_at, "
                             "updated_at) VALUES ('nightly', '0 3 * * *', 1, "
                             "'{\"executor\": \"device\"}', 1, 1)")
        finally:
            conn.close()
    if how == "wrong counts":
        manifest = json.loads((backup_dir / "manifest.json").read_text())
        manifest["counts"]["jobs"] = 5
        (backup_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how, words", [
    ("fifo id", "is not a regular file"),
    ("fifo manifest", "is not a regular file"),
    ("huge id", "is larger than 802 bytes"),
    ("huge manifest", "larger than such a file can be"),
    ("/dev/zero as collector-id", "is a symbolic link"),
    ("/dev/zero as manifest.json", "is a symbolic link"),
    ("/dev/zero as fleet.sqlite3", "is a symbolic link"),
    ("recursive view", "defines a view ('jobs'"),
    ("a trigger", "defines a trigger ('t' on 'jobs')"),
    ("no jobs table", "has no table 'jobs', which schema version"),
    ("a column missing", "table 'devices' does not have the columns"),
    ("wrong counts", "says 5 jobs, but the database holds 1"),
    ("a sequence near 2**63", "numbers the rows of 'jobs' up to 9223372036854775806"),
    ("a row numbered near 2**63", "up to 9223372036854775806"),
    ("a spec that is not JSON", "column 'spec': holds 'not json' where a job spec"),
    ("a time kept as text", "column 'created_at': holds 'yesterday' where a time"),
    ("a job id that is not UTF-8", "column 'job_id': holds bytes that are not UTF-8"),
    ("a template with no workload", "table 'schedules', rowid 1, column 'template'"),
])
def test_a_hostile_backup_is_refused_at_once_with_nothing_changed(
        tmp_path: Path, how: str, words: str) -> None:
    """Whatever a backup's files are (a FIFO, a sparse gigabyte, a link to /dev/zero, a database
    whose `jobs` is an endless view, that lacks a table or a column, has a trigger, does not
    hold what its manifest counts, or holds a row the collector's readers cannot take: a
    restored collector answered 500 on every job listing that met one), restore refuses in one
    sentence, within the hang detector and the child's 1 GiB of address space, and the data
    directory stays as it was."""
    data, _, backup_dir = backed_up(tmp_path)
    hostile(backup_dir, how)
    refused_unchanged(backup_dir, data, tmp_path / "fresh", words, timeout=2 * HANG_S)


# -- a backup whose schema differs only where the columns check cannot see ---------------------


def schema_of(db: Path) -> list[tuple[str, str]]:
    conn = sqlite3.connect(db)
    try:
        return sorted(conn.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL"))
    finally:
        conn.close()


def rewrite_schema(db: Path, how: str) -> None:
    """Change the backup's schema where only its SQL says so; integrity_check stays ok."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        if how == "unique index":  # a real index, consistent, under the collector's index name
            conn.execute("DROP INDEX jobs_created")
            conn.execute("CREATE UNIQUE INDEX jobs_created ON jobs(executor)")
            return
        table, change = {
            "check": ("jobs", lambda sql: sql[:sql.rindex(")")]
                      + ", CHECK (job_id GLOB 'x*'))"),
            "collate nocase": ("devices", lambda sql: sql.replace(
                "device_id TEXT PRIMARY KEY", "device_id TEXT PRIMARY KEY COLLATE NOCASE", 1)),
        }[how]
        sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
        assert change(sql) != sql
        version = conn.execute("PRAGMA schema_version").fetchone()[0]
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_master SET sql = ? WHERE name = ?", (change(sql), table))
        conn.execute(f"PRAGMA schema_version = {version + 1}")
        conn.execute("PRAGMA writable_schema = OFF")
    finally:
        conn.close()
    check = sqlite3.connect(db)
    try:
        assert check.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        check.close()


@pytest.mark.parametrize("how", ["check", "collate nocase", "unique index"])
def test_a_backup_schema_rewritten_in_its_sql_is_not_installed(tmp_path: Path, how: str) -> None:
    """A backup whose jobs table carries an extra CHECK, whose devices.device_id is COLLATE
    NOCASE, or whose index is UNIQUE on a column that is not (same name, table and columns, so
    the columns check passes): restore installs the collector's own schema with the backup's
    rows, and a collector started on it takes what that schema would have refused."""
    data = tmp_path / "data"
    proc = CollectorProcess(data).start()
    try:
        assert proc.client.post("/jobs", {"schema": 1, "job_id": "x", "workload": "benchmark",
                                          "executor": "device", "backend": "synthetic"})[0] == 201
        assert proc.client.post("/devices/register", registration("Pi-1"))[0] in (200, 201)
        status, reply = upload(proc.url, b"an unreleased build")
        assert status == 201, reply
    finally:
        proc.stop()
    honest = schema_of(data / "fleet.sqlite3")
    backup_dir = tmp_path / "bk"
    assert fleet("backup", str(backup_dir), "--data", str(data), "--with-artifacts"
                 ).returncode == 0
    conn = sqlite3.connect(backup_dir / "fleet.sqlite3", isolation_level=None)
    try:  # as when jobs were deleted: the next job's seq continues past the number handed out
        assert conn.execute("UPDATE sqlite_sequence SET seq = 41 WHERE name = 'jobs'").rowcount
    finally:
        conn.close()
    rows = dump(backup_dir / "fleet.sqlite3")
    rewrite_schema(backup_dir / "fleet.sqlite3", how)
    assert schema_of(backup_dir / "fleet.sqlite3") != honest
    target = tmp_path / "restored"
    result = fleet("restore", str(backup_dir), "--data", str(target))
    assert result.returncode == 0, result.stderr
    assert schema_of(target / "fleet.sqlite3") == honest
    assert dump(target / "fleet.sqlite3") == rows
    with running_collector(target) as restored:
        client = restored.client
        assert client.get("/api/jobs/x")[0] == 200  # the backup's rows are served
        assert client.request("GET", f"/api/artifacts/{reply['sha256']}")[0] == 200
        # ids the hostile schema refuses: not x*, a second job on the same executor
        assert client.post("/jobs", {"schema": 1, "job_id": "y", "workload": "benchmark",
                                     "executor": "device", "backend": "synthetic"})[0] == 201
        assert client.post("/devices/register", registration("pi-1"))[0] in (200, 201)
        devices = {d["device_id"] for d in client.get("/api/devices")[1]["devices"]}
        assert devices == {"Pi-1", "pi-1"}, devices
    conn = read_db(target / "fleet.sqlite3")
    try:  # the backup's sequence carried over
        assert [tuple(row) for row in conn.execute(
            "SELECT job_id, seq FROM jobs ORDER BY seq")] == [("x", 1), ("y", 42)]
    finally:
        conn.close()
