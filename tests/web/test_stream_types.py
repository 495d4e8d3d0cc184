"""The dashboard's live stream listens for every event type a screen reloads on. EventSource
delivers a named event only to a listener for that name, so a type missing from stream.js's
TYPES leaves its screens stale until they are opened again (the executors and templates screens
were, until both types joined the list). Read from the shipped files: no browser needed."""

from __future__ import annotations

import re
from pathlib import Path

DASH = Path(__file__).resolve().parents[2] / "fleet_min" / "web" / "dash"
COLLECTOR = DASH.parents[1] / "collector"


def streamed_types() -> set[str]:
    text = (DASH / "lib" / "stream.js").read_text()
    listed = re.search(r"const TYPES = \[(.*?)\];", text, re.S)
    assert listed is not None, "stream.js no longer lists TYPES"
    return set(re.findall(r'"([a-z-]+)"', listed.group(1)))


def listened_types() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(DASH.rglob("*.js")):
        for kind in re.findall(r'\be\.type === "([a-z-]+)"', path.read_text()):
            found.setdefault(kind, set()).add(path.name)
    return found


def test_every_type_a_screen_listens_for_is_streamed_to_it() -> None:
    listened = listened_types()
    assert listened, "no screen filters stream events any more: update this test"
    missing = {kind: files for kind, files in listened.items() if kind not in streamed_types()}
    assert missing == {}, f"listened for in these screens, never dispatched: {missing}"


def test_every_streamed_type_is_one_the_collector_emits() -> None:
    source = "\n".join(p.read_text() for p in COLLECTOR.rglob("*.py"))
    emitted = set(re.findall(r'emit\("([a-z-]+)"', source))
    emitted |= set(re.findall(r'"type": "([a-z-]+)"', source))
    emitted |= {"result", "beacon"}  # published by the results path under these names
    assert streamed_types() <= emitted, streamed_types() - emitted
