"""Every setting in one table: name, environment variable, default, type, help.

The CLI builds its flags from this table and `docs/configuration.md` lists it, so a setting is
added in exactly one place. Precedence: command-line flag, then environment, then default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str  # attribute name on the resolved config
    env: str
    default: Any
    kind: Callable[[str], Any]
    help: str
    flag: str | None = None  # command-line flag, when the setting has one


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be a positive number, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a port number from 0 to 65535, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"must be 1/0, true/false, yes/no or on/off, got {text!r}")


COLLECTOR_SETTINGS: tuple[Setting, ...] = (
    Setting("bind", "FLEET_BIND", ("0.0.0.0",), _csv,
            "Comma-separated addresses to listen on. Default: every interface (a warning is "
            "logged; loopback plus a private mesh address is recommended).", "--bind"),
    Setting("port", "FLEET_PORT", 8788, _port, "TCP port.", "--port"),
    Setting("data_dir", "FLEET_DATA_DIR", "./fleet-data", str,
            "Directory for the SQLite database, artifacts and the stable collector id.", "--data"),
    Setting("name", "FLEET_NAME", "", str,
            "Display name of this collector (default: the host name)."),
    Setting("long_poll_s", "FLEET_LONG_POLL_S", 25.0, _positive_float,
            "How long a next-job poll is held before answering 204."),
    Setting("sweep_s", "FLEET_SWEEP_S", 15.0, _positive_float,
            "Interval of the lease sweep (it also runs at start-up and on POST /jobs/sweep)."),
    Setting("max_json_bytes", "FLEET_MAX_JSON_BYTES", 1 << 20, _positive_int,
            "Largest JSON request body accepted (413 above it)."),
    Setting("synchronous", "FLEET_SQLITE_SYNCHRONOUS", "FULL", str,
            "SQLite synchronous mode. FULL survives a power cut; NORMAL survives a crash only."),
    Setting("log_level", "FLEET_LOG_LEVEL", "INFO", str, "Log level (DEBUG, INFO, WARNING)."),
)


@dataclass
class Config:
    values: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, item: str) -> Any:
        try:
            return self.values[item]
        except KeyError:
            raise AttributeError(item) from None


class ConfigError(ValueError):
    pass


def resolve(settings: Sequence[Setting], flags: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
    """Resolve every setting: explicit override, then flag, then environment, then default."""
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
    return Config(values)


def add_flags(parser: argparse.ArgumentParser, settings: Sequence[Setting]) -> None:
    for setting in settings:
        if setting.flag:
            parser.add_argument(setting.flag, dest=setting.name, default=None,
                                help=f"{setting.help} Env: {setting.env}.")


def markdown_table(settings: Sequence[Setting]) -> str:
    """The table docs/configuration.md carries; a test keeps the doc in step with this."""
    lines = ["| Variable | Flag | Default | Meaning |", "|---|---|---|---|"]
    for s in settings:
        default = ",".join(s.default) if isinstance(s.default, tuple) else s.default
        lines.append(f"| `{s.env}` | {f'`{s.flag}`' if s.flag else ''} | `{default}` | {s.help} |")
    return "\n".join(lines)
