"""Every setting in one table: name, environment variable, default, type, help.

The CLI builds its flags from this table and `docs/configuration.md` lists it, so a setting is
added in exactly one place. Precedence: command-line flag, then environment, then default.

`resolve` turns a table into its service's typed configuration (CollectorConfig here, the
control plane's ControlPlaneConfig beside its table): a frozen dataclass with one field per
setting, so mypy checks every `config.name` read. tests/test_config_types.py holds each table
and its class to the same names and types.
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast, overload
from urllib.parse import urlsplit

from fleet_min.origin import ALLOWED_HOSTS_ENV, host_patterns


@dataclass(frozen=True)
class Setting:
    name: str  # attribute name on the resolved config
    env: str
    default: Any
    kind: Callable[[str], Any]
    help: str
    flag: str | None = None  # command-line flag, when the setting has one


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a positive number, got {text!r}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a port number from 0 to 65535, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def csv_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """A byte count: 1048576, 512K, 500M, 16G (binary units; a trailing B or iB is allowed)."""
    cleaned = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = cleaned[-1:] if cleaned[-1:] in _SIZE_UNITS else ""
    try:
        value = int(float(cleaned[:len(cleaned) - len(unit)]) * _SIZE_UNITS[unit])
    except ValueError:
        raise ValueError(f"must be a size such as 1048576, 500M or 16G, got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be a positive size, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"must be a number, 0 or more, got {text!r}")
    return value


def timezone_name(text: str) -> str:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    name = text.strip()
    if name:
        try:
            ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{name[:60]!r} is not a time zone name such as Europe/Berlin") \
                from None
    return name


def http_url(text: str) -> str:
    """An http(s) URL with a host and, when it gives one, a port that is one; "" for none."""
    url = text.strip()
    if not url:
        return url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"must be an http:// or https:// URL, got {shown_url(url)!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port past 65535 or not a number
    except ValueError:
        raise ValueError(f"must be a URL with a valid host and port, got {shown_url(url)!r}"
                         ) from None
    if not parts.hostname:
        raise ValueError(f"must name a host, got {shown_url(url)!r}")
    return url.rstrip("/") if url.count("/") > 2 else url


def shown_url(url: str) -> str:
    """A URL as a refusal may quote it: its scheme and host, without a user or password and
    without its path or query, where a webhook carries its secret. The refusal is the start-up
    error, which the service manager's journal keeps."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url[:12] + ("..." if len(url) > 12 else "")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    host = authority.rpartition("@")[2]
    return f"{scheme[:12]}://{host[:80]}" + ("/..." if len(rest) > len(authority) else "")


def flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"must be 1/0, true/false, yes/no or on/off, got {text!r}")


def peer_connections(text: str) -> str:
    """FLEET_MAX_PEER_CONNECTIONS: auto, or a count of connections (0 turns the rule off); the
    count stays text because auto is only a number once the descriptor limit is known
    (fleet_min.serving.peer_share)."""
    cleaned = text.strip().lower()
    if cleaned == "auto":
        return cleaned
    try:
        value = int(cleaned)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"must be auto or a number of connections (0 turns the rule off), "
                         f"got {text[:80]!r}")
    return str(value)


PEER_CONNECTIONS_HELP = (
    "The most connections one peer may hold at once: an IPv4 address, an IPv6 /64 (loopback "
    "and Unix sockets are exempt); past it, that peer's new connections are closed at once. "
    "auto is a quarter of the connection cap (the descriptor limit less a reserve), 64 at "
    "least, so no one neighbour can take every connection and lock out the agents, dashboards "
    "and health checks. A host executor driving many devices, or agents behind one NAT or "
    "proxy address, may need more: set a number (and raise LimitNOFILE= or ulimit -n to "
    "match); 0 turns the rule off.")

_FLAG_TRUE = {"1", "true", "yes", "on"}
_FLAG_FALSE = {"0", "false", "no", "off", ""}


