"""The API through aiohttp's test client, on a fake host: routes, actions, settings, bundles.

Real parts throughout: runner directories, the fake systemctl starting real listener processes,
the fake GitHub API server, a real SQLite file. The auth and error tables are also run against a
real daemon process in test_daemon.py.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from typing import Any

from fleet_min.controlplane.http.app import create_app
from tests.support import cp_fakes as fakes
from tests.support.collector import ROOT as REPO_ROOT
from tests.support.controlplane import Host, auth, cp_of, make_config, until

SECRET_LINE = ("[2026-01-01 00:00:00Z ERR  Runner] auth failed "
               "token=ghp_abcdefghijklmnopqrstuvwxyz0123456789")


async def act(client: Any, action: str, **args: Any) -> tuple[int, dict[str, Any]]:
    resp = await client.post("/api/action", json={"id": action, "args": args},
                             headers=auth(cp_of(client)))
    return resp.status, await resp.json()


async def state(client: Any) -> dict[str, Any]:
    return await (await client.get("/api/state")).json()


async def runner_view(client: Any, name: str) -> dict[str, Any] | None:
    return next((r for r in (await state(client))["runners"] if r["name"] == name), None)


# --- pages and static files ------------------------------------------------------------------

async def test_index_and_public_files(client: Any) -> None:
    resp = await client.get("/")
    assert resp.status == 200 and "text/html" in resp.headers["Content-Type"]
    csp = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert resp.headers["X-Frame-Options"] == "DENY"
    assert resp.headers["Referrer-Policy"] == "no-referrer"
    assert "/public/app.js" in await resp.text()
    js = await client.get("/public/app.js")
    assert js.status == 200 and js.headers["Content-Type"].startswith("text/javascript")
    assert "EventSource" in await js.text()
    assert (await client.get("/public/app.css")).status == 200


async def test_the_ui_libraries_come_from_the_shared_vendor_folder(client: Any) -> None:
    """Every library file the UI names under vendor/ is served from fleet_min/web/vendor/ (the
    collector's copy, the only one), byte for byte."""
    ui = REPO_ROOT / "fleet_min" / "web" / "controlplane"
    named = {m.group(1) for path in ui.rglob("*") if path.suffix in (".js", ".html")
             for m in re.finditer(r"/vendor/([\w./-]+\.(?:js|css))", path.read_text())}
    assert {"preact/preact.module.js", "htm/htm.module.js", "uplot/uPlot.esm.js"} <= named
    for name in sorted(named):
        resp = await client.get(f"/public/vendor/{name}")
        assert resp.status == 200, name
        assert await resp.read() == (REPO_ROOT / "fleet_min" / "web" / "vendor" / name
                                     ).read_bytes()


async def test_public_paths_cannot_escape(client: Any) -> None:
    for path in ("/public/../controlplane/app.py", "/public/%2e%2e/%2e%2e/db.py",
                 "/public/..%2f..%2fdb.py", "/public/.hidden", "/public/nothing.js",
                 "/public/a\\b", "/public//etc/passwd", "/public/vendor/../controlplane/app.js",
                 "/public/vendor/..%2f..%2fdb.py", "/public/vendor/", "/public/vendor/.x"):
        resp = await client.get(path)
        assert resp.status == 404, path
        assert "error" in await resp.json()


# --- snapshot, stream, runner detail -----------------------------------------------------------

async def test_state_lists_runners_with_service_registration_and_versions(host: Host,
                                                                         apply_env: Host,
                                                                         aiohttp_client: Any
                                                                         ) -> None:
    host.add_runner("r1", labels=["gpu"], staged=("2.312.0",))
    host.add_runner("r2", repo="octo/lib", unit=False, registered=False)
    pid = host.start_unit("r1")
    client = await aiohttp_client(create_app(make_config(host), dict(os.environ)))
    await until(lambda: _registered(client, "r1"))
    snap = await state(client)
    assert set(snap) >= {"generated_at", "runners", "active_runs", "groups", "vitals",
                         "capacity", "drift", "queue_causes", "alerts", "host"}
    assert snap["generated_at"].endswith("Z")
    r1 = next(r for r in snap["runners"] if r["name"] == "r1")
    assert r1["listener"]["pid"] == pid and r1["state"] == "idle"
    assert r1["service"]["active"] == "active" and r1["version"] == "2.311.0"
    assert r1["staged_versions"] == ["2.312.0"] and "gpu" in r1["labels"]
    kinds = {(d["kind"], d.get("runner")) for d in snap["drift"]}
    assert ("service-missing", "r2") in kinds and ("unregistered", "r2") in kinds
    assert {g["key"] for g in snap["groups"]} == {"octo/app", "octo/lib"}
    assert snap["vitals"]["cores"] >= 1 and snap["capacity"]["runners"] == 2


async def _registered(client: Any, name: str) -> bool:
    view = await runner_view(client, name)
    return bool(view and view["registration"] == "registered")


async def test_stream_sends_a_snapshot_on_connect_and_every_tick(host: Host, client: Any
                                                                 ) -> None:
    resp = await client.get("/api/stream")
    assert resp.headers["Content-Type"] == "text/event-stream"
    events = []
    while len(events) < 2:
        line = await resp.content.readline()
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
    assert set(events[0]) == set(await state(client))
    assert events[1]["generated_at"] >= events[0]["generated_at"]
    resp.close()


async def test_busy_runner_is_working_and_queue_causes_explain_waiting_runs(host: Host,
                                                                            client: Any) -> None:
    path = host.add_runner("r1", labels=["linux"])
    host.start_unit("r1")
    host.github.add_run("octo/app", "queued", "2026-01-01T00:00:00Z", ["self-hosted", "gpu"])
    (path / ".fake-busy").touch()
    cp_of(client).wake(github=True)
    view = await until(lambda: _with_state(client, "r1", "working"))
    assert view["workers"] and view["busy"]
    snap = await state(client)
    assert snap["capacity"]["busy"] == 1
    causes = await until(lambda: _queue_causes(client))
    assert causes[0]["cause"] == "label-mismatch" and causes[0]["confidence"] == "high"
    snap = await state(client)
    assert any(d["kind"] == "queue-stuck" for d in snap["drift"])
    assert snap["active_runs"][0]["jobs"][0]["labels"] == ["self-hosted", "gpu"]


async def test_a_run_for_github_hosted_runners_is_never_stuck_here(host: Host,
                                                                   client: Any) -> None:
    host.add_runner("r1", labels=["linux"])
    hosted = host.github.add_run("octo/app", "queued", "2026-01-01T00:00:00Z", ["ubuntu-latest"])
    ours = host.github.add_run("octo/app", "queued", "2026-01-01T00:00:00Z",
                               ["self-hosted", "linux"])
    cp_of(client).wake(github=True)
    causes = await until(lambda: _causes_for(client, {hosted, ours}))
    assert causes[hosted] == "github-hosted"
    snap = await state(client)
    stuck = {d["run_id"] for d in snap["drift"] if d["kind"] == "queue-stuck"}
    assert stuck == {ours}


async def _causes_for(client: Any, runs: set[int]) -> dict[int, str] | None:
    causes = {c["run_id"]: c["cause"] for c in await _queue_causes(client)}
    return causes if runs <= set(causes) else None


async def _queue_causes(client: Any) -> list[dict[str, Any]]:
    return (await (await client.get("/api/queue-causes")).json())["queue_causes"]


async def _with_state(client: Any, name: str, wanted: str) -> dict[str, Any] | None:
    view = await runner_view(client, name)
    return view if view and view["state"] == wanted else None


async def test_runner_detail_redacts_diag_and_refuses_bad_names(host: Host, apply_env: Host,
                                                                aiohttp_client: Any) -> None:
    path = host.add_runner("r1")
    (path / "_diag").mkdir()
    (path / "_diag" / "Runner_20260101-000000-utc.log").write_text(
        "[2026-01-01 00:00:00Z INFO Runner] Listening for Jobs\n" + SECRET_LINE + "\n")
    (path / "_diag" / "Runner_zz-link.log").symlink_to(path / ".runner")
    client = await aiohttp_client(create_app(make_config(host), dict(os.environ)))
    resp = await client.get("/api/runner?name=r1")
    assert resp.status == 200
    detail = await resp.json()
    text = json.dumps(detail)
    assert "ghp_abc" not in text and "<redacted>" in text
    assert detail["diag"]["errors"] == 1 and detail["diag"]["files"] == 1
    assert detail["version"] == {"active": "2.311.0", "staged": []}
    assert set(detail) >= {"events", "jobs", "utilization", "runner"}
    assert (await client.get("/api/runner?name=ghost")).status == 404
    assert (await client.get("/api/runner")).status == 400
    assert (await client.get("/api/runner?name=../../etc")).status == 400


# --- actions -----------------------------------------------------------------------------------

async def test_action_catalogue_needs_no_token(client: Any) -> None:
    body = await (await client.get("/api/actions")).json()
    assert {a["id"] for a in body["actions"]} == {"runner.duplicate", "runner.drain",
                                                  "runner.resume", "runner.deregister",
                                                  "health.check"}


async def test_drain_idle_stops_now_and_resume_starts(host: Host, client: Any) -> None:
    host.add_runner("r1")
    pid = host.start_unit("r1")
    status, body = await act(client, "runner.drain", name="r1")
    assert status == 200 and body["ok"] and body["stopped"] is True
    assert set(body) >= {"ok", "code", "output", "durationMs", "command"}
    assert not fakes.pid_alive(pid)
    assert (host.root / "r1" / ".fleet-drain").exists()
    view = await runner_view(client, "r1")
    assert view and view["draining"] and view["state"] == "drained"
    status, body = await act(client, "runner.resume", name="r1")
    assert status == 200 and body["ok"], body
    new_pid = host.wait_listener("r1")
    assert new_pid != pid and not (host.root / "r1" / ".fleet-drain").exists()
    calls = [c["argv"] for c in host.calls("systemctl")]
    assert ["--user", "stop", host.unit("r1")] in calls
    assert ["--user", "start", host.unit("r1")] in calls
    rows = sqlite3.connect(host.state / "controlplane.db").execute(
        "SELECT who, action, ok, code FROM audit ORDER BY id").fetchall()
    assert [(r[1], r[2]) for r in rows] == [("runner.drain", 1), ("runner.resume", 1)]
    assert rows[0][0].startswith("control token from ")


async def test_drain_busy_waits_for_the_job_to_end(host: Host, client: Any) -> None:
    path = host.add_runner("r1")
    pid = host.start_unit("r1")
    (path / ".fake-busy").touch()
    await until(lambda: _with_state(client, "r1", "working"))
    status, body = await act(client, "runner.drain", name="r1")
    assert status == 200 and body["stopped"] is False
    status, body = await act(client, "runner.deregister", name="r1")
    assert status == 409 and body["ok"] is False and "running a job" in body["error"]
    assert fakes.pid_alive(pid)
    (path / ".fake-busy").unlink()
    await until(lambda: not fakes.pid_alive(pid))
    await until(lambda: _drain_stop_recorded(client))


async def _drain_stop_recorded(client: Any) -> bool:
    events = (await (await client.get("/api/runner?name=r1")).json())["events"]
    return any(e["kind"] == "drain" and "service stopped" in e["message"] for e in events)


async def test_deregister_removes_registration_and_keeps_or_deletes_dir(host: Host,
                                                                        client: Any) -> None:
    host.add_runner("r1")
    host.add_runner("r2")
    pid = host.start_unit("r1")
    await until(lambda: _registered(client, "r1"))
    status, body = await act(client, "runner.deregister", name="r1")
    assert status == 200 and body["ok"], body
    assert not fakes.pid_alive(pid)
    assert "r1" not in host.github.repos["octo/app"]["runners"]
    assert (host.root / "r1").is_dir() and not (host.root / "r1" / ".runner").exists()
    assert not (host.xdg / "systemd" / "user" / host.unit("r1")).exists()
    config_calls = host.calls("config.sh")
    assert config_calls[-1]["argv"] == ["remove"]  # the token went by environment, not argv
    status, body = await act(client, "runner.deregister", name="r2", delete_dir=True)
    assert status == 200 and body["deleted_dir"] and not (host.root / "r2").exists()
    status, body = await act(client, "runner.deregister", name="r1")
    assert status == 404


async def test_duplicate_registers_a_sibling_with_its_labels_and_starts_it(host: Host,
                                                                          client: Any) -> None:
    host.add_runner("build-1", labels=["gpu", "big"])
    (host.root / "build-1" / ".credentials").write_text('{"scheme": "OAuth"}')
    await until(lambda: _registered(client, "build-1"))
    status, body = await act(client, "runner.duplicate", name="build-1")
    assert status == 200 and body["ok"], body
    assert body["runner"] == "build-2"
    new = host.root / "build-2"
    assert (new / ".runner").exists() and not (new / ".credentials").exists()
    assert os.stat(new / "bin" / "Runner.Listener").st_ino == \
        os.stat(host.root / "build-1" / "bin" / "Runner.Listener").st_ino  # hard-linked
    registered = host.github.repos["octo/app"]["runners"]["build-2"]
    assert [lb["name"] for lb in registered["labels"] if lb["type"] == "custom"] == ["gpu", "big"]
    host.wait_listener("build-2")
    argv = host.calls("config.sh")[-1]["argv"]
    assert "--labels" in argv and "gpu,big" in argv
    assert not any(a.startswith("A") and "TOKEN" in a for a in argv)
    view = await until(lambda: _with_state(client, "build-2", "idle"))
    assert view["service"]["active"] == "active"


async def test_duplicate_is_refused_by_capacity_and_the_per_repo_limit(host: Host,
                                                                       client: Any) -> None:
    host.add_runner("r1")
    await until(lambda: _registered(client, "r1"))
    settings = {"Authorization": auth(cp_of(client))["Authorization"]}
    await client.post("/api/settings", json={"key": "ceiling", "value": 1}, headers=settings)
    status, body = await act(client, "runner.duplicate", name="r1")
    assert status == 409 and "ceiling of 1" in body["error"]
    await client.post("/api/settings", json={"key": "ceiling", "reset": True}, headers=settings)
    await client.post("/api/settings", json={"key": "max_per_repo", "value": 1},
                      headers=settings)
    status, body = await act(client, "runner.duplicate", name="r1")
    assert status == 409 and "per-repo limit is 1" in body["error"]
    assert not (host.root / "r1-2").exists()


async def test_duplicate_failure_cleans_up(host: Host, client: Any) -> None:
    host.add_runner("r1")
    await until(lambda: _registered(client, "r1"))
    host.github.fail_next = 10  # the registration token cannot be had
    status, body = await act(client, "runner.duplicate", name="r1", new_name="other")
    assert status == 503 and "registration token" in body["error"]
    assert not (host.root / "other").exists()


async def test_health_check_runs_the_script_and_redacts(client: Any) -> None:
    status, body = await act(client, "health.check")
    assert status == 200 and body["ok"] and "disk ok" in body["output"]
    assert "ghp_" not in body["output"]
    assert "gh token in env: none" in body["output"]  # our GitHub token is withheld


async def test_action_validation(host: Host, client: Any) -> None:
    host.add_runner("r1")
    headers = auth(cp_of(client))
    cases = [({"id": "runner.explode", "args": {}}, 400),
             ({"args": {}}, 400),
             ({"id": "runner.drain", "args": []}, 400),
             ({"id": "runner.drain", "args": {}}, 400),
             ({"id": "runner.drain", "args": {"name": 5}}, 400),
             ({"id": "runner.drain", "args": {"name": "a/../b"}}, 400),
             ({"id": "runner.drain", "args": {"name": "ghost"}}, 404),
             ({"id": "runner.deregister", "args": {"name": "r1", "delete_dir": "yes"}}, 400),
             ({"id": "runner.duplicate", "args": {"name": "r1", "new_name": "../x"}}, 400)]
    for body, expected in cases:
        resp = await client.post("/api/action", json=body, headers=headers)
        reply = await resp.json()
        assert resp.status == expected, (body, reply)
        assert reply["ok"] is False if "ok" in reply else "error" in reply
        assert isinstance(reply["error"], str)


async def test_action_body_needs_id_and_args_and_every_refusal_is_audited(
        host: Host, client: Any) -> None:
    """The spec's body is {id, args}: a missing or mistyped field is a 400 that names it, and
    every refused request lands in the audit log with its reason, bad bodies included."""
    host.add_runner("r1")
    headers = auth(cp_of(client))
    cases = [({"id": "health.check"}, "args"),
             ({"id": "runner.drain"}, "args"),
             ({"args": {}}, "id"),
             ({}, "no id and no args"),
             ({"id": 5, "args": {}}, "id must be"),
             ({"id": ["runner.drain"], "args": {}}, "id must be"),
             ({"id": "runner.drain", "args": "r1"}, "args must be"),
             ({"id": "runner.drain", "args": None}, "args must be"),
             ({"id": "runner.drain", "args": {"name": {"deep": [1]}}}, "args.name"),
             ({"id": "runner.drain", "args": {"name": "ghost"}}, "no runner named")]
    said = []
    for body, named in cases:
        resp = await client.post("/api/action", json=body, headers=headers)
        reply = await resp.json()
        assert resp.status in (400, 404), (body, reply)
        assert reply["ok"] is False and named in reply["error"], (body, reply)
        said.append(reply["error"])
    resp = await client.post("/api/action", data=b'{"id": "health.check", ', headers={
        **headers, "Content-Type": "application/json"})
    assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]
    resp = await client.post("/api/action", json=["health.check"], headers=headers)
    assert resp.status == 400
    with sqlite3.connect(host.state / "controlplane.db") as conn:
        rows = conn.execute("SELECT action, args, ok, error FROM audit ORDER BY id").fetchall()
    assert len(rows) == len(cases) + 2, rows
    assert all(ok == 0 and error for _, _, ok, error in rows), rows
    assert [r[3] for r in rows[:len(cases)]] == said  # each with the reason it was given
    assert rows[0][0] == "health.check" and rows[2][0] == "action.invalid"
    assert json.loads(rows[8][1]) == {"name": "<dict>"}  # nothing a client nested is stored
    assert "not valid JSON" in rows[-2][3] and "JSON object" in rows[-1][3]
    assert (host.root / "r1" / ".fleet-drain").exists() is False


