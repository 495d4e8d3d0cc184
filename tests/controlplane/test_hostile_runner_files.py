"""A runner's directory is written by the jobs it runs: what the control plane does with what
it finds there (a second round of review; test_runner_files_hostile.py holds the first).

Each test plants one hostile entry with real files and asks the real control plane (the app
in-process over the fake systemctl and GitHub API, or its functions over a tmp directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleet_min.controlplane.http.actions import ACTIONS
from fleet_min.controlplane.http.app import create_app
from fleet_min.controlplane.runners import bundle, diag, discovery, supervisor
from fleet_min.controlplane.runners.supervisor import service_name
from tests.support import cp_fakes as fakes
from tests.support.controlplane import Host, auth, cp_of, make_config, until

pytestmark = pytest.mark.timeout(60, method="thread")

OUTSIDE = "OUTSIDE-THE-RUNNER-DIRECTORY"


@pytest.fixture
def host_env(host: Host, monkeypatch: pytest.MonkeyPatch) -> Host:
    for key, value in host.env.items():
        monkeypatch.setenv(key, value)
    return host


async def start(host: Host, aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(make_config(host), dict(os.environ)))


def _victim_unit(host: Host) -> tuple[str, Path]:
    """A user unit that is no runner's (say, the operator's own daemon), started: its pid file."""
    unit = "victim.service"
    folder = host.xdg / "systemd" / "user"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / unit).write_text(f"[Service]\nExecStart={sys.executable} -c "
                               "\"import time; time.sleep(120)\"\n")
    subprocess.run(["systemctl", "--user", "start", unit], env=host.full_env(), check=True,
                   timeout=20)
    return unit, host.systemd / "user" / f"{unit}.pid"


async def test_a_service_file_naming_another_unit_never_gets_it_stopped(
        host_env: Host, aiohttp_client: Any) -> None:
    """`.service` says which unit is the runner's, and the daemon stops a drained runner's unit
    by itself once it is idle: a job that wrote another unit's name there and left a drain
    marker had that unit stopped at the next tick (with `sudo -n systemctl` for a system unit:
    sshd, a database, the control plane itself). Only a name svc.sh gives a runner is taken."""
    unit, pid_file = _victim_unit(host_env)
    pid = int(pid_file.read_text())
    try:
        path = host_env.add_runner("r1")
        (path / ".service").write_text(unit + "\n")
        (path / ".fleet-drain").write_text("")
        client = await start(host_env, aiohttp_client)
        await until(lambda: cp_of(client).snapshot.get("runners"))
        stops = [c["argv"] for c in host_env.calls("systemctl") if "stop" in c["argv"]]
        assert not [argv for argv in stops if unit in argv]
        assert fakes.pid_alive(pid)
        body = await (await client.get("/api/state")).json()
        view = {r["name"]: r for r in body["runners"]}["r1"]
        assert view["service"]["unit"] == host_env.unit("r1")
    finally:
        os.kill(pid, signal.SIGKILL)


async def test_a_service_file_naming_another_runners_unit_never_acts_on_that_runner(
        host_env: Host, aiohttp_client: Any) -> None:
    """A runner unit's name is no proof it is this runner's: a job on alpha that named beta's
    unit in alpha's `.service` and left a drain marker had the daemon stop beta by itself at the
    next tick, and deregistering alpha stopped, disabled and deleted beta's unit. A unit runs
    in its runner's directory (svc.sh's and the daemon's alike); one that runs in another is
    shown as not this runner's and never started, stopped or removed for it."""
    alpha = host_env.add_runner("alpha")
    host_env.add_runner("beta")
    host_env.start_unit("alpha")
    beta_pid = host_env.start_unit("beta")
    beta_unit = host_env.unit("beta")
    setup_calls = len(host_env.calls("systemctl"))
    (alpha / ".service").write_text(beta_unit + "\n")
    (alpha / ".fleet-drain").write_text("")
    client = await start(host_env, aiohttp_client)
    await until(lambda: cp_of(client).snapshot.get("runners"))
    await asyncio.sleep(1.5)  # ticks of 0.5 s: the drained runner is idle by now
    body = await (await client.get("/api/state")).json()
    view = {r["name"]: r for r in body["runners"]}
    assert view["alpha"]["service"]["unit"] == beta_unit
    assert view["alpha"]["service"]["loaded"] is False
    assert "not this runner's" in view["alpha"]["service"]["sub"]
    assert str(host_env.root / "beta") in view["alpha"]["service"]["sub"]
    assert view["beta"]["service"]["active"] == "active"  # beta's own view is its own
    for action in ("runner.drain", "runner.deregister", "runner.resume"):
        await client.post("/api/action", json={"id": action, "args": {"name": "alpha"}},
                          headers=auth(cp_of(client)))
    touched = [c["argv"] for c in host_env.calls("systemctl")[setup_calls:]
               if beta_unit in c["argv"] and "show" not in c["argv"]]
    assert touched == []
    assert fakes.pid_alive(beta_pid)
    assert (host_env.xdg / "systemd" / "user" / beta_unit).exists()


