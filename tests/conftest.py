from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import settings as hypothesis_settings

from fleet_min.collector.http.app import create_app
from fleet_min.config import COLLECTOR_SETTINGS, resolve

CollectorFactory = Callable[..., Any]

# The property tests draw the same examples on every run of one tree ("gate"), so a run gives the
# same verdict on a fresh machine as here: a random draw once failed CI on an input no run before
# had tried. Looking for new inputs is a run of its own, FLEET_HYPOTHESIS=explore with larger
# example counts (docs/testing.md, "Property tests"). Loaded here, before any test module builds
# its own settings on top of the profile.
hypothesis_settings.register_profile("gate", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", derandomize=False, database=None)
hypothesis_settings.load_profile(os.environ.get("FLEET_HYPOTHESIS", "gate"))

# The fast lane (`pytest --fast`, `bash scripts/test.sh --fast`) for the edit-test loop: it leaves
# out what needs a browser, the end-to-end runs of real process fleets and fault loops (marked
# slow) and the long fuzzing runs. The full suite stays what CI runs.
FAST_LANE_SKIPS = ("slow", "browser", "fuzz")
BROWSER_FIXTURES = frozenset({"browser", "open_page"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="the fast lane: leave out tests marked " + ", ".join(FAST_LANE_SKIPS))
    parser.addoption("--rest", action="store_true",
                     help="only what the fast lane leaves out (the full suite is the two lanes)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if BROWSER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.browser)
    fast, rest = config.getoption("--fast"), config.getoption("--rest")
    if not fast and not rest:
        return
    kept, left_out = [], []
    for item in items:
        slow = any(item.get_closest_marker(name) for name in FAST_LANE_SKIPS)
        (left_out if slow == fast else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture
def collector_factory(aiohttp_client: Any, tmp_path: Path) -> CollectorFactory:
    """Start a real collector (real socket, real SQLite file) in this test's event loop."""

    async def start(**overrides: Any) -> TestClient:
        settings: dict[str, Any] = {"data_dir": str(tmp_path / "data"), "long_poll_s": 1.0,
                                    "sweep_s": 3600.0, "bind": ("127.0.0.1",), "port": 0}
        settings.update(overrides)
        # The environment counts (tests set FLEET_* with monkeypatch); overrides win over it.
        config = resolve(COLLECTOR_SETTINGS, environ=os.environ, **settings)
        return await aiohttp_client(create_app(config))

    return start


@pytest.fixture
async def client(collector_factory: CollectorFactory) -> TestClient:
    return await collector_factory()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "fleet.sqlite3"