# --- settings ----------------------------------------------------------------------------------

async def test_settings_list_change_reset(client: Any) -> None:
    listing = {s["key"]: s for s in (await (await client.get("/api/settings")).json())["settings"]}
    assert listing["ceiling"]["source"] == "env" and listing["ceiling"]["value"] == 4
    assert listing["grouping"]["source"] == "default"
    headers = auth(cp_of(client))
    resp = await client.post("/api/settings", json={"key": "ceiling", "value": 7},
                             headers=headers)
    assert await resp.json() == {"ok": True, "key": "ceiling", "value": 7, "source": "stored"}
    await until(lambda: _ceiling(client, 7))
    for bad in ({"key": "ceiling", "value": 0}, {"key": "ceiling", "value": "7"},
                {"key": "ceiling"}, {"key": "warp", "value": 1}, {"value": 1},
                {"key": "ceiling", "reset": "yes"}, {"key": "grouping", "value": "color"}):
        resp = await client.post("/api/settings", json=bad, headers=headers)
        assert resp.status == 400, bad
    resp = await client.post("/api/settings", json={"key": "ceiling", "reset": True},
                             headers=headers)
    assert (await resp.json())["value"] == 4
    resp = await client.post("/api/settings", json={"key": "grouping", "value": "owner"},
                             headers=headers)
    assert resp.status == 200
    await until(lambda: _grouped_by(client, "owner"))


