"""`python -m fleet_min collector`: start the collector on its configured addresses."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import sys

from aiohttp import web

from fleet_min import jsonio, logs
from fleet_min.config import COLLECTOR_SETTINGS, ConfigError, add_flags, markdown_table, resolve
from fleet_min.db import StorageError

log = logging.getLogger("fleet_min.collector")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet-min collector",
        description="Run the device job collector. Backups: `fleet-min collector backup PATH "
                    "[--with-artifacts]` and `fleet-min collector restore PATH --data DIR` "
                    "(each has its own --help).",
        epilog="Settings without a flag are read from the environment:\n\n"
               + markdown_table([s for s in COLLECTOR_SETTINGS if not s.flag]),
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


def main(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:
        from fleet_min.collector import backup

        return backup.main(argv[0], argv[1:])
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
    from fleet_min.collector.app import create_app

    try:
        app = create_app(config)
    except ConfigError as exc:
        print(f"fleet-min collector: {exc}", file=sys.stderr)
        return 2
    _warn_about_bind(config.bind)
    log.info("collector on %s port %s, data in %s%s", ",".join(config.bind), config.port,
             config.data_dir, " (uvloop)" if fast else "")
    try:
        web.run_app(app, host=list(config.bind), port=config.port, print=None,
                    shutdown_timeout=5.0, access_log=None, handle_signals=True,
                    # A client that goes away ends its handler at once: a held long poll or stream
                    # is released (and counted out of stream_clients) without waiting for a write.
                    handler_cancellation=True)
    except StorageError as exc:
        log.error("%s", exc)
        print(f"fleet-min collector: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the port is taken, or the address is not this host's
        print(f"fleet-min collector: cannot listen on {','.join(config.bind)} port "
              f"{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    log.info("collector stopped cleanly")
    return 0
