"""The snapshot asks the service manager about the runners of its last build while discovery
walks the root, then about any runner that is new or whose service name changed: the states it
ends with are those of one `systemctl show` of every runner found, as a rebuild that asked after
discovery had them. Real runner directories, the fake systemctl (a real executable on PATH)."""

from __future__ import annotations

import shutil
from typing import Any

from fleet_min.controlplane.runners.discovery import discover
from fleet_min.controlplane.snapshot import Snapshots
from tests.support import cp_fakes as fakes
from tests.support.controlplane import Host, Parts, open_parts


def _shows(host: Host) -> list[list[str]]:
    """The units each `systemctl show` since the last call was asked about."""
    calls = [c["argv"] for c in host.calls("systemctl") if "show" in c["argv"]]
    return [[a for a in argv if a.endswith(".service")] for argv in calls]


async def _asked_after_discovery(host: Host, parts: Parts) -> dict[str, Any]:
    """What one query of every runner found, made after discovery, says (the reference)."""
    runners = discover(host.root, [])
    return {name: state.as_json()
            for name, state in (await parts.supervisor.states(runners)).items()}


def _states(parts: Parts) -> dict[str, Any]:
    return {name: state.as_json() for name, state in parts.plane.states.items()}


async def test_new_changed_and_removed_runners_get_the_states_of_one_query_after_discovery(
        apply_env: Host) -> None:
    host = apply_env
    for i in range(6):
        host.add_runner(f"r{i}", repo="octo/app")
    host.start_unit("r1")
    async with open_parts(host) as parts:
        snapshots = Snapshots(parts.plane, parts.supervisor, parts.github, parts.hub)
        await snapshots.rebuild()
        assert _states(parts) == await _asked_after_discovery(host, parts)
        assert parts.plane.states["r1"].active == "active"

        # Nothing changed: one query, of every runner, per rebuild.
        before = len(_shows(host))
        await snapshots.rebuild()
        assert len(_shows(host)) == before + 1 and len(_shows(host)[-1]) == 6

        # A runner added (its service already running), one removed, and one whose service
        # name changed (svc.sh wrote another unit's name into .service) to a running unit.
        host.add_runner("r9", repo="octo/app")
        host.start_unit("r9")
        shutil.rmtree(host.root / "r5")
        custom = fakes.user_unit(host.xdg, host.root / "r2", "octo/custom", "r2")
        (host.root / "r2" / ".service").write_text(custom + "\n")
        host.start_unit("r2", repo="octo/custom")
        before = len(_shows(host))
        snapshot = await snapshots.rebuild()

        expected = await _asked_after_discovery(host, parts)
        assert _states(parts) == expected
        assert sorted(expected) == ["r0", "r1", "r2", "r3", "r4", "r9"]
        assert expected["r9"]["active"] == "active" and expected["r2"]["unit"] == custom
        assert expected["r2"]["active"] == "active"
        # The views say the same as the states.
        assert {v["name"]: v["service"] for v in snapshot["runners"]} == expected
        # The first query named the runners of the last build; the second only the two whose
        # unit it did not cover (the query for the reference came after).
        first, second = _shows(host)[before:before + 2]
        assert host.unit("r5") in first and host.unit("r9") not in first
        assert sorted(second) == sorted([host.unit("r9"), custom])
