"""Pure pieces without HTTP: tokens, auth rules, live settings, discovery, capacity, drift,
and the parsers of /proc, ps, sysctl/vm_stat, systemctl show, launchctl list."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from fleet_min.controlplane import tokens
from fleet_min.controlplane.analysis.capacity import capacity, refusals_for_repo
from fleet_min.controlplane.analysis.drift import drift_alerts
from fleet_min.controlplane.http import auth
from fleet_min.controlplane.http.auth import Need
from fleet_min.controlplane.runners import procs, vitals
from fleet_min.controlplane.runners.actions import copy_name
from fleet_min.controlplane.runners.discovery import discover, repo_of
from fleet_min.controlplane.runners.procs import Proc
from fleet_min.controlplane.runners.supervisor import parse_launchctl_list, parse_show
from fleet_min.controlplane.settings import BY_KEY, LiveValues, lookup
from fleet_min.errors import BadRequest, Forbidden, Unauthorized
from tests.support import cp_fakes as fakes

# --- tokens ------------------------------------------------------------------------------------


def test_token_is_created_0600_and_kept(tmp_path: Path) -> None:
    token = tokens.ensure_token(tmp_path)
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE((tmp_path / "control-token").stat().st_mode) == 0o600
    assert tokens.ensure_token(tmp_path) == token


@pytest.mark.parametrize("content", ["short", "z" * 64, ""])
def test_invalid_token_file_is_replaced(tmp_path: Path, content: str) -> None:
    (tmp_path / "control-token").write_text(content)
    token = tokens.ensure_token(tmp_path)
    assert token != content and len(token) == 64


def test_loose_permissions_are_tightened(tmp_path: Path) -> None:
    tokens.ensure_token(tmp_path)
    (tmp_path / "control-token").chmod(0o644)
    tokens.ensure_token(tmp_path)
    assert stat.S_IMODE((tmp_path / "control-token").stat().st_mode) == 0o600


def test_agent_token_falls_back_to_control(tmp_path: Path) -> None:
    control = tokens.ensure_token(tmp_path)
    assert tokens.agent_token(tmp_path, control) == control
    agent = tokens.ensure_token(tmp_path, tokens.AGENT_FILE)
    assert tokens.agent_token(tmp_path, control) == agent != control


def test_matches_is_exact_and_nothing_matches_without_a_token() -> None:
    assert tokens.matches("a" * 64, "a" * 64)
    assert not tokens.matches("a" * 63, "a" * 64)
    assert not tokens.matches("", None)
    assert not tokens.matches("é", "a" * 64)


# --- auth --------------------------------------------------------------------------------------

CONTROL, AGENT = "c" * 64, "a" * 64


def _authorize(need: Need, headers: dict[str, str], read_only: bool = False) -> str:
    return auth.authorize(need, headers, read_only=read_only, control=CONTROL, agent=AGENT)


def test_auth_rows() -> None:
    host = {"Host": "127.0.0.1:7878"}
    assert _authorize(Need.NONE, {}) == "anonymous"
    with pytest.raises(Unauthorized):
        _authorize(Need.CONTROL, host)
    with pytest.raises(Unauthorized):
        _authorize(Need.CONTROL, {**host, "Authorization": "Basic xyz"})
    with pytest.raises(Forbidden):
        _authorize(Need.CONTROL, {**host, "Authorization": f"Bearer {AGENT}"})
    assert _authorize(Need.CONTROL, {**host, "Authorization": f"Bearer {CONTROL}"})
    assert _authorize(Need.AGENT, {**host, "Authorization": f"Bearer {AGENT}"}) == "agent token"
    assert _authorize(Need.AGENT, {**host, "Authorization": f"Bearer {CONTROL}"})


def test_a_host_token_speaks_for_its_host_only() -> None:
    """A host token is the agent token narrowed to one name: it passes the agent routes as that
    host alone, never a control route, and any change to it is a wrong token."""
    host = {"Host": "127.0.0.1:7878"}
    edge = tokens.host_token(AGENT, "edge")
    assert edge.startswith("edge~") and tokens.token_host(edge, AGENT) == "edge"
    as_edge = {**host, "Authorization": f"Bearer {edge}"}
    assert _authorize(Need.AGENT, as_edge) == "agent token for edge"
    assert auth.token_host(as_edge, AGENT) == "edge"
    assert auth.token_host({**host, "Authorization": f"Bearer {AGENT}"}, AGENT) is None
    with pytest.raises(Forbidden):
        _authorize(Need.CONTROL, as_edge)
    mac = edge.split("~", 1)[1]
    forged = [f"other~{mac}",                      # another name with edge's code
              f"edge~{mac[:-1]}{'0' if mac[-1] != '0' else '1'}",  # one digit changed
              tokens.host_token("b" * 64, "edge"),  # made with another agent token
              f"edge~{mac}~", "~" + mac, "edge~", mac,
              f"\udcff~{mac}"]  # a header byte that is not UTF-8 (aiohttp's surrogate)
    for token in forged:
        assert tokens.token_host(token, AGENT) is None, token
        with pytest.raises(Forbidden):
            _authorize(Need.AGENT, {**host, "Authorization": f"Bearer {token}"})
    assert tokens.token_host(edge, None) is None  # read-only: no agent token at all


def test_host_tokens_only_refuses_the_shared_agent_token() -> None:
    """With agent_tokens at host the shared agent token, which speaks for any name, is refused
    on the agent routes; host tokens and the operator's control token still pass."""
    host = {"Host": "127.0.0.1:7878"}

    def strict(token: str) -> str:
        return auth.authorize(Need.AGENT, {**host, "Authorization": f"Bearer {token}"},
                              read_only=False, control=CONTROL, agent=AGENT, shared_agent=False)
    with pytest.raises(Forbidden, match="--agent-host"):
        strict(AGENT)
    assert strict(tokens.host_token(AGENT, "edge")) == "agent token for edge"
    assert strict(CONTROL) == "control token"


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "http://127.0.0.1:9999"},
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"},
])
def test_cross_origin_is_refused_even_with_a_valid_token(headers: dict[str, str]) -> None:
    with pytest.raises(Forbidden, match="cross-origin"):
        _authorize(Need.CONTROL, {"Host": "127.0.0.1:7878",
                                  "Authorization": f"Bearer {CONTROL}", **headers})