async def _ceiling(client: Any, value: int) -> bool:
    return (await state(client))["capacity"]["ceiling"] == value


async def _grouped_by(client: Any, mode: str) -> bool:
    groups = (await state(client))["groups"]
    return all(g["by"] == mode for g in groups)


# --- bundle ------------------------------------------------------------------------------------

async def test_bundle_is_redacted_allow_listed_and_names_exclusions(host: Host,
                                                                   client: Any) -> None:
    path = host.add_runner("r1")
    (path / ".credentials").write_text('{"token": "SHOULD-NEVER-APPEAR-1"}')
    (path / ".credentials_rsaparams").write_text("SHOULD-NEVER-APPEAR-2")
    (path / ".env").write_text("LANG=C.UTF-8\nNPM_TOKEN=npm_abcdefabcdefabcdef\n")
    (path / ".path").write_text("/usr/bin:/bin\n" + "x" * (300 * 1024))
    (path / "_diag").mkdir()
    (path / "_diag" / "Runner_1.log").write_text(SECRET_LINE + "\n")
    cp = cp_of(client)
    await until(lambda: runner_view(client, "r1"))
    assert (await client.get("/api/runner/bundle?name=r1")).status == 401
    resp = await client.get("/api/runner/bundle?name=r1", headers=auth(cp))
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    assert 'filename="runner-r1-bundle.txt"' in resp.headers["Content-Disposition"]
    text = await resp.text()
    assert "SHOULD-NEVER-APPEAR" not in text and "ghp_abc" not in text
    assert "npm_abcdef" not in text and "LANG=C.UTF-8" in text
    assert ".credentials (credentials, never read)" in text
    assert ".path (over the 256 KiB cap" in text
    assert "config.sh (not on the allow-list)" in text
    assert "===== _diag tail =====" in text and "<redacted>" in text
    assert (await client.get("/api/runner/bundle?name=ghost", headers=auth(cp))).status == 404
    assert (await client.get("/api/runner/bundle", headers=auth(cp))).status == 400


