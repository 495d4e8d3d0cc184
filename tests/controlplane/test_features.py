"""Each control-plane feature built alone from the parts it declares (the plane over a real
SQLite file, the fake host's runners and systemctl, the fake GitHub API), with no app, no HTTP
and no other feature than those it is handed: what the split of the old engine is for."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest

from fleet_min.controlplane import store
from fleet_min.controlplane.analysis.admission import AdmissionLog
from fleet_min.controlplane.analysis.autoscaler import Autoscaler
from fleet_min.controlplane.analysis.billing import Billing
from fleet_min.controlplane.analysis.forecaster import Forecaster
from fleet_min.controlplane.analysis.reports import Reports
from fleet_min.controlplane.analysis.rounds import AnalysisRounds
from fleet_min.controlplane.federation.coordinator import Coordinator
from fleet_min.controlplane.federation.link import CoordinatorLink
from fleet_min.controlplane.github import history
from fleet_min.controlplane.github.sync import GitHubSync
from fleet_min.controlplane.github.workflow_files import WorkflowFiles
from fleet_min.controlplane.live import LiveSettings
from fleet_min.controlplane.runners.actions import Actions
from fleet_min.controlplane.runners.detail import runner_detail
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.errors import BadRequest, Conflict, NotFound
from fleet_min.timeutil import iso, parse_iso
from tests.support import cp_fakes as fakes
from tests.support import history_gen
from tests.support.controlplane import Host, Parts, open_parts


def snapshots_of(parts: Parts) -> Snapshots:
    return Snapshots(parts.plane, parts.supervisor, parts.github, parts.hub)


def actions_of(parts: Parts, snapshots: Snapshots) -> Actions:
    return Actions(parts.plane, snapshots, parts.supervisor, parts.github)


async def audit_rows(parts: Parts) -> list[dict[str, Any]]:
    return [dict(r) for r in await parts.plane.db.read(
        "SELECT who, action, ok, error FROM audit ORDER BY id")]


async def test_snapshots_alone_discover_the_runners_and_publish_each_build(apply_env: Host
                                                                           ) -> None:
    apply_env.add_runner("r1", repo="octo/app")
    async with open_parts(apply_env) as parts:
        snapshots = snapshots_of(parts)
        built = await snapshots.rebuild()
        assert [v["name"] for v in built["runners"]] == ["r1"]
        assert built["runners"][0]["registration"] == "unknown"  # GitHub not asked yet
        assert parts.plane.view("r1")["repo"] == "octo/app" and snapshots.ticks == 1
        assert parts.hub.latest is not None and b'"name":"r1"' in parts.hub.latest


async def test_github_sync_alone_fills_the_repositories_and_the_next_build_shows_them(
        apply_env: Host) -> None:
    apply_env.add_runner("r1", repo="octo/app", labels=["linux"])
    async with open_parts(apply_env) as parts:
        snapshots = snapshots_of(parts)
        await snapshots.rebuild()  # the runners say which repositories to watch
        await GitHubSync(parts.plane, parts.github, snapshots).refresh()
        assert parts.plane.repos["octo/app"].runners is not None
        view = (await snapshots.rebuild())["runners"][0]
        assert view["registration"] == "registered" and "linux" in view["labels"]


async def test_actions_alone_drain_an_idle_runner_and_audit_every_request(apply_env: Host
                                                                          ) -> None:
    apply_env.add_runner("r1")
    pid = apply_env.start_unit("r1")
    async with open_parts(apply_env) as parts:
        actions = actions_of(parts, snapshots_of(parts))
        reply = await actions.run("runner.drain", {"name": "r1"}, "a test")
        assert reply["ok"] and reply["stopped"] is True
        assert reply["command"].startswith("systemctl --user stop")
        assert parts.plane.view("r1")["state"] == "drained"  # rebuilt before the reply
        with pytest.raises(NotFound):
            await actions.run("runner.drain", {"name": "ghost"}, "a test")
        rows = await audit_rows(parts)
    assert not fakes.pid_alive(pid)
    assert [(r["who"], r["action"], r["ok"]) for r in rows] == [
        ("a test", "runner.drain", 1), ("a test", "runner.drain", 0)]
    assert "ghost" in rows[1]["error"]


async def test_an_action_for_an_agents_runner_is_queued_and_its_result_comes_back(
        host: Host) -> None:
    async with open_parts(host) as parts:
        actions = actions_of(parts, snapshots_of(parts))
        coordinator = Coordinator(parts.plane, None)
        report = {"host": "agent-1", "runners": [{"name": "far-1", "repo": "octo/app"}]}
        first = await coordinator.heartbeat(report)
        assert first["ok"] and first["commands"] == []
        reply = await actions.run("runner.drain", {"name": "far-1"}, "a test")
        assert reply["queued"] and reply["host"] == "agent-1" and reply["seq"] == 1
        again = await coordinator.heartbeat({**report, "queue": first["queue"], "applied": 0})
        (command,) = again["commands"]
        assert (command["action"], command["args"], command["seq"]) == (
            "runner.drain", {"name": "far-1"}, 1)
        done = await coordinator.results(
            {"host": "agent-1", "results": [{"id": command["id"], "ok": True}]}, "agent")
        assert done == {"ok": True, "received": 1, "matched": 1}
        hosts = await coordinator.hosts_report()
        assert [h["host"] for h in hosts["hosts"]] == [parts.plane.host_name, "agent-1"]
        assert hosts["commands"][0]["ok"] is True
        with pytest.raises(Conflict):
            await coordinator.heartbeat({"host": parts.plane.host_name})
        assert [r["action"] for r in await audit_rows(parts)] == [
            "runner.drain", "host.result:agent-1"]


async def test_an_action_for_an_agent_never_falls_back_to_this_hosts_runner(
        apply_env: Host) -> None:
    """args.host naming an agent that does not report the runner ran the action on this host's
    runner of that name: a drain aimed at an agent drained a local runner, and a deregister
    with delete_dir removed its directory."""
    local = apply_env.add_runner("shared-name")
    async with open_parts(apply_env) as parts:
        actions = actions_of(parts, snapshots_of(parts))
        coordinator = Coordinator(parts.plane, None)
        await coordinator.heartbeat({"host": "agent-1", "runners": [{"name": "far-1"}]})
        for action, args in (("runner.drain", {"name": "shared-name", "host": "agent-1"}),
                             ("runner.deregister", {"name": "shared-name", "host": "agent-1",
                                                    "delete_dir": True})):
            with pytest.raises(NotFound, match="agent host 'agent-1' reports no runner"):
                await actions.run(action, args, "a test")
        assert local.is_dir() and not (local / ".fleet-drain").exists()
        assert [c["action"] for c in await parts.plane.hosts.commands()] == []
        # Named without a host, the local runner is still the one acted on.
        reply = await actions.run("runner.drain", {"name": "shared-name"}, "a test")
        assert reply["ok"] and (local / ".fleet-drain").exists()


async def test_the_agent_link_alone_runs_allowed_commands_through_the_actions(
        apply_env: Host, tmp_path: Path) -> None:
    apply_env.add_runner("r1")
    token_file = tmp_path / "coordinator-token"
    async with open_parts(apply_env) as parts:
        snapshots = snapshots_of(parts)
        link = CoordinatorLink(parts.plane, actions_of(parts, snapshots), snapshots,
                               "http://127.0.0.1:9/", token_file)
        with pytest.raises(ValueError, match="coordinator token file"):
            await link.load()
        token_file.write_text("secret\n")
        await link.load()
        assert link.token == "secret" and link.status()["coordinator"] == "http://127.0.0.1:9"
        await snapshots.rebuild()
        refused = await link.execute("c1", {"action": "settings.change", "args": {}})
        assert not refused["ok"] and "not allowed on agent hosts" in refused["error"]
        ran = await link.execute("c2", {"action": "runner.drain", "args": {"name": "r1"}})
        assert ran["ok"] and ran["runner"] == "r1"
        rows = await audit_rows(parts)
    assert [(r["who"], r["action"]) for r in rows] == [
        ("coordinator http://127.0.0.1:9", "runner.drain")]


async def test_live_settings_alone_check_store_audit_and_rebuild(apply_env: Host) -> None:
    apply_env.add_runner("r1", repo="octo/app")
    async with open_parts(apply_env) as parts:
        snapshots = snapshots_of(parts)
        live = LiveSettings(parts.plane, snapshots)
        for body in ({"key": "grouping"}, {"key": "grouping", "reset": "yes"},
                     {"key": "nope", "value": 1}, {"key": "tick_s", "value": -1}):
            with pytest.raises(BadRequest):
                await live.change(body, "a test")
        assert snapshots.ticks == 0 and await audit_rows(parts) == []
        reply = await live.change({"key": "grouping", "value": "owner"}, "a test")
        assert reply == {"ok": True, "key": "grouping", "value": "owner", "source": "stored"}
        assert [g["key"] for g in parts.plane.snapshot["groups"]] == ["octo"]
        assert (await store.stored_settings(parts.plane.db)) == {"grouping": "owner"}
        reset = await live.change({"key": "grouping", "reset": True}, "a test")
        assert reset["source"] != "stored"
        assert [r["action"] for r in await audit_rows(parts)] == ["settings", "settings"]


def _job(n: int, at: float) -> dict[str, Any]:
    return {"job_id": 900 + n, "run_id": 90 + n, "repo": "octo/app", "name": "build",
            "workflow": "CI", "runner": "r1", "status": "completed", "conclusion": "success",
            "created_at": at, "started_at": at + 10, "completed_at": at + 70,
            "labels": ["self-hosted", "linux"]}


async def test_reports_alone_replay_and_count_the_stored_jobs(host: Host) -> None:
    async with open_parts(host) as parts:
        plane = parts.plane
        files = WorkflowFiles(parts.github, plane.db, plane.clock)
        reports = Reports(plane, files, Billing(parts.github, plane.clock),
                          AdmissionLog(plane.state_dir / "admission.log", plane.db))
        at = time.time() - 3600
        await plane.db.write(store.upsert_jobs, [_job(n, at + 30 * n) for n in range(6)])
        with pytest.raises(BadRequest, match="runnerCounts"):
            await reports.simulate({"repo": "octo/app", "runnerCounts": [], "sloSec": 60})
        with pytest.raises(NotFound):
            await reports.simulate({"repo": "octo/none", "runnerCounts": [1], "sloSec": 60})
        replay = await reports.simulate({"repo": "octo/app", "runnerCounts": [1, 2],
                                         "sloSec": 60})
        assert replay["repo"] == "octo/app" and replay["self_hosted_only"] is True
        figures = await reports.analytics(1)
        assert [r["repo"] for r in figures["repos"]] == ["octo/app"]
        # Built once for every request that asks while it is built (twenty at once took
        # twenty copies of the window's rows: 4.5 GB at 200,000 jobs); another window is its
        # own report. 8 days is read as the 10-day window, and the report says so.
        same = await asyncio.gather(*(reports.analytics(7) for _ in range(5)),
                                    reports.analytics(8))
        assert all(report is same[0] for report in same[:5]) and same[5] is not same[0]
        assert (same[0]["days"], same[5]["days"]) == (7, 10)
        assert abs(parse_iso(same[5]["until"]) - parse_iso(same[5]["since"]) - 10 * 86400) < 1
        # Asked for later with the same jobs in its window, a report is answered anew from the
        # figures it kept; a job entering the window has them built again.
        again = await reports.analytics(7)
        assert again is not same[0] and again["repos"] is same[0]["repos"]
        await plane.db.write(store.upsert_jobs, [_job(6, at + 600)])
        fresh = await reports.analytics(7)
        assert fresh["repos"] is not same[0]["repos"] and fresh["repos"][0]["jobs"] == 7
        # The sync's next round upserts the same jobs: nothing a report reads changed.
        await plane.db.write(store.upsert_jobs, [_job(n, at + 30 * n) for n in range(6)])
        assert (await reports.analytics(7))["repos"] is fresh["repos"]
        # A conclusion corrected in place changes neither the count nor the completion times
        # of the window's jobs, and is seen at once.
        await plane.db.write(store.upsert_jobs, [{**_job(3, at + 90), "conclusion": "failure"}])
        corrected = await reports.analytics(7)
        assert corrected["repos"] is not fresh["repos"]
        assert corrected["repos"][0]["failures"] == 1
        repos = await asyncio.gather(reports.repo("octo/app"), reports.repo("octo/app"))
        assert repos[0] is repos[1] and repos[0]["repo"] == "octo/app"
        with pytest.raises(NotFound):  # a failure reaches every request that shared it
            await asyncio.gather(reports.repo("octo/none"), reports.repo("octo/none"))


async def test_analysis_rounds_alone_collect_history_and_forecast(host: Host) -> None:
    end = time.time()
    host.github.load_history(history_gen.generate("octo/app", end, 3, runners=1, seed=3,
                                                  ids=itertools.count(7_000_000)))
    env = {**host.full_env(), "FLEET_WATCH_REPOS": "octo/app"}
    async with open_parts(host, env) as parts:
        plane = parts.plane
        files = WorkflowFiles(parts.github, plane.db, plane.clock)
        forecaster = Forecaster(plane, files)
        rounds = AnalysisRounds(plane, parts.github, files, forecaster)
        await rounds.round()
        (status,) = await history.status(plane.db, ["octo/app"])
        stored = await plane.db.read_one("SELECT count(*) AS n FROM jobs")
    assert rounds.rounds == 1 and stored is not None and stored["n"] > 0
    assert status["repo"] == "octo/app" and status["last_round_at"] is not None
    assert forecaster.latest["octo/app"]["source"] == "combined"


async def test_forecasts_asked_for_at_once_are_made_once(host: Host) -> None:
    """Each forecast holds the history of every watched repository for a moment, and each
    request made its own: twenty at once took 1.4 GB. Requests that come while one is made
    share it; the next one after it is made anew."""
    end = time.time()
    host.github.load_history(history_gen.generate("octo/app", end, 3, runners=1, seed=5,
                                                  ids=itertools.count(8_000_000)))
    env = {**host.full_env(), "FLEET_WATCH_REPOS": "octo/app"}
    async with open_parts(host, env) as parts:
        files = WorkflowFiles(parts.github, parts.plane.db, parts.plane.clock)
        forecaster = Forecaster(parts.plane, files)
        await AnalysisRounds(parts.plane, parts.github, files, forecaster).collector.round(
            ["octo/app"])
        together = await asyncio.gather(*(forecaster.forecast() for _ in range(8)))
        assert all(result is together[0] for result in together)
        assert together[0]["repos"][0]["repo"] == "octo/app"
        again = await forecaster.forecast()
        assert again is not together[0]


async def test_the_autoscaler_alone_proposes_a_duplicate_for_a_repo_at_capacity(
        apply_env: Host) -> None:
    host = apply_env
    host.add_runner("lib-1", repo="octo/lib", labels=["linux"])
    host.start_unit("lib-1", "octo/lib")
    host.github.repos["octo/lib"]["runners"]["lib-1"]["busy"] = True
    host.github.add_run("octo/lib", "queued", iso(time.time() - 200) or "",
                        ["self-hosted", "linux"])
    env = {**host.full_env(), "FLEET_AUTOSCALE": "on"}
    async with open_parts(host, env) as parts:
        snapshots = snapshots_of(parts)
        forecaster = Forecaster(parts.plane, WorkflowFiles(parts.github, parts.plane.db,
                                                           parts.plane.clock))
        autoscaler = Autoscaler(parts.plane, actions_of(parts, snapshots), forecaster)
        await snapshots.rebuild()
        await GitHubSync(parts.plane, parts.github, snapshots).refresh()
        await snapshots.rebuild()
        await autoscaler.evaluate()
        report = await autoscaler.report()
    assert report["enabled"] and report["mode"] == "dry-run"
    (decision,) = report["decisions"]
    assert (decision["repo"], decision["outcome"], decision["action"]) == (
        "octo/lib", "proposed", {"id": "runner.duplicate", "args": {"name": "lib-1"}})
    assert not (host.root / "lib-2").exists()  # dry-run: nothing ran


async def test_runner_detail_alone(apply_env: Host) -> None:
    apply_env.add_runner("r1")
    async with open_parts(apply_env) as parts:
        await snapshots_of(parts).rebuild()
        detail = await runner_detail(parts.plane, "r1")
        assert detail["runner"]["name"] == "r1" and detail["utilization"]["busy_now"] is False
        with pytest.raises(NotFound):
            await runner_detail(parts.plane, "ghost")
