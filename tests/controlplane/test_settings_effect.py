"""A live setting acts at once: a real daemon whose GitHub and analysis intervals are 300 s is
told 0.5 s over POST /api/settings, and the fake GitHub API sees the rounds start within
seconds rather than after the old 300 s."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.support.controlplane import Host, until
from tests.support.fake_github import FakeGitHub

pytestmark = pytest.mark.slow

SLOW = {"FLEET_GITHUB_S": "300", "FLEET_HISTORY_S": "300"}


def refreshes(github: FakeGitHub) -> int:
    """Rounds of the GitHub loop: each lists the repository's registered runners once."""
    return sum(1 for method, path, _ in list(github.log)
               if method == "GET" and path.startswith("/repos/octo/app/actions/runners"))


def history_listings(github: FakeGitHub) -> int:
    """Rounds of the analysis loop: each lists completed runs by creation range."""
    return sum(1 for method, path, _ in list(github.log)
               if method == "GET" and "created=" in path)


async def change(http: aiohttp.ClientSession, d: Any, key: str, value: Any) -> None:
    async with http.post(f"{d.url}/api/settings", json={"key": key, "value": value},
                         headers=d.headers()) as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize(("key", "count"), [("github_s", refreshes),
                                            ("history_s", history_listings)])
async def test_a_shorter_interval_takes_effect_at_once(
        key: str, count: Any, host: Host, github: FakeGitHub, daemon_factory: Any,
        http: aiohttp.ClientSession) -> None:
    host.add_runner("r1")
    d = daemon_factory(SLOW)
    await until(lambda: count(github) >= 1, timeout=30)  # the round at start-up
    await change(http, d, key, 0.5)
    before = count(github)
    # With the old 300 s still running, no further round would come for minutes.
    await until(lambda: count(github) >= before + 3, timeout=20)