def test_same_origin_passes() -> None:
    headers = {"Host": "localhost:7878", "Origin": "http://localhost:7878",
               "Sec-Fetch-Site": "same-origin", "Authorization": f"Bearer {CONTROL}"}
    assert _authorize(Need.CONTROL, headers) == "control token"


def test_read_only_refuses_before_anything_else() -> None:
    with pytest.raises(Forbidden, match="read-only"):
        auth.authorize(Need.CONTROL, {}, read_only=True, control=None, agent=None)
    assert auth.authorize(Need.NONE, {}, read_only=True, control=None, agent=None)


# --- live settings -----------------------------------------------------------------------------

def test_live_setting_checks() -> None:
    ceiling = lookup("ceiling")
    assert ceiling.check(3) == 3 and ceiling.check(3.0) == 3
    for bad in (0, 257, 2.5, "3", True, None, float("nan")):
        with pytest.raises(BadRequest):
            ceiling.check(bad)
    with pytest.raises(BadRequest):
        BY_KEY["tick_s"].check(float("inf"))
    assert BY_KEY["grouping"].check("owner") == "owner"
    with pytest.raises(BadRequest):
        BY_KEY["grouping"].check("color")
    for bad_key in ("nope", "", 5, None):
        with pytest.raises(BadRequest):
            lookup(bad_key)


def test_live_values_sources() -> None:
    values = LiveValues({"ceiling": 3}, {"FLEET_MAX_PER_REPO": "2"})
    assert (values.get("ceiling"), values.source("ceiling")) == (3, "stored")
    assert (values.get("max_per_repo"), values.source("max_per_repo")) == (2, "env")
    assert values.source("tick_s") == "default"
    listing = {row["key"]: row for row in values.listing()}
    assert listing["ceiling"]["min"] == 1 and listing["ceiling"]["max"] == 256
    assert listing["grouping"]["choices"] == ["repo", "owner", "labels"]
    with pytest.raises(ValueError, match="FLEET_CEILING"):
        LiveValues({}, {"FLEET_CEILING": "0"})


# --- discovery ---------------------------------------------------------------------------------

def test_repo_of() -> None:
    assert repo_of("https://github.com/octo/app") == ("octo", "octo/app")
    assert repo_of("https://github.com/octo") == ("octo", None)
    assert repo_of("https://github.com/octo/../etc") == ("octo", None)
    assert repo_of("https://ghe.example/enterprises/big") == (None, None)


