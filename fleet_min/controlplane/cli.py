"""`fleet-min controlplane [options]` runs the daemon; `fleet-min controlplane token [--agent]`
prints a token (creating it when missing)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from fleet_min import heap, jsonio, logs
from fleet_min.config import ConfigError, add_flags, resolve
from fleet_min.controlplane import tokens
from fleet_min.controlplane.agent_link import coordinator_token, coordinator_token_file
from fleet_min.controlplane.settings import CONTROLPLANE_SETTINGS, LiveValues

log = logging.getLogger("fleet_min.controlplane")


def _token_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleet-min controlplane token",
                                     description="Print the control token (or the agent token).")
    parser.add_argument("--agent", action="store_true",
                        help="print the agent token, creating a separate one if there is none")
    parser.add_argument("--state", dest="state_dir", default=None,
                        help="state directory (default: FLEET_STATE_DIR or ~/.config/fleet-min)")
    args = parser.parse_args(argv)
    try:
        cfg = resolve(CONTROLPLANE_SETTINGS, {"state_dir": args.state_dir})
    except ConfigError as exc:
        print(f"fleet-min controlplane: {exc}", file=sys.stderr)
        return 2
    state = Path(cfg.state_dir).expanduser()
    name = tokens.AGENT_FILE if args.agent else tokens.CONTROL_FILE
    print(tokens.ensure_token(state, name))
    return 0


async def _serve(app: web.Application, host: str, port: int) -> None:
    # keepalive_timeout also closes a connection that never completes a request (slow loris);
    # AppRunner's default is aiohttp's 3630 s, web.run_app's (the collector) 75 s.
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=3.0, access_log=None,
                           keepalive_timeout=75.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    heap.settle_after_start()
    bound = runner.addresses[0][1] if runner.addresses else port
    # Tests and scripts read this line to learn the port when --port 0 asked for a free one.
    print(f"fleet-min controlplane listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    """`fleet-min controlplane [--coordinator URL] ...`: with --coordinator this host runs as an
    agent of that coordinator (it reads the agent token from FLEET_COORDINATOR_TOKEN_FILE,
    default <state>/coordinator-token)."""
    if argv and argv[0] == "token":
        return _token_command(argv[1:])
    parser = argparse.ArgumentParser(prog="fleet-min controlplane",
                                     description="Supervise this host's GitHub Actions runners "
                                                 "and serve their dashboard API.")
    add_flags(parser, CONTROLPLANE_SETTINGS)
    args = parser.parse_args(argv)
    try:
        cfg = resolve(CONTROLPLANE_SETTINGS, vars(args))

        LiveValues({}, os.environ)  # refuse a bad FLEET_CEILING etc. now, not at the first tick
        if cfg.coordinator:
            coordinator_token(coordinator_token_file(cfg))  # an agent without it cannot start
    except (ConfigError, ValueError) as exc:
        print(f"fleet-min controlplane: {exc}", file=sys.stderr)
        return 2
    logs.setup(cfg.log_level, cfg.log_file)  # one line per event; SIGHUP reopens, never stops
    if jsonio.REFUSED:  # an orjson too old to trust: say so once, at start
        log.warning("%s", jsonio.REFUSED)
    from fleet_min.controlplane.app import create_app
    try:
        asyncio.run(_serve(create_app(cfg), cfg.host, cfg.port))
    except OSError as exc:
        print(f"fleet-min controlplane: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}",
              file=sys.stderr)
        return 1
    return 0
