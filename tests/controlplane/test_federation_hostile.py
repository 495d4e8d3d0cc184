"""Federation against a hostile or broken peer, over real HTTP.

Two directions. A real agent daemon (`--coordinator URL`) calling a small aiohttp server of
this file that poses as its coordinator and answers what no coordinator should (deep nesting,
huge or odd bodies, redirects elsewhere). And a real coordinator daemon called by this file
posing as an agent holding the agent token (floods, forged results, odd bodies)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from fleet_min.controlplane.federation.hosts import (
    COMMANDS_PER_REPLY,
    MAX_HOSTS,
    MAX_REMOTE_RUNNERS,
    MAX_RESULTS,
    MAX_RUNNERS,
    REPLY_BUDGET,
    clean_report,
)
from fleet_min.controlplane.federation.link import (
    KEPT_QUEUES,
    MAX_OWED,
    MAX_REPLY_BYTES,
    MIN_EXCHANGE_S,
)
from fleet_min.controlplane.labels import MAX_LABEL_CHARS
from tests.support.controlplane import REPO_ROOT, Daemon, Host, agent_token, until
from tests.support.fake_github import FakeGitHub

Answer = Callable[[web.Request, int], Awaitable[web.StreamResponse]]
QUEUE = "ab" * 8
GOOD = {"ok": True, "queue": QUEUE, "commands": []}


class FakeCoordinator:
    """A coordinator that answers the agent's n-th call (from 1) with `answer(request, n)`,
    and keeps every call's path, headers and body."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.calls: list[tuple[str, dict[str, str], bytes]] = []
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.calls.append((request.path, dict(request.headers), await request.read()))
        return await self.answer(request, len(self.calls))

    def heartbeats(self) -> int:
        return sum(path == "/api/host/heartbeat" for path, _, _ in self.calls)


@asynccontextmanager
async def fake_coordinator(answer: Answer) -> AsyncIterator[FakeCoordinator]:
    fake = FakeCoordinator(answer)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake._handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake
    finally:
        await runner.cleanup()