def test_discovery_reads_bom_versions_drain_and_processes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    path = fakes.make_install(root / "team" / "r1", staged=("2.312.0",))
    fakes.write_runner_file(path, "r1", "octo/app")
    (path / ".fleet-drain").write_text("2026-01-01T00:00:00Z")
    (path / ".credentials").write_text("{}")
    broken = root / "broken"
    broken.mkdir()
    (broken / ".runner").write_text("{not json")
    (root / "linked").symlink_to(path)  # a symlinked dir is not walked (no escaping the root)
    listener = Proc(10, ("python3", f"{path}/bin/Runner.Listener", "run"), 1000, 5.0)
    worker = Proc(11, (f"{path}/bin/Runner.Worker", "spawnclient"), 500, 1.0)
    stranger = Proc(12, ("/elsewhere/bin/Runner.Listener",), 1, 1.0)
    [runner] = discover(root, [listener, worker, stranger])
    assert (runner.name, runner.repo, runner.rel) == ("r1", "octo/app", "team/r1")
    assert runner.version == "2.311.0" and runner.staged == ["2.312.0"]
    assert runner.draining_since == "2026-01-01T00:00:00Z"
    assert runner.listener == listener and runner.workers == [worker] and runner.working


# --- capacity, drift, queue causes -------------------------------------------------------------

