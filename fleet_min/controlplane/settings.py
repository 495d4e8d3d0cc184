"""Settings of the control plane: start-up settings (flags/env) and live settings (the API).

Start-up settings go through fleet_min.config like every other service. Live settings are the
knobs `POST /api/settings` turns without a restart (capacity limits, tick intervals, grouping);
each has a type, a range, a default and an environment variable, and the stored value wins
over the environment, which wins over the default.
"""

from __future__ import annotations

import math
import os
import re
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fleet_min.config import (
    PEER_CONNECTIONS_HELP,
    Setting,
    SettingsTable,
    flag,
    peer_connections,
    port_number,
    positive_float,
    positive_int,
)
from fleet_min.errors import BadRequest
from fleet_min.origin import ALLOWED_HOSTS_ENV, host_patterns


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {text!r}")
        return text
    return parse


def _repos(text: str) -> tuple[str, ...]:
    repos = tuple(part.strip() for part in text.split(",") if part.strip())
    for repo in repos:
        owner, _, project = repo.partition("/")
        if not (_SLUG.fullmatch(owner) and _SLUG.fullmatch(project)) or ".." in repo:
            raise ValueError(f"must be owner/project names separated by commas, got {repo!r}")
    return repos


def _host_name(text: str) -> str:
    if text and not _SLUG.fullmatch(text):
        raise ValueError(f"must be letters, digits, '.', '_' or '-', got {text!r}")
    return text


def _coordinator(text: str) -> str:
    if text and not is_http_url(text):
        raise ValueError(f"must be an http(s) URL such as http://10.0.0.2:7878, got {text!r}")
    return text.rstrip("/")


def is_http_url(text: str) -> bool:
    """An http(s) URL with a host part. urlsplit raises on some text that is not a URL at all
    (a lone bracket, a host that NFKC folds into a '/'): that is no URL either."""
    try:
        parts = urlsplit(text)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def _days(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 365:
        raise ValueError(f"must be a whole number of days from 1 to 365, got {text!r}")
    return value


_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True, slots=True)
class ControlPlaneConfig:
    """The control plane's resolved start-up settings (CONTROLPLANE_SETTINGS says what each one
    means); live settings are LiveValues."""

    host: str
    port: int
    allowed_hosts: tuple[str, ...]
    root: str
    state_dir: str
    read_only: bool
    github_api: str
    health_script: str
    supervisor: str
    systemd_scope: str
    command_timeout_s: float
    max_json_bytes: int
    synchronous: str
    log_level: str
    log_file: str
    stop_grace_s: float
    max_peer_connections: str
    host_name: str
    coordinator: str
    coordinator_token_file: str
    watch_repos: tuple[str, ...]
    agent_repos: tuple[str, ...]
    backfill_days: int
    admission_log: str


CONTROLPLANE_SETTINGS: SettingsTable[ControlPlaneConfig] = SettingsTable(
    ControlPlaneConfig,
    Setting("host", "FLEET_HOST", "127.0.0.1", str,
            "Address to listen on. Loopback by default; reach it through an SSH tunnel.",
            "--host"),
    Setting("port", "FLEET_CONTROL_PORT", 7878, port_number, "TCP port.", "--port"),
    Setting("allowed_hosts", ALLOWED_HOSTS_ENV, (), host_patterns,
            "Host names (comma-separated; `*.example.lan` patterns allowed) the daemon answers "
            "to besides IP addresses, localhost and its own host names: the name in "
            "FLEET_COORDINATOR URLs of agents, a proxy's name. Any other Host gets 421."),
    Setting("root", "FLEET_ROOT", "~/actions-runners", str,
            "Directory holding the runner installations (one directory per runner).", "--root"),
    Setting("state_dir", "FLEET_STATE_DIR", "~/.config/fleet-min", str,
            "Directory for the SQLite database and the token files.", "--state"),
    Setting("read_only", "FLEET_READ_ONLY", False, flag,
            "Read-only mode: no token exists and every mutating route answers 403."),
    Setting("github_api", "FLEET_GITHUB_API", "https://api.github.com", str,
            "Base URL of the GitHub REST API (GitHub Enterprise: https://HOST/api/v3)."),
    Setting("health_script", "FLEET_HEALTH_SCRIPT", "", str,
            "Executable run by the health.check action (no arguments)."),
    Setting("supervisor", "FLEET_SUPERVISOR", "auto", _choice("auto", "systemd", "launchd"),
            "Service manager of the runners: auto picks launchd on macOS, systemd elsewhere."),
    Setting("systemd_scope", "FLEET_SYSTEMD_SCOPE", "auto", _choice("auto", "system", "user"),
            "Where runner units live: system, user, or auto (both are looked at; new units "
            "go where their sibling's is)."),
    Setting("command_timeout_s", "FLEET_COMMAND_TIMEOUT_S", 120.0, positive_float,
            "Longest a runner command (config.sh, systemctl, the health script) may run."),
    Setting("max_json_bytes", "FLEET_MAX_JSON_BYTES", 1 << 20, positive_int,
            "Largest JSON request body accepted (413 above it)."),
    Setting("synchronous", "FLEET_SQLITE_SYNCHRONOUS", "FULL", str,
            "SQLite synchronous mode. FULL survives a power cut; NORMAL survives a crash only."),
    Setting("log_level", "FLEET_LOG_LEVEL", "INFO", str, "Log level (DEBUG, INFO, WARNING)."),
    Setting("log_file", "FLEET_LOG_FILE", "", str,
            "Write the log to this file (reopened on SIGHUP, for logrotate) instead of stderr."),
    Setting("stop_grace_s", "FLEET_STOP_GRACE_S", 3.0, positive_float,
            "On SIGTERM or SIGINT, how long requests in progress get to finish before they "
            "are cut; streams end at once, a second signal exits."),
    Setting("max_peer_connections", "FLEET_MAX_PEER_CONNECTIONS", "auto", peer_connections,
            PEER_CONNECTIONS_HELP),
    Setting("host_name", "FLEET_HOST_NAME", "", _host_name,
            "This host's name in the federation (default: the system's host name)."),
    Setting("coordinator", "FLEET_COORDINATOR", "", _coordinator,
            "Run as an agent of this coordinator (its URL): send heartbeats, run the runner "
            "actions and health checks it forwards, in order.", "--coordinator"),
    Setting("coordinator_token_file", "FLEET_COORDINATOR_TOKEN_FILE", "", str,
            "File holding the coordinator's agent token (default: <state>/coordinator-token)."),
    Setting("watch_repos", "FLEET_WATCH_REPOS", (), _repos,
            "Repositories to collect history and workflow files for besides those of the "
            "runners (owner/project, comma-separated)."),
    Setting("agent_repos", "FLEET_AGENT_REPOS", (), _repos,
            "Coordinator: repositories of agent hosts' runners it watches too (owner/project, "
            "comma-separated). An agent's runner of a repository neither listed here nor "
            "watched already (this host's runners, FLEET_WATCH_REPOS) is shown but costs no "
            "GitHub request."),
    Setting("backfill_days", "FLEET_BACKFILL_DAYS", 30, _days,
            "Days of job history fetched when a repository is first watched."),
    Setting("admission_log", "FLEET_ADMISSION_LOG", "", str,
            "Log the job-started hook appends its decisions to (default: <state>/admission.log)."),
)


