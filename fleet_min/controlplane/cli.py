"""`fleet-min controlplane [options]` runs the daemon; `fleet-min controlplane token [--agent]`
prints a token (creating it when missing)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet_min import filemodes, heap, jsonio, logs, serving
from fleet_min.config import ConfigError, add_flags, help_epilog, resolve
from fleet_min.controlplane import tokens
from fleet_min.controlplane.federation.hosts import check_host
from fleet_min.controlplane.federation.link import (
    check_token_host,
    coordinator_token,
    coordinator_token_file,
)
from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS, LiveValues, live_help
from fleet_min.controlplane.state import own_host_name
from fleet_min.errors import Refused

log = logging.getLogger("fleet_min.controlplane")


def _token_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fleet-min controlplane token",
        description="Print the control token (or the agent token, or a host token).")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--agent", action="store_true",
                       help="print the agent token, creating a separate one if there is none")
    which.add_argument("--agent-host", default=None, metavar="NAME",
                       help="print a host token: the agent token narrowed to the agent host "
                            "NAME (its FLEET_HOST_NAME), which may speak for that host only")
    parser.add_argument("--state", dest="state_dir", default=None,
                        help="state directory (default: FLEET_STATE_DIR or ~/.config/fleet-min)")
    args = parser.parse_args(argv)
    try:
        cfg = resolve(CONTROLPLANE_SETTINGS, {"state_dir": args.state_dir})
        host = check_host(args.agent_host) if args.agent_host is not None else None
    except (ConfigError, Refused) as exc:
        print(f"fleet-min controlplane: {exc}", file=sys.stderr)
        return 2
    state = Path(cfg.state_dir).expanduser()
    try:
        if host is not None:
            # Made from the agent token the daemon holds now (the control token while there is
            # no separate one), so it is good at once, without a restart.
            print(tokens.host_token(tokens.agent_token(state, tokens.ensure_token(state)), host))
            return 0
        name = tokens.AGENT_FILE if args.agent else tokens.CONTROL_FILE
        print(tokens.ensure_token(state, name))
    except OSError as exc:
        print(f"fleet-min controlplane token: cannot use the state directory {cfg.state_dir}: "
              f"{_why(exc, state)}", file=sys.stderr)
        return 1
    return 0


def _why(exc: OSError, state: Path) -> str:
    """An OSError as the end of a sentence about the state directory, naming the file it was
    about when that is not the directory itself (a NotPrivate reason names it already)."""
    if isinstance(exc, (FileExistsError, NotADirectoryError)) and not state.is_dir():
        return "it is a file, not a directory" if state.exists() else \
            "a file stands where a directory on its path should be"
    text = exc.strerror or str(exc)
    text = text[:1].lower() + text[1:]
    if exc.filename and Path(exc.filename) != state and not isinstance(
            exc, filemodes.NotPrivate):
        text += f" ({exc.filename})"
    return text


def _announce(cfg: Any) -> Callable[[list[tuple[str, int]]], None]:
    def announce(bound: list[tuple[str, int]]) -> None:
        heap.settle_after_start()
        urls = ", ".join(f"http://{serving.url_host(host)}:{port}" for host, port in bound)
        log.info("controlplane listening on %s, state in %s", urls, cfg.state_dir)
        # Tests and scripts read this line on stdout to learn the port when --port 0 asked for
        # a free one.
        print(f"fleet-min controlplane listening on {urls.split(', ')[0]}", flush=True)
    return announce


def _run(cfg: Any) -> int:
    """Own the state directory, bind, run until a signal; the exit code."""
    from fleet_min.controlplane.http.app import create_app

    return serving.run("controlplane", Path(cfg.state_dir).expanduser(), cfg.state_dir,
                       "state directory", [cfg.host], cfg.port, lambda: create_app(cfg),
                       grace_s=cfg.stop_grace_s, announce=_announce(cfg),
                       log_file=cfg.log_file, dir_mode=filemodes.CONTROLPLANE_DIR,
                       peer_connections=cfg.max_peer_connections)


def main(argv: list[str]) -> int:
    """`fleet-min controlplane [--coordinator URL] ...`: with --coordinator this host runs as an
    agent of that coordinator (it reads the agent token from FLEET_COORDINATOR_TOKEN_FILE,
    default <state>/coordinator-token)."""
    if argv and argv[0] == "token":
        return _token_command(argv[1:])
    parser = argparse.ArgumentParser(
        prog="fleet-min controlplane",
        description="Supervise this host's GitHub Actions runners and serve their dashboard "
                    "API.\n\n`fleet-min controlplane token [--agent | --agent-host NAME]` "
                    "prints a token (its own --help).",
        epilog=help_epilog(CONTROLPLANE_SETTINGS, live_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, CONTROLPLANE_SETTINGS)
    args = parser.parse_args(argv)
    try:
        cfg = resolve(CONTROLPLANE_SETTINGS, vars(args))

        LiveValues({}, os.environ)  # refuse a bad FLEET_CEILING etc. now, not at the first tick
        if cfg.coordinator:  # an agent without its token, or with another host's, cannot start
            check_token_host(coordinator_token(coordinator_token_file(cfg)), own_host_name(cfg))
    except (ConfigError, ValueError) as exc:
        print(f"fleet-min controlplane: {exc}", file=sys.stderr)
        return 2
    logs.setup(cfg.log_level, cfg.log_file)  # one line per event; SIGHUP reopens, never stops
    if jsonio.REFUSED:  # an orjson too old to trust: say so once, at start
        log.warning("%s", jsonio.REFUSED)
    return _run(cfg)
