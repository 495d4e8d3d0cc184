"""The plain-text diagnostic bundle of one runner.

Only files on ALLOWED are included, each under SIZE_CAP; every other entry of the runner's
directory is named as excluded (its contents never read), and every line of the bundle passes
through the redactor before it leaves, then through printable(): a job running as the runner's
user chooses the names of the files it leaves there and what the included files hold, and an
escape sequence or a line break in either would reach the terminal a person `cat`s the bundle
in (or forge a section of it).

Each section is redacted on its own, and each included file and each name on its own within
theirs: a private key's header with no end line (a file named `-----BEGIN PRIVATE KEY-----`)
is redacted to the end of its own text, and cannot blank the sections after it.

The bundle is read by a person (often pasted into an issue): state, host and log summary are
written as `key: value` lines, nested parts indented, lists joined with commas, a missing value
as "none" and a flag as yes/no; never a Python repr or a JSON dump. Only the included files and
the log tail are quoted as they are.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleet_min.controlplane.runners.diag import SCAN_LIMIT, safe_file, summary_and_tail
from fleet_min.controlplane.runners.discovery import read_small
from fleet_min.controlplane.runners.redact import redact, redact_lines
from fleet_min.logs import printable

ALLOWED = (".runner", ".service", ".env", ".path", ".fleet-drain", "run.sh", "svc.sh", "env.sh")
SIZE_CAP = 256 * 1024


def _section(title: str, body: Iterable[str]) -> list[str]:
    return ["", f"===== {title} =====", *(printable(line) for line in redact_lines(list(body)))]


def _name(name: str) -> str:
    """A directory entry's name as one line of the bundle, redacted alone."""
    return printable(redact(name))


EXCLUDED_LISTED = 200  # names of entries off the allow-list the bundle lists, in name order


def _files(runner_dir: Path) -> tuple[list[str], list[str]]:
    included: list[str] = []
    excluded: list[str] = []
    for name in ALLOWED:
        path = runner_dir / name
        info = safe_file(path, runner_dir)
        if info is None:
            continue
        if info.st_size > SIZE_CAP:
            excluded.append(f"{name} (over the {SIZE_CAP // 1024} KiB cap: {info.st_size} bytes)")
            continue
        # Read as discovery reads: the entry checked above may have been swapped for a FIFO or
        # a link since, and such a read returns nothing rather than waiting or following it.
        raw = read_small(path, SIZE_CAP, follow=False)
        if raw is None:
            continue
        text = raw.decode("utf-8-sig", "replace")
        included += [f"--- {name} ({info.st_size} bytes)", *redact(text).splitlines()]
    others, more = _other_names(runner_dir)
    for name in others[:EXCLUDED_LISTED]:
        why = ("credentials, never read" if name.startswith(".credentials")
               else "not on the allow-list")
        excluded.append(f"{_name(name)} ({why})")
    if len(others) > EXCLUDED_LISTED:
        excluded.append(f"(and {len(others) - EXCLUDED_LISTED} more entries, not listed)")
    if more:
        excluded.append(f"(the directory holds more than {SCAN_LIMIT} entries; only that many "
                        "were looked at)")
    return included, excluded


def _other_names(runner_dir: Path) -> tuple[list[str], bool]:
    """The names of the directory's entries not on the allow-list, sorted, from at most
    SCAN_LIMIT entries; and whether there were more. A job runs as the runner's user and can
    fill the directory: every entry was sorted and listed, so 300,000 made the bundle
    hundreds of thousands of lines."""
    names: list[str] = []
    more = False
    try:
        with os.scandir(runner_dir) as entries:
            for examined, entry in enumerate(entries):
                if examined >= SCAN_LIMIT:
                    more = True
                    break
                if entry.name not in ALLOWED:
                    names.append(entry.name)
    except OSError:
        pass
    return sorted(names), more


MAX_DEPTH = 4  # the snapshot's own shapes nest three deep; anything deeper is summarised


def _scalar(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, dict | list | tuple)


def readable(data: dict[str, Any], indent: str = "", depth: int = 0) -> list[str]:
    """`key: value` lines for a person: nested objects indented under their key, lists of plain
    values joined with commas, lists of objects as `-` items."""
    lines = []
    for key, value in data.items():
        label = f"{indent}{str(key).replace('_', ' ')}:"
        if _is_scalar(value):
            lines.append(f"{label} {_scalar(value)}")
        elif not value:
            lines.append(f"{label} none")
        elif depth >= MAX_DEPTH:
            lines.append(f"{label} ({len(value)} entries)")
        elif isinstance(value, dict):
            lines += [label, *readable(value, indent + "  ", depth + 1)]
        elif all(_is_scalar(item) for item in value):
            lines.append(f"{label} {', '.join(_scalar(item) for item in value)}")
        else:
            lines.append(label)
            for item in value:
                fields = readable(item if isinstance(item, dict) else {"value": item},
                                  indent + "    ", depth + 1)
                lines += [f"{indent}  - {fields[0].strip()}", *fields[1:]] if fields else []
    return lines


def job_line(job: dict[str, Any]) -> str:
    """One recorded job as a sentence: when, where, what, and how it ended (or that it has not)."""
    when = job.get("started_at") or job.get("created_at") or "(time unknown)"
    run = f" (run {job['run_id']})" if job.get("run_id") else ""
    if job.get("conclusion"):
        outcome = str(job["conclusion"]).replace("_", " ")
    else:
        outcome = f"{str(job.get('status') or 'unknown').replace('_', ' ')}, no conclusion yet"
    took = f", took {job['duration_s']:g} s" if job.get("duration_s") is not None else ""
    return f"{when} {job.get('repo')} {job.get('name')}{run}: {outcome}{took}"


def build_bundle(runner: dict[str, Any], host: dict[str, Any], runner_dir: Path,
                 events: list[dict[str, Any]], jobs: list[dict[str, Any]], generated_at: str
                 ) -> str:
    included, excluded = _files(runner_dir)
    diag = summary_and_tail(runner_dir, lines=200)
    tail = diag.pop("tail")
    lines = [printable(f"fleet-min diagnostic bundle for runner {runner['name']}"),
             f"generated at {generated_at}"]
    lines += _section("state", readable(runner))
    lines += _section("host", readable(host))
    lines += _section("files", included)
    lines += _section("excluded", excluded or ["(nothing)"])
    lines += _section("_diag summary", readable(diag))
    lines += _section("_diag tail", tail or ["(no log in _diag)"])
    lines += _section("recent events",
                      [f"{e['at']} {e['kind']}: {e['message']}" for e in events] or ["(none)"])
    lines += _section("recent jobs", [job_line(j) for j in jobs] or ["(none)"])
    # printable() writes a lone surrogate (a file name the OS could not decode, or one from
    # .runner's JSON) as its escape (\udcff), so the text is UTF-8.
    return "\n".join(lines) + "\n"
