"""A collector that does not answer to the name an agent uses for it (FLEET_ALLOWED_HOSTS, the
guard against DNS rebinding) refuses the agent with 421 and a sentence; the agent, a real
process, logs that sentence once for that collector, not once per retry, and keeps retrying
quietly with backoff. The same agent against a collector that admits the name registers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.agent import AgentProc, resolving_to_loopback, wait_for
from tests.support.collector import CollectorProcess

pytestmark = pytest.mark.slow

NAME = "fleet-collector.test"
SENTENCE = (f"does not answer to the name '{NAME}'; add it to FLEET_ALLOWED_HOSTS if agents or "
            "browsers reach it by that name")


def test_a_refused_name_is_logged_once_and_an_admitted_one_works(tmp_path: Path) -> None:
    env = resolving_to_loopback(tmp_path / "resolver", NAME)
    refusing = CollectorProcess(tmp_path / "refusing",
                                env={"FLEET_ALLOWED_HOSTS": "collector.lan"})
    admitting = CollectorProcess(tmp_path / "admitting", env={"FLEET_ALLOWED_HOSTS": NAME})
    agents: list[AgentProc] = []
    try:
        refusing.start()
        admitting.start()
        refused = AgentProc(tmp_path, [f"http://{NAME}:{refusing.port}"], "refused", env=env)
        agents.append(refused.start())
        retries = re.compile(rf"DEBUG http://{re.escape(NAME)}:\d+: .*answered 421.*retrying")
        # Several refused attempts, each retried after a backoff of at most 1 s.
        wait_for(lambda: len(retries.findall(refused.log())) >= 4, 30, what="refused retries")
        told = [line for line in refused.log().splitlines()
                if SENTENCE in line and " DEBUG " not in line]
        assert len(told) == 1 and " ERROR " in told[0], refused.log()[-3000:]
        assert not re.search(r"WARNING .*421", refused.log())
        assert refusing.client.get("/api/devices")[1]["devices"] == []

        admitted = AgentProc(tmp_path, [f"http://{NAME}:{admitting.port}"], "admitted", env=env)
        agents.append(admitted.start())
        wait_for(lambda: [d["device_id"] for d in admitting.client.get("/api/devices")[1][
            "devices"]] == ["admitted"], 30, what="registration through the admitted name")
        assert SENTENCE not in admitted.log()
    finally:
        for agent in agents:
            agent.stop()
        refusing.stop()
        admitting.stop()