def test_a_unit_is_the_runners_when_it_runs_in_the_runners_directory(tmp_path: Path) -> None:
    """foreign_unit by the working directory systemd or the plist gives: the same directory by
    any path (a link, systemd's "!" and "-" prefixes) is the runner's; one that cannot be told
    (none, a home-relative "~") is taken as named; another directory, or one gone, is not."""
    own, other = tmp_path / "alpha", tmp_path / "beta"
    own.mkdir()
    other.mkdir()
    (tmp_path / "link").symlink_to(own)
    for same in (str(own), f"!{own}", f"-{own}", str(tmp_path / "link"), "", "~"):
        assert supervisor.foreign_unit(own, same) is None, same
    for elsewhere in (str(other), f"!{other}", str(tmp_path / "gone"), "/"):
        assert supervisor.foreign_unit(own, elsewhere) == elsewhere.lstrip("!"), elsewhere


def runner_naming(tmp_path: Path, service: str) -> discovery.Runner:
    """Runner r1 of octo/app, discovered with `service` in its .service file."""
    path = tmp_path / "r1"
    path.mkdir()
    (path / ".runner").write_text(json.dumps({"agentName": "r1", "gitHubUrl":
                                              "https://github.com/octo/app"}))
    (path / ".service").write_text(service + "\n")
    runner = discovery.load_runner(path, tmp_path)
    assert runner is not None
    return runner


@pytest.mark.parametrize("hint", [
    "sshd.service", "fleet-min-controlplane.service",
    "/Library/LaunchDaemons/com.openssh.sshd.plist",
    # an argument of systemctl start/stop and launchctl: a leading "-" is an option
    "--now", "-H", "-.service"])
def test_a_service_file_must_name_a_runner_unit(tmp_path: Path, hint: str) -> None:
    """Any other name in .service is not this runner's unit: the usual name is used."""
    runner = runner_naming(tmp_path, hint)
    assert runner.unit_hint is None
    assert service_name(runner) == "actions.runner.octo-app.r1"


@pytest.mark.parametrize("text", [
    "actions.runner.octo-app.r1.service",  # svc.sh on Linux
    "/Users/me/Library/LaunchAgents/actions.runner.octo-app.r1.plist",  # svc.sh on macOS
    "actions.runner.octo-a-very-long-repository-name-cut-by-svc.sh.r1-1234.service"])
def test_a_service_file_svc_sh_wrote_is_still_taken(tmp_path: Path, text: str) -> None:
    runner = runner_naming(tmp_path, text)
    assert service_name(runner) == text.rsplit("/", 1)[-1].removesuffix(".plist").removesuffix(
        ".service")


# --- _diag swapped for a link while it is read ----------------------------------------------

_TOGGLE = '''
import os, sys
os.chdir(sys.argv[1])
while True:
    os.rename("_diag", "_diag_real"); os.rename("_diag_link", "_diag")
    os.rename("_diag", "_diag_link"); os.rename("_diag_real", "_diag")
'''


