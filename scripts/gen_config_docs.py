#!/usr/bin/env python3
"""Write the settings tables in docs/ from the tables the programs themselves are built from.

    python3 scripts/gen_config_docs.py           rewrite every generated block in docs/
    python3 scripts/gen_config_docs.py --check   change nothing; exit 1 naming each doc that
                                                 differs from what would be written

A generated block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->` lines; everything
else in a doc is prose and left alone. The sources:

- collector-settings          fleet_min.config.COLLECTOR_SETTINGS (flags and environment)
- controlplane-settings       fleet_min.controlplane.settings.CONTROLPLANE_SETTINGS
- controlplane-live-settings  fleet_min.controlplane.settings.LIVE_SETTINGS (POST /api/settings)
- agent-options               agent/fleet_agent.py's build_parser(): the agent is loaded from its
                              file, as a person runs it, and never imports fleet_min

tests/test_config_docs.py fails when a doc differs from what this writes.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere: the checkout's fleet_min, not an installed one
    sys.path.insert(0, str(ROOT))

from fleet_min.config import COLLECTOR_SETTINGS, markdown_table  # noqa: E402
from fleet_min.controlplane.settings import (  # noqa: E402
    CONTROLPLANE_SETTINGS,
    live_markdown_table,
)

DOCS = ("docs/configuration.md", "docs/controlplane.md", "docs/agent.md")
AGENT_FILE = ROOT / "agent" / "fleet_agent.py"
BLOCK = re.compile(r"(<!-- (?P<name>[a-z-]+):begin -->\n)(?P<body>.*?)(\n<!-- (?P=name):end -->)",
                   re.S)


def load_agent() -> ModuleType:
    """agent/fleet_agent.py as a module of its own (it is a script, not part of fleet_min)."""
    spec = importlib.util.spec_from_file_location("fleet_agent_docs", AGENT_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    flag = action.option_strings[0]
    if action.nargs == 0:
        return f"`{flag}`"
    value = "|".join(action.choices) if action.choices else str(action.metavar or action.dest)
    return _cell(f"`{flag} {value}`")


def agent_table(parser: argparse.ArgumentParser) -> str:
    """The agent's options: flag, environment variable, default, meaning."""
    lines = ["| Flag | Variable | Default | Meaning |", "|---|---|---|---|"]
    for action in parser._actions:  # argparse offers no public list of its options
        if isinstance(action, argparse._HelpAction):
            continue
        env = getattr(action, "env", None)
        shown = _cell(getattr(action, "shown", ""))
        default = f"`{shown}`" if getattr(action, "literal", False) else shown
        meaning = _cell(getattr(action, "meaning", action.help or ""))
        lines.append(f"| {_flag(action)} | {f'`{env}`' if env else ''} | {default} | {meaning} |")
    return "\n".join(lines)


def sources() -> dict[str, Callable[[], str]]:
    return {
        "collector-settings": lambda: markdown_table(COLLECTOR_SETTINGS),
        "controlplane-settings": lambda: markdown_table(CONTROLPLANE_SETTINGS),
        "controlplane-live-settings": live_markdown_table,
        "agent-options": lambda: agent_table(load_agent().build_parser()),
    }


def render(text: str) -> str:
    """The doc with every generated block written afresh from the code."""
    made = sources()

    def fill(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in made:
            raise SystemExit(f"unknown generated block {name!r}; known: {', '.join(made)}")
        return match.group(1) + made[name]() + match.group(4)

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when a doc differs from the code")
    args = parser.parse_args(argv)
    stale = []
    for name in DOCS:
        path = ROOT / name
        text = path.read_text()
        fresh = render(text)
        if fresh != text:
            stale.append(name)
            if not args.check:
                path.write_text(fresh)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python3 scripts/gen_config_docs.py",
              file=sys.stderr)
        return 1
    for name in stale:
        print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