def start_agent(host: Host, url: str, token_file: Path | None = None,
                mode: int = 0o600) -> Daemon:
    env = {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1"}
    if token_file is None:
        token_file = host.state / "coordinator-token"
    else:
        env["FLEET_COORDINATOR_TOKEN_FILE"] = str(token_file)
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text("a" * 64 + "\n")
    token_file.chmod(mode)
    return Daemon(host, env, args=("--coordinator", url))


async def agent_until(host: Host, answer: Answer, done: Callable[[FakeCoordinator], bool],
                      timeout: float = 20) -> FakeCoordinator:
    """A real agent daemon against a fake coordinator answering `answer`, until `done` says
    enough was asked of it; the fake, with every call it took."""
    async with fake_coordinator(answer) as fake:
        agent = start_agent(host, fake.url)
        try:
            await until(lambda: done(fake), timeout=timeout)
        finally:
            agent.stop()
    return fake


async def link_of(http: aiohttp.ClientSession, agent: Daemon) -> dict[str, Any]:
    async with http.get(f"{agent.url}/api/hosts") as resp:
        assert resp.status == 200
        return dict((await resp.json())["hosts"][0]["coordinator"])


async def link_error(http: aiohttp.ClientSession, agent: Daemon, words: str) -> str:
    async def failed() -> str | None:
        error = (await link_of(http, agent))["last_error"]
        return error if error and words in error else None
    return str(await until(failed, timeout=4))


# --- the agent, facing a hostile coordinator ------------------------------------------------

async def test_a_deeply_nested_answer_does_not_end_the_agents_link(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """100,000 nested brackets made the parser raise RecursionError out of the link's loop:
    the agent never called in again, with no error to show for it."""
    async def answer(_request: web.Request, n: int) -> web.StreamResponse:
        if n == 1:
            return web.Response(body=b"[" * 100_000 + b"]" * 100_000,
                                content_type="application/json")
        return web.json_response(GOOD)
    async with fake_coordinator(answer) as fake:
        agent = start_agent(Host(tmp_path, github), fake.url)
        try:
            assert "nested deeper" in await link_error(http, agent, "nested")
            await until(lambda: fake.heartbeats() >= 2, timeout=4)  # the link lives on
            await until(lambda: link_of(http, agent), timeout=4)
        finally:
            agent.stop()


async def test_an_oversized_answer_is_cut_off(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A coordinator streaming an answer past the limit (no Content-Length) is refused once it
    passes it, not read whole into the agent's memory."""
    sent: list[int] = []

    async def answer(request: web.Request, _n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        chunk = b" " * (1 << 20)
        try:
            await resp.write(b'{"ok": true, "queue": "' + QUEUE.encode() + b'", "pad": "')
            for _ in range(2 * MAX_REPLY_BYTES >> 20):
                await resp.write(chunk)
                sent.append(len(chunk))
            await resp.write(b'"}')
        except ConnectionError:  # the agent hung up: what this test wants
            pass
        return resp
    async with fake_coordinator(answer) as fake:
        agent = start_agent(Host(tmp_path, github), fake.url)
        try:
            error = await link_error(http, agent, "larger than")
            assert str(MAX_REPLY_BYTES) in error
            assert (await link_of(http, agent))["heartbeats"] == 0
        finally:
            agent.stop()


async def test_a_redirect_elsewhere_is_not_followed(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A 307 to another address: aiohttp would post the report there again and take commands
    from whatever answers. The agent talks only to the coordinator it was given."""
    async def obedient(_request: web.Request, _n: int) -> web.StreamResponse:
        return web.json_response(GOOD)
    async with fake_coordinator(obedient) as elsewhere:
        async def answer(request: web.Request, _n: int) -> web.StreamResponse:
            raise web.HTTPTemporaryRedirect(
                elsewhere.url.replace("127.0.0.1", "localhost") + request.path)
        async with fake_coordinator(answer) as fake:
            agent = start_agent(Host(tmp_path, github), fake.url)
            try:
                error = await link_error(http, agent, "redirect")
                assert "307" in error and "final URL" in error
                assert fake.heartbeats() >= 1 and elsewhere.calls == []
            finally:
                agent.stop()


async def test_odd_answers_change_nothing_on_the_agent(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """Held up: wrong shapes at every level, NaN, 1e400, huge ints, control characters and a
    lone surrogate in the answers neither stop the link nor run anything."""
    odd = [b"null", b"\x00\xff",  # not a JSON object: a failed call, retried in 1 s
           b'{"ok": true, "queue": 5, "commands": {}, "x": [1e400, -1e400, ' + b"9" * 4000
           + b', "\\u0000\\u001f"]}',
           b'{"ok": true, "queue": "\\ud800", "commands": []}',
           b'{"ok": true, "queue": "' + QUEUE.encode() + b'", "commands": [null, 1, "x", []]}',
           b'{"ok": true, "queue": "' + QUEUE.encode() + b'", "commands": '
           b'[{"id": "\\ud800\\u0000", "seq": 1e400, "action": "runner.explode", "args": []}, '
           b'{"id": "c2", "seq": "2", "action": null, "args": {"name": NaN}}]}']

    async def answer(_request: web.Request, n: int) -> web.StreamResponse:
        # A good answer between odd ones: the link's back-off starts again from 1 s.
        odd_one = n % 2 == 1 and n // 2 < len(odd)
        body = odd[n // 2] if odd_one else json.dumps(GOOD).encode()
        return web.Response(body=body, content_type="application/json")
    host = Host(tmp_path, github)
    async with fake_coordinator(answer) as fake:
        agent = start_agent(host, fake.url)
        try:
            await until(lambda: len(fake.calls) > 2 * len(odd) + 2, timeout=20)
            link = await link_of(http, agent)
            assert link["last_error"] is None and link["queue"] == QUEUE
        finally:
            agent.stop()
    with sqlite3.connect(host.state / "controlplane.db") as conn:
        assert conn.execute("SELECT count(*) FROM audit").fetchone() == (0,)  # nothing ran


async def test_an_agent_takes_at_most_a_pages_worth_of_commands_from_one_reply(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A lying coordinator's reply of 620,000 commands held an agent six minutes (a read and
    writes each) with no heartbeat meanwhile. An agent takes the first COMMANDS_PER_REPLY of a
    reply, by number, and its next heartbeat says how far it got; a real coordinator pages as
    many (and sends the rest again)."""
    flood = {"ok": True, "queue": QUEUE, "commands": [
        {"id": f"c{n}", "seq": n, "action": "runner.explode", "args": {}}
        for n in range(1000, 0, -1)]}  # out of order: taken by number

    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        return web.json_response(flood if n == 1 else GOOD)
    host = Host(tmp_path, github)
    fake = await agent_until(host, answer, lambda fake: fake.heartbeats() >= 2)
    second = json.loads(next(body for path, _, body in fake.calls[1:]
                             if path == "/api/host/heartbeat"))
    assert second["queue"] == QUEUE and second["applied"] == COMMANDS_PER_REPLY
    with sqlite3.connect(host.state / "controlplane.db") as conn:
        ids = {row[0] for row in conn.execute("SELECT id FROM link_results")}
    assert ids == {f"c{n}" for n in range(1, COMMANDS_PER_REPLY + 1)}


async def test_a_new_queue_in_every_reply_keeps_only_a_few(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """Each reply naming a queue the agent had not seen added a link_state row, never
    deleted: a coordinator answering every heartbeat with a new queue id made 350,000 a day.
    The agent keeps the current queue and the few before it, and starts again from the
    current one."""
    async def answer(_request: web.Request, n: int) -> web.StreamResponse:
        return web.json_response({"ok": True, "queue": f"{n:016x}", "commands": []})
    host = Host(tmp_path, github)
    await agent_until(host, answer, lambda fake: fake.heartbeats() >= 2 * KEPT_QUEUES + 2,
                      timeout=30)
    with sqlite3.connect(host.state / "controlplane.db") as conn:
        queues = [int(row[0], 16) for row in conn.execute(
            "SELECT queue FROM link_state ORDER BY updated_at")]
    assert len(queues) == KEPT_QUEUES and queues[0] > KEPT_QUEUES, queues
    assert queues == list(range(queues[-1] - KEPT_QUEUES + 1, queues[-1] + 1))  # the newest
    async def good(_request: web.Request, _n: int) -> web.StreamResponse:
        return web.json_response(GOOD)
    fake = await agent_until(host, good, lambda fake: fake.heartbeats() >= 1)
    first = json.loads(fake.calls[0][2])
    assert first["queue"] == f"{queues[-1]:016x}"


async def test_results_a_coordinator_never_takes_are_capped(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A coordinator refusing POST /api/host/results while sending new commands made the
    agent owe every result for good: 200 more rows each reply. Past MAX_OWED the oldest are
    dropped, and the log says so."""
    async def answer(request: web.Request, n: int) -> web.StreamResponse:
        if request.path == "/api/host/results":
            return web.json_response({"error": "try later"}, status=503)
        return web.json_response({"ok": True, "queue": f"{n:016x}", "commands": [
            {"id": f"c{n}-{k}", "seq": k, "action": "runner.explode", "args": {}}
            for k in range(1, COMMANDS_PER_REPLY + 1)]})
    replies = MAX_OWED // COMMANDS_PER_REPLY + 1  # enough to owe more than MAX_OWED
    host = Host(tmp_path, github)
    fake = await agent_until(host, answer, lambda fake: sum(
        path == "/api/host/results" for path, _, _ in fake.calls) >= replies, timeout=30)
    with sqlite3.connect(host.state / "controlplane.db") as conn:
        owed = {row[0] for row in conn.execute("SELECT id FROM link_results WHERE reported = 0")}
        queues = conn.execute("SELECT count(*) FROM link_state").fetchone()[0]
    answered = [n for n, (path, _, _) in enumerate(fake.calls, 1)
                if path == "/api/host/heartbeat"]
    assert len(owed) == MAX_OWED and queues <= KEPT_QUEUES
    # The newest results are the ones kept: every one of the last reply's commands is owed.
    last = [n for n in answered if any(i.startswith(f"c{n}-") for i in owed)][-1]
    assert {f"c{last}-{k}" for k in range(1, COMMANDS_PER_REPLY + 1)} <= owed
    assert f"c{answered[0]}-1" not in owed  # the oldest went first
    logged = (host.tmp / "daemon.log").read_text()
    assert "has not taken this agent's command results" in logged, logged[-2000:]


async def test_a_coordinator_that_answers_at_once_is_not_called_in_a_loop(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A coordinator holds a heartbeat until it has commands or its wait is over; one that
    answers every heartbeat at once had the agent call in 1,300 times a second. Heartbeats
    are now MIN_EXCHANGE_S apart at least: in two seconds, at most a handful."""
    async def answer(_request: web.Request, n: int) -> web.StreamResponse:
        return web.json_response(GOOD)
    async with fake_coordinator(answer) as fake:
        agent = start_agent(Host(tmp_path, github), fake.url)
        try:
            await until(lambda: fake.heartbeats() >= 1, timeout=20)
            first = fake.heartbeats()
            await asyncio.sleep(2)
            assert fake.heartbeats() - first <= 2 / MIN_EXCHANGE_S + 2, fake.heartbeats()
        finally:
            agent.stop()


async def test_a_loose_coordinator_token_file_is_made_owner_only(
        tmp_path: Path, github: FakeGitHub) -> None:
    """In the state directory the daemon tightened it (with the whole directory) already; one
    named by FLEET_COORDINATOR_TOKEN_FILE elsewhere was used as it was, readable by all."""
    async def answer(_request: web.Request, _n: int) -> web.StreamResponse:
        return web.json_response(GOOD)
    host = Host(tmp_path, github)
    token_file = tmp_path / "etc" / "coordinator-token"
    async with fake_coordinator(answer) as fake:
        agent = start_agent(host, fake.url, token_file, mode=0o644)
        try:
            assert os.stat(token_file).st_mode & 0o777 == 0o600
        finally:
            agent.stop()


def test_an_agents_instance_is_kept_across_restarts_and_differs_by_boot(tmp_path: Path) -> None:
    """What the coordinator tells agents apart by: the same after a restart, different for
    another state directory, and different for a copy of the state directory booted on
    another machine (an image cloned after its agent first ran)."""
    import shutil

    from fleet_min.controlplane.federation.link import INSTANCE_FILE, instance_id
    boot, other_boot = tmp_path / "boot_id", tmp_path / "other_boot_id"
    boot.write_text("6f1c0b6e-1111-4c1e-9d59-8f6a2c3e4b5a\n")
    other_boot.write_text("0a9b8c7d-2222-4e5f-8a7b-6c5d4e3f2a1b\n")
    one = instance_id(tmp_path / "a", boot)
    assert re.fullmatch(r"[0-9a-f]{32}", one)
    assert instance_id(tmp_path / "a", boot) == one
    assert instance_id(tmp_path / "b", boot) != one
    assert os.stat(tmp_path / "a" / INSTANCE_FILE).st_mode & 0o777 == 0o600
    shutil.copytree(tmp_path / "a", tmp_path / "clone")
    assert instance_id(tmp_path / "clone", boot) == one  # the same machine: indistinguishable
    assert instance_id(tmp_path / "clone", other_boot) != one
    assert instance_id(tmp_path / "a", tmp_path / "no-such-file") != one  # no boot id (macOS)


# --- the coordinator, called by a hostile agent ---------------------------------------------

class Agentish:
    """Raw calls to a real coordinator daemon with its agent token (the control token also
    passes the agent routes)."""

    def __init__(self, coord: Daemon, http: aiohttp.ClientSession) -> None:
        self.coord, self.http = coord, http

    async def post(self, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.http.post(f"{self.coord.url}{path}", data=data, headers={
                **self.coord.headers(), "Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json()

    async def hosts(self) -> dict[str, Any]:
        async with self.http.get(f"{self.coord.url}/api/hosts") as resp:
            return dict(await resp.json())

    async def queue_check(self, host: str) -> dict[str, Any]:
        status, reply = await self.post("/api/action", {"id": "health.check",
                                                        "args": {"host": host}})
        assert status == 200 and reply["queued"], reply
        return dict(reply)


def start_coordinator(tmp_path: Path, github: FakeGitHub) -> Daemon:
    return Daemon(Host(tmp_path, github), {"FLEET_HOST_NAME": "coord"})


async def test_a_result_for_a_command_never_sent_is_not_taken(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A command no heartbeat has handed out cannot have run: a result for it (its id read
    from GET /api/hosts) settled it with a forged outcome, and the agent never got it."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        assert (await agent.post("/api/host/heartbeat", {"host": "edge"}))[0] == 200
        queued = await agent.queue_check("edge")
        forged = {"id": queued["command_id"], "ok": True, "output": "forged"}
        status, reply = await agent.post("/api/host/results",
                                         {"host": "edge", "results": [forged]})
        assert status == 200 and reply["matched"] == 0, reply
        # The real agent's next heartbeat still gets it, and its result is then taken.
        status, beat = await agent.post("/api/host/heartbeat", {"host": "edge"})
        assert [c["id"] for c in beat["commands"]] == [queued["command_id"]]
        status, reply = await agent.post("/api/host/results", {"host": "edge", "results": [
            {"id": queued["command_id"], "ok": True, "output": "disk ok"}]})
        assert reply["matched"] == 1
        # Held up: a replay, or another host's claim to it, settles nothing again.
        for host in ("edge", "other"):
            status, reply = await agent.post("/api/host/results", {"host": host,
                                                                   "results": [forged]})
            assert status == 200 and reply["matched"] == 0
        done = next(c for c in (await agent.hosts())["commands"]
                    if c["id"] == queued["command_id"])
        assert done["output"] == "disk ok"
        # Only the result that settled the command is in the operator's audit, once.
        assert _host_result_audit(coord) == [("host.result:edge", queued["command_id"], 1)]
    finally:
        coord.stop()


def _host_result_audit(coord: Daemon) -> list[tuple[str, str, int]]:
    with sqlite3.connect(coord.host.state / "controlplane.db") as conn:
        return [(action, json.loads(args)["id"], ok) for action, args, ok in conn.execute(
            "SELECT action, args, ok FROM audit WHERE action LIKE 'host.result:%' ORDER BY id")]


async def test_results_that_settle_nothing_cannot_fill_the_audit(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """The audit keeps a fixed number of rows (KEEP_AUDIT). Every posted result was audited,
    matched or not, so an agent posting ids of its own making, 200 a request, pushed the
    operator's own rows out of it; and a name's flood was logged line by line."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        assert (await agent.post("/api/host/heartbeat", {"host": "edge"}))[0] == 200
        queued = await agent.queue_check("edge")  # an operator's action: one audit row
        before = _audit_count(coord)
        for post in range(5):
            status, reply = await agent.post("/api/host/results", {"host": "edge", "results": [
                {"id": f"made-up-{post}-{i}", "ok": True, "error": "x" * 600}
                for i in range(MAX_RESULTS)]})
            assert status == 200 and reply == {"ok": True, "received": MAX_RESULTS,
                                               "matched": 0}, reply
        assert _audit_count(coord) == before
        assert _host_result_audit(coord) == []
        # A name that never sent a heartbeat gets no log line (nor memory) of its own.
        for name in ("never-seen-1", "never-seen-2"):
            status, reply = await agent.post("/api/host/results", {
                "host": name, "results": [{"id": "x", "ok": True}]})
            assert status == 200 and reply["matched"] == 0
        log = (coord.host.tmp / "daemon.log").read_text()
        assert log.count("answer no command sent to it") == 1, log[-2000:]
        assert f"host edge posted {MAX_RESULTS} command result(s)" in log
        # The command queued meanwhile still settles, and is audited with its outcome.
        status, beat = await agent.post("/api/host/heartbeat", {"host": "edge"})
        assert [c["id"] for c in beat["commands"]] == [queued["command_id"]]
        status, reply = await agent.post("/api/host/results", {"host": "edge", "results": [
            {"id": queued["command_id"], "ok": False, "error": "disk full"},
            {"id": "made-up-again", "ok": True}]})
        assert reply["matched"] == 1
        assert _host_result_audit(coord) == [("host.result:edge", queued["command_id"], 0)]
    finally:
        coord.stop()


def _audit_count(coord: Daemon) -> int:
    with sqlite3.connect(coord.host.state / "controlplane.db") as conn:
        count: int = conn.execute("SELECT count(*) FROM audit").fetchone()[0]
        return count


async def test_results_are_bounded_per_post(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """50,000 results in one post took 50,000 writes and audit rows (the audit keeps a fixed
    number, so the operator's own were pushed out) and held the writer for seconds."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        status, reply = await agent.post("/api/host/results", {
            "host": "edge", "results": [{"id": f"r{i}"} for i in range(MAX_RESULTS + 1)]})
        assert status == 400 and f"at most {MAX_RESULTS}" in reply["error"], reply
        with sqlite3.connect(coord.host.state / "controlplane.db") as conn:
            assert conn.execute("SELECT count(*) FROM audit WHERE action LIKE 'host.result:%'"
                                ).fetchone() == (0,)  # nothing changed
        status, reply = await agent.post("/api/host/results", {
            "host": "edge", "results": [{"id": f"r{i}"} for i in range(MAX_RESULTS)]})
        assert status == 200 and reply["received"] == MAX_RESULTS
    finally:
        coord.stop()


async def test_agent_hosts_are_bounded(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """One holder of the agent token could register any number of hosts, each with up to 500
    runners held in memory and listed in every snapshot (300 such made /api/hosts 22 MB)."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        for i in range(MAX_HOSTS):
            assert (await agent.post("/api/host/heartbeat", {"host": f"h{i}"}))[0] == 200
        status, reply = await agent.post("/api/host/heartbeat", {"host": "one-too-many"})
        assert status == 409 and f"{MAX_HOSTS} agent hosts" in reply["error"], reply
        names = {h["host"] for h in (await agent.hosts())["hosts"]}
        assert "one-too-many" not in names and len(names) == MAX_HOSTS + 1
        assert (await agent.post("/api/host/heartbeat", {"host": "h0"}))[0] == 200  # known
    finally:
        coord.stop()


async def test_heartbeat_replies_are_paged(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """Commands whose args outgrow a reply come in later replies, in order, so a real
    coordinator's answer stays far below the agent's limit on answers."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        await agent.post("/api/host/heartbeat", {"host": "edge", "runners": [{"name": "b-1"}]})
        pad = "x" * (REPLY_BUDGET * 2 // 3)
        ids = []
        for _ in range(3):
            status, reply = await agent.post("/api/action", {
                "id": "runner.drain", "args": {"name": "b-1", "note": pad}})
            assert status == 200 and reply["host"] == "edge", reply
            ids.append(reply["command_id"])
        got: list[str] = []
        queue = None
        while len(got) < 3:
            _, beat = await agent.post("/api/host/heartbeat", {
                "host": "edge", "queue": queue, "applied": len(got)})
            assert len(beat["commands"]) == 1  # one padded command fits a page, never two
            got += [c["id"] for c in beat["commands"]]
            queue = beat["queue"]
        assert got == ids
        await agent.post("/api/host/heartbeat", {"host": "edge", "queue": queue,
                                                 "applied": len(got),
                                                 "runners": [{"name": "b-1"}]})
        for _ in range(COMMANDS_PER_REPLY + 5):  # small ones: the count bounds a page too
            status, _ = await agent.post("/api/action", {"id": "runner.drain",
                                                         "args": {"name": "b-1"}})
            assert status == 200
        _, beat = await agent.post("/api/host/heartbeat", {
            "host": "edge", "queue": queue, "applied": len(got)})
        assert len(beat["commands"]) == COMMANDS_PER_REPLY
    finally:
        coord.stop()


async def test_odd_agent_bodies_change_nothing_on_the_coordinator(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """Held up: every odd body gets a 4xx with a sentence, and no host is recorded."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        raw = [b"[" * 100_000 + b"]" * 100_000, b'{"host": "\\ud800"}',
               b'{"host": "edge", "wait_s": NaN}', b'{"host": "edge", "wait_s": 1e400}',
               b'{"host": "edge", "applied": ' + b"9" * 5000 + b"}",
               b'{"host": "edge", "pad": "' + b"x" * (2 << 20) + b'"}', b"null", b"[]"]
        for body in raw:
            status, reply = await agent.post("/api/host/heartbeat", None, raw=body)
            assert status in (400, 413) and isinstance(reply["error"], str), (body[:40], reply)
        shaped = [{"host": name} for name in ("../edge", "a/b", "a\x00b", "x" * 101, "", None,
                                              5, ["edge"], {"name": "edge"}, "coord")]
        shaped += [{"host": "edge", **bad} for bad in (
            {"runners": None}, {"runners": {}}, {"runners": [None]},
            {"runners": [{"name": "../r"}]}, {"runners": [{"name": "r"}] * 501},
            {"wait_s": "5"}, {"wait_s": -1}, {"applied": "3"}, {"applied": 2**53},
            {"applied": True}, {"queue": "../x"}, {"queue": 7})]
        for body in shaped:
            status, reply = await agent.post("/api/host/heartbeat", body)
            assert status in (400, 409) and isinstance(reply["error"], str), (body, reply)
        for body in ({"host": "edge", "results": None}, {"host": "edge", "results": [None]},
                     {"host": "edge", "results": [{"id": 5}]}, {"host": "../e", "results": []}):
            status, reply = await agent.post("/api/host/results", body)
            assert status == 400, (body, reply)
        async with http.post(f"{coord.url}/api/host/heartbeat", json={"host": "edge"},
                             headers={"Authorization": "Bearer " + "0" * 64}) as resp:
            assert resp.status == 403
        assert [h["host"] for h in (await agent.hosts())["hosts"]] == ["coord"]
    finally:
        coord.stop()


async def test_one_host_name_is_one_agent_instance(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A second instance calling in under a name the first is using is refused, for heartbeats
    and results alike (it could settle the first's commands with its own outcomes), until the
    first has been silent for stale_after_s, and across a restart of the coordinator. Agents
    that send no instance (older versions) are not checked."""
    # Long enough that the restart below surely ends inside it on a loaded machine.
    env = {"FLEET_HOST_NAME": "coord", "FLEET_STALE_AFTER_S": "30"}
    coord = Daemon(Host(tmp_path, github), env)
    first, second = "a1" * 16, "b2" * 16
    try:
        agent = Agentish(coord, http)
        assert (await agent.post("/api/host/heartbeat", {"host": "edge", "instance": first}
                                 ))[0] == 200
        coord.stop()
        coord = Daemon(coord.host, env)
        agent = Agentish(coord, http)
        queued = await agent.queue_check("edge")
        status, reply = await agent.post("/api/host/heartbeat",
                                         {"host": "edge", "instance": second})
        assert status == 409 and "FLEET_HOST_NAME" in reply["error"], reply
        status, beat = await agent.post("/api/host/heartbeat",
                                        {"host": "edge", "instance": first})
        assert [c["id"] for c in beat["commands"]] == [queued["command_id"]]
        answer = {"id": queued["command_id"], "ok": True, "output": "from the clone"}
        status, reply = await agent.post("/api/host/results", {
            "host": "edge", "instance": second, "results": [answer]})
        assert status == 409, reply
        status, reply = await agent.post("/api/host/results", {
            "host": "edge", "instance": first, "results": [{**answer, "output": "disk ok"}]})
        assert status == 200 and reply["matched"] == 1
        for odd in ("not hex", "ab", 12, "ab" * 40):
            status, reply = await agent.post("/api/host/heartbeat",
                                             {"host": "edge", "instance": odd})
            assert status == 400 and "instance" in reply["error"], (odd, reply)
        assert (await agent.post("/api/host/heartbeat", {"host": "edge"}))[0] == 200  # older
        # The first falls silent (stale_after_s made 1 s, live): the name passes to the second,
        # and is then refused to the first.
        status, reply = await agent.post("/api/settings", {"key": "stale_after_s", "value": 1})
        assert status == 200, reply
        await asyncio.sleep(1.5)
        assert (await agent.post("/api/host/heartbeat", {"host": "edge", "instance": second}
                                 ))[0] == 200
        assert (await agent.post("/api/host/heartbeat", {"host": "edge", "instance": first}
                                 ))[0] == 409
    finally:
        coord.stop()


def _cli(host: Host, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet_min", "controlplane", *args],
                          env={**host.full_env(), "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


async def test_a_host_token_speaks_for_its_host_only(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """Whoever held the one agent token could report, and settle commands, under any host's
    name. A host token (`token --agent-host NAME` on the coordinator) speaks for NAME alone:
    a real agent runs on it, the same token under another name is refused, and an agent given
    another host's token refuses to start."""
    coord_host = Host(tmp_path / "coord", github)
    made = _cli(coord_host, "token", "--agent-host", "edge", "--state", str(coord_host.state))
    assert made.returncode == 0, made.stderr
    edge_token = made.stdout.strip()
    assert _cli(coord_host, "token", "--agent-host", "not a name", "--state", str(coord_host.state)
                ).returncode == 2
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord"})
    edge_host = Host(tmp_path / "edge", github)
    edge_host.state.mkdir(parents=True, exist_ok=True)
    (edge_host.state / "coordinator-token").write_text(edge_token + "\n")
    (edge_host.state / "coordinator-token").chmod(0o600)
    agent = Daemon(edge_host, {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "1"},
                   args=("--coordinator", coord.url))
    try:
        async def listed() -> bool:
            hosts = await Agentish(coord, http).hosts()
            return any(h["host"] == "edge" for h in hosts["hosts"])
        await until(listed, timeout=30)
        as_edge = {"Authorization": f"Bearer {edge_token}", "Content-Type": "application/json"}
        for path, body in (("/api/host/heartbeat", {"host": "other"}),
                           ("/api/host/results", {"host": "other", "results": []}),
                           ("/api/action", {"id": "health.check", "args": {"host": "edge"}})):
            async with http.post(f"{coord.url}{path}", json=body, headers=as_edge) as resp:
                assert resp.status == 403, (path, await resp.text())
                if path != "/api/action":
                    assert "host token of 'edge'" in (await resp.json())["error"]
        names = {h["host"] for h in (await Agentish(coord, http).hosts())["hosts"]}
        assert names == {"coord", "edge"}
        # A token that is not UTF-8 is a wrong token (it was a 500: the name could not be coded).
        address = coord.url.removeprefix("http://")
        reader, writer = await asyncio.open_connection(*address.rsplit(":", 1))
        writer.write(b"POST /api/host/heartbeat HTTP/1.1\r\nHost: " + address.encode()
                     + b"\r\nAuthorization: Bearer \xff~" + edge_token.split("~")[1].encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 16\r\n"
                     b"Connection: close\r\n\r\n" + b'{"host": "edge"}')
        assert (await reader.readline()).startswith(b"HTTP/1.1 403")
        writer.close()

        other_host = Host(tmp_path / "other", github)
        other_host.state.mkdir(parents=True, exist_ok=True)
        (other_host.state / "coordinator-token").write_text(edge_token + "\n")
        (other_host.state / "coordinator-token").chmod(0o600)
        refused = subprocess.run(
            [sys.executable, "-m", "fleet_min", "controlplane", "--port", "0", "--state",
             str(other_host.state), "--coordinator", coord.url],
            env={**other_host.full_env(), "PYTHONPATH": str(REPO_ROOT),
                 "FLEET_HOST_NAME": "other"},
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "host token of 'edge'" in refused.stderr, refused
    finally:
        agent.stop()
        coord.stop()


async def test_a_coordinator_set_to_host_tokens_refuses_the_shared_agent_token(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """The shared agent token speaks for any host name, so its holder can report and settle
    commands as any agent even where every agent has its own host token. With the live setting
    agent_tokens at host, the coordinator takes host tokens only: a real agent on the shared
    token is refused with a 403 that its own Hosts screen shows, a real agent on its host token
    carries on, and setting it back lets the first in again."""
    coord_host = Host(tmp_path / "coord", github)
    shared_host = Host(tmp_path / "shared", github)
    shared_token = agent_token(coord_host, shared_host)
    edge_host = Host(tmp_path / "edge", github)
    edge_host.state.mkdir(parents=True, exist_ok=True)
    made = _cli(coord_host, "token", "--agent-host", "edge", "--state", str(coord_host.state))
    (edge_host.state / "coordinator-token").write_text(made.stdout)
    (edge_host.state / "coordinator-token").chmod(0o600)
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord"})
    agents = {name: Daemon(host, {"FLEET_HOST_NAME": name, "FLEET_HEARTBEAT_S": "0.5"},
                           args=("--coordinator", coord.url))
              for name, host in (("shared", shared_host), ("edge", edge_host))}
    try:
        async def link(name: str) -> dict[str, Any]:
            async with http.get(f"{agents[name].url}/api/hosts") as resp:
                return dict((await resp.json())["hosts"][0]["coordinator"])

        async def both_heard() -> bool:
            states = [await link(name) for name in agents]
            return all(s["last_error"] is None and s["last_ok_at"] is not None for s in states)
        await until(both_heard, timeout=30)

        async def setting(value: str) -> None:
            async with http.post(f"{coord.url}/api/settings", headers=coord.headers(),
                                 json={"key": "agent_tokens", "value": value}) as resp:
                assert resp.status == 200, await resp.text()
        await setting("host")
        raw = {"Authorization": f"Bearer {shared_token}", "Content-Type": "application/json"}
        for path, body in (("/api/host/heartbeat", {"host": "edge"}),
                           ("/api/host/results", {"host": "edge", "results": []})):
            async with http.post(f"{coord.url}{path}", json=body, headers=raw) as resp:
                assert resp.status == 403, (path, await resp.text())
                assert "agent_tokens is host" in (await resp.json())["error"]

        async def shared_refused() -> bool:
            return "--agent-host" in ((await link("shared"))["last_error"] or "")
        await until(shared_refused, timeout=30)
        # The host-token agent is still heard after the refusal began.
        refused_since = (await link("shared"))["last_ok_at"]
        heard = (await link("edge"))["last_ok_at"]

        async def edge_heard_again() -> bool:
            return bool((await link("edge"))["last_ok_at"] != heard)
        await until(edge_heard_again, timeout=30)
        assert (await link("edge"))["last_error"] is None
        assert (await link("shared"))["last_ok_at"] == refused_since

        await setting("any")

        async def shared_back() -> bool:
            return (await link("shared"))["last_error"] is None
        await until(shared_back, timeout=30)
        with sqlite3.connect(coord_host.state / "controlplane.db") as conn:
            changes = [json.loads(args)["value"] for (args,) in conn.execute(
                "SELECT args FROM audit WHERE action = 'settings' ORDER BY id")]
        assert changes == ["host", "any"]
    finally:
        for agent in agents.values():
            agent.stop()
        coord.stop()


async def test_an_agent_token_made_while_the_coordinator_runs_is_good_at_once(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """`token --agent` on a running coordinator wrote a new agent token that the daemon did not
    know until it restarted: an agent given it (or a host token made from it) was refused as
    "the bearer token is wrong". The daemon now reads the file again when it changes."""
    coord_host = Host(tmp_path / "coord", github)
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord"})
    edge_host = Host(tmp_path / "edge", github)
    try:
        async def beat(token: str) -> int:
            async with http.post(f"{coord.url}/api/host/heartbeat", json={"host": "edge"},
                                 headers={"Authorization": f"Bearer {token}"}) as resp:
                return resp.status

        first = agent_token(coord_host, edge_host)  # made now, with the daemon running
        assert first != coord.token
        agent = Daemon(edge_host, {"FLEET_HOST_NAME": "edge", "FLEET_HEARTBEAT_S": "0.5"},
                       args=("--coordinator", coord.url))
        try:
            async def reported() -> bool:
                hosts = await Agentish(coord, http).hosts()
                return any(h["host"] == "edge" for h in hosts["hosts"])
            await until(reported, timeout=30)
        finally:
            agent.stop()
        host_token = _cli(coord_host, "token", "--agent-host", "edge", "--state",
                          str(coord_host.state)).stdout.strip()
        assert await beat(host_token) == 200
        # Rotated: the file replaced by a new token; the old one and its host tokens stop.
        (coord_host.state / "agent-token").unlink()
        second = agent_token(coord_host, edge_host)
        assert second != first
        assert (await beat(second), await beat(first), await beat(host_token)) == (200, 403, 403)
        # A loosened file is made the owner's again when it is read.
        (coord_host.state / "agent-token").chmod(0o644)
        assert await beat(second) == 200
        assert os.stat(coord_host.state / "agent-token").st_mode & 0o777 == 0o600
        # Removed: the control token is the agent token again, as at a start without the file.
        (coord_host.state / "agent-token").unlink()
        assert (await beat(second), await beat(coord.token)) == (403, 200)
    finally:
        coord.stop()


async def test_a_reports_free_form_parts_are_bounded(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """capacity and vitals were kept as sent: a megabyte of `[{}, {}, ...]` became some 24 MB
    of objects a host name (2.4 GB for a hundred names, parsed again at every start) and a
    100 MB GET /api/hosts. Only their known figures are kept, so neither has room for that;
    an agent's own are kept. `load` is at most the three load averages (a megabyte of numbers
    a name took 700 MB for 100 names)."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        status, _ = await agent.post("/api/host/heartbeat", {
            "host": "edge", "capacity": HONEST_CAPACITY, "vitals": {"x": [{}] * 200_000}})
        assert status == 200
        loads = ([0.5, 0.25, None], [1, 2, 3, 4], [True, 0, 0],
                 [0.5 + n / 1e6 for n in range(90_000)])
        for n, load in enumerate(loads):
            status, _ = await agent.post("/api/host/heartbeat", {"host": f"h{n}", "load": load})
            assert status == 200
        listed = {h["host"]: h for h in (await agent.hosts())["hosts"]}
        assert listed["edge"]["capacity"] == KEPT_CAPACITY and listed["edge"]["vitals"] is None
        assert listed["h0"]["load"] == [0.5, 0.25, None]
        assert listed["h1"]["load"] is None and listed["h2"]["load"] is None
        assert listed["h3"]["load"] is None
        coord.stop()
        coord = Daemon(coord.host, {"FLEET_HOST_NAME": "coord"})  # as kept in SQLite
        listed = {h["host"]: h for h in (await Agentish(coord, http).hosts())["hosts"]}
        assert listed["edge"]["capacity"] == KEPT_CAPACITY and listed["edge"]["vitals"] is None
        assert listed["h0"]["load"] == [0.5, 0.25, None] and listed["h3"]["load"] is None
    finally:
        coord.stop()


# An agent's own capacity (analysis/capacity.py) and what the coordinator keeps of it: the
# figures and why no runner fits; per_repo and limits are this host's business.
HONEST_CAPACITY = {"ceiling": 4, "runners": 2, "busy": 1, "idle": 1, "headroom": 2,
                   "busy_headroom": 3, "per_repo": {"octo/app": 2},
                   "limits": {"max_per_repo": 4}, "can_add": False,
                   "reasons": ["only 90 MiB of memory is available; the floor is 512 MiB"]}
KEPT_CAPACITY = {"ceiling": 4, "runners": 2, "busy": 1, "idle": 1, "headroom": 2,
                 "busy_headroom": 3, "can_add": False,
                 "reasons": ["only 90 MiB of memory is available; the floor is 512 MiB"]}
# What a figure must not be: an object whose String() throws, a list, text, a flag, an
# object in place of a number.
HOSTILE_FIGURES = [{"toString": None}, {"valueOf": None, "toString": None}, [1, 2], "12", "",
                   True, {"busy": 1}]
HONEST_VITALS = {"cores": 4, "mem_total_mb": 3906, "mem_available_mb": 2100,
                 "swap_total_mb": 0, "swap_used_mb": 0, "disk_free_gb": 20.5,
                 "disk_total_gb": 29.1, "load_per_core": 0.1, "uptime_s": 3600,
                 "load": [0.4, 0.3, 0.2],
                 "memory_pressure": {"some_avg10_pct": 0.0, "some_avg60_pct": 0.12}}
# Linux's pressure figures and macOS's are one shape: the other platform's are null.
KEPT_VITALS = {**HONEST_VITALS, "memory_pressure": {
    "some_avg10_pct": 0.0, "some_avg60_pct": 0.12, "pressure_pct": None}}


def _only_figures(part: dict[str, Any]) -> bool:
    """Every value a finite number or null (capacity's can_add a boolean or null)."""
    return all(value is None or (type(value) in (int, float) and abs(value) < 1e300)
               or (key == "can_add" and isinstance(value, bool))
               or (key == "reasons" and all(isinstance(r, str) and r.isprintable()
                                            and len(r) <= 300 for r in value))
               for key, value in part.items())


async def test_a_hostile_capacity_or_vitals_keeps_only_figures(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """`"capacity": {"busy": {"toString": null}}` was stored and served as sent, and the Hosts
    screen's String() of it threw on every render: no host was listed at all until the agent
    was forgotten. Each field is now a finite number or null (unknown fields dropped), as
    `load` already was; also for a report an older version stored as sent, at the next start."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        for n, odd in enumerate(HOSTILE_FIGURES):
            status, reply = await agent.post("/api/host/heartbeat", {
                "host": f"evil-{n}", "runners": [{"name": "r1", "repo": "octo/app"}],
                "capacity": {"busy": odd, "ceiling": 2, "html": "<b>x</b>", "can_add": odd,
                             "reasons": [odd, "\x1b[2J" + "r" * 1000] * 20},
                "vitals": {"cores": odd, "load": [odd, 0.5, 0.25], "memory_pressure": odd,
                           "uptime_s": 60, "extra": {"toString": None}}})
            assert status == 200, (odd, reply)
        status, _ = await agent.post("/api/host/heartbeat", {
            "host": "edge", "capacity": HONEST_CAPACITY, "vitals": HONEST_VITALS})
        assert status == 200

        def check(listed: dict[str, dict[str, Any]]) -> None:
            for n, odd in enumerate(HOSTILE_FIGURES):
                capacity, vitals = listed[f"evil-{n}"]["capacity"], listed[f"evil-{n}"]["vitals"]
                assert set(capacity) == {*KEPT_CAPACITY} and _only_figures(capacity), capacity
                assert (capacity["busy"], capacity["ceiling"], capacity["can_add"]) == (
                    None, 2, odd if odd is True else None)
                wanted = ["\\x1b[2J" + "r" * 293] * (10 if isinstance(odd, str) else 5)
                if isinstance(odd, str):  # a text among the reasons is a reason too
                    wanted = [odd, wanted[0]] * 5
                if n == 0:  # as stored by an older version and read back (below)
                    wanted = capacity["reasons"]
                assert capacity["reasons"] == wanted, capacity["reasons"]
                assert vitals["load"] is None and vitals["memory_pressure"] is None
                assert vitals["cores"] is None and vitals["uptime_s"] == 60
                assert "extra" not in vitals and _only_figures(
                    {k: v for k, v in vitals.items() if k not in ("load", "memory_pressure")})
            assert listed["edge"]["capacity"] == KEPT_CAPACITY
            assert listed["edge"]["vitals"] == KEPT_VITALS

        check({h["host"]: h for h in (await agent.hosts())["hosts"]})
        # A report stored as sent (an older version kept capacity and vitals verbatim) is
        # read back with its figures only.
        coord.stop()
        with sqlite3.connect(coord.host.state / "controlplane.db") as conn:
            stored = json.loads(conn.execute("SELECT report FROM hosts WHERE name = 'evil-0'")
                                .fetchone()[0])
            stored["capacity"] = {"busy": {"toString": None}, "ceiling": 2, "x": [{}] * 100}
            stored["vitals"] = {"cores": [1], "uptime_s": 60, "load": "high"}
            conn.execute("UPDATE hosts SET report = ? WHERE name = 'evil-0'",
                         (json.dumps(stored),))
        coord = Daemon(coord.host, {"FLEET_HOST_NAME": "coord"})
        listed = {h["host"]: h for h in (await Agentish(coord, http).hosts())["hosts"]}
        check(listed)
    finally:
        coord.stop()


async def test_a_newer_heartbeat_answers_the_one_held_before_it(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """Held heartbeats of one host had no bound: forty parallel ones, each holding its parsed
    body for 30 s, took a gigabyte. One agent sends one at a time, so a newer heartbeat makes
    the one held before it answer at once; the newest is still held, and a queued command
    still reaches it."""
    coord = start_coordinator(tmp_path, github)
    try:
        agent = Agentish(coord, http)
        assert (await agent.post("/api/host/heartbeat", {"host": "edge"}))[0] == 200
        held = [asyncio.ensure_future(agent.post("/api/host/heartbeat",
                                                 {"host": "edge", "wait_s": 30}))]
        for _ in range(3):
            await asyncio.sleep(0.5)  # each is held before the next arrives
            assert not held[-1].done()
            held.append(asyncio.ensure_future(agent.post("/api/host/heartbeat",
                                                         {"host": "edge", "wait_s": 30})))
            status, reply = await asyncio.wait_for(held[-2], 10)  # not its 30 s hold
            assert status == 200 and reply["commands"] == []
        await asyncio.sleep(0.5)
        assert not held[-1].done()
        queued = await agent.queue_check("edge")
        status, reply = await asyncio.wait_for(held[-1], 10)
        assert [c["id"] for c in reply["commands"]] == [queued["command_id"]]
    finally:
        coord.stop()


# --- what an agent's report makes the coordinator read, and keep ----------------------------

def _runner_listings(github: FakeGitHub, since: int = 0) -> list[str]:
    """The repositories whose runner list the coordinator asked GitHub for, in order (each
    refresh of a repository starts with it)."""
    return [path.split("/")[2] + "/" + path.split("/")[3] for _, path, _ in github.log[since:]
            if re.fullmatch(r"/repos/[^/]+/[^/]+/actions/runners\?.*", path)]


async def _own_rounds(github: FakeGitHub, since: int, rounds: int) -> None:
    """Until the coordinator has refreshed its own octo/app `rounds` times after `since`."""
    await until(lambda: _runner_listings(github, since).count("octo/app") >= rounds,
                timeout=30)


async def test_a_host_token_cannot_make_the_coordinator_read_other_repositories(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """Every repository an agent's runner named was watched: one heartbeat on a host token
    with 500 runners of victim/private-N made the coordinator read each one from GitHub with
    its own token (2,500 requests a round, its own repository waiting behind them) and serve
    what it read without a token. An agent's runner now makes its repository watched only
    when the coordinator watches it already or FLEET_AGENT_REPOS lists it; the rest are
    listed, named in the reply, and never asked for. Its own repositories go first."""
    coord_host = Host(tmp_path, github)
    coord_host.add_runner("a-1", repo="octo/app")
    for repo in ("aaa/tools", *(f"victim/private-{i}" for i in range(40))):
        github.repo(repo)
    made = _cli(coord_host, "token", "--agent-host", "evil", "--state", str(coord_host.state))
    assert made.returncode == 0, made.stderr
    listings: list[tuple[float, str]] = []  # when each runner list was asked for

    async def timed(request: web.Request) -> None:
        if re.fullmatch(r"/repos/[^/]+/[^/]+/actions/runners", request.path):
            listings.append((asyncio.get_running_loop().time(), request.path.split("/")[2]))
    github.hijack = timed
    # Rounds 2 s apart: a refresh's requests come milliseconds apart, rounds seconds apart.
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord", "FLEET_AGENT_REPOS": "aaa/tools",
                                "FLEET_GITHUB_S": "2"})
    try:
        await _own_rounds(github, 0, 1)
        before = len(github.log)
        victims = [f"victim/private-{i}" for i in range(40)]
        runners = [{"name": f"x{i}", "repo": repo} for i, repo in enumerate(victims)]
        runners += [{"name": "t1", "repo": "aaa/tools"}, {"name": "t2", "repo": "AAA/Tools"},
                    {"name": "o1", "repo": "Octo/App"}, {"name": "n1"}]
        async with http.post(f"{coord.url}/api/host/heartbeat",
                             json={"host": "evil", "runners": runners},
                             headers={"Authorization": f"Bearer {made.stdout.strip()}"}) as resp:
            assert resp.status == 200, await resp.text()
            reply = await resp.json()
        # The allow-listed repository is watched (in the list's spelling, once) ...
        await until(lambda: "aaa/tools" in _runner_listings(github, before), timeout=30)
        await _own_rounds(github, before, 3)
        asked = {path for _, path, _ in github.log[before:]}
        assert not [p for p in asked if "victim" in p.lower()], sorted(asked)[:5]
        assert reply["unwatched_repos"] == sorted(victims), reply
        assert (reply["runners_kept"], reply["runners_dropped"]) == (len(runners), 0)
        assert not [p for p in asked if "/AAA/" in p or "/Octo/" in p]
        # ... always after the coordinator's own, in each round (though "aaa" sorts first).
        rounds = [[listings[0][1]]]
        for (was, _), (at, owner) in itertools.pairwise(listings):
            if at - was > 1.0:
                rounds.append([])
            rounds[-1].append(owner)
        assert ["octo", "aaa"] in rounds and all(r in (["octo"], ["octo", "aaa"])
                                                 for r in rounds), rounds
        state = await (await http.get(f"{coord.url}/api/state")).json()
        assert sorted(state["github"]["repos"]) == ["aaa/tools", "octo/app"]
        shown = [r["name"] for r in state["runners"] if r["host"] == "evil"]
        assert len(shown) == len(runners)  # listed as that host's runners all the same
        async with http.get(f"{coord.url}/api/repo", params={"name": victims[7]}) as resp:
            assert resp.status == 404, await resp.text()
        evil = next(h for h in (await Agentish(coord, http).hosts())["hosts"]
                    if h["host"] == "evil")
        assert evil["unwatched_repos"] == sorted(victims)
    finally:
        coord.stop()


async def test_a_stale_hosts_repositories_stop_being_watched(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A host's repositories stayed watched for the 7 days its report is kept, long after it
    fell silent (and across restarts). They are watched while it is heard from (within
    stale_after_s) and no longer: the host and its runners are still listed, as stale."""
    coord_host = Host(tmp_path, github)
    coord_host.add_runner("a-1", repo="octo/app")
    github.repo("octo/lib")
    coord = Daemon(coord_host, {"FLEET_HOST_NAME": "coord", "FLEET_AGENT_REPOS": "octo/lib",
                                "FLEET_STALE_AFTER_S": "3"})
    try:
        agent = Agentish(coord, http)
        status, _ = await agent.post("/api/host/heartbeat", {
            "host": "edge", "runners": [{"name": "b-1", "repo": "octo/lib"}]})
        assert status == 200

        async def watched() -> list[str]:
            async with http.get(f"{coord.url}/api/state") as resp:
                return sorted((await resp.json())["github"]["repos"])
        await until(lambda: "octo/lib" in _runner_listings(github), timeout=30)
        hosts = await until(lambda: _stale(agent), timeout=30)
        assert [r["name"] for r in hosts["edge"]["runners"]] == ["b-1"]
        await until(lambda: _is(watched(), ["octo/app"]), timeout=30)
        since = len(github.log)
        await _own_rounds(github, since, 4)
        assert "octo/lib" not in _runner_listings(github, since)
        # Heard from again: watched again.
        await agent.post("/api/host/heartbeat", {
            "host": "edge", "runners": [{"name": "b-1", "repo": "octo/lib"}]})
        await until(lambda: "octo/lib" in _runner_listings(github, since), timeout=30)
    finally:
        coord.stop()


async def _stale(agent: Agentish) -> dict[str, Any] | None:
    hosts = {h["host"]: h for h in (await agent.hosts())["hosts"]}
    return hosts if hosts.get("edge", {}).get("stale") else None


async def _is(value: Awaitable[Any], expected: Any) -> bool:
    return bool(await value == expected)


async def test_remote_runners_are_bounded_across_hosts(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """100 host names of 500 runners each (all a holder of the agent token needs) made every
    snapshot 18.7 MB and stalled the loop a quarter second a tick. The coordinator keeps
    MAX_REMOTE_RUNNERS of them across its hosts: a report past the room the others leave keeps
    its first runners, and the reply and the hosts list say how many were dropped. A runner's
    labels are bounded as a whole, and a restart keeps the bound."""
    coord = start_coordinator(tmp_path, github)
    labels = [f"L{j:02d}" + "x" * 10 for j in range(10)]

    def report(host: str, count: int, first: int = 0) -> dict[str, Any]:
        return {"host": host, "runners": [
            {"name": f"r{i}", "repo": "octo/app", "labels": labels, "state": "idle",
             "owner": "o", "version": "v", "registration": "registered"}
            for i in range(first, first + count)]}
    full = MAX_REMOTE_RUNNERS // MAX_RUNNERS
    try:
        agent = Agentish(coord, http)
        for i in range(full):
            status, reply = await agent.post("/api/host/heartbeat", report(f"h{i}", MAX_RUNNERS))
            assert status == 200, reply
        status, late = await agent.post("/api/host/heartbeat", report("late", MAX_RUNNERS))
        assert status == 200  # still heard: its commands flow, its runners are not kept

        async def remote_count() -> tuple[int, int]:
            async with http.get(f"{coord.url}/api/state") as resp:
                body = await resp.read()
            return sum(r["remote"] for r in json.loads(body)["runners"]), len(body)
        listed = {h["host"]: h for h in (await agent.hosts())["hosts"]}
        assert sum(len(h["runners"]) for h in listed.values() if not h["local"]) \
            == MAX_REMOTE_RUNNERS and listed["late"]["runners"] == []
        assert (late["runners_kept"], late["runners_dropped"]) == (0, MAX_RUNNERS), late
        # A host already kept keeps its own room.
        status, reply = await agent.post("/api/host/heartbeat", report("h0", MAX_RUNNERS, 1))
        assert (reply["runners_kept"], reply["runners_dropped"]) == (MAX_RUNNERS, 0)
        # Room given back goes to the next report, its first runners in its own order.
        await agent.post("/api/host/heartbeat", report("h1", 100))
        status, reply = await agent.post("/api/host/heartbeat", report("late", MAX_RUNNERS))
        assert (reply["runners_kept"], reply["runners_dropped"]) == (400, 100)
        listed = {h["host"]: h for h in (await agent.hosts())["hosts"]}
        assert listed["late"]["dropped_runners"] == 100 and listed["h1"]["dropped_runners"] == 0
        assert [r["name"] for r in listed["late"]["runners"]] == [f"r{i}" for i in range(400)]
        await until(lambda: _counted(remote_count()), timeout=10)  # the snapshot, bounded
        count, size = await remote_count()
        assert count == MAX_REMOTE_RUNNERS and size < 1_500_000, (count, size)

        # A runner's labels: kept in order while they fit MAX_LABEL_CHARS together.
        await agent.post("/api/host/heartbeat", {"host": "h1", "runners": [
            {"name": "wide", "labels": [f"{j:03d}" + "y" * 97 for j in range(50)]}]})
        listed = {h["host"]: h for h in (await agent.hosts())["hosts"]}
        kept = listed["h1"]["runners"][0]["labels"]
        assert kept == [f"{j:03d}" + "y" * 97 for j in range(MAX_LABEL_CHARS // 100)]

        # Reports kept beyond the bound (by an older version) are cut to it at the next start,
        # the hosts heard from last keeping theirs first.
        coord.stop()
        with sqlite3.connect(coord.host.state / "controlplane.db") as conn:
            conn.execute("UPDATE hosts SET report = ?, last_seen = last_seen + 1 WHERE "
                         "name = 'h1'", (json.dumps(clean_report(report("h1", MAX_RUNNERS))),))
            conn.execute("UPDATE hosts SET report = ?, last_seen = (SELECT min(last_seen) "
                         "FROM hosts) - 1 WHERE name = 'late'",
                         (json.dumps(clean_report(report("late", MAX_RUNNERS))),))
        coord = Daemon(coord.host, {"FLEET_HOST_NAME": "coord"})
        listed = {h["host"]: h for h in (await Agentish(coord, http).hosts())["hosts"]}
        assert sum(len(h["runners"]) for h in listed.values() if not h["local"]) \
            == MAX_REMOTE_RUNNERS
        assert len(listed["h1"]["runners"]) == MAX_RUNNERS
        assert (len(listed["late"]["runners"]), listed["late"]["dropped_runners"]) == (
            0, MAX_RUNNERS)
    finally:
        coord.stop()


async def _counted(value: Awaitable[tuple[int, int]]) -> bool:
    return (await value)[0] == MAX_REMOTE_RUNNERS


def test_a_runner_field_that_would_redraw_the_page_is_not_kept() -> None:
    """An agent's runner names its owner, state, version and labels in its own words: one
    holding a control character or a direction override (which would reorder the Hosts page
    after it) is not kept, while right-to-left text is."""
    kept = clean_report({"runners": [{
        "name": "r1", "owner": "octo\u202etac", "state": "idle\x1b[2K", "version": "2.320.0",
        "labels": ["self-hosted", "lin\u2066ux", "\u05de\u05e2\u05d1\u05d3\u05d4"]}]})
    (runner,) = kept["runners"]
    assert (runner["owner"], runner["state"], runner["version"]) == (None, None, "2.320.0")
    assert runner["labels"] == ["self-hosted", "\u05de\u05e2\u05d1\u05d3\u05d4"]


async def test_a_queue_id_not_of_the_coordinators_shape_is_neither_taken_nor_kept(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """A queue id is sent back with every heartbeat and kept across restarts: one a wrong or
    hostile server gave once ("NOT-A-QUEUE") had every heartbeat to the real coordinator refused
    with a 400, for good. Only the coordinator's shape (hex) is taken, and one kept from before
    that is not of it is dropped at start."""
    async def answer(_request: web.Request, _n: int) -> web.StreamResponse:
        return web.json_response({"ok": True, "queue": "NOT-A-QUEUE", "commands": []})
    host = Host(tmp_path, github)
    fake = await agent_until(host, answer, lambda fake: fake.heartbeats() >= 3)
    sent = [json.loads(body)["queue"] for path, _, body in fake.calls
            if path == "/api/host/heartbeat"]
    assert set(sent) == {None}, sent
    with sqlite3.connect(host.state / "controlplane.db") as conn:
        conn.execute("INSERT INTO link_state (queue, applied, updated_at) "
                     "VALUES ('NOT-A-QUEUE', 5, 4102444800)")  # what an older agent kept
    async def good(_request: web.Request, _n: int) -> web.StreamResponse:
        return web.json_response(GOOD)
    fake = await agent_until(host, good, lambda fake: fake.heartbeats() >= 2)
    bodies = [json.loads(body) for path, _, body in fake.calls if path == "/api/host/heartbeat"]
    assert (bodies[0]["queue"], bodies[0]["applied"]) == (None, 0)
    assert bodies[1]["queue"] == QUEUE


async def test_a_coordinators_command_acts_on_the_agents_own_runners_only(
        tmp_path: Path, github: FakeGitHub, http: aiohttp.ClientSession) -> None:
    """An agent with agents of its own ran a coordinator's command for a runner only one of
    those reports through its action path, which queued it on to that agent: a deregister
    with delete_dir went down a tier the coordinator has no token for."""
    mid = Host(tmp_path / "mid", github)
    mid.add_runner("m-1")
    token = subprocess.run(
        [sys.executable, "-m", "fleet_min", "controlplane", "token", "--agent", "--state",
         str(mid.state)], env={**mid.full_env(), "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT,
        capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    armed, results = asyncio.Event(), []
    commands = [{"id": "c1", "seq": 1, "action": "runner.deregister",
                 "args": {"name": "x-1", "delete_dir": True}}]

    async def answer(request: web.Request, _n: int) -> web.StreamResponse:
        body = await request.json()
        if request.path.endswith("/results"):
            results.extend(body["results"])
            return web.json_response({"ok": True})
        return web.json_response({**GOOD, "commands": commands if armed.is_set() else []})
    async with fake_coordinator(answer) as fake:
        (mid.state / "coordinator-token").write_text("c" * 64 + "\n")
        (mid.state / "coordinator-token").chmod(0o600)
        agent = Daemon(mid, {"FLEET_HOST_NAME": "mid", "FLEET_HEARTBEAT_S": "1"},
                       args=("--coordinator", fake.url))
        try:
            beat = {"host": "sub", "instance": "cd" * 16, "role": "agent", "wait_s": 0,
                    "runners": [{"name": "x-1", "repo": "octo/lib", "state": "idle"}]}
            auth = {"Authorization": f"Bearer {token}"}
            async with http.post(f"{agent.url}/api/host/heartbeat", json=beat,
                                 headers=auth) as resp:
                assert resp.status == 200, await resp.text()
            armed.set()
            await until(lambda: results, timeout=20)
            assert results[0]["id"] == "c1" and results[0]["ok"] is False
            assert results[0]["error"].startswith("no runner named 'x-1' on this host mid")
            async with http.get(f"{agent.url}/api/hosts") as resp:
                assert (await resp.json())["commands"] == []  # nothing queued on to "sub"
        finally:
            agent.stop()
