"""The live mirror of a running host job over HTTP (fleet_min.collector.insight.mirror).

Routes:
    POST /api/jobs/{job_id}/mirror   a JPEG frame from the job's executor: 204
    GET  /api/jobs/{job_id}/mirror   the frames as multipart/x-mixed-replace (an <img> shows it)
    GET  /api/jobs/{job_id}/mirror/status   whether a frame is held for the job
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys

from aiohttp import HttpVersion11, web

from fleet_min.collector.http import access
from fleet_min.collector.insight import mirror
from fleet_min.collector.service import Service
from fleet_min.errors import NotFound
from fleet_min.http import (
    SECURITY_HEADERS,
    json_response,
    read_bytes,
    within_stall,
    write_shared,
    write_stall_s,
)
from fleet_min.logs import Throttled
from fleet_min.timeutil import iso, now

# A frame's poster chooses its bytes: with a boundary known in advance, a "JPEG" holding
# `\r\n--boundary\r\nContent-Type: text/html` would start a part of its own, which a browser
# that renders each part by its type would run as a page of the collector's origin. So each
# stream has a boundary of its own, which no poster can know, and a policy that runs nothing.
STREAM_POLICY = "default-src 'none'; sandbox"
# A viewer with no new frame re-checks the job this often, so a stream of a job that ended
# without a word (a lapsed lease) ends too.
RECHECK_S = 10.0

log = logging.getLogger(__name__)
_cut = Throttled(log, "cut a live-mirror viewer of job %s still being sent a frame: the frames "
                      "held for the mirror reached FLEET_MAX_MIRROR_HELD_BYTES (%d bytes)")


def copies_unsent(transport: asyncio.BaseTransport) -> bool:
    """Whether the transport keeps what the socket did not take as a copy of its own (Python
    3.11's asyncio: a bytearray per connection) rather than the bytes object it was handed
    (uvloop, the asyncio of 3.12 and later): then a viewer's connection holds up to a frame of
    its own, and the budget counts it so."""
    return sys.version_info < (3, 12) and type(transport).__module__.startswith("asyncio")


class Handlers:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.mirrors = mirror.Mirrors(service.config.max_mirror_held_bytes)

    async def post_frame(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        executor = request.query.get("executor") or request.headers.get("X-Fleet-Executor")
        device_id = request.query.get("device_id")
        body = bytes(await read_bytes(request, self.service.config.max_mirror_bytes))
        mirror.check_frame(body)
        await self.service.transact(mirror.check_poster, job_id, executor or None,
                                    device_id or None, now(),
                                    caller=access.mesh_caller(request))
        self.mirrors.put(job_id, body, now())
        return web.Response(status=204)

    async def status(self, request: web.Request) -> web.Response:
        """Whether the job has a frame to show now, as the original's dashboards ask before
        opening a viewer (a job of any status answers; an unknown one is 404, like every
        other job route)."""
        job_id = request.match_info["job_id"]
        if await self._status(job_id) is None:
            raise NotFound(f"no job {job_id!r}")
        frame = self.mirrors.newest(job_id)
        return json_response({"streaming": frame is not None,
                              "frame_at": iso(frame.at) if frame else None,
                              "viewers": self.mirrors.viewers(job_id)})

    async def view(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["job_id"]
        await self._check_viewable(job_id)
        boundary = f"fleet-frame-{secrets.token_hex(16)}"
        part_head = f"--{boundary}\r\nContent-Type: image/jpeg\r\n\r\n".encode()
        response = web.StreamResponse(headers={
            "Content-Type": f"multipart/x-mixed-replace; boundary={boundary}",
            "Cache-Control": "no-store", "X-Accel-Buffering": "no", **SECURITY_HEADERS,
            "Content-Security-Policy": STREAM_POLICY})
        if request.version >= HttpVersion11:
            response.enable_chunked_encoding()  # what aiohttp would choose; write_shared frames it
        await response.prepare(request)
        transport = request.transport
        if transport is None:
            return response  # the viewer went already
        # A drain waits until the connection holds nothing, not merely under 16 KiB: while any
        # byte of a frame waits in it, the transport holds the whole frame (a slice of it), so
        # the frame counts as held for this viewer until then (Mirrors.sending).
        transport.set_write_buffer_limits(high=0)
        self.mirrors.join(job_id)
        try:
            await self._send_frames(request, transport, response, job_id, part_head)
        except ConnectionError:
            pass  # the viewer went, or was cut off: it took nothing for the stall deadline, or
            # was still being sent an old frame when the budget needed its bytes
        finally:
            self.mirrors.leave(job_id)
            if not transport.is_closing():
                transport.set_write_buffer_limits()  # the connection may serve more requests
        return response

    async def _send_frames(self, request: web.Request, transport: asyncio.Transport,
                           response: web.StreamResponse, job_id: str, part_head: bytes) -> None:
        stall_s = write_stall_s(request)
        copies, loop = copies_unsent(transport), asyncio.get_running_loop()

        def cut() -> None:
            transport.abort()
            _cut(job_id, self.mirrors.budget)

        # Each frame is followed at once by the next boundary and the next part's headers:
        # Chromium shows a part only once it has read the headers of the part after it.
        await within_stall(request, stall_s, response.write(part_head))
        seq = 0
        while True:
            frame = await self.mirrors.next_frame(job_id, seq, RECHECK_S)
            if frame is mirror.ENDED:
                return
            if frame is None:
                if await self._status(job_id) != "claimed":
                    return
                continue
            assert isinstance(frame, mirror.Frame)
            # The newest frame each time the viewer has taken all of the last: never a backlog,
            # and a viewer that stops reading holds one frame, which the budget counts until it
            # is taken (or the viewer is cut). The frame's bytes object itself is queued, one
            # for every viewer, not a copy each.
            sending = self.mirrors.sending(frame, cut)
            if copies:
                # What the transport kept of its own is known once write_shared has written,
                # which it does before it first waits: the loop's next turn, if it waits at all.
                loop.call_soon(self._count_copy, sending, transport)
            try:
                await write_shared(request, response, frame.data, stall_s)
            finally:
                self.mirrors.sent(sending)
            await within_stall(request, stall_s, response.write(b"\r\n" + part_head))
            seq = frame.seq

    def _count_copy(self, sending: mirror.Sending, transport: asyncio.Transport) -> None:
        if not transport.is_closing():
            self.mirrors.copied(sending, transport.get_write_buffer_size())

    async def _status(self, job_id: str) -> str | None:
        row = await self.service.db.read_one(mirror.STATUS_SQL, (job_id,))
        return str(row[0]) if row else None

    async def _check_viewable(self, job_id: str) -> None:
        refusal = mirror.viewer_refusal(job_id, await self._status(job_id))
        if refusal is not None:
            raise refusal


def setup(app: web.Application, service: Service) -> None:
    """Wire the mirror: its routes, its listener (a job that leaves its claim ends its
    mirror) and, on shutdown, the end of every viewer's stream."""
    h = Handlers(service)
    service.listeners.append(h.mirrors.on_event)
    service.health_extras.append(lambda: {"mirrored_jobs": h.mirrors.jobs,
                                          "mirror_held_bytes": h.mirrors.held_bytes})
    app.router.add_routes([
        web.post("/api/jobs/{job_id}/mirror", h.post_frame),
        web.get("/api/jobs/{job_id}/mirror", h.view),
        web.get("/api/jobs/{job_id}/mirror/status", h.status),
    ])

    async def end_streams(_app: web.Application) -> None:
        h.mirrors.close()

    app.on_shutdown.append(end_streams)
