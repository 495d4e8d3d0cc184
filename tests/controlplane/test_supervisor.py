"""Systemd and launchd supervisors against the fake systemctl/launchctl on PATH: a listener
process really starts and stops."""

from __future__ import annotations

import dataclasses
import os
import plistlib
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet_min.controlplane.http.app import create_app
from fleet_min.controlplane.runners import commands
from fleet_min.controlplane.runners.discovery import discover
from fleet_min.controlplane.runners.procs import process_table
from fleet_min.controlplane.runners.supervisor import Launchd, ServiceState, Systemd, service_name
from tests.support import cp_fakes as fakes
from tests.support.controlplane import Host, auth, cp_of, make_config, until


async def test_systemd_user_unit_start_stop_and_state(apply_env: Host) -> None:
    host = apply_env
    host.add_runner("r1")
    sup = Systemd("user", 20)
    [runner] = discover(host.root, process_table())
    state = (await sup.states([runner]))["r1"]
    assert (state.loaded, state.active, state.scope) == (True, "inactive", "user")
    assert (await sup.start(runner, state)).ok
    pid = host.wait_listener("r1")
    [runner] = discover(host.root, process_table())
    assert runner.listener is not None and runner.listener.pid == pid
    state = (await sup.states([runner]))["r1"]
    assert state.active == "active" and state.main_pid == pid
    assert (await sup.stop(runner, state)).ok
    assert not fakes.pid_alive(pid)
    assert (await sup.states([runner]))["r1"].active == "inactive"


async def test_systemd_auto_scope_finds_system_units_and_missing_ones(apply_env: Host) -> None:
    host = apply_env
    path = host.add_runner("sys1", unit=False)
    host.add_runner("none1", unit=False)
    # The runner's own svc.sh installs the system unit.
    result = await commands.run([str(path / "svc.sh"), "install", "root"], timeout_s=20, cwd=path)
    assert result.ok, result.output
    runners = discover(host.root, [])
    states = await Systemd("auto", 20).states(runners)
    assert states["sys1"].scope == "system" and states["sys1"].loaded
    assert states["sys1"].unit == "actions.runner.octo-app.sys1.service"
    assert not states["none1"].loaded and states["none1"].scope is None


async def test_systemd_install_writes_a_user_unit_and_uninstall_removes_it(apply_env: Host
                                                                            ) -> None:
    host = apply_env
    host.add_runner("r2", unit=False)
    sup = Systemd("user", 20)
    [runner] = discover(host.root, [])
    assert (await sup.install(runner, "user")).ok
    unit = host.xdg / "systemd" / "user" / "actions.runner.octo-app.r2.service"
    assert "ExecStart=" in unit.read_text() and (runner.path / ".service").exists()
    [runner] = discover(host.root, [])
    state = (await sup.states([runner]))["r2"]
    assert state.loaded
    assert (await sup.uninstall(runner, state)).ok
    assert not unit.exists()
    tools = [c["argv"] for c in host.calls("systemctl")]
    assert ["--user", "enable", "actions.runner.octo-app.r2.service"] in tools
    assert ["--user", "disable", "actions.runner.octo-app.r2.service"] in tools


async def installed_on_launchd(host: Host, monkeypatch: pytest.MonkeyPatch
                               ) -> tuple[Launchd, Any]:
    """Runner mac1 installed as a launchd job by its own svc.sh, read back (its .service now
    names the plist)."""
    monkeypatch.setenv("FAKE_SVC_MODE", "launchd")
    host.add_runner("mac1", unit=False)
    sup = Launchd(20)
    [runner] = discover(host.root, [])
    assert (await sup.install(runner, None)).ok
    [runner] = discover(host.root, [])
    return sup, runner