def test_a_diag_swapped_for_a_link_while_it_is_read_is_neither_followed_nor_fatal(
        tmp_path: Path) -> None:
    """A job can swap its runner's `_diag` for a link to another directory and back, again and
    again, while the runner's (unauthenticated) detail is asked for. The log was checked by
    resolving its path and then opened by that path again: between the two, `_diag` may have
    become a link (a log of the same name elsewhere is read and served) or resolving it may
    fail (EINVAL, when a link became a directory again in the middle: the request ended
    with a 500). The log is now opened through the `_diag` the walk opened, never by path."""
    runner = tmp_path / "r1"
    (runner / "_diag").mkdir(parents=True)
    (runner / "_diag" / "Runner_1.log").write_text("inside line\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "Runner_1.log").write_text(OUTSIDE + "\n")
    (runner / "_diag_link").symlink_to(outside)
    toggler = subprocess.Popen([sys.executable, "-c", _TOGGLE, str(runner)])
    try:
        deadline = time.monotonic() + 2.5
        reads = 0
        while time.monotonic() < deadline:
            out = diag.summary_and_tail(runner)
            assert OUTSIDE not in "\n".join(out["tail"])
            assert out["tail"] in ([], ["inside line"])
            reads += 1
        assert reads > 100
    finally:
        toggler.kill()
        toggler.wait()


def test_a_bundle_file_swapped_between_link_and_file_is_not_fatal(tmp_path: Path) -> None:
    """The same for the allow-listed files of the bundle: `.env` flipping between a file and a
    link made resolving its path fail now and then (the bundle request ended with a 500)."""
    runner = tmp_path / "r1"
    runner.mkdir()
    (runner / "env_file").write_text("A=1\n")
    (runner / "env_link").symlink_to("/etc/hostname")
    code = ('import os, sys\nos.chdir(sys.argv[1])\nwhile True:\n'
            '    os.link("env_file", ".env_new"); os.replace(".env_new", ".env")\n'
            '    os.symlink("/etc/hostname", ".env_new"); os.replace(".env_new", ".env")\n')
    toggler = subprocess.Popen([sys.executable, "-c", code, str(runner)])
    try:
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            bundle._files(runner)
    finally:
        toggler.kill()
        toggler.wait()


# --- .runner fields of any size and text -----------------------------------------------------

async def test_labels_and_url_of_a_runner_file_are_kept_as_githubs_are(
        host_env: Host, aiohttp_client: Any) -> None:
    """`.runner`'s labels went into every snapshot as they were (60,000 labels, labels holding
    escape sequences and bidi controls), and so did its URL (300 KB of it): a runner not (yet)
    registered shows its `.runner` labels (1.36 MB of snapshot for this one runner, every
    tick). They follow the rule GitHub's and an agent's labels follow, and a URL longer than
    any GitHub URL, or holding a control character, is no URL."""
    long_one = host_env.add_runner("long", registered=False)
    data = json.loads((long_one / ".runner").read_text(encoding="utf-8-sig"))
    data["labels"] = ["self-hosted", "\x1b[2Jred", "a\u202eb"] + [f"l{i}" for i in range(60_000)]
    data["gitHubUrl"] = "https://github.com/octo/app/" + "x" * 300_000
    (long_one / ".runner").write_text(json.dumps(data), encoding="utf-8-sig")
    odd = host_env.add_runner("odd", registered=False)
    data = json.loads((odd / ".runner").read_text(encoding="utf-8-sig"))
    data["gitHubUrl"] = "https://github.com/octo/app\x1b]8;;https://evil.example\x07"
    (odd / ".runner").write_text(json.dumps(data), encoding="utf-8-sig")
    client = await start(host_env, aiohttp_client)
    body = await (await client.get("/api/state")).read()
    assert len(body) < 64 * 1024
    views = {r["name"]: r for r in json.loads(body)["runners"]}
    labels = views["long"]["labels"]
    assert labels[0] == "self-hosted" and len(labels) <= 50
    assert not [label for label in labels if not label.isprintable()]
    assert views["long"]["url"] is None and views["odd"]["url"] is None


async def test_a_runner_file_whose_url_is_no_url_is_not_fatal(host_env: Host,
                                                              aiohttp_client: Any) -> None:
    """A job writes its runner's `.runner`; a URL there that urlsplit cannot even split (a lone
    bracket, a host NFKC folds into '#') raised out of the discovery and ended the snapshot of
    every runner of the host. That runner is shown with no URL and no repo; the others as
    ever."""
    host_env.add_runner("plain", registered=False)
    for name, url in (("bracket", "https://]x/octo/app"), ("folded", "https://a\uff03b/octo/app")):
        folder = host_env.add_runner(name, registered=False)
        data = json.loads((folder / ".runner").read_text(encoding="utf-8-sig"))
        data["gitHubUrl"] = url
        (folder / ".runner").write_text(json.dumps(data), encoding="utf-8-sig")
    client = await start(host_env, aiohttp_client)
    resp = await client.get("/api/state")
    assert resp.status == 200, await resp.text()
    views = {r["name"]: r for r in (await resp.json())["runners"]}
    assert set(views) == {"plain", "bracket", "folded"}
    for name in ("bracket", "folded"):
        assert views[name]["url"] is None and views[name]["repo"] is None, views[name]
    assert views["plain"]["url"] is not None


def test_an_honest_runner_file_keeps_its_labels_and_url(tmp_path: Path) -> None:
    path = tmp_path / "r1"
    path.mkdir()
    (path / ".runner").write_text(json.dumps({
        "agentName": "r1", "gitHubUrl": "https://github.com/octo/app",
        "labels": ["self-hosted", "linux", "ARM64", "gpu-large"]}), encoding="utf-8-sig")
    runner = discovery.load_runner(path, tmp_path)
    assert runner is not None
    assert runner.labels == ["self-hosted", "linux", "ARM64", "gpu-large"]
    assert (runner.url, runner.repo) == ("https://github.com/octo/app", "octo/app")


# --- the drain marker ------------------------------------------------------------------------

async def test_drain_never_writes_through_a_link_planted_after_discovery(
        host_env: Host, tmp_path: Path, aiohttp_client: Any) -> None:
    """drain() writes the marker when discovery found none. Between that discovery and the
    write a job can plant `.fleet-drain` as a link to a file of the daemon's user: it was
    written through (and the file's contents replaced by a time)."""
    host_env.add_runner("r1")
    client = await start(host_env, aiohttp_client)
    cp = cp_of(client)
    runner, state = cp.find("r1")
    assert not runner.draining
    victim = tmp_path / "daemon-owned-file"
    victim.write_text("keep me\n")
    (runner.path / ".fleet-drain").symlink_to(victim)
    reply = await client.server.app[ACTIONS].drain(runner, state)
    assert reply["ok"] is True
    assert victim.read_text() == "keep me\n"
    assert (runner.path / ".fleet-drain").is_symlink()


async def test_drain_still_writes_its_marker(host_env: Host, aiohttp_client: Any) -> None:
    host_env.add_runner("r1")
    client = await start(host_env, aiohttp_client)
    cp = cp_of(client)
    runner, state = cp.find("r1")
    await client.server.app[ACTIONS].drain(runner, state)
    text = (runner.path / ".fleet-drain").read_text()
    assert discovery._DRAIN_TIME.fullmatch(text)


# --- a runner's files changing under discovery -----------------------------------------------

_FLIP_BIN = '''
import os, sys
names = sys.argv[1:]
while True:
    for folder in names:
        os.unlink(f"{folder}/bin"); os.symlink("bin.2.311.0", f"{folder}/bin")
'''


def test_a_bin_link_flipping_under_discovery_does_not_fail_it(tmp_path: Path) -> None:
    """A job can remove and recreate its runner's `bin` link as fast as it likes. Reading the
    runner's version saw a link, then read it: gone by then, readlink's FileNotFoundError
    ended the whole discovery, so the snapshot of every runner of the host (and any action, which
    discovers first) failed. The runner is now read without a version that time."""
    folder = tmp_path / "r0"
    (folder / "bin.2.311.0").mkdir(parents=True)
    (folder / "bin").symlink_to("bin.2.311.0")
    (folder / ".runner").write_text(json.dumps({"agentName": "r0", "gitHubUrl":
                                                "https://github.com/octo/app"}))
    flipper = subprocess.Popen([sys.executable, "-c", _FLIP_BIN, str(folder)])
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert discovery.versions(folder)[0] in (None, "2.311.0")
        assert [r.name for r in discovery.Discovery(tmp_path).discover([])] == ["r0"]
    finally:
        flipper.kill()
        flipper.wait()


# --- a drain marker or a .service that is a directory ------------------------------------------

async def test_a_drain_marker_made_a_directory_is_refused_in_a_sentence(
        host_env: Host, aiohttp_client: Any) -> None:
    """Any entry named `.fleet-drain` drains the runner; resume unlinked it and a directory
    made unlink raise: a 500 and a traceback. Now a 409 that says what to do, nothing changed."""
    path = host_env.add_runner("r1")
    (path / ".fleet-drain").mkdir()
    client = await start(host_env, aiohttp_client)
    await until(lambda: cp_of(client).snapshot.get("runners"))
    resp = await client.post("/api/action", json={"id": "runner.resume", "args": {"name": "r1"}},
                             headers=auth(cp_of(client)))
    body = await resp.json()
    assert resp.status == 409, body
    assert body["error"].startswith(f"the drain marker {path / '.fleet-drain'} is not the file "
                                    "drain writes and could not be removed (")
    assert (path / ".fleet-drain").is_dir()
    assert not [c for c in host_env.calls("systemctl") if "start" in c["argv"]]


async def test_a_service_file_made_a_directory_does_not_break_a_deregister(
        host_env: Host, aiohttp_client: Any) -> None:
    """Uninstalling a user unit removes the runner's `.service`; a directory there raised after
    the unit was stopped, disabled and deleted, before config.sh removed the registration (a 500
    and a runner registered at GitHub with no service). The directory is left; the rest runs."""
    path = host_env.add_runner("r1")
    host_env.start_unit("r1")
    (path / ".service").mkdir()
    client = await start(host_env, aiohttp_client)
    await until(lambda: cp_of(client).snapshot.get("runners"))
    resp = await client.post("/api/action",
                             json={"id": "runner.deregister", "args": {"name": "r1"}},
                             headers=auth(cp_of(client)))
    body = await resp.json()
    assert resp.status == 200 and body["ok"], body
    assert [c["argv"][-1] for c in host_env.calls("config.sh")] == ["remove"]
    assert not (host_env.xdg / "systemd" / "user" / host_env.unit("r1")).exists()


async def test_a_runner_file_taking_another_runners_name_stops_actions_on_that_name(
        host_env: Host, aiohttp_client: Any) -> None:
    """A job on alpha that rewrote alpha's `.runner` to say `beta` hid the real beta (the first
    directory in path order won, silently), and a drain of beta wrote its marker into alpha's
    directory. The clash is now an alert and a log line, and actions on the name are refused."""
    alpha = host_env.add_runner("alpha")
    beta = host_env.add_runner("beta")
    fakes.write_runner_file(alpha, "beta", "octo/app")
    client = await start(host_env, aiohttp_client)
    await until(lambda: cp_of(client).snapshot.get("runners"))
    sentence = ("the runner directories alpha, beta all claim the name 'beta' in their .runner "
                "files (a job may have rewritten one); no action is taken on beta until one "
                "alone does")
    body = await (await client.get("/api/state")).json()
    assert {"severity": "warning", "message": sentence} in body["alerts"]
    for action in ("runner.drain", "runner.deregister", "runner.duplicate"):
        resp = await client.post("/api/action", json={"id": action, "args": {"name": "beta"}},
                                 headers=auth(cp_of(client)))
        assert resp.status == 409 and (await resp.json())["error"] == sentence
    assert not (alpha / ".fleet-drain").exists() and not (beta / ".fleet-drain").exists()
    assert not host_env.calls("config.sh")
    fakes.write_runner_file(alpha, "alpha", "octo/app")  # mended: both are runners again
    await until(lambda: {r.name for r in cp_of(client).runners} == {"alpha", "beta"})
    assert cp_of(client).clashes == {}
