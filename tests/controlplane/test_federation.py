"""Federation with two real daemons on loopback: a coordinator, and an agent started with
`--coordinator URL` on a second fake host. The agent calls in; the coordinator never connects
to it. Remote runners join the coordinator's snapshot; actions on them are forwarded to the
agent through its numbered command queue, and reach it in order, each exactly once, whatever
happens to either process in between (SIGKILL, SIGSTOP, restarts)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest

from tests.support import cp_fakes as fakes
from tests.support.collector import free_port
from tests.support.controlplane import REPO_ROOT, Daemon, Host, agent_token, until
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
    agent_token(coord_host, edge_host)
    # octo/lib is the agent's alone: the coordinator reads it from GitHub because it is listed.
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord", "FLEET_STALE_AFTER_S": "3",
                                "FLEET_AGENT_REPOS": "octo/lib"})
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

    # Duplicate and deregister are forwarded too: the agent runs them and the result (with the
    # new runner's name) comes back.
    status, reply = await act(http, coord, "runner.duplicate", name="b-1")
    assert status == 200 and reply["queued"] and reply["host"] == "edge", reply
    done = await until(lambda: command(http, coord, reply["command_id"]), timeout=60)
    assert done["ok"] and done["runner"] == "b-2" and done["code"] == 0, done
    edge_host.wait_listener("b-2", timeout=20)
    await until(lambda: remote(http, coord, "b-2"), timeout=30)
    status, reply = await act(http, coord, "runner.deregister", name="b-2", delete_dir=True)
    assert status == 200 and reply["queued"], reply
    done = await until(lambda: command(http, coord, reply["command_id"]), timeout=60)
    assert done["ok"] and done["runner"] == "b-2", done
    assert not (edge_host.root / "b-2").exists()
    status, reply = await act(http, coord, "runner.deregister", name="b-1", delete_dir="yes")
    assert status == 400 and "delete_dir" in reply["error"]  # checked before it is sent
    status, reply = await act(http, coord, "health.check", host="nowhere")
    assert status == 404
    # Only allow-listed actions run there: a row written straight into the queue (by an older
    # version: no number yet) is numbered in turn, sent, and refused by the agent.
    with sqlite3.connect(coord.host.state / "controlplane.db", timeout=30) as conn:
        conn.execute("INSERT INTO host_commands (id, host, action, args, who, queued_at) VALUES "
                     "('cmd-forged', 'edge', 'runner.explode', '{\"name\": \"b-1\"}', 'test', "
                     "?)", (time.time(),))
    status, reply = await act(http, coord, "health.check", host="edge")  # rings the agent
    refused = await until(lambda: command(http, coord, "cmd-forged"), timeout=30)
    assert refused["ok"] is False and "not allowed on agent hosts" in refused["error"]
    assert refused["seq"] < reply["seq"]
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


class Order:
    """A coordinator on a fixed port and its agent, with the commands sent so far."""

    COORD_ENV = {"FLEET_HOST_NAME": "coord"}
    # A long heartbeat: the coordinator holds each poll up to 20 s, so one is always held
    # when a test needs a command to meet a poll whose agent has just died.
    EDGE_ENV = {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "20"}

    def __init__(self, coord_host: Host, edge_host: Host, http: aiohttp.ClientSession) -> None:
        self.coord_host, self.edge_host, self.http = coord_host, edge_host, http
        self.port = free_port()
        self.coord = Daemon(coord_host, self.COORD_ENV, port=self.port)
        self.edge = self.start_edge()
        self.sent: list[tuple[str, str]] = []  # (command id, action)

    def start_edge(self) -> Daemon:
        return Daemon(self.edge_host, self.EDGE_ENV, args=("--coordinator", self.coord.url))

    async def send(self, action: str) -> str:
        status, reply = await act(self.http, self.coord, action, name="b-1")
        assert status == 200 and reply["queued"] and reply["host"] == "edge", reply
        self.sent.append((reply["command_id"], action))
        return str(reply["command_id"])

    async def done(self, command_id: str) -> dict[str, Any]:
        return await until(lambda: command(self.http, self.coord, command_id), timeout=90)

    async def poll_held(self, after: str) -> None:
        """Wait until the agent has called in after `after` (a time): as nothing is queued,
        that call is now held by the coordinator."""
        async def called() -> bool:
            hosts = await get(self.http, f"{self.coord.url}/api/hosts")
            edge = next((h for h in hosts["hosts"] if h["host"] == "edge"), None)
            return bool(edge and edge["last_heartbeat_at"] > after)
        await until(called, timeout=30)

    async def sent_out(self, command_id: str) -> None:
        """Wait until the coordinator has handed the command to a poll (dead or alive)."""
        async def handed() -> bool:
            body = await get(self.http, f"{self.coord.url}/api/hosts")
            return any(c["id"] == command_id and c["sent_at"] for c in body["commands"])
        await until(handed, timeout=30)

    def applied(self) -> list[str]:
        """The actions the agent ran for the coordinator, in the order its audit log has them."""
        with sqlite3.connect(self.edge_host.state / "controlplane.db", timeout=30) as conn:
            return [row[0] for row in conn.execute(
                "SELECT action FROM audit WHERE who LIKE 'coordinator %' ORDER BY id")]


async def test_commands_reach_the_agent_in_order_exactly_once(
        tmp_path: Any, github: FakeGitHub) -> None:
    coord_host, edge_host = Host(tmp_path / "coord", github), Host(tmp_path / "edge", github)
    edge_host.add_runner("b-1", repo="octo/lib", labels=["linux"])
    edge_host.start_unit("b-1", "octo/lib")
    agent_token(coord_host, edge_host)
    # No kept-alive connection: the coordinator is killed and restarted on the same address.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        await _order_scenario(coord_host, edge_host, http)


async def _order_scenario(coord_host: Host, edge_host: Host,
                          http: aiohttp.ClientSession) -> None:
    o = Order(coord_host, edge_host, http)
    try:
        await until(lambda: remote(http, o.coord, "b-1"), timeout=30)
        first = await o.done(await o.send("runner.drain"))

        # SIGKILL the agent while the coordinator holds its poll: the next command is handed
        # to that dead poll. The restarted agent must get it before the one queued after it.
        await o.poll_held(first["done_at"])
        o.edge.proc.kill()
        o.edge.proc.wait()
        lost = await o.send("runner.resume")
        await o.sent_out(lost)
        o.edge = o.start_edge()
        last = await o.done(await o.send("runner.drain"))
        await o.done(lost)

        # SIGSTOP the agent while its poll is held; two commands are queued; SIGCONT.
        await o.poll_held(last["done_at"])
        o.edge.proc.send_signal(signal.SIGSTOP)
        try:
            await o.send("runner.resume")
            stopped = await o.send("runner.drain")
        finally:
            o.edge.proc.send_signal(signal.SIGCONT)
        last = await o.done(stopped)

        # SIGKILL the coordinator right after it acknowledged a command, restart it on the
        # same address with the same database, and send one more.
        await o.poll_held(last["done_at"])
        unsure = await o.send("runner.resume")
        o.coord.proc.kill()
        o.coord.proc.wait()
        o.coord = Daemon(coord_host, Order.COORD_ENV, port=o.port)
        final = await o.send("runner.drain")
        await o.done(unsure)
        await o.done(final)

        expected = [action for _, action in o.sent]
        assert o.applied() == expected  # in the order sent, none twice, none lost
        # The service went down and up in that order too (a drain's stop may be issued twice,
        # by the action and by the drain enforcement racing it; that changes no state).
        verbs = [c["argv"][1] for c in edge_host.calls("systemctl")
                 if c["argv"][1:2] in (["start"], ["stop"])
                 and c["argv"][2] == edge_host.unit("b-1", "octo/lib")]
        states = [v for i, v in enumerate(verbs) if i == 0 or verbs[i - 1] != v]
        assert states == ["start"] + ["stop" if a == "runner.drain" else "start"
                                      for a in expected], verbs
        hosts = await get(http, f"{o.coord.url}/api/hosts")
        seqs = {c["id"]: c["seq"] for c in hosts["commands"]}
        assert [seqs[c] for c, _ in o.sent] == list(range(1, len(o.sent) + 1))
    finally:
        o.edge.stop()
        o.coord.stop()
        fakes.kill_all_listeners(edge_host.root)


async def test_a_command_the_agent_died_in_is_not_run_again(
        tmp_path: Any, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """SIGKILL while a forwarded health check runs: after the restart that command is settled
    as interrupted (not run a second time) and the queue goes on with the next one."""
    coord_host, edge_host = Host(tmp_path / "coord", github), Host(tmp_path / "edge", github)
    runs, gate = tmp_path / "runs", tmp_path / "gate"
    script = tmp_path / "health.sh"
    script.write_text(f"#!/bin/sh\necho run >> '{runs}'\n"
                      f"while [ ! -e '{gate}' ]; do sleep 0.05; done\necho disk ok\n")
    script.chmod(0o755)
    agent_token(coord_host, edge_host)
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord"})
    edge_env = {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1",
                "FLEET_HEALTH_SCRIPT": str(script)}
    edge = Daemon(edge_host, edge_env, args=("--coordinator", coord.url))
    try:
        await until(lambda: _host_listed(http, coord), timeout=30)
        status, reply = await act(http, coord, "health.check", host="edge")
        assert status == 200, reply
        await until(lambda: runs.exists(), timeout=30)
        edge.proc.kill()
        edge.proc.wait()
        fakes.kill_all_listeners(edge_host.root)
        gate.touch()
        edge = Daemon(edge_host, edge_env, args=("--coordinator", coord.url))
        done = await until(lambda: command(http, coord, reply["command_id"]), timeout=30)
        assert done["ok"] is False and "not run again" in done["error"], done
        status, second = await act(http, coord, "health.check", host="edge")
        done = await until(lambda: command(http, coord, second["command_id"]), timeout=30)
        assert done["ok"] and second["seq"] == reply["seq"] + 1
        assert runs.read_text().count("run") == 2  # the first once, the second once
    finally:
        edge.stop()
        coord.stop()


async def _host_listed(http: aiohttp.ClientSession, coord: Daemon) -> bool:
    hosts = await get(http, f"{coord.url}/api/hosts")
    return any(h["host"] == "edge" for h in hosts["hosts"])



async def test_a_second_agent_under_the_same_name_is_refused(
        tmp_path: Any, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """Two machines from one image keep its host name: both agents called in as `edge`, shared
    one queue, and a command queued for `edge` ran on both (here each counts its health checks
    in a file of its own). The second is refused while the first is heard from; the first,
    restarted, goes on at once, since its instance is the same."""
    coord_host = Host(tmp_path / "coord", github)
    hosts = {which: Host(tmp_path / which, github) for which in ("first", "clone")}
    for host in hosts.values():  # the one agent token, as on every machine of the image
        agent_token(coord_host, host)
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord"})
    agents: dict[str, Daemon] = {}

    def start(which: str) -> Daemon:
        script = tmp_path / f"health-{which}.sh"
        script.write_text(f"#!/bin/sh\necho run >> '{tmp_path / ('runs-' + which)}'\n"
                          "echo disk ok\n")
        script.chmod(0o755)
        agents[which] = Daemon(hosts[which], {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1",
                                      "FLEET_HEALTH_SCRIPT": str(script)},
                               args=("--coordinator", coord.url))
        return agents[which]

    async def link(which: str) -> dict[str, Any]:
        body = await get(http, f"{agents[which].url}/api/hosts")
        return dict(body["hosts"][0]["coordinator"])

    async def refused(which: str) -> str | None:
        error = (await link(which))["last_error"]
        return error if error and "409" in error else None

    try:
        start("first")
        await until(lambda: _host_listed(http, coord), timeout=30)
        start("clone")
        error = await until(lambda: refused("clone"), timeout=30)
        assert "FLEET_HOST_NAME" in error and "in use by another agent" in error
        assert (await link("clone"))["heartbeats"] == 0
        assert (await link("first"))["instance"] != (await link("clone"))["instance"]

        status, reply = await act(http, coord, "health.check", host="edge")
        assert status == 200, reply
        done = await until(lambda: command(http, coord, reply["command_id"]), timeout=30)
        assert done["ok"] and "disk ok" in done["output"]
        assert (tmp_path / "runs-first").read_text() == "run\n"
        assert not (tmp_path / "runs-clone").exists()

        # The first agent restarted (same state directory, same boot): let in at once.
        before = (await link("first"))["instance"]
        agents["first"].stop()
        agents["first"] = Daemon(agents["first"].host, {
            "FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1",
            "FLEET_HEALTH_SCRIPT": str(tmp_path / "health-first.sh")},
            args=("--coordinator", coord.url))

        async def back() -> bool:
            state = await link("first")
            return bool(state["heartbeats"] >= 1 and state["last_error"] is None)
        await until(back, timeout=30)
        assert (await link("first"))["instance"] == before
        assert await refused("clone")
    finally:
        for agent in agents.values():
            agent.stop()
        coord.stop()


@pytest.mark.parametrize("bad", ["http://]x:7878", "http://[x:7878", "http://a\uff03b:7878",
                                 "ftp://x:7878", "x:7878"])
def test_a_coordinator_address_that_is_no_url_is_refused_in_a_sentence(bad: str) -> None:
    """urlsplit raises its own ValueError on some of these (a lone bracket; a host NFKC folds
    into '#'): the sentence is still the setting's, naming what to give."""
    from fleet_min.controlplane.federation.link import check_url
    from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS
    [setting] = [s for s in CONTROLPLANE_SETTINGS if s.name == "coordinator"]
    with pytest.raises(ValueError, match=r"must be an http\(s\) URL such as http://10\.0\.0\.2"):
        setting.kind(bad)
    with pytest.raises(ValueError, match=r"the coordinator must be an http\(s\) URL"):
        check_url(bad)