def proxy_networks(text: str) -> tuple[str, ...]:
    """FLEET_TRUST_PROXY: the proxies whose X-Forwarded-For is believed, as addresses or networks
    (127.0.0.1, 10.0.0.0/8, ::1). 0/false/off: none. The old 1/true spelling believed any peer;
    it is refused rather than quietly given a narrower meaning, so nothing a proxy on another
    host sends is suddenly read as coming from that proxy's own (LAN) address."""
    import ipaddress

    lowered = text.strip().lower()
    if lowered in _FLAG_FALSE:
        return ()
    if lowered in _FLAG_TRUE:
        raise ValueError(f"{text.strip()!r} no longer switches proxy trust on: name the proxies "
                         "whose X-Forwarded-For header is believed, e.g. 127.0.0.1 for a proxy on "
                         "this host, or 10.0.0.5,fd00::/8")
    networks = []
    for part in csv_list(text):
        try:
            networks.append(str(ipaddress.ip_network(part, strict=False)))
        except ValueError:
            raise ValueError(f"{part[:80]!r} is not an address or network such as 127.0.0.1 or "
                             "10.0.0.0/8") from None
    return tuple(dict.fromkeys(networks))


_REPO_NAME = re.compile(r"[a-z0-9_.-]{1,100}")


def repo_patterns(text: str) -> tuple[str, ...]:
    """FLEET_CI_STATUS_REPOS: `owner/repo` and `owner/*` entries, compared case-insensitively
    (as GitHub compares names). `.` and `..` are never names: they would walk the API's path."""
    patterns = []
    for part in csv_list(text):
        owner, slash, repo = part.lower().partition("/")
        if not slash or not all(_REPO_NAME.fullmatch(n) and n not in (".", "..")
                                for n in (owner, repo if repo != "*" else "x")):
            raise ValueError(f"{part[:80]!r} is not owner/repo or owner/* (letters, digits, "
                             "'.', '_' and '-')")
        patterns.append(f"{owner}/{repo}")
    return tuple(dict.fromkeys(patterns))


C = TypeVar("C")


class SettingsTable(Sequence[Setting], Generic[C]):
    """A service's settings, in the order its help and docs list them, and the class of the
    configuration `resolve` builds from them."""

    def __init__(self, config: type[C], *settings: Setting) -> None:
        self.config = config
        self._settings = settings

    @overload
    def __getitem__(self, index: int) -> Setting: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Setting]: ...

    def __getitem__(self, index: int | slice) -> Setting | Sequence[Setting]:
        return self._settings[index]

    def __len__(self) -> int:
        return len(self._settings)

    def __iter__(self) -> Iterator[Setting]:
        return iter(self._settings)


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    """The collector's resolved settings (COLLECTOR_SETTINGS says what each one means)."""

    bind: tuple[str, ...]
    port: int
    data_dir: str
    name: str
    long_poll_s: float
    sweep_s: float
    max_json_bytes: int
    synchronous: str
    log_level: str
    stop_grace_s: float
    max_devices: int
    max_artifact_bytes: int
    max_mirror_bytes: int
    max_mirror_held_bytes: int
    write_stall_s: float
    max_peer_connections: str
    schedule_tz: str
    schedule_tick_s: float
    alert_tick_s: float
    alert_offline_s: float
    alert_beacon_fresh_s: float
    alert_stuck_factor: float
    alert_job_failed_window_s: float
    alert_battery_pct: float
    alert_thermal_states: tuple[str, ...]
    alert_schedule_late_s: float
    alert_regression_pct: float
    alert_data_bytes: int
    alert_log_bytes: int
    alert_free_bytes: int
    alert_log_paths: tuple[str, ...]
    alert_webhook: str
    alert_webhook_attempts: int
    alert_webhook_backoff_s: float
    alert_webhook_timeout_s: float
    retain_beacons_days: float
    retain_events_days: float
    retain_alerts_days: float
    retention_auto: bool
    log_file: str
    sse_keepalive_s: float
    allowed_hosts: tuple[str, ...]
    dash_token: str
    mesh_allow: tuple[str, ...]
    mesh_whois: str
    trust_proxy: tuple[str, ...]
    peers: tuple[str, ...]
    mdns: bool
    github_api: str
    ci_status_token: str
    github_token: str
    ci_status_repos: tuple[str, ...]


