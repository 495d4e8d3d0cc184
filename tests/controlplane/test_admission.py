"""Admission: the shipped job-started hook and its installer as real shell scripts, and the
daemon's incremental reader of the hook's log (partial lines, truncation, replacement)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from fleet_min.controlplane.analysis.admission import AdmissionLog
from fleet_min.db import Database
from tests.support import cp_fakes as fakes
from tests.support.controlplane import REPO_ROOT

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
