"""A live-stream (SSE) client for the tests: reads frames and checks their shape against
decisions.md."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient

READ_TIMEOUT_S = 15.0


def parse_frame(raw: bytes) -> dict[str, Any]:
    """One SSE frame -> {"id", "event", "data", "retry", "comments"} (data JSON-decoded)."""
    frame: dict[str, Any] = {"id": None, "event": None, "data": None, "retry": None,
                             "comments": []}
    data_lines = []
    for line in raw.decode().split("\n"):
        if not line:
            continue
        if line.startswith(":"):
            frame["comments"].append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data_lines.append(value)
        elif name in ("id", "event", "retry"):
            frame[name] = value
    if data_lines:
        frame["data"] = json.loads("\n".join(data_lines))
    return frame


class StreamReader:
    """A live-stream client on an aiohttp response: reads frames and checks their shape."""

    def __init__(self, client: TestClient | aiohttp.ClientSession, url: str = "/api/stream",
                 last_event_id: str | None = None) -> None:
        self.client = client
        self.url = url
        self.headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
        self.response: aiohttp.ClientResponse | None = None
        self.hello: dict[str, Any] = {}
        self.last_id: str | None = None

    async def __aenter__(self) -> StreamReader:
        self.response = await self.client.get(self.url, headers=self.headers)
        assert self.response.status == 200
        assert self.response.headers["Content-Type"].startswith("text/event-stream")
        first = await self.frame()
        assert first["event"] == "hello" and first["data"]["type"] == "hello"
        self.hello = first["data"]
        self.hello_retry = first["retry"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.response is not None:
            self.response.close()

    async def frame(self) -> dict[str, Any]:
        assert self.response is not None
        raw = await asyncio.wait_for(self.response.content.readuntil(b"\n\n"), READ_TIMEOUT_S)
        assert raw.endswith(b"\n\n"), "the stream ended"
        return parse_frame(raw)

    async def event(self) -> dict[str, Any]:
        """The next event (keep-alive comments skipped), checked against decisions.md."""
        while True:
            frame = await self.frame()
            if frame["data"] is None:
                continue
            data = frame["data"]
            assert frame["event"] == data["type"], frame
            assert data["at"].endswith("Z")
            if frame["id"] is not None:
                assert self.last_id is None or int(frame["id"]) > int(self.last_id)
                self.last_id = frame["id"]
            frame["data"]["_id"] = frame["id"]
            return frame["data"]

    async def next_of(self, type_: str) -> dict[str, Any]:
        while True:
            data = await self.event()
            if data["type"] == type_:
                data.pop("_id")
                return data