COLLECTOR_SETTINGS: SettingsTable[CollectorConfig] = SettingsTable(
    CollectorConfig,
    Setting("bind", "FLEET_BIND", ("0.0.0.0",), csv_list,
            "Comma-separated addresses to listen on; 0.0.0.0 is every interface (a warning is "
            "logged: loopback plus a private mesh address is recommended).", "--bind"),
    Setting("port", "FLEET_PORT", 8788, port_number, "TCP port.", "--port"),
    Setting("data_dir", "FLEET_DATA_DIR", "./fleet-data", str,
            "Directory for the SQLite database, artifacts and the stable collector id.", "--data"),
    Setting("name", "FLEET_NAME", "", str,
            "Display name of this collector (default: the host name)."),
    Setting("long_poll_s", "FLEET_LONG_POLL_S", 25.0, positive_float,
            "How long a next-job poll is held before answering 204."),
    Setting("sweep_s", "FLEET_SWEEP_S", 15.0, positive_float,
            "Interval of the lease sweep (it also runs at start-up and on POST /jobs/sweep)."),
    Setting("max_json_bytes", "FLEET_MAX_JSON_BYTES", 1 << 20, positive_int,
            "Largest JSON request body accepted (413 above it)."),
    Setting("synchronous", "FLEET_SQLITE_SYNCHRONOUS", "FULL", str,
            "SQLite synchronous mode. FULL survives a power cut; NORMAL survives a crash only."),
    Setting("log_level", "FLEET_LOG_LEVEL", "INFO", str, "Log level (DEBUG, INFO, WARNING)."),
    Setting("stop_grace_s", "FLEET_STOP_GRACE_S", 3.0, positive_float,
            "On SIGTERM or SIGINT, how long requests in progress (an upload) get to finish "
            "before they are cut; long polls and streams end at once, a second signal exits."),
    Setting("max_devices", "FLEET_MAX_DEVICES", 25000, positive_int,
            "Most devices the registry holds. Past it a new device takes the place of a "
            "temporary one (a browser runner's) that left the shelf, or is refused with 507; "
            "one already registered may always register again. Every device listing reads "
            "them all, so a bound keeps a flood of registrations from making each listing "
            "gigabytes."),
    # artifacts
    Setting("max_artifact_bytes", "FLEET_MAX_ARTIFACT_BYTES", 4 << 30, byte_size,
            "Largest artifact accepted by POST /artifacts (413 above it; a larger declared "
            "length is refused before the body is sent)."),
    Setting("max_mirror_bytes", "FLEET_MAX_MIRROR_BYTES", 1 << 20, byte_size,
            "Largest live-mirror frame accepted by POST /api/jobs/{id}/mirror (413 above it)."),
    Setting("max_mirror_held_bytes", "FLEET_MAX_MIRROR_HELD_BYTES", 64 << 20, byte_size,
            "Most bytes of live-mirror frames held in memory at once, over all jobs, the "
            "frames viewers are still being sent included. Past it viewers still being sent "
            "a replaced frame are cut, then the frames posted longest ago are let go (each "
            "job's comes back with its next post); the newest frame is always kept."),
    Setting("write_stall_s", "FLEET_WRITE_STALL_S", 60.0, positive_float,
            "Seconds a client may take nothing of an answer before its connection is cut: a "
            "streamed answer's next piece (an artifact download's 1 MiB, a live-mirror frame), "
            "or any other answer once more than 64 KiB of it waits for the client."),
    Setting("max_peer_connections", "FLEET_MAX_PEER_CONNECTIONS", "auto", peer_connections,
            PEER_CONNECTIONS_HELP),
    # scheduler and alerts
    Setting("schedule_tz", "FLEET_SCHEDULE_TZ", "", timezone_name,
            "IANA time zone cron expressions are read in; empty means the host's local time."),
    Setting("schedule_tick_s", "FLEET_SCHEDULE_TICK_S", 20.0, positive_float,
            "Scheduler tick period, aligned to multiples of it on the clock."),
    Setting("alert_tick_s", "FLEET_ALERT_TICK_S", 60.0, positive_float,
            "Alert rule evaluation period."),
    Setting("alert_offline_s", "FLEET_ALERT_OFFLINE_S", 900.0, positive_float,
            "A device an operator named that is unseen this long raises device-offline."),
    Setting("alert_beacon_fresh_s", "FLEET_ALERT_BEACON_FRESH_S", 900.0, positive_float,
            "Beacons older than this no longer raise thermal or battery alerts."),
    Setting("alert_stuck_factor", "FLEET_ALERT_STUCK_FACTOR", 2.0, positive_float,
            "A claimed job with no result rows for this many lease TTLs raises job-stuck."),
    Setting("alert_job_failed_window_s", "FLEET_ALERT_JOB_FAILED_WINDOW_S", 86400.0,
            positive_float, "How long a job-failed alert stays open."),
    Setting("alert_battery_pct", "FLEET_ALERT_BATTERY_PCT", 15.0, positive_float,
            "Battery percentage under which a device that is not charging raises low-battery."),
    Setting("alert_thermal_states", "FLEET_ALERT_THERMAL_STATES",
            ("serious", "severe", "critical", "emergency", "shutdown"), csv_list,
            "Beacon thermal values that raise thermal-critical."),
    Setting("alert_schedule_late_s", "FLEET_ALERT_SCHEDULE_LATE_S", 300.0, positive_float,
            "How late a due schedule run must be to raise schedule-missed."),
    Setting("alert_regression_pct", "FLEET_ALERT_REGRESSION_PCT", 20.0, positive_float,
            "A benchmark whose decode tok/s falls this many percent under the median of its "
            "earlier runs (same device and configuration) raises benchmark-regressed."),
    Setting("alert_data_bytes", "FLEET_ALERT_DATA_BYTES", 16 << 30, byte_size,
            "Database plus artifacts size that raises disk-size."),
    Setting("alert_log_bytes", "FLEET_ALERT_LOG_BYTES", 1 << 30, byte_size,
            "Log size that raises disk-size."),
    Setting("alert_free_bytes", "FLEET_ALERT_FREE_BYTES", 1 << 30, byte_size,
            "Free space on the data disk under which disk-size is raised."),
    Setting("alert_log_paths", "FLEET_ALERT_LOG_PATHS", (), csv_list,
            "Files or directories counted as logs for disk-size (the log file is counted too)."),
    Setting("alert_webhook", "FLEET_ALERT_WEBHOOK", "", http_url,
            "URL that receives each new alert once as a JSON POST."),
    Setting("alert_webhook_attempts", "FLEET_ALERT_WEBHOOK_ATTEMPTS", 10, positive_int,
            "Delivery attempts for one alert before it is marked failed."),
    Setting("alert_webhook_backoff_s", "FLEET_ALERT_WEBHOOK_BACKOFF_S", 2.0, positive_float,
            "First webhook retry delay; it doubles on each attempt (with jitter, at most 300 s)."),
    Setting("alert_webhook_timeout_s", "FLEET_ALERT_WEBHOOK_TIMEOUT_S", 10.0, positive_float,
            "Timeout of one webhook attempt."),
    # retention, stream, system
    Setting("retain_beacons_days", "FLEET_RETAIN_BEACONS_DAYS", 30.0, non_negative_float,
            "Beacons older than this many days are pruned by retention (0 keeps them)."),
    Setting("retain_events_days", "FLEET_RETAIN_EVENTS_DAYS", 30.0, non_negative_float,
            "Topic events older than this many days are pruned by retention (0 keeps them)."),
    Setting("retain_alerts_days", "FLEET_RETAIN_ALERTS_DAYS", 90.0, non_negative_float,
            "Alerts resolved longer ago than this many days are pruned (0 keeps them)."),
    Setting("retention_auto", "FLEET_RETENTION_AUTO", True, flag,
            "Apply retention a minute after start and then daily; false applies it only on "
            "request (POST /api/system/retention)."),
    Setting("log_file", "FLEET_LOG_FILE", "", str,
            "Write the log to this file (reopened on SIGHUP, for logrotate) instead of stderr."),
    Setting("sse_keepalive_s", "FLEET_SSE_KEEPALIVE_S", 15.0, positive_float,
            "Interval of keep-alive comments on /api/stream."),
    # access, peers, discovery, CI status
    Setting("allowed_hosts", ALLOWED_HOSTS_ENV, (), host_patterns,
            "Host names (comma-separated; `*.example.lan` patterns allowed) this collector "
            "answers to besides IP addresses, localhost and its own host names; any other Host "
            "gets 421 (a guard against DNS rebinding). `*` admits every name."),
    Setting("dash_token", "FLEET_DASH_TOKEN", "", str,
            "When set, dashboard changes need this value in the X-Fleet-Token header; unset "
            "leaves them open. POST /jobs and agent routes stay open either way."),
    Setting("mesh_allow", "FLEET_MESH_ALLOW", (), csv_list,
            "Mesh node names (exact) allowed to use the agent routes (register, poll, "
            "results and beacons, release) from 100.64.0.0/10 and fd7a:115c:a1e0::/48; a "
            "device then answers only to the node it registered from, an executor name to the "
            "node that first used it. Unset admits everyone."),
    Setting("mesh_whois", "FLEET_MESH_WHOIS", "tailscale", str,
            "Identity lookup program, run as `<program> whois --json <ip>`."),
    Setting("trust_proxy", "FLEET_TRUST_PROXY", (), proxy_networks,
            "Comma-separated addresses or networks of the reverse proxies whose "
            "X-Forwarded-For header is believed (e.g. 127.0.0.1 for a proxy on this host); "
            "from any other peer the header is ignored. Unset or 0: believed from nobody. The "
            "old spelling 1/true is refused at start."),
    Setting("peers", "FLEET_PEERS", (), csv_list,
            "Addresses of other collectors to read (host:port or http(s)://host:port)."),
    Setting("mdns", "FLEET_MDNS", False, flag,
            "Advertise this collector on the LAN as _fleet-collector._tcp.local."),
    Setting("github_api", "FLEET_GITHUB_API", "https://api.github.com", http_url,
            "Base URL of GitHub's API for commit statuses (GitHub Enterprise or a test fake)."),
    Setting("ci_status_token", "FLEET_CI_STATUS_TOKEN", "", str,
            "Token for posting commit statuses; without one (and without GITHUB_TOKEN) they "
            "are recorded as dry runs."),
    Setting("github_token", "GITHUB_TOKEN", "", str,
            "Fallback token for commit statuses when FLEET_CI_STATUS_TOKEN is unset."),
    Setting("ci_status_repos", "FLEET_CI_STATUS_REPOS", (), repo_patterns,
            "Comma-separated repositories (owner/repo) and owners (owner/*) commit statuses "
            "may be posted to. When set, POST /jobs refuses a report_to.ci_status outside it "
            "(400). With a token but no list, no status is posted."),
)


