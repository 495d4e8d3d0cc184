"""No web page elsewhere can read or drive the control plane (port 7878 on loopback).

- DNS rebinding: a Host that is not an IP address, localhost, this machine's name or a name in
  FLEET_ALLOWED_HOSTS gets 421 (the UI, the snapshot and the stream included: a rebound page
  would read them as its own).
- Cross-site writes: every change refuses a foreign Origin (403, token or not) and a body of a
  type a page can send without a preflight (415), the token-free POST /api/simulate too.

A real daemon process over real HTTP for each rule, the in-process app for the rest.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from tests.support import raw_http
from tests.support.controlplane import Host, auth, cp_of

SETTING = "add it to FLEET_ALLOWED_HOSTS"
JSON = {"Content-Type": "application/json"}
SIMPLE_TYPES = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=b"]


def body(value: Any) -> bytes:
    return json.dumps(value).encode()


@pytest.mark.slow
def test_a_real_daemon_checks_host_origin_and_body_type(host: Host,
                                                        daemon_factory: Any) -> None:
    daemon = daemon_factory({"FLEET_ALLOWED_HOSTS": "cp.lan,*.tunnel.test"})
    url, token = daemon.url, daemon.headers()
    port = url.rsplit(":", 1)[1]

    # Host: IP literals, localhost, this machine and the listed names; nothing else.
    for name in (f"127.0.0.1:{port}", f"localhost:{port}", f"cp.lan:{port}",
                 f"me.tunnel.test:{port}", socket.gethostname()):
        assert raw_http.ask(url, "GET", "/api/state", host=name)[0] == 200, name
    for path in ("/", "/api/state", "/api/settings", "/openapi.json"):
        status, reply = raw_http.ask(url, "GET", path, host=f"evil.example:{port}")
        assert status == 421, path
        assert reply == {"error": "this control plane does not answer to the name "
                                  f"'evil.example'; {SETTING} if agents or browsers reach it "
                                  "by that name"}
    status, _ = raw_http.ask(url, "POST", "/api/settings", {**JSON, **token},
                             body({"key": "tick_s", "value": 9}), host="evil.example")
    assert status == 421

    # Body types: refused with the right token too; JSON passes.
    change = body({"key": "tick_s", "value": 8})
    for content_type in SIMPLE_TYPES:
        status, reply = raw_http.ask(url, "POST", "/api/settings",
                                     {"Content-Type": content_type, **token}, change)
        assert status == 415 and "send the body as application/json" in reply["error"]
    assert raw_http.ask(url, "POST", "/api/settings", token, change)[0] == 415  # no type
    status, reply = raw_http.ask(url, "POST", "/api/simulate", {"Content-Type": "text/plain"},
                                 body({"repo": "octo/app"}))
    assert status == 415, reply

    # Origin: a foreign page is refused whatever it carries.
    for foreign in ("http://evil.example", "null", "http://127.0.0.1:1"):
        status, reply = raw_http.ask(url, "POST", "/api/settings",
                                     {**JSON, **token, "Origin": foreign}, change)
        assert status == 403 and "cross-origin" in reply["error"], foreign
    settings = raw_http.ask(url, "GET", "/api/settings")[1]["settings"]
    assert next(s for s in settings if s["key"] == "tick_s")["source"] != "stored"

    status, reply = raw_http.ask(url, "POST", "/api/settings",
                                 {**JSON, **token, "Origin": url}, change)
    assert status == 200 and reply["value"] == 8


async def test_every_change_refuses_a_foreign_page(client: Any) -> None:
    cp = cp_of(client)
    agent = {"Authorization": f"Bearer {cp.agent_token}"}
    changes = [("/api/action", {"id": "health.check", "args": {}}, auth(cp)),
               ("/api/settings", {"key": "tick_s", "value": 5}, auth(cp)),
               ("/api/simulate", {"repo": "octo/app"}, {}),
               ("/api/host/heartbeat", {"host": "agent-1", "runners": []}, agent),
               ("/api/host/results", {"host": "agent-1", "results": []}, agent)]
    for path, value, token in changes:
        for foreign in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                        {"Sec-Fetch-Site": "cross-site"}):
            resp = await client.post(path, json=value, headers={**token, **foreign})
            assert resp.status == 403, (path, foreign)
        for content_type in SIMPLE_TYPES:
            resp = await client.post(path, data=json.dumps(value),
                                     headers={**token, "Content-Type": content_type})
            assert resp.status == 415, (path, content_type)
            assert "application/json" in (await resp.json())["error"]
    assert cp.live.source("tick_s") != "stored"


async def test_reads_answer_only_known_names(client: Any) -> None:
    for path in ("/", "/api/state", "/api/runner?name=r1", "/public/app.js"):
        resp = await client.get(path, headers={"Host": "rebound.example"})
        assert resp.status == 421, path
        assert "'rebound.example'" in (await resp.json())["error"]
    for name in ("127.0.0.1", "[::1]:7878", "localhost", "ui.localhost:7878"):
        resp = await client.get("/api/state", headers={"Host": name})
        assert resp.status == 200, name


async def test_a_bodiless_change_needs_no_type(client: Any) -> None:
    cp = cp_of(client)
    resp = await client.post("/api/settings", headers=auth(cp))  # no body, no type: not a 415
    assert resp.status == 400 and "JSON body" in (await resp.json())["error"]


async def test_a_foreign_page_cannot_make_the_daemon_build_reads(client: Any) -> None:
    """A page on another site cannot read an answer (no CORS headers), but its no-cors GETs
    still had the daemon build them: twenty analytics reads at once were gigabytes. API reads
    asked for by another page are refused; the daemon's own pages, an address typed, and
    clients that are not browsers are answered."""
    for path in ("/api/analytics?days=30", "/api/state", "/api/hosts"):
        for foreign in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                        {"Origin": "http://evil.example"},
                        {"Referer": "http://evil.example/page"}):
            resp = await client.get(path, headers=foreign)
            assert resp.status == 403 and "cross-origin" in (await resp.json())["error"], (
                path, foreign)
        for own in ({}, {"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}):
            assert (await client.get(path, headers=own)).status == 200, (path, own)
    # A page of its own is still reached from a link elsewhere.
    assert (await client.get("/", headers={"Sec-Fetch-Site": "cross-site"})).status == 200


@pytest.mark.slow
def test_a_real_daemon_answers_an_unreadable_request_in_json(daemon_factory: Any) -> None:
    """aiohttp answers what it cannot parse itself (text/plain quoting the bytes); the control
    plane's answer is its own JSON error with the security headers, nothing echoed."""
    daemon = daemon_factory({})
    for data in (b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: \x01<script>\r\n\r\n",
                 b"G<script> /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):
        reply = raw_http.reply_of(raw_http.raw_exchange(daemon.url, data))
        assert reply.status == 400 and reply.media == "application/json", reply
        assert reply.json()["error"].startswith("the request could not be read as HTTP/1.1: ")
        assert reply.headers["X-Content-Type-Options"] == "nosniff", reply
        assert b"script" not in reply.body
    assert raw_http.ask(daemon.url, "GET", "/api/state")[0] == 200
