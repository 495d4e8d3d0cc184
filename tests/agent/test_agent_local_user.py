"""The real agent process against a hostile local user: another account that could write the
agent's state directory (a loose ~/.fleet-agent, a shared --state-dir) and planted files, links
and directories there, and the agent's own diagnostic options and a second agent started beside
a running one. Real collector, real files, real links; "another user" is a uid with no account,
given files with os.chown (the tests run as root, so the agent does too: a root agent must
refuse what a non-root user owns, as sshd does)."""

from __future__ import annotations

import hashlib
import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import AGENT_FILE, REPO, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                       reason="giving a file to another user (os.chown) needs root"),
]

# An agent refused at start exits at once; one that was not refused runs until stopped.
REFUSAL_TIMEOUT_S = 20


def other_uid() -> int:
    """A uid no account has: a user who is neither root nor the agent's."""
    for uid in range(54321, 65000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise AssertionError("no free uid")


def registered(collector, device_id: str) -> bool:
    return collector.get(f"/api/devices/{device_id}")[0] == 200


def shell_job(job_id: str, sha: str) -> dict:
    return {"schema": 1, "job_id": job_id, "workload": "shell", "executor": "device",
            "params": {"script_sha256": sha, "args": []}}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def run_agent(state: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The agent, run until it exits (a refusal) or REFUSAL_TIMEOUT_S passes (a failure)."""
    argv = [sys.executable, str(AGENT_FILE), "--collector", "http://127.0.0.1:9",
            "--state-dir", str(state), "--device-id", "local-1", "--retry-base-s", "0.2",
            *extra]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          timeout=REFUSAL_TIMEOUT_S, env=env)


def assert_refused(done: subprocess.CompletedProcess, state: Path, *says: str) -> None:
    """Exit status 2 and one sentence, after at most the log lines of what it made private."""
    *before, last = done.stderr.strip().splitlines() or [""]
    assert done.returncode == 2, done
    assert all(" WARNING tightened the mode of " in line for line in before), done.stderr
    for words in says:
        assert words in last, (words, last)


# --- finding 1: a cached artifact is hashed again, not trusted by its name -----------------------


def legit_and_evil(tmp_path: Path) -> tuple[bytes, bytes, Path, Path]:
    """A legitimate script and a planted one of the same length (so a size check alone cannot
    tell them apart), and the files each leaves when it runs."""
    legit_mark, evil_mark = tmp_path / "legit-ran", tmp_path / "evil-ran"
    legit = f"#!/bin/sh\necho legit >> {legit_mark}\n".encode()
    evil = f"#!/bin/sh\necho pwned >> {evil_mark}\n".encode()
    evil = evil.replace(b"pwned", b"pwned" + b"#" * (len(legit) - len(evil)))
    assert len(evil) == len(legit)
    return legit, evil, legit_mark, evil_mark


def test_a_script_planted_under_its_pinned_name_in_the_cache_is_not_run(procs, tmp_path):
    collector = procs.collector()
    legit, evil, legit_mark, evil_mark = legit_and_evil(tmp_path)
    sha = collector.upload(legit, "legit.sh")
    state = tmp_path / "state-plant-1"
    (state / "cache").mkdir(parents=True)
    (state / "shell-allowlist").write_text(sha + "\n")
    planted = state / "cache" / sha
    planted.write_bytes(evil)  # the agent user's own file, as every file there must now be
    planted.chmod(0o700)
    agent = procs.agent([collector], "plant-1")
    wait_for(lambda: registered(collector, "plant-1"), 20, what="registration")
    collector.enqueue(shell_job("planted", sha))
    job = collector.wait_status("planted", ("done", "failed"), timeout=30)
    assert job["status"] == "done", job
    assert not evil_mark.exists(), "the planted script ran"
    assert legit_mark.read_text() == "legit\n"
    assert planted.read_bytes() == legit  # removed and downloaded again
    assert f"cached artifact {sha[:12]} was not used: its bytes no longer hash to its name" \
        in agent.log()


def test_a_cached_script_changed_after_it_was_verified_is_fetched_again(procs, tmp_path):
    collector = procs.collector()
    legit, evil, legit_mark, evil_mark = legit_and_evil(tmp_path)
    sha = collector.upload(legit, "legit.sh")
    state = tmp_path / "state-swap-1"
    state.mkdir()
    (state / "shell-allowlist").write_text(sha + "\n")
    procs.agent([collector], "swap-1")
    wait_for(lambda: registered(collector, "swap-1"), 20, what="registration")
    collector.enqueue(shell_job("first", sha))
    assert collector.wait_status("first", ("done", "failed"), timeout=30)["status"] == "done"
    cached = state / "cache" / sha
    assert cached.read_bytes() == legit
    before = cached.stat()
    # Changed in place (same inode, same size), then as a new file given the old times back:
    # each is what a job of the agent's own user could do; neither may be run.
    for round_, swap in enumerate(("in place", "new file, old times"), 1):
        if swap == "in place":
            with open(cached, "r+b") as fh:
                fh.write(evil)
        else:
            fresh = cached.with_name(".swap")
            fresh.write_bytes(evil)
            os.utime(fresh, ns=(before.st_atime_ns, before.st_mtime_ns))
            os.replace(fresh, cached)
        assert cached.stat().st_size == before.st_size
        collector.enqueue(shell_job(f"after-{round_}", sha))
        job = collector.wait_status(f"after-{round_}", ("done", "failed"), timeout=30)
        assert job["status"] == "done", (swap, job)
        assert not evil_mark.exists(), f"the script changed {swap} ran"
        assert cached.read_bytes() == legit, swap
    assert legit_mark.read_text() == "legit\n" * 3


# --- finding 1: the state directory is the agent user's own, and private -------------------------


def test_the_reviewers_repro_a_cache_directory_of_another_user_is_refused(tmp_path):
    """Finding 1 as reported: a state directory of mode 0777, and another user's cache/ in it
    holding a script under a pinned name."""
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    sha = hashlib.sha256(b"the owner's script").hexdigest()
    (state / "shell-allowlist").write_text(sha + "\n")
    cache = state / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    planted = cache / sha
    planted.write_text(f"#!/bin/sh\nid > {tmp_path / 'pwned'}\n")
    planted.chmod(0o755)
    uid = other_uid()
    os.chown(cache, uid, uid)
    os.chown(planted, uid, uid)
    done = run_agent(state)
    assert_refused(done, state, f"fleet_agent: refusing the state directory {state}: "
                                f"{cache} is owned by uid {uid}, not by uid 0 that the agent "
                                "runs as")
    assert mode(state) == 0o700  # the agent's own directory was still made private
    assert mode(cache) == 0o777 and planted.read_text().endswith("pwned\n")  # not theirs to fix
    assert not (tmp_path / "pwned").exists()


def test_a_state_directory_another_user_owns_is_refused_by_a_root_agent(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    uid = other_uid()
    os.chown(state, uid, uid)
    done = run_agent(state)
    assert_refused(done, state, f"fleet_agent: refusing the state directory {state}: it is "
                                f"owned by uid {uid}, not by uid 0 that the agent runs as; "
                                "give it to that user or choose another --state-dir")
    assert mode(state) == 0o777 and state.stat().st_uid == uid  # untouched
    assert list(state.iterdir()) == []  # no lock, no state.json, no spool


def test_a_state_directory_under_a_parent_anyone_may_write_is_refused(procs, tmp_path):
    """A parent every user may write to, without the sticky bit, lets any of them rename the
    state directory and put their own in its place: refused, and nothing trusted made. With
    the sticky bit (as /tmp has it), the same place serves."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    state = shared / "deeper" / "state"
    done = run_agent(state)
    assert_refused(done, state, f"fleet_agent: refusing the state directory {state}: its "
                                f"parent {shared} has mode 0777: any user may rename the state "
                                "directory")
    assert "chmod o-w" in done.stderr
    assert not (state / "state.json").exists() and not (state / "spool").exists()
    shared.chmod(0o1777)
    collector = procs.collector()
    home = shared / "person"
    home.mkdir()
    agent = procs.agent([collector], "sticky-1", home=home)
    wait_for(lambda: registered(collector, "sticky-1"), 20, what="registration")
    assert agent.proc.poll() is None and "refusing" not in agent.log()


def _own(uid: int, *paths: Path) -> None:
    for path in paths:
        os.chown(path, uid, uid, follow_symlinks=False)


def _file(path: Path, text: str = "x\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _link(path: Path, target: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


# name -> plant(state, elsewhere, uid) -> the offending path. `elsewhere` holds a file and a
# directory outside the state directory, the agent user's own, that a link points at.
PLANTS: dict[str, Callable[[Path, Path, int], Path]] = {
    "shell-allowlist, another user's": lambda s, e, u: (
        _own(u, _file(s / "shell-allowlist", "a" * 64 + "\n")), s / "shell-allowlist")[1],
    "shell-allowlist, a link": lambda s, e, u: _link(s / "shell-allowlist", e / "file"),
    "build-repos, another user's": lambda s, e, u: (
        _own(u, _file(s / "build-repos", "https://evil.example/\n")), s / "build-repos")[1],
    "build-repos, a link": lambda s, e, u: _link(s / "build-repos", e / "file"),
    "state.json, a link": lambda s, e, u: _link(s / "state.json", e / "file"),
    "cache/, a link": lambda s, e, u: _link(s / "cache", e / "dir"),
    "a cached artifact, another user's": lambda s, e, u: (
        _own(u, _file(s / "cache" / ("b" * 64))), s / "cache" / ("b" * 64))[1],
    "a cached artifact, a link": lambda s, e, u: _link(s / "cache" / ("b" * 64), e / "file"),
    "credentials/, another user's": lambda s, e, u: (
        _own(u, _dir(s / "credentials")), s / "credentials")[1],
    "a credential item, another user's": lambda s, e, u: (
        _own(u, _file(s / "credentials" / "play.json", "{}")), s / "credentials" / "play.json")[1],
    "a credential item, a link": lambda s, e, u: _link(s / "credentials" / "play.json",
                                                       e / "file"),
    "spool/, a link": lambda s, e, u: _link(s / "spool", e / "dir"),
    "a spooled row, another user's": lambda s, e, u: (
        _own(u, _file(s / "spool" / "00000000000000000001-000001.json", "{}")),
        s / "spool" / "00000000000000000001-000001.json")[1],
    "spool/rejected/, another user's": lambda s, e, u: (
        _own(u, _dir(s / "spool" / "rejected")), s / "spool" / "rejected")[1],
    "work/, a link": lambda s, e, u: _link(s / "work", e / "dir"),
    "the lock file, a link": lambda s, e, u: _link(s / "agent.lock", e / "file"),
    "the lock file, another user's": lambda s, e, u: (
        _own(u, _file(s / "agent.lock", "")), s / "agent.lock")[1],
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_trusted_file_that_is_a_link_or_another_users_is_refused(tmp_path, plant):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    target_file = _file(elsewhere / "file", "the agent user's own file\n")
    target_dir = _dir(elsewhere / "dir")
    _file(target_dir / "local-1" / "precious.txt", "keep me\n")  # what work/local-1 would be
    uid = other_uid()
    offending = PLANTS[plant](state, elsewhere, uid)
    done = run_agent(state)
    assert_refused(done, state, f"fleet_agent: refusing the state directory {state}: ",
                   str(offending))
    if offending.is_symlink():
        assert "is a symbolic link" in done.stderr or "cannot be opened" in done.stderr
    else:
        assert f"is owned by uid {uid}, not by uid 0" in done.stderr
    # Nothing a link points at was written, emptied or removed.
    assert target_file.read_text() == "the agent user's own file\n"
    assert (target_dir / "local-1" / "precious.txt").read_text() == "keep me\n"


def test_a_loose_state_directory_of_its_own_is_made_private(procs, tmp_path):
    collector = procs.collector()
    state = tmp_path / "state-loose-1"
    for folder in (state, state / "cache", state / "spool"):
        folder.mkdir()
        folder.chmod(0o777)
    allow = _file(state / "shell-allowlist", "c" * 64 + "\n")
    allow.chmod(0o666)
    agent = procs.agent([collector], "loose-1")
    wait_for(lambda: registered(collector, "loose-1"), 20, what="registration")
    assert {name: oct(mode(state / name)) for name in (".", "cache", "spool")} == {
        ".": "0o700", "cache": "0o700", "spool": "0o700"}
    assert mode(allow) == 0o644  # readable as before, writable by nobody else
    assert f"tightened the mode of {state} from 0777 to 0700" in agent.log()
    assert agent.proc.poll() is None


# --- finding 2: one agent per state directory; the diagnostic options only read --------------


def long_job(collector, tmp_path: Path, job_id: str) -> tuple[str, Path]:
    """A pinned script that runs for a few seconds in its job directory; (its sha, marker)."""
    marker = tmp_path / f"{job_id}-finished"
    script = (f"#!/bin/sh\necho started\nsleep 4\necho finished > result.txt\n"
              f"cat result.txt > {marker}\n").encode()
    return collector.upload(script, "long.sh"), marker


def running_job_dir(state: Path, device_id: str) -> Path:
    found = wait_for(lambda: list((state / "work" / device_id).glob("job-*/output.log")), 20,
                     what="the job's directory")
    return found[0].parent


def test_describe_and_print_descriptor_beside_a_running_job_touch_nothing(procs, tmp_path):
    collector = procs.collector()
    sha, marker = long_job(collector, tmp_path, "diag")
    state = tmp_path / "state-diag-1"
    state.mkdir()
    (state / "shell-allowlist").write_text(sha + "\n")
    procs.agent([collector], "diag-1")
    wait_for(lambda: registered(collector, "diag-1"), 20, what="registration")
    collector.enqueue(shell_job("diag", sha))
    job_dir = running_job_dir(state, "diag-1")
    def tree() -> dict:  # all but the job's own directory, where the job is writing
        return {p: p.lstat().st_mtime_ns for p in state.rglob("*")
                if p != job_dir and job_dir not in p.parents}

    before = tree()
    for option in ("--describe", "--print-descriptor"):
        done = subprocess.run([sys.executable, str(AGENT_FILE), "--state-dir", str(state),
                               option], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "diag-1" in done.stdout  # the running agent's id, read from state.json
        assert job_dir.is_dir(), f"{option} removed the running job's directory"
    assert tree() == before
    job = collector.wait_status("diag", ("done", "failed"), timeout=30)
    assert job["status"] == "done", job
    assert marker.read_text() == "finished\n"


def test_the_diagnostic_options_create_nothing(tmp_path):
    fresh = tmp_path / "fresh"
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "state.json").write_text('{"device_id": "kept-1"}\n')
    for option in ("--describe", "--print-descriptor"):
        for state, device in ((fresh, "new-1"), (kept, "other-1")):
            done = subprocess.run([sys.executable, str(AGENT_FILE), "--state-dir", str(state),
                                   "--device-id", device, option], cwd=REPO,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert device in done.stdout
    assert not fresh.exists()
    assert [p.name for p in kept.iterdir()] == ["state.json"]
    assert (kept / "state.json").read_text() == '{"device_id": "kept-1"}\n'


def test_a_second_agent_on_the_same_state_directory_is_refused_naming_the_first(procs,
                                                                               tmp_path):
    collector = procs.collector()
    sha, marker = long_job(collector, tmp_path, "twice")
    state = tmp_path / "state-twice-1"
    state.mkdir()
    (state / "shell-allowlist").write_text(sha + "\n")
    first = procs.agent([collector], "twice-1")
    wait_for(lambda: registered(collector, "twice-1"), 20, what="registration")
    collector.enqueue(shell_job("twice", sha))
    job_dir = running_job_dir(state, "twice-1")
    for device in ("twice-1", "twice-2"):  # the same id, or another one: one spool either way
        done = subprocess.run([*first.argv[:-2], "--device-id", device], cwd=REPO,
                              capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)
        assert_refused(done, state, f"fleet_agent: another agent (pid {first.proc.pid}) is "
                                    f"running on the state directory {state}; stop it, or "
                                    "give this agent its own --state-dir")
        assert job_dir.is_dir()
    assert (state / "agent.lock").read_text() == f"{first.proc.pid}\n"
    assert mode(state / "agent.lock") == 0o600
    job = collector.wait_status("twice", ("done", "failed"), timeout=30)
    assert job["status"] == "done", job
    assert marker.read_text() == "finished\n"
    # Once the first has stopped, its lock file (with its pid) is no obstacle.
    assert first.stop() == 0
    second = procs.agent([collector], "twice-1")
    wait_for(lambda: (state / "agent.lock").read_text() == f"{second.proc.pid}\n", 20,
             what="the next agent to take the lock")
    assert second.proc.poll() is None


def test_the_default_state_directory_is_made_private_and_locked(procs, tmp_path):
    collector = procs.collector()
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    old = os.umask(0o022)
    try:
        agent = procs.agent([collector], "home-1", home=home)
    finally:
        os.umask(old)
    wait_for(lambda: registered(collector, "home-1"), 20, what="registration")
    state = home / ".fleet-agent"
    assert agent.state == state and mode(state) == 0o700
    assert mode(state / "agent.lock") == 0o600
    assert (state / "agent.lock").read_text() == f"{agent.proc.pid}\n"
    assert "tightened" not in agent.log()  # nothing to tighten in what it made itself
