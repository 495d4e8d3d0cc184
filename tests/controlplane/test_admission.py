"""Admission: the shipped job-started hook and its installer as real shell scripts (the installer
keeps .env's mode and refuses a value that would add lines to it), and the daemon's incremental
reader of the hook's log (partial lines, truncation, replacement)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fleet_min.controlplane.analysis.admission import AdmissionLog
from fleet_min.db import Database
from tests.support import cp_fakes as fakes
from tests.support.controlplane import REPO_ROOT, Host

DEPLOY = REPO_ROOT / "deploy" / "controlplane"
HOOK = DEPLOY / "job-started.sh"
INSTALLER = DEPLOY / "install-admission-hook.sh"


def hook_env(tmp: Path, load: str, **extra: str) -> dict[str, str]:
    loadavg = tmp / "loadavg"
    loadavg.write_text(f"{load} 0.50 0.40 1/200 12345\n")
    return {"PATH": os.environ["PATH"], "HOME": str(tmp), "FLEET_ADMIT_LOADAVG_FILE":
            str(loadavg), "FLEET_ADMIT_CORES": "2", "FLEET_ADMIT_MAX_LOAD": "1.5",
            "FLEET_ADMIT_MEMINFO_FILE": str(tmp / "no-meminfo"),
            "FLEET_ADMISSION_LOG": str(tmp / "log" / "admission.log"), "FLEET_ADMIT_POLL_S": "1",
            "RUNNER_NAME": "r1", "GITHUB_REPOSITORY": "octo/app", "GITHUB_RUN_ID": "42",
            "GITHUB_JOB": "e2e", "GITHUB_WORKFLOW": 'CI "nightly" \\ x', **extra}


def lines(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "log" / "admission.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_hook(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The runner runs .sh hooks with bash; -e is how job steps run too.
    return subprocess.run(["bash", "-e", str(HOOK)], env=env, capture_output=True, text=True,
                          timeout=30)


def test_installer_sets_the_hook_in_each_runners_env_and_removes_it(tmp_path: Path) -> None:
    runner = fakes.make_install(tmp_path / "r1")
    fakes.write_runner_file(runner, "r1", "octo/app")
    (runner / ".env").write_text("LANG=C.UTF-8\nACTIONS_RUNNER_HOOK_JOB_STARTED=/old.sh\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "FLEET_HOOK_DIR": str(tmp_path / "hooks")}
    for _ in range(2):  # twice: the second run changes nothing
        done = subprocess.run(["sh", str(INSTALLER), "--log", "/var/log/adm.log", str(runner)],
                              env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    hook = tmp_path / "hooks" / "job-started.sh"
    assert os.access(hook, os.X_OK) and hook.read_bytes() == HOOK.read_bytes()
    assert (runner / ".env").read_text().splitlines() == [
        "LANG=C.UTF-8", f"ACTIONS_RUNNER_HOOK_JOB_STARTED={hook}",
        "FLEET_ADMISSION_LOG=/var/log/adm.log"]
    not_a_runner = tmp_path / "empty"
    not_a_runner.mkdir()
    done = subprocess.run(["sh", str(INSTALLER), str(not_a_runner)], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "not a configured runner" in done.stderr
    done = subprocess.run(["sh", str(INSTALLER), "--uninstall", str(runner)], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and (runner / ".env").read_text() == "LANG=C.UTF-8\n"


def install(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    old = os.umask(0o022)  # the usual umask, under which a new file is readable by everyone
    try:
        return subprocess.run(["sh", str(INSTALLER), *args], env=env, capture_output=True,
                              text=True, timeout=30)
    finally:
        os.umask(old)


def test_installer_keeps_each_env_files_mode_and_makes_a_new_one_private(
        tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "FLEET_HOOK_DIR": str(tmp_path / "hooks")}
    kept, new = fakes.make_install(tmp_path / "r1"), fakes.make_install(tmp_path / "r2")
    for runner, name in ((kept, "r1"), (new, "r2")):
        fakes.write_runner_file(runner, name, "octo/app")
    (kept / ".env").write_text("LANG=C\nMY_SECRET=hunter2\n")
    (kept / ".env").chmod(0o600)
    (new / ".env").unlink(missing_ok=True)
    for args in (("--log", "/var/log/adm.log"), ("--uninstall",)):
        done = install(env, *args, str(kept), str(new))
        assert done.returncode == 0, done.stderr
        for runner in (kept, new):
            assert stat.S_IMODE((runner / ".env").stat().st_mode) == 0o600, (runner, args)
    assert (kept / ".env").read_text() == "LANG=C\nMY_SECRET=hunter2\n"


def test_installer_refuses_a_value_that_would_add_lines_to_env(tmp_path: Path) -> None:
    runner = fakes.make_install(tmp_path / "r1")
    fakes.write_runner_file(runner, "r1", "octo/app")
    (runner / ".env").write_text("LANG=C\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "FLEET_HOOK_DIR": str(tmp_path / "hooks")}
    for log in ("/tmp/a.log\nLD_PRELOAD=/tmp/evil.so", "/tmp/a.log\rX=1", "/tmp/a\tb.log"):
        done = install(env, "--log", log, str(runner))
        assert done.returncode == 2, done.stdout
        assert done.stderr.startswith("install-admission-hook: --log contains a newline or "
                                      "another control character"), done.stderr
    hooks = tmp_path / "hooks\nLD_PRELOAD=x"
    done = install({**env, "FLEET_HOOK_DIR": str(hooks)}, str(runner))
    assert done.returncode == 2 and "the hook directory" in done.stderr, done.stderr
    assert (runner / ".env").read_text() == "LANG=C\n"  # untouched by every refusal
    assert not (tmp_path / "hooks").exists() and not hooks.exists()


def test_hook_admits_at_once_when_the_host_is_within_limits(tmp_path: Path) -> None:
    done = run_hook(hook_env(tmp_path, "1.00"))
    assert done.returncode == 0, done.stderr
    [entry] = lines(tmp_path)
    assert entry["decision"] == "admitted" and entry["wait_s"] == 0 and entry["load"] == 0.5
    assert (entry["runner"], entry["repo"], entry["run_id"], entry["job"]) == (
        "r1", "octo/app", "42", "e2e")
    assert entry["workflow"] == 'CI "nightly" \\ x' and entry["at"].endswith("Z")


def test_hook_holds_while_overloaded_and_releases(tmp_path: Path) -> None:
    env = hook_env(tmp_path, "5.00")
    proc = subprocess.Popen(["bash", "-e", str(HOOK)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not lines(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines(tmp_path)[0]["decision"] == "held"
        assert "load per core 2.50 > 1.5" in lines(tmp_path)[0]["reason"]
        assert proc.poll() is None  # the job is still waiting
        (tmp_path / "loadavg").write_text("0.20 0.50 0.40 1/200 12345\n")
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "released after" in out
    held, released = lines(tmp_path)
    assert held["decision"] == "held" and released["decision"] == "released"
    assert released["wait_s"] >= 0


def test_hook_times_out_and_goes_on_or_fails_as_configured(tmp_path: Path) -> None:
    done = run_hook(hook_env(tmp_path, "9.00", FLEET_ADMIT_TIMEOUT_S="1"))
    assert done.returncode == 0
    assert [e["decision"] for e in lines(tmp_path)] == ["held", "timed_out"]
    failing = run_hook(hook_env(tmp_path, "9.00", FLEET_ADMIT_TIMEOUT_S="1",
                                FLEET_ADMIT_FAIL_ON_TIMEOUT="1"))
    assert failing.returncode == 1 and "still overloaded" in failing.stdout


def test_hook_checks_available_memory_too(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4000000 kB\nMemAvailable: 204800 kB\n")
    env = hook_env(tmp_path, "0.10", FLEET_ADMIT_MEMINFO_FILE=str(meminfo),
                   FLEET_ADMIT_MIN_MEM_MB="512", FLEET_ADMIT_TIMEOUT_S="1")
    run_hook(env)
    assert lines(tmp_path)[0]["reason"] == "available memory 200 MB < 512 MB"


# --- the daemon's reader -------------------------------------------------------------------------

def entry(decision: str, n: int) -> bytes:
    return json.dumps({"at": f"2026-01-01T00:00:{n:02d}Z", "decision": decision,
                       "wait_s": n, "runner": "r1", "run_id": str(n)}).encode() + b"\n"


async def decisions(db: Database) -> list[tuple[str, int]]:
    rows = await db.read("SELECT decision, run_id FROM admission ORDER BY id")
    return [(r["decision"], r["run_id"]) for r in rows]


async def test_reader_takes_whole_lines_once_and_counts_bad_ones(tmp_path: Path,
                                                                  db: Database) -> None:
    path = tmp_path / "admission.log"
    reader = AdmissionLog(path, db)
    assert await reader.ingest(0) == 0  # no log yet
    whole, half = entry("admitted", 1), entry("held", 2)
    path.write_bytes(whole + b"not json\n" + b'{"decision": "exploded"}\n' + half[:20])
    assert await reader.ingest(0) == 1
    assert await reader.ingest(0) == 0  # nothing new; the half line waits
    with open(path, "ab") as handle:
        handle.write(half[20:] + entry("released", 3))
    assert await reader.ingest(0) == 2
    assert await decisions(db) == [("admitted", 1), ("held", 2), ("released", 3)]
    report = await reader.report(60)
    assert report["bad_lines"] == 2 and report["totals"]["held"] == 1
    assert report["decisions"][0]["decision"] == "released"  # newest first
    # A new reader on the same database (a restart) stores nothing twice.
    assert await AdmissionLog(path, db).ingest(0) == 0


async def test_reader_survives_truncation_rotation_and_rewrites(tmp_path: Path,
                                                                db: Database) -> None:
    path = tmp_path / "admission.log"
    reader = AdmissionLog(path, db)
    path.write_bytes(entry("admitted", 1) + entry("admitted", 2))
    await reader.ingest(0)
    path.write_bytes(entry("held", 3))  # truncated (copytruncate) and written again: shorter
    assert await reader.ingest(0) == 1
    path.write_bytes(entry("held", 4) + entry("released", 5) + entry("admitted", 6))
    assert await reader.ingest(0) == 3  # rewritten past the old offset: the first bytes differ
    path.unlink()
    path.write_bytes(entry("timed_out", 7))  # rotated: a new file
    assert await reader.ingest(0) == 1
    assert [d for d, _ in await decisions(db)] == [
        "admitted", "admitted", "held", "held", "released", "admitted", "timed_out"]


def line_with(**fields: Any) -> bytes:
    base = {"at": "2026-01-01T00:00:10Z", "decision": "released", "wait_s": 4, "load": 0.5,
            "runner": "r1", "repo": "octo/app", "run_id": "10", "job": "e2e", "workflow": "CI"}
    return json.dumps({**base, **fields}).encode() + b"\n"


# Lines no row can hold as they are meant: numbers that are not finite or (the run id) not a
# whole number within SQLite's INTEGER, a time that is not text, nesting past the parser.
UNSTORABLE = [
    line_with(run_id="nan"), line_with(run_id="inf"), line_with(run_id="-Infinity"),
    line_with(run_id=1e30), line_with(run_id="1e30"), line_with(run_id=2**63),
    line_with(run_id=str(2**63)), line_with(run_id=-(2**63) - 1), line_with(run_id=12.5),
    line_with(run_id=True), line_with(run_id=[1]),
    line_with(wait_s=float("inf")), line_with(wait_s=float("nan")), line_with(wait_s="abc"),
    line_with(load=float("-inf")), line_with(load={"x": 1}),
    line_with(at=5), line_with(at=None),
    line_with().replace(b'"wait_s": 4', b'"wait_s": 1e400'),
    b'{"at": "2026-01-01T00:00:10Z", "decision": "held", "job": ' + b"[" * 30000
    + b"]" * 30000 + b"}\n",
]


@pytest.mark.parametrize("bad", UNSTORABLE, ids=range(len(UNSTORABLE)))
async def test_reader_skips_and_counts_a_line_no_row_can_hold(tmp_path: Path, db: Database,
                                                              bad: bytes) -> None:
    """Such a line once raised (int(nan), int(inf)) or failed the INSERT (1e30): the read
    position stayed before it, and no later decision was ever stored."""
    path = tmp_path / "admission.log"
    path.write_bytes(entry("admitted", 1) + bad + entry("held", 2))
    reader = AdmissionLog(path, db)
    assert await reader.ingest(0) == 2
    with open(path, "ab") as handle:
        handle.write(entry("released", 3))
    assert await reader.ingest(0) == 1
    assert await decisions(db) == [("admitted", 1), ("held", 2), ("released", 3)]
    report = await reader.report(60)
    assert report["bad_lines"] == 1 and report["read_offset"] == path.stat().st_size
    json.dumps(report, allow_nan=False)


async def test_reader_keeps_what_a_line_holds_within_range(tmp_path: Path,
                                                           db: Database) -> None:
    path = tmp_path / "admission.log"
    path.write_bytes(line_with(run_id=str(2**63 - 1), runner="lone \ud800", wait_s="2.5")
                     + line_with(run_id=-(2**63), load=None, wait_s="", job=7)
                     + line_with(run_id="12.0", load="0.25", job=["x"]))
    reader = AdmissionLog(path, db)
    assert await reader.ingest(0) == 3
    rows = [dict(r) for r in await db.read(
        "SELECT runner, run_id, wait_s, load, job FROM admission ORDER BY id")]
    assert [(r["run_id"], r["wait_s"], r["load"], r["job"]) for r in rows] == [
        (2**63 - 1, 2.5, 0.5, "e2e"), (-(2**63), None, None, "7"), (12, 4.0, 0.25, None)]
    assert rows[0]["runner"] == "lone \ufffd"
    assert (await reader.report(60))["bad_lines"] == 0


async def test_the_admission_api_goes_on_after_a_line_no_row_can_hold(
        host: Host, client: Any) -> None:
    log = host.state / "admission.log"
    log.write_bytes(entry("admitted", 1) + line_with(run_id="nan") + line_with(run_id=1e30))
    for _ in range(2):
        resp = await client.get("/api/admission")
        body = await resp.json()
        assert resp.status == 200, body
        assert body["bad_lines"] == 2 and [d["run_id"] for d in body["decisions"]] == [1]
    with open(log, "ab") as handle:
        handle.write(entry("released", 2))
    body = await (await client.get("/api/admission")).json()
    assert [d["run_id"] for d in body["decisions"]] == [2, 1] and body["bad_lines"] == 2
