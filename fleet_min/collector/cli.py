"""`python -m fleet_min collector`: start the collector on its configured addresses."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from fleet_min import filemodes, jsonio, logs, serving
from fleet_min.config import (
    COLLECTOR_SETTINGS,
    CollectorConfig,
    ConfigError,
    add_flags,
    help_epilog,
    resolve,
)

log = logging.getLogger("fleet_min.collector")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet-min collector",
        description="Run the device job collector.\n\nBackups: `fleet-min collector backup "
                    "PATH [--with-artifacts]`,\n`fleet-min collector restore PATH --check` and "
                    "`fleet-min collector restore PATH --data DIR`\n(each has its own --help).",
        epilog=help_epilog(COLLECTOR_SETTINGS),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, COLLECTOR_SETTINGS)
    return parser


def _warn_about_bind(addresses: tuple[str, ...]) -> None:
    for address in addresses:
        try:
            unspecified = ipaddress.ip_address(address).is_unspecified
        except ValueError:
            unspecified = False
        if unspecified:
            log.warning("listening on every interface (%s): anyone who can reach this host can "
                        "enqueue jobs. Recommended: FLEET_BIND=127.0.0.1,<your mesh address>",
                        address)


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


SUBCOMMANDS = ("backup", "restore")  # `collector backup PATH`, `collector restore PATH --data DIR`


def _announce(config: CollectorConfig, fast: bool) -> Callable[[list[tuple[str, int]]], None]:
    def announce(bound: list[tuple[str, int]]) -> None:
        urls = [f"http://{serving.url_host(host)}:{port}" for host, port in bound]
        # An address that means "every interface" is no page to open; loopback always is.
        host, port = bound[0]
        shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        log.info("collector listening on %s (dashboard http://%s:%s/dash), data in %s%s",
                 ", ".join(urls), serving.url_host(shown), port, config.data_dir,
                 " (uvloop)" if fast else "")
        _warn_about_bind(config.bind)
    return announce


def _serve(app: web.Application, config: CollectorConfig, fast: bool) -> int:
    """Own the data directory, bind, run until a signal; the exit code."""
    return serving.run(
        "collector", Path(config.data_dir), config.data_dir, "data directory", config.bind,
        config.port, lambda: app, grace_s=config.stop_grace_s,
        announce=_announce(config, fast), log_file=config.log_file,
        dir_mode=filemodes.COLLECTOR_DIR,
        peer_connections=config.max_peer_connections,
        # A client that goes away ends its handler at once: a held long poll or stream is
        # released (and counted out of stream_clients) without waiting for a write.
        handler_cancellation=True)


def main(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:
        from fleet_min.collector.storage import backup_cli

        return backup_cli.main(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    try:
        config = resolve(COLLECTOR_SETTINGS, vars(args))
    except ConfigError as exc:
        print(f"fleet-min collector: {exc}", file=sys.stderr)
        return 2
    logs.setup(config.log_level, config.log_file)  # also makes SIGHUP reopen the log file
    if jsonio.REFUSED:  # an orjson too old to trust: say so once, at start
        log.warning("%s", jsonio.REFUSED)
    fast = install_uvloop()
    from fleet_min.collector.http.app import create_app

    try:
        app = create_app(config)
    except ConfigError as exc:
        print(f"fleet-min collector: {exc}", file=sys.stderr)
        return 2
    return _serve(app, config, fast)