def _setting(overrides: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    values = LiveValues({"ceiling": 3, "min_free_mem_mb": 100, "min_free_disk_gb": 1.0,
                         "max_load_per_core": 2.0, "max_per_repo": 2, **(overrides or {})}, {})
    return values.get


def _view(name: str, repo: str = "octo/app", busy: bool = False, **extra: object) -> dict:
    view = {"name": name, "repo": repo, "busy": busy, "draining": False, "labels": ["linux"],
            "listener": {"pid": 1}, "registration": "registered",
            "registered": {"id": 1, "status": "online", "busy": busy},
            "service": {"unit": f"{name}.service", "loaded": True, "active": "active"}}
    view.update(extra)
    return view


def test_capacity_reasons() -> None:
    vitals_ok = {"mem_available_mb": 4000, "load_per_core": 0.5, "disk_free_gb": 50}
    cap = capacity([_view("a", busy=True), _view("b")], vitals_ok, _setting())
    assert cap["can_add"] and cap["busy"] == 1 and cap["headroom"] == 1
    assert refusals_for_repo(cap, "octo/app") == [
        "octo/app already has 2 runners here; the per-repo limit is 2"]
    assert refusals_for_repo(cap, "octo/other") == []
    starved = {"mem_available_mb": 50, "load_per_core": 3.0, "disk_free_gb": 0.5}
    cap = capacity([_view("a"), _view("b"), _view("c")], starved, _setting())
    assert not cap["can_add"] and len(cap["reasons"]) == 4


def test_drift_kinds() -> None:
    views = [
        _view("missing", service={"unit": "u", "loaded": False, "active": "inactive"}),
        _view("dead", service={"unit": "u", "loaded": True, "active": "failed"}),
        _view("nolistener", listener=None),
        _view("unreg", registration="missing", registered=None),
        _view("offline", registered={"id": 2, "status": "offline", "busy": False}),
        _view("odd", labels=["gpu"]),
        _view("drained", draining=True, registered={"id": 3, "status": "offline", "busy": False},
              service={"unit": "u", "loaded": True, "active": "inactive"}, listener=None),
    ]
    runs = [{"id": 9, "repo": "octo/app", "name": "CI", "status": "queued",
             "created_at": "2026-01-01T00:00:00Z"}]
    jobs = [{"run_id": 9, "labels": ["self-hosted", "linux"]}]
    alerts = drift_alerts(views, runs, jobs, views, now=1767225600 + 3600, stuck_s=900)
    kinds = {(a["kind"], a.get("runner")) for a in alerts}
    assert ("service-missing", "missing") in kinds and ("service-dead", "dead") in kinds
    assert ("no-listener", "nolistener") in kinds and ("unregistered", "unreg") in kinds
    assert ("offline", "offline") in kinds
    assert not any(a.get("runner") == "drained" for a in alerts)
    assert any(a["kind"] == "label-mismatch" for a in alerts)
    assert any(a["kind"] == "queue-stuck" and a["run_id"] == 9 for a in alerts)


def test_only_runs_for_self_hosted_runners_can_be_stuck() -> None:
    """A job on a GitHub image waits on GitHub's runners, not ours: no queue-stuck for it. A
    job asking for self-hosted, or only for labels one of our runners carries, is ours."""
    views = [_view("r1", labels=["self-hosted", "Linux", "gpu"])]
    labels = {1: ["ubuntu-latest"], 2: ["self-hosted", "arm64"], 3: ["gpu", "linux"],
              4: ["windows-2022", "large"], 5: []}
    runs = [{"id": n, "repo": "octo/app", "name": "CI", "status": "queued",
             "created_at": "2026-01-01T00:00:00Z"} for n in [*labels, 6]]
    jobs = [{"run_id": n, "labels": wanted} for n, wanted in labels.items()]
    alerts = drift_alerts(views, runs, jobs, views, now=1767225600 + 3600, stuck_s=900)
    assert sorted(a["run_id"] for a in alerts if a["kind"] == "queue-stuck") == [2, 3]
    # the same labels in another repository: no runner of ours there carries them
    other = [{**run, "repo": "octo/web"} for run in runs]
    alerts = drift_alerts(views, other, jobs, views, now=1767225600 + 3600, stuck_s=900)
    assert sorted(a["run_id"] for a in alerts if a["kind"] == "queue-stuck") == [2]


# --- parsers -----------------------------------------------------------------------------------

def test_meminfo_and_psi() -> None:
    mem = vitals.parse_meminfo("MemTotal: 8000000 kB\nMemAvailable: 2048000 kB\n"
                               "SwapTotal: 1024000 kB\nSwapFree: 512000 kB\n")
    assert mem == {"mem_total_mb": 7812, "mem_available_mb": 2000, "swap_total_mb": 1000,
                   "swap_used_mb": 500}
    psi = vitals.parse_psi("some avg10=1.50 avg60=0.25 avg300=0.00 total=1\n"
                           "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert psi == {"some_avg10_pct": 1.5, "some_avg60_pct": 0.25}


def test_darwin_vitals_parser() -> None:
    vm_stat = ("Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
               "Pages free:                               10000.\n"
               "Pages inactive:                           20000.\n"
               "Pages speculative:                         2000.\n")
    out = vitals.parse_darwin("17179869184\n", "{ 1.50 2.00 2.50 }\n",
                              "total = 2048.00M  used = 512.00M  free = 1536.00M  (encrypted)\n",
                              "{ sec = 1700000000, usec = 0 } Tue Nov 14\n", vm_stat, "72\n",
                              1700000100.0)
    assert out["mem_total_mb"] == 16384 and out["mem_available_mb"] == 500
    assert out["load"] == [1.5, 2.0, 2.5] and out["swap_used_mb"] == 512
    assert out["uptime_s"] == 100 and out["memory_pressure"] == {"pressure_pct": 28}


def test_linux_vitals_on_this_machine(tmp_path: Path) -> None:
    v = vitals.host_vitals(tmp_path)
    assert v["cores"] >= 1 and v["disk_free_gb"] > 0 and len(v["load"]) == 3


def test_ps_parser() -> None:
    text = ("  101   501  20480 01-02:03:04 /r/a/bin/Runner.Listener run\n"
            "  102     0   1024       05:06 /usr/bin/sshd\n"
            "  103   501   2048          07 /r/a/bin/Runner.Worker spawnclient\n")
    found = procs.parse_ps(text)
    assert [(p.pid, p.uid, p.rss_kb, p.uptime_s) for p in found] == [
        (101, 501, 20480, 93784), (103, 501, 2048, 7)]


def test_systemctl_show_and_launchctl_list_parsers() -> None:
    text = ("Id=a.service\nLoadState=loaded\nActiveState=active\nMainPID=5\n\n"
            "Id=b.service\nLoadState=not-found\nActiveState=inactive\nMainPID=0\n")
    parsed = parse_show(text)
    assert parsed["a.service"]["MainPID"] == "5" and parsed["b.service"]["LoadState"] == "not-found"
    rows = parse_launchctl_list("PID\tStatus\tLabel\n42\t0\tx.a\n-\t78\tx.b\nbad line\n")
    assert rows == {"x.a": (42, 0), "x.b": (None, 78)}


def test_runner_file_written_by_fakes_has_a_bom(tmp_path: Path) -> None:
    fakes.write_runner_file(tmp_path, "r", "o/p")
    raw = (tmp_path / ".runner").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf")
    assert json.loads(raw.decode("utf-8-sig"))["agentName"] == "r"


def test_copy_name_is_one_series() -> None:
    """A copy's default name: the name without a trailing -N, then the lowest free number from
    2 (the UI suggests the same; js/actions.js copyName)."""
    assert copy_name("app", set()) == "app-2"
    assert copy_name("app-1", {"app-1"}) == "app-2"
    assert copy_name("app-1", {"app-1", "app-2"}) == "app-3"
    assert copy_name("app-2", {"app-1", "app-2"}) == "app-3"
    assert copy_name("app-1", {"app-1", "app-3"}) == "app-2"  # a gap is filled
    assert copy_name("build-x64", set()) == "build-x64-2"
    assert copy_name("a", {f"a-{n}" for n in range(2, 1000)}) is None