async def test_launchd_install_load_unload(apply_env: Host, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    host = apply_env
    sup, runner = await installed_on_launchd(host, monkeypatch)
    assert service_name(runner) == "actions.runner.octo-app.mac1"
    plist = Path(host.env["HOME"]) / "Library/LaunchAgents/actions.runner.octo-app.mac1.plist"
    assert plistlib.loads(plist.read_bytes())["Label"] == "actions.runner.octo-app.mac1"
    state = (await sup.states([runner]))["mac1"]
    assert not state.loaded
    assert (await sup.start(runner, state)).ok
    pid = host.wait_listener("mac1")
    state = (await sup.states([runner]))["mac1"]
    assert (state.loaded, state.active, state.main_pid) == (True, "active", pid)
    assert (await sup.stop(runner, state)).ok
    await until(lambda: not fakes.pid_alive(pid))
    assert (await sup.uninstall(runner, state)).ok and not plist.exists()


async def test_commands_time_out_and_report_missing_programs(tmp_path: Path) -> None:
    slow = await commands.run(["sleep", "5"], timeout_s=0.3)
    assert slow.timed_out and slow.code is None and not slow.ok
    missing = await commands.run([str(tmp_path / "nope")], timeout_s=1)
    assert missing.code is None and "could not start" in missing.output
    echoed = await commands.run(["sh", "-c", "echo token=ghp_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],
                                timeout_s=5)
    assert echoed.ok and "ghp_" not in echoed.output
    # Output that is only parsed (the supervisors' state queries) comes back as printed.
    raw = await commands.run(["sh", "-c", "echo token=ghp_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],
                             timeout_s=5, parse_only=True)
    assert raw.ok and raw.output.strip() == "token=ghp_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"


async def test_systemd_states_of_many_units_come_from_one_show(apply_env: Host) -> None:
    """Sixty runners: one `systemctl show` call for all of them, each block matched to its
    runner whatever state its unit is in (running, failed, inactive, no unit at all)."""
    host = apply_env
    names = [f"m{i:02d}" for i in range(60)]
    for i, name in enumerate(names):
        host.add_runner(name, repo=f"octo/app{i % 3}", unit=i % 10 != 9)
    failed = host.systemd / "user" / (host.unit("m04", "octo/app1") + ".failed")
    failed.parent.mkdir(parents=True, exist_ok=True)
    failed.touch()
    runners = discover(host.root, [])
    sup = Systemd("user", 20)
    started = next(r for r in runners if r.name == "m07")
    assert (await sup.start(started, (await sup.states([started]))["m07"])).ok
    pid = host.wait_listener("m07")
    before = len(host.calls("systemctl"))
    states = await sup.states(runners)
    shows = [c["argv"] for c in host.calls("systemctl")[before:]]
    assert len(shows) == 1 and shows[0][:2] == ["--user", "show"]
    assert sorted(states) == names
    for i, name in enumerate(names):
        state = states[name]
        assert state.unit == host.unit(name, f"octo/app{i % 3}")
        if i % 10 == 9:
            assert (state.loaded, state.scope, state.active) == (False, None, "inactive")
        elif name == "m04":
            assert (state.loaded, state.active, state.sub) == (True, "failed", "failed")
        elif name == "m07":
            assert (state.active, state.sub, state.main_pid) == ("active", "running", pid)
        else:
            assert (state.loaded, state.scope, state.active, state.sub, state.main_pid) == (
                True, "user", "inactive", "dead", None)
    assert (await sup.stop(started, states["m07"])).ok


def test_service_state_json_has_every_field() -> None:
    state = ServiceState("u.service", "user", True, "active", "running", 42)
    assert state.as_json() == dataclasses.asdict(state)
    assert list(state.as_json()) == [f.name for f in dataclasses.fields(ServiceState)]


# --- what the service managers print that is no number -----------------------------------

# Put first on PATH under the tool's name: runs the fake tool ($REAL_TOOL) and rewrites what it
# printed with the regular expression $REWRITE_PATTERN -> $REWRITE_WITH.
REWRITER = f"""#!{sys.executable}
import os, re, subprocess, sys
done = subprocess.run([os.environ["REAL_TOOL"], *sys.argv[1:]], capture_output=True, text=True)
out = re.sub(os.environ["REWRITE_PATTERN"], os.environ["REWRITE_WITH"], done.stdout)
sys.stdout.write(out)
sys.stderr.write(done.stderr)
sys.exit(done.returncode)
"""
NO_PIDS = ["[not set]", "", "abc", "-1", "0x10", "\u00b2", "\u0663", "9" * 5000, "99999999999"]


def rewrite(host: Host, monkeypatch: pytest.MonkeyPatch, tool: str, pattern: str,
            replacement: str) -> None:
    wrapper = host.tmp / "rewriting-bin" / tool
    wrapper.parent.mkdir(exist_ok=True)
    wrapper.write_text(REWRITER)
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("REAL_TOOL", str(host.bin / tool))
    monkeypatch.setenv("REWRITE_PATTERN", pattern)
    monkeypatch.setenv("REWRITE_WITH", replacement.replace("\\", "\\\\"))


def short(value: object) -> str:
    text = ascii(value)
    return text if len(text) < 20 else f"{text[:8]}...({len(text)} chars)"


@pytest.mark.parametrize("main_pid", NO_PIDS, ids=short)
async def test_systemd_reads_a_main_pid_that_is_no_pid_as_none(
        apply_env: Host, monkeypatch: pytest.MonkeyPatch, main_pid: str) -> None:
    host = apply_env
    host.add_runner("r1")
    host.add_runner("r2")
    host.start_unit("r1")
    rewrite(host, monkeypatch, "systemctl", r"(?m)^MainPID=.*$", f"MainPID={main_pid}")
    states = await Systemd("user", 20).states(discover(host.root, []))
    assert {name: (s.loaded, s.active, s.main_pid) for name, s in states.items()} == {
        "r1": (True, "active", None), "r2": (True, "inactive", None)}


@pytest.mark.parametrize(("pid", "status", "active"), [
    ("\u00b2", "0", "inactive"), ("\u0663", "0", "inactive"), ("9" * 5000, "0", "inactive"),
    ("-", "--1", "inactive"), ("-", "-" + "9" * 5000, "inactive"), ("-", "\u0663", "inactive"),
    ("-", "1", "failed"), ("0", "-15", "failed")], ids=short)
async def test_launchd_reads_a_pid_or_status_that_is_no_number_as_none(
        apply_env: Host, monkeypatch: pytest.MonkeyPatch, pid: str, status: str,
        active: str) -> None:
    host = apply_env
    sup, runner = await installed_on_launchd(host, monkeypatch)
    assert (await sup.start(runner, (await sup.states([runner]))["mac1"])).ok
    listener = host.wait_listener("mac1")
    rewrite(host, monkeypatch, "launchctl", r"(?m)^[^\t\n]*\t[^\t\n]*\t(?=actions\.)",
            f"{pid}\t{status}\t")
    state = (await sup.states([runner]))["mac1"]
    assert (state.loaded, state.active, state.main_pid) == (True, active, None)
    assert (await sup.stop(runner, state)).ok
    await until(lambda: not fakes.pid_alive(listener))


async def test_the_daemon_starts_and_acts_while_systemctl_prints_no_main_pid(
        apply_env: Host, monkeypatch: pytest.MonkeyPatch, aiohttp_client: Any) -> None:
    """The first snapshot is built as the daemon starts: a ValueError there kept it from
    listening at all, and later failed every tick and every action."""
    host = apply_env
    host.add_runner("r1")
    pid = host.start_unit("r1")
    rewrite(host, monkeypatch, "systemctl", r"(?m)^MainPID=.*$", "MainPID=[not set]")
    client = await aiohttp_client(create_app(make_config(host), dict(os.environ)))
    first = await (await client.get("/api/state")).json()
    [view] = first["runners"]
    assert view["service"]["main_pid"] is None and view["service"]["active"] == "active"
    resp = await client.post("/api/action", json={"id": "runner.drain", "args": {"name": "r1"}},
                             headers=auth(cp_of(client)))
    body = await resp.json()
    assert resp.status == 200 and body["ok"] and body["stopped"] is True, body
    assert not fakes.pid_alive(pid)

    async def rebuilt() -> bool:  # the ticks go on
        now = await (await client.get("/api/state")).json()
        return bool(now["generated_at"] > first["generated_at"])
    await until(rebuilt)