RAW = re.compile(r"\bNone\b|\bnull\b|\bTrue\b|\bFalse\b|^\s*[\[\]{}]|[\[{]['\"]|['\"]:\s")


async def test_bundle_is_written_for_a_person(host: Host, client: Any) -> None:
    """A runner with a job still running (no conclusion, no duration) and a busy service: every
    line of the bundle outside the quoted files and log tail reads as text, with no Python None,
    JSON null, True/False or a dumped dict or list."""
    path = host.add_runner("r1", labels=["linux"])
    host.start_unit("r1")
    (path / "_diag").mkdir()
    (path / "_diag" / "Runner_1.log").write_text("[2026-01-01 00:00:00Z INFO Runner] up\n")
    host.github.add_run("octo/app", "in_progress", "2026-01-01T00:00:00Z",
                        ["self-hosted", "linux"], runner="r1")
    cp = cp_of(client)
    cp.wake(github=True)
    await until(lambda: _recorded_jobs(client, "r1"))
    await until(lambda: _with_registration(client, "r1"))
    resp = await client.get("/api/runner/bundle?name=r1", headers=auth(cp))
    assert resp.status == 200
    section, scanned = "", 0
    for line in (await resp.text()).splitlines():
        if line.startswith("===== "):
            section = line.strip("= ")
        elif section not in ("files", "_diag tail"):
            assert not RAW.search(line), f"{section}: {line!r}"
            scanned += 1
    assert scanned > 40
    text = await resp.text()
    assert "in progress, no conclusion yet" in text and "Nones" not in text
    assert "labels: self-hosted, Linux, X64, linux" in text
    assert "draining: no" in text and "  active: active" in text