class ConfigError(ValueError):
    pass


def resolve(settings: SettingsTable[C], flags: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None, **overrides: Any) -> C:
    """Resolve every setting: explicit override, then flag, then environment, then default.
    Overrides that name no setting are left out."""
    env = os.environ if environ is None else environ
    given = dict(flags or {})
    values: dict[str, Any] = {}
    for setting in settings:
        if setting.name in overrides:
            values[setting.name] = overrides[setting.name]
            continue
        raw = given.get(setting.name)
        source = setting.flag
        if raw is None and env.get(setting.env) not in (None, ""):
            raw, source = env[setting.env], setting.env
        if raw is None:
            values[setting.name] = setting.default
            continue
        try:
            values[setting.name] = setting.kind(raw) if isinstance(raw, str) else raw
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return cast(Any, settings.config)(**values)  # one keyword per field (test_config_types)


def shown_default(value: Any) -> str:
    """A default as a person writes it in the environment: lists comma-separated, flags as
    true/false; "" when there is none."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = ",".join(value)
    return str(value)


def add_flags(parser: argparse.ArgumentParser, settings: Sequence[Setting]) -> None:
    for setting in settings:
        if setting.flag:
            shown = shown_default(setting.default) or "none"
            text = f"{setting.help} (default: {shown}; env {setting.env})"
            parser.add_argument(setting.flag, dest=setting.name, default=None,
                                help=text.replace("%", "%%"))


def help_epilog(settings: Sequence[Setting], extra: str = "") -> str:
    """The `--help` text for the settings without a flag: variable, default, meaning."""
    lines = ["Settings without a flag are read from the environment. A flag wins over its",
             "variable, which wins over the default (docs/configuration.md lists them all):",
             ""]
    for s in settings:
        if not s.flag:
            lines.append(f"  {s.env} (default: {shown_default(s.default) or 'none'})")
            lines += textwrap.wrap(s.help, 88, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return "\n".join(lines) + extra


def markdown_table(settings: Sequence[Setting]) -> str:
    """The table docs/configuration.md carries; a test keeps the doc in step with this."""
    lines = ["| Variable | Flag | Default | Meaning |", "|---|---|---|---|"]
    for s in settings:
        shown = shown_default(s.default)
        default = f"`{shown}`" if shown else "(none)"
        lines.append(f"| `{s.env}` | {f'`{s.flag}`' if s.flag else ''} | {default} | {s.help} |")
    return "\n".join(lines)
