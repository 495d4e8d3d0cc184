"""A fake of GitHub's commit-status API (POST /repos/{owner}/{repo}/statuses/{sha}): a real
aiohttp server on a free port in the test's own event loop. It records each call and answers
from a script of statuses (201 once the script is used up)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

WAIT_S = 20  # upper bound for an event to arrive, never a measured duration


class FakeStatusesApi:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.script: list[int] = []  # statuses to answer before falling back to 201
        self.error_body: bytes | None = None  # what a scripted error answers, if not its message
        self.arrived = asyncio.Event()
        app = web.Application()
        app.router.add_post("/repos/{owner}/{repo}/statuses/{sha}", self.post)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url(""))

    async def post(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append({"path": request.path, "auth": request.headers.get("Authorization"),
                           "accept": request.headers.get("Accept"), **body})
        self.arrived.set()
        status = self.script.pop(0) if self.script else 201
        if status >= 400 and self.error_body is not None:
            return web.Response(body=self.error_body, status=status,
                                content_type="application/json")
        if status >= 400:
            return web.json_response({"message": f"scripted {status}"}, status=status)
        return web.json_response({"id": len(self.calls), "state": body["state"]}, status=201)

    async def wait_for(self, count: int) -> list[dict[str, Any]]:
        async with asyncio.timeout(WAIT_S):
            while len(self.calls) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.calls


@contextlib.asynccontextmanager
async def running_fake_statuses() -> AsyncIterator[FakeStatusesApi]:
    fake = FakeStatusesApi()
    await fake.server.start_server()
    try:
        yield fake
    finally:
        await fake.server.close()
