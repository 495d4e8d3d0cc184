"""A fake mesh identity lookup: a real executable named `tailscale` written into a directory
that goes first on PATH. It answers `tailscale whois --json <ip>` from a JSON map of address to
answer (a whois object, a string printed as is, "hang" to sleep 30 s, or "flood" to print
spaces until it is stopped) and appends each argv
to a log file, so a test can count the lookups a collector made."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path
from typing import Any

FAKE = textwrap.dedent("""\
    #!{python}
    import json, os, sys, time
    with open(os.environ["FAKE_WHOIS_LOG"], "a") as log:
        log.write(" ".join(sys.argv[1:]) + "\\n")
    if sys.argv[1:3] != ["whois", "--json"] or len(sys.argv) != 4:
        sys.exit("usage: tailscale whois --json <ip>")
    answers = json.load(open(os.environ["FAKE_WHOIS_MAP"]))
    answer = answers.get(sys.argv[3])
    if answer == "hang":
        time.sleep(30)
    if answer == "flood":  # output without end, until the collector stops it
        while True:
            sys.stdout.write(" " * 65536)
    if answer is None:
        sys.exit("no match for IP:port " + sys.argv[3])
    print(answer if isinstance(answer, str) else json.dumps(answer))
""")


def whois(name: str, computed: str | None = None, hostname: str | None = None
          ) -> dict[str, Any]:
    """A whois answer for a node with this MagicDNS name (and short name, and self-reported
    host name, which a collector must never believe)."""
    node: dict[str, Any] = {"ID": 1, "StableID": "n1", "Name": name,
                            "Hostinfo": {"Hostname": hostname or "whatever", "OS": "linux"}}
    if computed is not None:
        node["ComputedName"] = computed
    return {"Node": node, "UserProfile": {"LoginName": "someone@example.com"}}


def install(directory: Path, answers: dict[str, Any]) -> dict[str, str]:
    """Write the fake and its answers under `directory`; the environment a collector needs to
    use it (PATH first, the answers file, the log file). The log is `directory/whois.log`."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "tailscale"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (directory / "whois.json").write_text(json.dumps(answers))
    log = directory / "whois.log"
    log.touch()
    return {"FAKE_WHOIS_MAP": str(directory / "whois.json"), "FAKE_WHOIS_LOG": str(log),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
