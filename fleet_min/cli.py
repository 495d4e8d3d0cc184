"""`python -m fleet_min <service> ...` and the `fleet-min` console script."""

from __future__ import annotations

import os
import sys

from fleet_min import __version__

USAGE = """usage: fleet-min {collector,controlplane} [options]

  collector      run the device job collector (port 8788)
                 collector backup PATH / collector restore PATH --data DIR
  controlplane   run the CI runner control plane (port 7878, loopback)

Run `fleet-min <command> --help` for the options of one command.
"""


def private_umask() -> None:
    """Make nothing the services write group-writable or open to others, whatever umask the
    shell had (the systemd units set UMask=0027 too). Each file and folder of their own is
    made with its mode, but the parents a path needs, a log file and a backup's folders take
    the umask's: under umask 000 they were 0777 and 0666, so another user could write the log
    or swap the data directory for a link before the next start."""
    os.umask(os.umask(0o027) | 0o027)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(USAGE)
        return 0 if args else 2
    if args[0] == "--version":
        print(f"fleet-min {__version__}")
        return 0
    command, rest = args[0], args[1:]
    private_umask()
    if command == "collector":
        from fleet_min.collector.cli import main as collector_main
        return collector_main(rest)
    if command == "controlplane":
        from fleet_min.controlplane.cli import main as controlplane_main
        return controlplane_main(rest)
    print(f"fleet-min: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