@dataclass(frozen=True)
class LiveSetting:
    key: str
    env: str
    default: Any
    low: float | None
    high: float | None
    help: str
    choices: tuple[str, ...] = ()
    shown: str = ""  # the default in words, when it depends on the host (the ceiling)

    @property
    def kind(self) -> str:
        if self.choices:
            return "choice"
        return "integer" if isinstance(self.default, int) else "number"

    def check(self, value: Any) -> Any:
        """The value as stored, or BadRequest naming the type or range it missed."""
        if self.choices:
            if not isinstance(value, str) or value not in self.choices:
                raise BadRequest(f"{self.key} must be one of {', '.join(self.choices)}")
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(f"{self.key} must be a number")
        if self.kind == "integer":
            if isinstance(value, float) and not value.is_integer():
                raise BadRequest(f"{self.key} must be a whole number")
            value = int(value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"{self.key} must be a finite number")
        assert self.low is not None and self.high is not None
        if not self.low <= value <= self.high:
            raise BadRequest(f"{self.key} must be from {_num(self.low)} to {_num(self.high)}")
        return value if self.kind == "integer" else float(value)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "type": self.kind, "default": self.default,
                               "env": self.env, "help": self.help}
        if self.choices:
            out["choices"] = list(self.choices)
        else:
            out["min"], out["max"] = _num(self.low), _num(self.high)
        return out


def _num(value: float | None) -> float | int | None:
    if value is not None and float(value).is_integer():
        return int(value)
    return value


