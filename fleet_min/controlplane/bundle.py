"""The plain-text diagnostic bundle of one runner.

Only files on ALLOWED are included, each under SIZE_CAP; every other entry of the runner's
directory is named as excluded (its contents never read), and every line of the bundle passes
through the redactor before it leaves.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleet_min.controlplane.diag import safe_file, summary_and_tail
from fleet_min.controlplane.redact import redact

ALLOWED = (".runner", ".service", ".env", ".path", ".fleet-drain", "run.sh", "svc.sh", "env.sh")
SIZE_CAP = 256 * 1024


def _section(title: str, body: Iterable[str]) -> list[str]:
    return ["", f"===== {title} =====", *body]


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
        text = path.read_text(encoding="utf-8-sig", errors="replace")
        included += [f"--- {name} ({info.st_size} bytes)", *text.splitlines()]
    for entry in sorted(runner_dir.iterdir()):
        if entry.name in ALLOWED:
            continue
        why = ("credentials, never read" if entry.name.startswith(".credentials")
               else "not on the allow-list")
        excluded.append(f"{entry.name} ({why})")
    return included, excluded


def build_bundle(runner: dict[str, Any], host: dict[str, Any], runner_dir: Path,
                 events: list[dict[str, Any]], jobs: list[dict[str, Any]], generated_at: str
                 ) -> str:
    included, excluded = _files(runner_dir)
    diag = summary_and_tail(runner_dir, lines=200)
    tail = diag.pop("tail")
    lines = [f"fleet-min diagnostic bundle for runner {runner['name']}",
             f"generated at {generated_at}"]
    lines += _section("state", json.dumps(runner, indent=2, sort_keys=True).splitlines())
    lines += _section("host", json.dumps(host, indent=2, sort_keys=True).splitlines())
    lines += _section("files", included)
    lines += _section("excluded", excluded or ["(nothing)"])
    lines += _section("_diag summary", json.dumps(diag, indent=2, sort_keys=True).splitlines())
    lines += _section("_diag tail", tail)
    lines += _section("recent events",
                      [f"{e['at']} {e['kind']}: {e['message']}" for e in events] or ["(none)"])
    lines += _section("recent jobs",
                      [f"{j['started_at'] or j['created_at']} {j['repo']} {j['name']} "
                       f"{j['status']}/{j['conclusion']} {j['duration_s']}s" for j in jobs]
                      or ["(none)"])
    # One pass over the whole text keeps multi-line secrets (PEM blocks) caught as a block.
    return redact("\n".join(lines)) + "\n"
