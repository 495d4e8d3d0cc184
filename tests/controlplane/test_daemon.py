"""End to end: `python -m fleet_min controlplane` as a real process on a fake host.

Every route, and every row of the spec's authentication and error tables, is exercised here
against the real daemon, with fake runners, the fake systemctl and the fake GitHub API.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import stat
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest

from tests.support import cp_fakes as fakes
from tests.support.controlplane import REPO_ROOT, Host, until

pytestmark = pytest.mark.slow


async def get_json(http: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with http.get(url, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


async def post_json(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any
                    ) -> tuple[int, Any]:
    async with http.post(url, json=body, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


async def runner_state(http: aiohttp.ClientSession, base: str, name: str) -> dict[str, Any] | None:
    _, snap = await get_json(http, f"{base}/api/state")
    return next((r for r in snap.get("runners", []) if r["name"] == name), None)


async def test_daemon_serves_every_route_and_drives_real_listeners(
        host: Host, daemon_factory: Any, http: aiohttp.ClientSession) -> None:
    host.add_runner("r1", labels=["linux"])
    pid = host.start_unit("r1")
    d = daemon_factory()
    base = d.url
    token_file = host.state / "control-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(d.token) == 64

    async with http.get(f"{base}/") as resp:
        assert resp.status == 200 and "default-src 'none'" in resp.headers[
            "Content-Security-Policy"]
    async with http.get(f"{base}/public/app.js") as resp:
        assert resp.status == 200
    view = await until(lambda: _registered(http, base, "r1"))
    assert view["listener"]["pid"] == pid and view["state"] == "idle"
    for path in ("/api/queue-causes", "/api/actions", "/api/settings", "/api/hosts",
                 "/api/runner?name=r1"):
        status, _ = await get_json(http, base + path)
        assert status == 200, path
    async with http.get(f"{base}/api/stream") as resp:
        line = b""
        while not line.startswith(b"data: "):
            line = await resp.content.readline()
        assert json.loads(line[6:])["runners"][0]["name"] == "r1"

    # drain: the listener process really stops; resume: a new one really starts
    status, body = await post_json(http, f"{base}/api/action",
                                   {"id": "runner.drain", "args": {"name": "r1"}},
                                   headers=d.headers())
    assert status == 200 and body["ok"] and body["command"].startswith("systemctl --user stop")
    assert not fakes.pid_alive(pid)
    status, body = await post_json(http, f"{base}/api/action",
                                   {"id": "runner.resume", "args": {"name": "r1"}},
                                   headers=d.headers())
    assert status == 200 and body["ok"]
    new_pid = host.wait_listener("r1")
    assert new_pid != pid

    # duplicate through the real daemon: config.sh, unit install, start
    status, body = await post_json(http, f"{base}/api/action",
                                   {"id": "runner.duplicate", "args": {"name": "r1"}},
                                   headers=d.headers())
    assert status == 200 and body["ok"], body
    host.wait_listener("r1-2")
    dup = await until(lambda: _registered(http, base, "r1-2"))
    assert "linux" in dup["labels"]

    status, body = await post_json(http, f"{base}/api/settings",
                                   {"key": "ceiling", "value": 9}, headers=d.headers())
    assert (status, body["value"]) == (200, 9)
    async with http.get(f"{base}/api/runner/bundle?name=r1", headers=d.headers()) as resp:
        assert resp.status == 200 and "bundle for runner r1" in await resp.text()
    status, body = await post_json(http, f"{base}/api/action",
                                   {"id": "health.check", "args": {}}, headers=d.headers())
    assert status == 200 and "disk ok" in body["output"]

    started = time.monotonic()
    assert d.stop() == 0 and time.monotonic() - started < 10


async def _registered(http: aiohttp.ClientSession, base: str, name: str) -> dict[str, Any] | None:
    view = await runner_state(http, base, name)
    return view if view and view["registration"] == "registered" else None


CONTROL_ROUTES = [("POST", "/api/action", {"id": "runner.drain", "args": {"name": "ghost"}}),
                  ("POST", "/api/settings", {"key": "tick_s", "value": 0.5}),
                  ("GET", "/api/runner/bundle?name=r1", None)]
AGENT_ROUTES = [("POST", "/api/host/heartbeat", {"host": "pi-1"}),
                ("POST", "/api/host/results", {"host": "pi-1", "results": []})]
OPEN_ROUTES = ["/api/state", "/api/stream", "/api/runner?name=r1", "/api/queue-causes",
               "/api/actions", "/api/settings", "/api/hosts", "/", "/public/app.css"]


async def _call(http: aiohttp.ClientSession, method: str, url: str, body: Any,
                headers: dict[str, str]) -> tuple[int, Any]:
    async with http.request(method, url, json=body, headers=headers) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, None


async def test_authentication_table(host: Host, daemon_factory: Any,
                                    http: aiohttp.ClientSession) -> None:
    host.add_runner("r1")
    agent = subprocess.run([sys.executable, "-m", "fleet_min", "controlplane", "token",
                            "--agent", "--state", str(host.state)], capture_output=True,
                           text=True, check=True, env={**host.full_env(),
                                                       "PYTHONPATH": str(REPO_ROOT)},
                           cwd=REPO_ROOT).stdout.strip()
    d = daemon_factory()
    base = d.url
    good = d.headers()
    wrong = {"Authorization": "Bearer " + "0" * 64}
    same = base.removeprefix("http://")
    for method, path, body in CONTROL_ROUTES + AGENT_ROUTES:
        status, reply = await _call(http, method, base + path, body, {})
        assert status == 401 and "Bearer" in reply["error"], path           # missing token
        status, reply = await _call(http, method, base + path, body, wrong)
        assert status == 403 and reply["error"] == "the bearer token is wrong", path
        for cross in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            status, reply = await _call(http, method, base + path, body, {**good, **cross})
            assert status == 403 and "cross-origin" in reply["error"], (path, cross)
        status, _ = await _call(http, method, base + path, body,
                                {**good, "Origin": f"http://{same}",
                                 "Sec-Fetch-Site": "same-origin"})
        assert status in (200, 404), path  # passes auth (404: the ghost runner)
    for method, path, body in AGENT_ROUTES:
        status, reply = await _call(http, method, base + path, body,
                                    {"Authorization": f"Bearer {agent}"})
        assert status == 200 and reply["ok"], path
    for method, path, body in CONTROL_ROUTES:  # the agent token is no control token
        status, _ = await _call(http, method, base + path, body,
                                {"Authorization": f"Bearer {agent}"})
        assert status == 403, path
    for path in OPEN_ROUTES:
        async with http.get(base + path) as resp:
            assert resp.status == 200, path


async def test_error_table(host: Host, daemon_factory: Any, http: aiohttp.ClientSession) -> None:
    host.add_runner("r1")
    d = daemon_factory({"FLEET_MAX_JSON_BYTES": "4096"})
    base, good = d.url, d.headers()
    cases: list[tuple[int, str, str, Any, dict[str, str] | None]] = [
        (400, "GET", "/api/runner", None, None),
        (400, "GET", "/api/runner?name=..%2Fetc", None, None),
        (400, "POST", "/api/action", {"id": "nope", "args": {}}, good),
        (400, "POST", "/api/settings", {"key": "ceiling", "value": -1}, good),
        (401, "POST", "/api/action", {"id": "health.check", "args": {}}, None),
        (403, "POST", "/api/action", {"id": "health.check", "args": {}},
         {"Authorization": "Bearer nope"}),
        (404, "GET", "/api/runner?name=ghost", None, None),
        (404, "POST", "/api/action", {"id": "runner.drain", "args": {"name": "ghost"}}, good),
        (404, "GET", "/api/nothing-here", None, None),
        (404, "GET", "/public/../../pyproject.toml", None, None),
        (405, "DELETE", "/api/state", None, None),
    ]
    for status, method, path, body, headers in cases:
        got, reply = await _call(http, method, base + path, body, headers or {})
        assert got == status, (path, reply)
        assert isinstance(reply["error"], str) and set(reply) <= {"error", "ok"}, reply
    async with http.post(f"{base}/api/action", data=b"{not json", headers=good) as resp:
        assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]
    big = {"id": "health.check", "args": {"pad": "x" * 10_000}}
    got, reply = await _call(http, "POST", base + "/api/action", big, good)
    assert got == 413 and "limit" in reply["error"]
    # 500: someone drops a table under the running daemon (a hand-edited or half-restored
    # database); the client gets the generic sentence, never a traceback.
    with sqlite3.connect(host.state / "controlplane.db") as conn:
        conn.execute("DROP TABLE events")
    got, reply = await _call(http, "GET", base + "/api/runner?name=r1", None, {})
    assert got == 500 and reply == {"error": "internal error; the service log has the details"}


async def test_stream_holds_hundreds_of_clients(host: Host, daemon_factory: Any) -> None:
    host.add_runner("r1")
    d = daemon_factory()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def first_two_events() -> int:
            got = 0
            async with session.get(f"{d.url}/api/stream") as resp:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        got += 1
                        if got == 2:
                            return got
            return got

        results = await asyncio.wait_for(
            asyncio.gather(*(first_two_events() for _ in range(250))), 30)
    assert results == [2] * 250


async def test_read_only_daemon(host: Host, daemon_factory: Any,
                                http: aiohttp.ClientSession) -> None:
    host.add_runner("r1")
    d = daemon_factory({"FLEET_READ_ONLY": "1"})
    assert not (host.state / "control-token").exists()
    status, _ = await get_json(http, f"{d.url}/api/state")
    assert status == 200
    for method, path, body in CONTROL_ROUTES:
        status, reply = await _call(http, method, d.url + path, body, {})
        assert (status, reply) == (403, {"error": "this daemon is running read-only"})


async def test_token_rotation_and_cli(host: Host, daemon_factory: Any,
                                      http: aiohttp.ClientSession) -> None:
    env = {**host.full_env(), "PYTHONPATH": str(REPO_ROOT)}
    cli = [sys.executable, "-m", "fleet_min", "controlplane", "token", "--state", str(host.state)]
    printed = subprocess.run(cli, capture_output=True, text=True, env=env, check=True,
                             cwd=REPO_ROOT).stdout.strip()
    d = daemon_factory()
    assert d.token == printed
    d.stop()
    (host.state / "control-token").unlink()
    d2 = daemon_factory()
    assert d2.token != printed and len(d2.token) == 64
    status, _ = await post_json(http, f"{d2.url}/api/settings", {"key": "ceiling", "value": 3},
                                headers={"Authorization": f"Bearer {printed}"})
    assert status == 403
    status, body = await get_json(http, f"{d2.url}/api/settings")
    assert {s["key"]: s["source"] for s in body["settings"]}["ceiling"] == "env"


def test_bad_configuration_exits_2(host: Host) -> None:
    env = {**host.full_env(), "PYTHONPATH": str(REPO_ROOT), "FLEET_CEILING": "0"}
    result = subprocess.run([sys.executable, "-m", "fleet_min", "controlplane", "--port", "0"],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=30)
    assert result.returncode == 2 and "FLEET_CEILING" in result.stderr
    env["FLEET_CEILING"] = "2"
    env["FLEET_READ_ONLY"] = "perhaps"
    result = subprocess.run([sys.executable, "-m", "fleet_min", "controlplane", "--port", "0"],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=30)
    assert result.returncode == 2 and "FLEET_READ_ONLY" in result.stderr
    assert os.path.exists(REPO_ROOT / "fleet_min" / "controlplane" / "cli.py")
