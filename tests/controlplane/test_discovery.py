"""Discovery's cache of runner files (read again only when their stat signature changes) and the
attachment of processes to runners, against real directories."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from fleet_min.controlplane.runners.discovery import Discovery, Runner, attach_all, discover
from fleet_min.controlplane.runners.procs import Proc, process_table
from tests.support import cp_fakes as fakes

PAST = time.time() - 3600


def _runner(root: Path, name: str, repo: str = "octo/app") -> Path:
    path = fakes.make_install(root / name, staged=("2.312.0",))
    fakes.write_runner_file(path, name, repo)
    return path


def _age(path: Path) -> None:
    """Set the runner's directory and files an hour back (their ctime stays now, which is why
    these tests use racy_ns=0; test_a_fresh_runner_is_read_every_time covers the default)."""
    for entry in [path, *path.iterdir()]:
        os.utime(entry, (PAST, PAST), follow_symlinks=False)


def _fields(runners: list[Runner]) -> list[tuple[object, ...]]:
    return [(r.name, r.path, r.rel, r.url, r.repo, r.labels, r.version, r.staged,
             r.draining_since, r.unit_hint, r.listener, r.workers) for r in runners]


def test_unchanged_runners_come_from_the_cache_and_match_a_fresh_read(tmp_path: Path) -> None:
    root = tmp_path / "root"
    paths = [_runner(root, f"r{i}") for i in range(5)]
    for path in paths:
        _age(path)
    cache = Discovery(root, racy_ns=0)
    first = cache.discover([])
    assert cache.reads == 5 and [r.name for r in first] == [f"r{i}" for i in range(5)]
    second = cache.discover([])
    assert cache.reads == 5  # nothing read again
    assert _fields(second) == _fields(first) == _fields(discover(root, []))
    assert all(a is not b for a, b in zip(first, second, strict=True))  # fresh objects


def test_each_kind_of_change_is_seen(tmp_path: Path) -> None:
    root = tmp_path / "root"
    path = _runner(root, "r1")
    cache = Discovery(root, racy_ns=0)

    def settle() -> Runner:
        """Files an hour old, read once into the cache; a second look is served from it."""
        _age(path)
        cache.discover([])
        reads = cache.reads
        [cached] = cache.discover([])
        assert cache.reads == reads
        return cached

    def again() -> Runner:
        """After one change (which gives its file the time of now, not an hour back)."""
        reads = cache.reads
        [seen] = cache.discover([])
        assert cache.reads == reads + 1 and _fields([seen]) == _fields(discover(root, []))
        settle()
        return seen

    runner = settle()
    assert (runner.draining_since, runner.unit_hint, runner.version) == (None, None, "2.311.0")
    (path / ".fleet-drain").write_text("2026-01-01T00:00:00Z")
    assert again().draining_since == "2026-01-01T00:00:00Z"
    (path / ".fleet-drain").write_text("2026-01-02T00:00:00Z")  # same size, in place
    assert again().draining_since == "2026-01-02T00:00:00Z"
    (path / ".fleet-drain").unlink()
    assert again().draining_since is None
    (path / ".service").write_text("actions.runner.octo-app.r1.service\n")
    assert again().unit_hint == "actions.runner.octo-app.r1.service"
    fakes.write_runner_file(path, "renamed", "octo/other")
    seen = again()
    assert (seen.name, seen.repo) == ("renamed", "octo/other")
    (path / "bin").unlink()  # a self-update moves the bin link to the staged version
    (path / "bin").symlink_to("bin.2.312.0")
    (path / "bin.2.313.0").mkdir()
    seen = again()
    assert (seen.version, seen.staged) == ("2.312.0", ["2.311.0", "2.313.0"])
    other = _runner(root, "r2")
    assert [r.name for r in cache.discover([])] == ["renamed", "r2"]
    (path / ".runner").unlink()
    assert [r.name for r in cache.discover([])] == ["r2"]
    assert str(path) not in cache._known and str(other) in cache._known


def test_a_fresh_runner_is_read_every_time(tmp_path: Path) -> None:
    """By default a runner whose files changed in the last RACY_NS is not cached: a rewrite in
    the same clock tick (same size, same times) is still seen."""
    root = tmp_path / "root"
    path = _runner(root, "r1")
    (path / ".fleet-drain").write_text("2026-01-01T00:00:00Z")
    cache = Discovery(root)
    assert cache.discover([])[0].draining_since == "2026-01-01T00:00:00Z"
    stamp = os.stat(path / ".fleet-drain").st_mtime_ns
    (path / ".fleet-drain").write_text("2026-01-09T00:00:00Z")
    os.utime(path / ".fleet-drain", ns=(stamp, stamp))  # as if written in the same tick
    assert cache.discover([])[0].draining_since == "2026-01-09T00:00:00Z"
    assert cache.reads == 2


def test_symlinked_staged_versions_are_not_cached(tmp_path: Path) -> None:
    root = tmp_path / "root"
    path = _runner(root, "r1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (path / "bin.2.400.0").symlink_to(elsewhere)
    _age(path)
    cache = Discovery(root, racy_ns=0)
    assert cache.discover([])[0].staged == ["2.312.0", "2.400.0"]
    elsewhere.rmdir()  # the link's target goes; the runner's directory does not change
    assert cache.discover([])[0].staged == ["2.312.0"]


def test_processes_are_attached_afresh_each_time(tmp_path: Path) -> None:
    root = tmp_path / "root"
    path = _runner(root, "r1")
    _age(path)
    cache = Discovery(root, racy_ns=0)
    listener = Proc(10, ("python3", f"{path}/bin/Runner.Listener", "run"), 1000, 5.0)
    worker = Proc(11, (f"{path}/bin/Runner.Worker", "spawnclient"), 500, 1.0)
    [runner] = cache.discover([listener, worker])
    assert runner.listener == listener and runner.workers == [worker]
    [runner] = cache.discover([])
    assert runner.listener is None and runner.workers == [] and cache.reads == 1


def test_a_process_of_another_account_is_not_the_runners(tmp_path: Path) -> None:
    """A process names its runner by argv, which any account can set (`exec -a
    <runner>/bin/Runner.Worker sleep 120`): another account's made the runner look busy. Only
    the directory owner's processes and root's count."""
    root = tmp_path / "root"
    path = _runner(root, "r1")
    owner = path.stat().st_uid
    stranger = owner + 1000 if owner else 1000
    argv = (f"{path}/bin/Runner.Worker", "spawnclient")
    [runner] = Discovery(root, racy_ns=0).discover([
        Proc(20, argv, 1, 1.0, uid=stranger),
        Proc(21, (f"{path}/bin/Runner.Listener", "run"), 1, 1.0, uid=stranger)])
    assert runner.owner_uid == owner
    assert runner.workers == [] and runner.listener is None and not runner.working
    own, roots = Proc(22, argv, 1, 1.0, uid=owner), Proc(23, argv, 1, 1.0, uid=0)
    [runner] = Discovery(root, racy_ns=0).discover([own, roots])
    assert runner.workers == [own, roots]


@pytest.mark.skipif(os.geteuid() != 0, reason="a process of another account needs root")
def test_a_real_process_of_another_account_is_not_the_runners(tmp_path: Path) -> None:
    """The same with the process table itself: a worker's argv under the nobody account."""
    root = tmp_path / "root"
    path = _runner(root, "r1")
    spoof = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              "bash", "-c", f"exec -a {path}/bin/Runner.Worker sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while not any(p.pid == spoof.pid and p.argv[0].endswith("Runner.Worker")
                      for p in process_table()):
            assert time.monotonic() < deadline, "the spoofing process did not show"
            time.sleep(0.05)
        [runner] = discover(root, process_table())
        assert runner.workers == []
    finally:
        spoof.kill()
        spoof.wait()


