"""Fixtures of the control-plane tests: a fake host (runner dirs, fake systemctl/launchctl on
PATH, a fake GitHub API) and two ways to run the daemon against it: in-process through aiohttp's
test client, and as a real `python -m fleet_min controlplane` subprocess."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleet_min.controlplane import store
from fleet_min.controlplane.github.client import GitHub
from fleet_min.controlplane.http.app import create_app
from fleet_min.db import Database
from tests.support import cp_fakes as fakes
from tests.support.controlplane import Daemon, Host, make_config
from tests.support.fake_github import TOKEN, FakeGitHub


@pytest.fixture
def github() -> Iterator[FakeGitHub]:
    fake = FakeGitHub()
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
async def gh(github: FakeGitHub) -> AsyncIterator[GitHub]:
    """The real GitHub client on the fake API, with short back-offs."""
    client = GitHub(github.url, TOKEN, backoff_s=0.01)
    yield client
    await client.close()


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    """The control plane's database (its migrations) in a file of the test's own."""
    database = Database(tmp_path / "cp.db", store.MIGRATIONS, "NORMAL")
    await database.open()
    yield database
    await database.close()


@pytest.fixture
def host(tmp_path: Path, github: FakeGitHub) -> Iterator[Host]:
    h = Host(tmp_path, github)
    yield h
    fakes.kill_all_listeners(h.root)


@pytest.fixture
def apply_env(host: Host, monkeypatch: pytest.MonkeyPatch) -> Host:
    """Put the fake host's environment on this process (for in-process app tests)."""
    for key, value in host.env.items():
        monkeypatch.setenv(key, value)
    return host


@pytest.fixture
async def client(apply_env: Host, aiohttp_client: Any) -> AsyncIterator[Any]:
    """An aiohttp test client on a control plane over the fake host (runners added before use
    are discovered at start; later ones at the next tick or action)."""
    app = create_app(make_config(apply_env), dict(os.environ))
    test_client = await aiohttp_client(app)
    yield test_client


@pytest.fixture
def daemon_factory(host: Host) -> Iterator[Any]:
    started: list[Daemon] = []

    def start(extra_env: dict[str, str] | None = None) -> Daemon:
        d = Daemon(host, extra_env)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
