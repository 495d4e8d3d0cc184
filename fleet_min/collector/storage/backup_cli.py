"""`fleet-min collector backup PATH` and `fleet-min collector restore PATH`: the command line of
backup.py and restore.py (each a module of its own; this one imports both, so neither imports
the other's command)."""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from pathlib import Path

from fleet_min import filemodes
from fleet_min.collector.storage.backup import BackupError, Report, backup


def _data_dir(given: str | None, required: bool) -> Path:
    from fleet_min.config import COLLECTOR_SETTINGS, resolve

    if given is None and required and not os.environ.get("FLEET_DATA_DIR"):
        raise BackupError("say which data directory to restore into with --data DIR")
    return Path(resolve(COLLECTOR_SETTINGS, {"data_dir": given}).data_dir)


def _summary(verb: str, report: Report, *, checking: bool = False) -> str:
    counts = ", ".join(f"{n} {table}" for table, n in report.counts.items())
    line = f"{verb} {report.path}: {counts}; schema version {report.schema_version}"
    if report.artifacts_copied:
        line += (f"; {report.artifacts_copied} artifact files "
                 f"({report.artifacts_bytes / 1048576:.1f} MiB)"
                 + (" whose bytes match their hashes" if checking else ""))
    if report.undone:
        line += f"; an interrupted restore was undone first (from {report.undone})"
    if report.moved_aside:
        line += f"; the previous database was moved to {report.moved_aside}"
    if report.left_out:
        rows = sum(report.left_out.values())
        line += (f"; {'would leave' if checking else 'left'} out {rows} rows the collector's "
                 "readers cannot take ("
                 + ", ".join(f"{n} {table}" for table, n in report.left_out.items())
                 + "), listed below")
    if report.artifacts_missing:
        line += (f"; {len(report.artifacts_missing)} indexed artifacts have no bytes "
                 "(deleted meanwhile, or not in the backup: take one with --with-artifacts)")
    if checking:
        line += "; nothing was installed"
    return line + f" ({report.seconds} s)"


def _print_left_out(report: Report, verb: str) -> None:
    """A line for each row named of those left out, then how many more there were."""
    for row in report.left_out_rows:
        print(f"  {verb}: {row}")
    unnamed = sum(report.left_out.values()) - len(report.left_out_rows)
    if unnamed:
        print(f"  and {unnamed} more rows like them")


def main(command: str, argv: list[str]) -> int:
    """`fleet-min collector backup|restore ...`; 0 on success, 1 with a sentence on failure."""

    parser = argparse.ArgumentParser(prog=f"fleet-min collector {command}")
    parser.add_argument("path", help="the backup directory (created by backup, read by restore)")
    parser.add_argument("--data", dest="data_dir", default=None,
                        help="the collector's data directory (env FLEET_DATA_DIR)")
    if command == "backup":
        parser.description = ("Take a consistent online backup of the collector's database and "
                              "artifact index (safe while the collector runs).")
        parser.add_argument("--with-artifacts", action="store_true",
                            help="also copy the bytes of every artifact the index names")
    else:
        parser.description = ("Restore a backup into a data directory whose collector is "
                              "stopped.")
        parser.add_argument("--force", action="store_true",
                            help="move an existing database aside (pre-restore-<time>/) first")
        parser.add_argument("--check", action="store_true",
                            help="check the backup as restore would (manifest, database, every "
                                 "row, each artifact's bytes) and install nothing; --data is "
                                 "not needed, the database is staged under TMPDIR")
        parser.add_argument("--leave-out-bad-rows", action="store_true",
                            help="restore without the records (results, beacons, events, CI "
                                 "statuses, schedule runs, alerts, visual diffs) the collector "
                                 "cannot read, listing each, instead of refusing the backup")
    args = parser.parse_args(argv)
    try:
        if command == "backup":
            report = backup(_data_dir(args.data_dir, False), Path(args.path),
                            args.with_artifacts)
            print(_summary("backup written to", report))
        elif args.check:
            from fleet_min.collector.storage.restore import check  # its checks load on need

            report = check(Path(args.path), args.leave_out_bad_rows)
            print(_summary("checked", report, checking=True))
            _print_left_out(report, "would leave out")
        else:
            from fleet_min.collector.storage.restore import restore  # its checks load on need

            report = restore(Path(args.path), _data_dir(args.data_dir, True), args.force,
                             args.leave_out_bad_rows)
            print(_summary("restored into", report))
            _print_left_out(report, "left out")
    except BackupError as exc:
        print(f"fleet-min collector {command}: {exc}", file=sys.stderr)
        return 1
    except filemodes.NotPrivate as exc:
        print(f"fleet-min collector {command}: cannot use {exc.filename}: {exc.strerror}",
              file=sys.stderr)
        return 1
    except sqlite3.Error as exc:  # what the checks above did not word (a database gone bad)
        print(f"fleet-min collector {command}: SQLite refused: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        # A write that names no file: a backup writes under its PATH, a restore stages and
        # installs inside the data directory, so that is the disk that is full.
        where = exc.filename or (args.path if command == "backup" else
                                 args.data_dir or os.environ.get("FLEET_DATA_DIR") or args.path)
        print(f"fleet-min collector {command}: {exc.strerror or exc}: {where}", file=sys.stderr)
        return 1
    return 0