def _attach_one_by_one(runner: Runner, procs: list[Proc]) -> None:
    """The per-runner scan attach_all replaced, as the reference for its results."""
    prefix = str(runner.path) + os.sep
    for proc in procs:
        for arg in proc.argv[:3]:
            if not arg.startswith(prefix):
                continue
            base = os.path.basename(arg)
            if base == "Runner.Listener" and runner.listener is None:
                runner.listener = proc
            elif base == "Runner.Worker":
                runner.workers.append(proc)
            break


def test_attach_all_matches_the_per_runner_scan() -> None:
    rng = random.Random(7)
    paths = ["/srv/r/a", "/srv/r/a-b", "/srv/r/ab", "/srv/r/team/c", "runners/d"]
    tails = ["bin/Runner.Listener", "bin.2.311.0/Runner.Listener", "bin/Runner.Worker",
             "Runner.Worker", "bin/other", "_work/x/Runner.Worker", "x//bin/Runner.Listener"]
    others = ["python3", "run", "/srv/r", "/srv/r/a", "/srv/r/a-", "/usr/bin/Runner.Listener",
              "/srv/r/team/Runner.Worker", "spawnclient"]
    for _ in range(300):
        procs = []
        for pid in range(rng.randrange(0, 12)):
            argv = tuple(f"{rng.choice(paths)}/{rng.choice(tails)}" if rng.random() < 0.6
                         else rng.choice(others) for _ in range(rng.randrange(1, 5)))
            procs.append(Proc(pid, argv, 1, 1.0))

        def fresh() -> list[Runner]:
            return [Runner(name=p.rsplit("/", 1)[-1], path=Path(p), rel=p, url="", owner=None,
                           repo=None, agent_id=None, labels=[], version=None, staged=[],
                           draining_since=None, unit_hint=None) for p in paths]

        expected, got = fresh(), fresh()
        for runner in expected:
            _attach_one_by_one(runner, procs)
        attach_all(got, procs)
        assert _fields(got) == _fields(expected), procs


def test_runners_come_in_path_order_part_by_part(tmp_path: Path) -> None:
    """Sorted as paths are (`a/b` before `a-b`, since `a` < `a-b`), not as strings ('-' sorts
    before '/'), and a cached discovery keeps that order."""
    root = tmp_path / "root"
    for rel, name in (("a-b", "dash"), ("a/b", "nested"), ("a.c", "dot"), ("A", "upper")):
        path = fakes.make_install(root / rel)
        fakes.write_runner_file(path, name, "octo/app")
    expected = ["upper", "nested", "dash", "dot"]
    assert [r.name for r in discover(root, [])] == expected
    cache = Discovery(root, racy_ns=0)
    assert [r.name for r in cache.discover([])] == expected
    assert [r.name for r in cache.discover([])] == expected