async def _with_registration(client: Any, name: str) -> bool:
    view = await runner_view(client, name)
    return bool(view and view["registration"] == "registered")


async def _recorded_jobs(client: Any, name: str) -> list[Any]:
    detail = await (await client.get(f"/api/runner?name={name}")).json()
    return list(detail.get("jobs") or [])


# --- agent routes, hosts -----------------------------------------------------------------------

async def test_agent_routes_accept_the_agent_token(host: Host, apply_env: Host,
                                                   aiohttp_client: Any) -> None:
    from fleet_min.controlplane import tokens
    agent = tokens.ensure_token(host.state, tokens.AGENT_FILE)
    client = await aiohttp_client(create_app(make_config(host), dict(os.environ)))
    headers = {"Authorization": f"Bearer {agent}"}
    resp = await client.post("/api/host/heartbeat", json={"host": "pi-2", "runners": []},
                             headers=headers)
    reply = await resp.json()
    assert reply["ok"] is True and reply["commands"] == [] and len(reply["queue"]) == 16
    resp = await client.post("/api/host/results", headers=headers, json={
        "host": "pi-2", "results": [{"id": "c1", "ok": False, "error": "boom", "output": ""}]})
    assert (await resp.json())["received"] == 1
    hosts = (await (await client.get("/api/hosts")).json())["hosts"]
    assert [h["role"] for h in hosts] == ["coordinator", "agent"] and hosts[1]["host"] == "pi-2"
    # The agent token is not a control token.
    resp = await client.post("/api/settings", json={"key": "ceiling", "value": 2},
                             headers=headers)
    assert resp.status == 403
    for bad in ({"host": "../x"}, {"host": "pi", "results": [{"id": 1}]}, {"host": "pi"}):
        route = "/api/host/results" if "results" in bad or bad == {"host": "pi"} else \
            "/api/host/heartbeat"
        assert (await client.post(route, json=bad, headers=headers)).status == 400


# --- read-only mode ----------------------------------------------------------------------------

async def test_read_only_mode_has_no_token_and_refuses_mutations(host: Host, apply_env: Host,
                                                                 aiohttp_client: Any) -> None:
    host.add_runner("r1")
    cfg = make_config(host, read_only=True)
    client = await aiohttp_client(create_app(cfg, dict(os.environ)))
    assert not (host.state / "control-token").exists()
    assert (await client.get("/api/state")).status == 200
    assert (await (await client.get("/api/actions")).json())["read_only"] is True
    for method, path, body in (("POST", "/api/action", {"id": "health.check", "args": {}}),
                               ("POST", "/api/settings", {"key": "ceiling", "value": 2}),
                               ("GET", "/api/runner/bundle?name=r1", None),
                               ("POST", "/api/host/heartbeat", {"host": "x"})):
        resp = await client.request(method, path, json=body,
                                    headers={"Authorization": "Bearer " + "0" * 64})
        assert resp.status == 403
        assert await resp.json() == {"error": "this daemon is running read-only"}
