"""The snapshot hub behind GET /api/stream: one encoded snapshot shared by every client.

A snapshot is encoded once per tick, whatever the number of clients. Each client awaits the same
future, which publish() resolves and replaces, so hundreds of clients cost one wake-up each and
no per-client queue; a slow client skips to the newest snapshot instead of piling up old ones.
"""

from __future__ import annotations

import asyncio
import contextlib


class SnapshotHub:
    def __init__(self) -> None:
        self.latest: bytes | None = None
        self.clients = 0
        self.closed = False
        self._next: asyncio.Future[bytes | None] | None = None

    def _future(self) -> asyncio.Future[bytes | None]:
        if self._next is None or self._next.done():
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    def publish(self, payload: bytes) -> None:
        self.latest = payload
        waiting, self._next = self._next, None
        if waiting is not None and not waiting.done():
            waiting.set_result(payload)

    def close(self) -> None:
        """Release every waiting client (shutdown): they see None and end their stream."""
        self.closed = True
        waiting, self._next = self._next, None
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def wait(self, timeout_s: float) -> bytes | None:
        """The next published snapshot, or None after timeout_s (time for a keep-alive)."""
        if self.closed:
            return None
        future = self._future()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):  # not wait_for: see loops.py
                return await asyncio.shield(future)
        return None


def sse_event(payload: bytes) -> bytes:
    # json.dumps never emits a raw newline, so the snapshot is always one `data:` line.
    return b"data: " + payload + b"\n\n"


KEEP_ALIVE = b": keep-alive\n\n"
