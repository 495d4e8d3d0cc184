"""Federation with two real daemons on loopback: a coordinator, and an agent started with
`--coordinator URL` on a second fake host. The agent calls in; the coordinator never connects
to it. Remote runners join the coordinator's snapshot; actions on them are queued to the agent,
which runs only drain, resume and health check."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest

from tests.support import cp_fakes as fakes
from tests.support.controlplane import REPO_ROOT, Daemon, Host, until
from tests.support.fake_github import FakeGitHub

pytestmark = pytest.mark.slow


async def get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def act(http: aiohttp.ClientSession, d: Daemon, action: str, **args: Any
              ) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{d.url}/api/action", json={"id": action, "args": args},
                         headers=d.headers()) as resp:
        return resp.status, await resp.json()


async def remote(http: aiohttp.ClientSession, d: Daemon, name: str) -> dict[str, Any] | None:
    snap = await get(http, f"{d.url}/api/state")
    return next((r for r in snap["runners"] if r["name"] == name and r["remote"]), None)


async def command(http: aiohttp.ClientSession, d: Daemon, command_id: str
                  ) -> dict[str, Any] | None:
    body = await get(http, f"{d.url}/api/hosts")
    found = next((c for c in body["commands"] if c["id"] == command_id), None)
    return found if found and found["done_at"] else None


async def test_coordinator_and_agent(tmp_path: Any, github: FakeGitHub,
                                     http: aiohttp.ClientSession) -> None:
    coord_host, edge_host = Host(tmp_path / "coord", github), Host(tmp_path / "edge", github)
    coord_host.add_runner("a-1", repo="octo/app", labels=["linux"])
    edge_host.add_runner("b-1", repo="octo/lib", labels=["linux"])
    pid = edge_host.start_unit("b-1", "octo/lib")
    env = {**coord_host.full_env(), "PYTHONPATH": str(REPO_ROOT)}
    agent_token = subprocess.run(
        [sys.executable, "-m", "fleet_min", "controlplane", "token", "--agent", "--state",
         str(coord_host.state)], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
        check=True).stdout.strip()
    token_file = edge_host.state / "coordinator-token"
    edge_host.state.mkdir(parents=True, exist_ok=True)
    token_file.write_text(agent_token + "\n")
    token_file.chmod(0o600)
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord", "FLEET_STALE_AFTER_S": "3"})
    edge = None
    try:
        edge = Daemon(edge_host, {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1"},
                      args=("--coordinator", coord.url))
        await _scenario(http, coord, edge, edge_host, pid, github)
        # The agent stops calling in: after stale_after_s it is marked stale, runners too.
        edge.stop()
        hosts = await until(lambda: _stale(http, coord), timeout=30)
        assert hosts["edge"]["stale"] and hosts["edge"]["heartbeat_age_s"] >= 3
        async def stale_view() -> dict[str, Any] | None:
            view = await remote(http, coord, "b-1")
            return view if view and view["stale"] else None
        view = await until(stale_view, timeout=30)  # at the next snapshot
        assert view["state"] == "idle"  # its last known state
    finally:
        if edge is not None:
            edge.stop()
        coord.stop()
        fakes.kill_all_listeners(coord_host.root)
        fakes.kill_all_listeners(edge_host.root)


async def _stale(http: aiohttp.ClientSession, coord: Daemon) -> dict[str, Any] | None:
    hosts = {h["host"]: h for h in (await get(http, f"{coord.url}/api/hosts"))["hosts"]}
    return hosts if hosts.get("edge", {}).get("stale") else None


async def _scenario(http: aiohttp.ClientSession, coord: Daemon, edge: Daemon,
                    edge_host: Host, pid: int, github: FakeGitHub) -> None:
    # The agent's heartbeat brings its host and runners to the coordinator.
    view = await until(lambda: remote(http, coord, "b-1"), timeout=30)
    assert view["host"] == "edge" and view["repo"] == "octo/lib" and view["state"] == "idle"
    snap = await get(http, f"{coord.url}/api/state")
    local = next(r for r in snap["runners"] if r["name"] == "a-1")
    assert local["host"] == "coord" and local["remote"] is False
    hosts = await get(http, f"{coord.url}/api/hosts")
    by_name = {h["host"]: h for h in hosts["hosts"]}
    assert by_name["coord"]["role"] == "coordinator" and by_name["edge"]["role"] == "agent"
    assert [r["name"] for r in by_name["edge"]["runners"]] == ["b-1"]
    assert by_name["edge"]["capacity"]["runners"] == 1 and not by_name["edge"]["stale"]
    assert by_name["edge"]["heartbeat_age_s"] < 30
    edge_port = edge.url.rsplit(":", 1)[1]
    assert edge_port not in json.dumps(hosts)  # the coordinator does not even know its address
    agent_view = await get(http, f"{edge.url}/api/hosts")
    assert agent_view["hosts"][0]["role"] == "agent"
    assert agent_view["hosts"][0]["coordinator"]["coordinator"] == coord.url

    # A queued run of the agent's repository: the coordinator classifies it with the agent's
    # runner state (idle here: GitHub delay; draining below: runner down).
    run_id = github.add_run("octo/lib", "queued", "2026-01-01T00:00:00Z",
                            ["self-hosted", "linux"])

    async def cause(expected: str) -> bool:
        body = await get(http, f"{coord.url}/api/queue-causes")
        return any(c["run_id"] == run_id and c["cause"] == expected
                   for c in body["queue_causes"])
    await until(lambda: cause("github-delay"), timeout=30)

    # Drain through the coordinator: queued to the agent, run there, result back.
    status, reply = await act(http, coord, "runner.drain", name="b-1")
    assert status == 200 and reply["queued"] and reply["host"] == "edge", reply
    done = await until(lambda: command(http, coord, reply["command_id"]), timeout=30)
    assert done["ok"] and done["action"] == "runner.drain"
    assert not fakes.pid_alive(pid) and (edge_host.root / "b-1" / ".fleet-drain").exists()
    await until(lambda: _draining(http, coord), timeout=30)
    await until(lambda: cause("runner-down"), timeout=30)
    status, reply = await act(http, coord, "runner.resume", name="b-1")
    assert status == 200 and reply["queued"]
    await until(lambda: command(http, coord, reply["command_id"]), timeout=30)
    edge_host.wait_listener("b-1", timeout=20)

    # Health check on the agent host.
    status, reply = await act(http, coord, "health.check", host="edge")
    assert status == 200 and reply["queued"]
    done = await until(lambda: command(http, coord, reply["command_id"]), timeout=30)
    assert done["ok"] and "disk ok" in done["output"]

    # Only allow-listed actions travel; the agent refuses anything else it is sent.
    status, reply = await act(http, coord, "runner.duplicate", name="b-1")
    assert status == 409 and "only runner.drain" in reply["error"]
    status, reply = await act(http, coord, "health.check", host="nowhere")
    assert status == 404
    with sqlite3.connect(coord.host.state / "controlplane.db", timeout=30) as conn:
        conn.execute("INSERT INTO host_commands (id, host, action, args, who, queued_at) VALUES "
                     "('cmd-forged', 'edge', 'runner.deregister', '{\"name\": \"b-1\"}', 'test', "
                     "?)", (time.time(),))
    # It is picked up at the agent's next call (within one heartbeat interval).
    refused = await until(lambda: command(http, coord, "cmd-forged"), timeout=30)
    assert refused["ok"] is False and "not allowed on agent hosts" in refused["error"]
    assert (edge_host.root / "b-1" / ".runner").exists()

    # The agent's own audit log names the coordinator as the one who asked.
    with sqlite3.connect(edge_host.state / "controlplane.db", timeout=30) as conn:
        who = {row[0] for row in conn.execute("SELECT who FROM audit")}
    assert who == {f"coordinator {coord.url}"}
    assert os.stat(edge_host.state / "coordinator-token").st_mode & 0o077 == 0


async def _draining(http: aiohttp.ClientSession, coord: Daemon) -> bool:
    view = await remote(http, coord, "b-1")
    return bool(view and view["draining"])


def test_agent_mode_refuses_a_missing_token_file(tmp_path: Any, github: FakeGitHub) -> None:
    host = Host(tmp_path, github)
    env = {**host.full_env(), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "fleet_min", "controlplane", "--port", "0",
                           "--state", str(host.state), "--coordinator", "http://127.0.0.1:9"],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "coordinator token" in done.stderr
    done = subprocess.run([sys.executable, "-m", "fleet_min", "controlplane", "--port", "0",
                           "--coordinator", "ftp://x"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "http(s) URL" in done.stderr