LIVE_SETTINGS: tuple[LiveSetting, ...] = (
    LiveSetting("ceiling", "FLEET_CEILING", os.cpu_count() or 1, 1, 256,
                "Most runners this host keeps (and so most jobs at once); default: its cores.",
                shown="the host's cores"),
    LiveSetting("max_per_repo", "FLEET_MAX_PER_REPO", 4, 1, 64,
                "Most runners one repository may have on this host."),
    LiveSetting("min_free_mem_mb", "FLEET_MIN_FREE_MEM_MB", 512, 0, 1 << 22,
                "No new runner when less memory than this is available."),
    LiveSetting("max_load_per_core", "FLEET_MAX_LOAD_PER_CORE", 1.5, 0.1, 64.0,
                "No new runner when the 1-minute load per core is above this."),
    LiveSetting("min_free_disk_gb", "FLEET_MIN_FREE_DISK_GB", 2.0, 0.0, 1e6,
                "No new runner when the runner root's disk has less free space than this."),
    LiveSetting("tick_s", "FLEET_TICK_S", 10.0, 0.2, 3600.0,
                "Seconds between snapshots while every runner is idle."),
    LiveSetting("busy_tick_s", "FLEET_BUSY_TICK_S", 3.0, 0.2, 3600.0,
                "Seconds between snapshots while any runner is busy."),
    LiveSetting("github_s", "FLEET_GITHUB_S", 30.0, 0.5, 3600.0,
                "Seconds between GitHub API refreshes (conditional requests, ETag-cached)."),
    LiveSetting("stuck_queue_s", "FLEET_STUCK_QUEUE_S", 900, 30, 86400,
                "A run queued longer than this raises a drift alert."),
    LiveSetting("grouping", "FLEET_GROUPING", "repo", None, None,
                "How the snapshot groups runners: by repo, by owner, or by label set.",
                ("repo", "owner", "labels")),
    LiveSetting("history_s", "FLEET_HISTORY_S", 300.0, 0.5, 86400.0,
                "Seconds between job-history rounds (collection, forecast)."),
    LiveSetting("workflows_s", "FLEET_WORKFLOWS_S", 3600.0, 1.0, 86400.0,
                "Seconds between listings of the workflow files on the default branch."),
    LiveSetting("heartbeat_s", "FLEET_HEARTBEAT_S", 15.0, 0.5, 3600.0,
                "Agent mode: seconds between heartbeats to the coordinator."),
    LiveSetting("stale_after_s", "FLEET_STALE_AFTER_S", 60.0, 1.0, 86400.0,
                "An agent host whose last heartbeat is older than this is marked stale."),
    LiveSetting("agent_tokens", "FLEET_AGENT_TOKENS", "any", None, None,
                "Coordinator: which tokens agent hosts may report with: any (the shared agent "
                "token or a host token), or host (host tokens only: each speaks for its own "
                "name).", ("any", "host")),
    LiveSetting("autoscale", "FLEET_AUTOSCALE", "off", None, None,
                "Autoscale decisions: off, or on (then see autoscale_mode).", ("off", "on")),
    LiveSetting("autoscale_mode", "FLEET_AUTOSCALE_MODE", "dry-run", None, None,
                "dry-run proposes only; execute runs the decisions through the action path.",
                ("dry-run", "execute")),
    LiveSetting("autoscale_cooldown_s", "FLEET_AUTOSCALE_COOLDOWN_S", 600, 0, 86400,
                "Seconds after an executed autoscale action before the next for that repo."),
    LiveSetting("autoscale_idle_s", "FLEET_AUTOSCALE_IDLE_S", 1800, 0, 604800,
                "Seconds a duplicate runner must be idle before autoscale removes it."),
)

BY_KEY = {s.key: s for s in LIVE_SETTINGS}


def _shown(setting: LiveSetting) -> str:
    return setting.shown or str(setting.default)


def _allowed(setting: LiveSetting) -> str:
    if setting.choices:
        return ", ".join(setting.choices)
    return f"{_num(setting.low)} to {_num(setting.high)}"


def live_markdown_table() -> str:
    """The live settings as docs/configuration.md lists them (scripts/gen_config_docs.py)."""
    lines = ["| Key | Variable | Default | Allowed | Meaning |", "|---|---|---|---|---|"]
    for s in LIVE_SETTINGS:
        lines.append(f"| `{s.key}` | `{s.env}` | {_shown(s)} | {_allowed(s)} | {s.help} |")
    return "\n".join(lines)


def live_help() -> str:
    """The live settings for `fleet-min controlplane --help`."""
    lines = ["", "Live settings: read from the environment at start, changed at run time with",
             "POST /api/settings (a stored value wins over the environment):", ""]
    for s in LIVE_SETTINGS:
        lines.append(f"  {s.env} (default: {_shown(s)}; {_allowed(s)}; key {s.key})")
        lines += textwrap.wrap(s.help, 88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def lookup(key: Any) -> LiveSetting:
    if not isinstance(key, str) or not key:
        raise BadRequest("key must be a setting name such as \"ceiling\"")
    setting = BY_KEY.get(key)
    if setting is None:
        raise BadRequest(f"unknown setting {key!r}; GET /api/settings lists them")
    return setting


class LiveValues:
    """The current live values: stored (from the database) over environment over default."""

    def __init__(self, stored: Mapping[str, Any], environ: Mapping[str, str]) -> None:
        self.stored = dict(stored)
        self.env: dict[str, Any] = {}
        for setting in LIVE_SETTINGS:
            raw = environ.get(setting.env)
            if raw in (None, ""):
                continue
            parsed: Any = raw if setting.choices else _parse_number(raw)
            try:
                self.env[setting.key] = setting.check(parsed)
            except BadRequest as exc:
                raise ValueError(f"{setting.env}: {exc.message}") from None

    def get(self, key: str) -> Any:
        if key in self.stored:
            return self.stored[key]
        if key in self.env:
            return self.env[key]
        return BY_KEY[key].default

    def source(self, key: str) -> str:
        return "stored" if key in self.stored else "env" if key in self.env else "default"

    def listing(self) -> list[dict[str, Any]]:
        return [{**s.describe(), "value": self.get(s.key), "source": self.source(s.key)}
                for s in LIVE_SETTINGS]


def _parse_number(raw: str) -> float | int | str:
    try:
        return int(raw)
    except ValueError:
        try:
            return float(raw)
        except ValueError:
            return raw
