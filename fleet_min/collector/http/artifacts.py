"""The content-addressed artifact store over HTTP.

Bytes: `POST /artifacts` (streamed upload), `GET`/`HEAD /artifacts/{sha256}` (ranges, ETag).
Records: `/api/artifacts` (list, one, delete, pin, baseline, gc-candidates).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import ClientPayloadError, web
from aiohttp.web_protocol import RequestPayloadError

from fleet_min.collector.artifacts import store as artifacts
from fleet_min.collector.artifacts.store import ArtifactStore, Opened, RangeNotSatisfiable
from fleet_min.collector.service import Service
from fleet_min.errors import BadRequest, TimedOut, TooLarge
from fleet_min.http import (
    early_refusal,
    error_response,
    json_response,
    read_json_object,
    unreadable_body,
    within_stall,
    write_stall_s,
)
from fleet_min.timeutil import now

STORE = web.AppKey("artifact_store", ArtifactStore)
IMMUTABLE = "public, max-age=31536000, immutable"  # a hash's bytes never change
UPLOAD_WINDOW_S, UPLOAD_MIN_BYTES = 60.0, 64 * 1024  # slower than ~1 KiB/s is cut off
# sendfile is called for this much at a time, each call under the write-stall deadline: a
# client that takes less than a slice in FLEET_WRITE_STALL_S (60 s, ~17 KiB/s) is cut off.
SENDFILE_SLICE = 1 << 20


def store_of(request: web.Request) -> ArtifactStore:
    return request.app[STORE]


def _sha(request: web.Request) -> str:
    return artifacts.check_sha256(request.match_info["sha256"])


# -- bytes ----------------------------------------------------------------------------------------


async def refuse_oversized_early(request: web.Request) -> web.StreamResponse | None:
    """Answer `Expect: 100-continue` with 413 when the declared length is past the limit, so a
    client such as curl does not send gigabytes only to be refused; else let the body come. The
    same for an upload the access check refuses (a name, an origin, a body type)."""
    refused = early_refusal(request)
    if refused is not None:
        return refused
    limit = store_of(request).max_bytes
    if request.content_length is not None and request.content_length > limit:
        return error_response(413, _too_large(limit))
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        return error_response(417, f"Expect: {expect[:40]} is not supported; use 100-continue")
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim reply is not part of the response
    return None


def _too_large(limit: int) -> str:
    return f"the artifact is larger than the {limit}-byte limit ({artifacts.LIMIT_ENV})"


async def upload(request: web.Request) -> web.Response:
    store = store_of(request)
    publish = artifacts.publish_fields(request.headers)
    expected = request.headers.get("x-artifact-sha256")
    if expected is not None:
        expected = artifacts.check_sha256(expected.strip().lower())
    if request.content_length is not None and request.content_length > store.max_bytes:
        raise TooLarge(_too_large(store.max_bytes))
    try:
        # The body as it arrives (a few hundred KiB per read), never joined into bigger pieces:
        # aiohttp's iter_chunked(1 MiB) copies every byte into a new 1 MiB object, which cost the
        # event loop 2.5 times the CPU of taking the pieces as they are (bench/artifacts.py).
        # The store batches them into ~1 MiB lists for its worker threads.
        stored = await store.upload(at_a_living_rate(request.content.iter_any()), publish,
                                    expected, now())
    except (ClientPayloadError, ConnectionResetError):
        raise BadRequest("the upload ended before its body was complete; nothing was stored")\
            from None
    except RequestPayloadError as exc:
        raise unreadable_body(request, exc) from None
    # 201 every time, bytes stored now or already (decisions.md): one answer for clients to
    # check; `existed` says which.
    return json_response(stored, status=201)


async def at_a_living_rate(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The body's chunks, while each UPLOAD_WINDOW_S brings UPLOAD_MIN_BYTES at least: an
    upload that trickles (slow loris) is cut off with 408, and its temporary file removed."""
    loop = asyncio.get_running_loop()
    deadline, received = loop.time() + UPLOAD_WINDOW_S, 0
    iterator = aiter(chunks)
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            chunk = b""
        received += len(chunk)
        if loop.time() >= deadline:
            if received < UPLOAD_MIN_BYTES:
                raise TimedOut(f"the upload sent less than {UPLOAD_MIN_BYTES} bytes in "
                               f"{UPLOAD_WINDOW_S:g} s; nothing was stored")
            deadline, received = loop.time() + UPLOAD_WINDOW_S, 0
        if chunk:
            yield chunk


class ArtifactResponse(web.StreamResponse):
    """The bytes of one artifact, or a range of them; sent with sendfile where the event loop
    has it, else read 256 KiB at a time on a worker thread. Either way memory stays flat, and a
    client that takes nothing of a piece for `stall_s` is cut off."""

    def __init__(self, opened: Opened, span: tuple[int, int] | None, stall_s: float) -> None:
        first, last = span if span is not None else (0, opened.size - 1)
        super().__init__(status=206 if span is not None else 200)
        self._opened, self._offset, self._count = opened, first, max(0, last - first + 1)
        self._stall_s = stall_s
        self.content_type = "application/octet-stream"
        self.content_length = self._count
        self.headers.update({"ETag": f'"{opened.sha256}"', "Accept-Ranges": "bytes",
                             "Cache-Control": IMMUTABLE})
        if span is not None:
            self.headers["Content-Range"] = f"bytes {first}-{last}/{opened.size}"

    async def prepare(self, request: web.BaseRequest) -> Any:
        try:
            writer = await super().prepare(request)
            if request.method != "HEAD" and self._count:
                await self._send(request)
            await super().write_eof()
            return writer
        finally:
            await self._opened.close()

    async def _send(self, request: web.BaseRequest) -> None:
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        loop, offset, left = asyncio.get_running_loop(), self._offset, self._count
        try:
            while left > 0:
                sent = await within_stall(request, self._stall_s, loop.sendfile(
                    transport, self._opened.file, offset, min(SENDFILE_SLICE, left)))
                if not sent:
                    raise ConnectionResetError("the artifact file was truncated while being sent")
                offset, left = offset + sent, left - sent
        except NotImplementedError:  # uvloop, TLS: read it ourselves
            await self._send_by_reading(request, offset, left)

    async def _send_by_reading(self, request: web.BaseRequest, offset: int, left: int) -> None:
        fd = self._opened.file.fileno()
        while left > 0:
            chunk = await asyncio.to_thread(os.pread, fd, min(artifacts.READ_BYTES, left), offset)
            if not chunk:
                raise ConnectionResetError("the artifact file was truncated while being sent")
            await within_stall(request, self._stall_s, self.write(chunk))
            offset += len(chunk)
            left -= len(chunk)


def _matches(header: str | None, sha256: str) -> bool:
    """Does an If-None-Match / If-Range list name this artifact's ETag (weak or strong)?"""
    if header is None:
        return False
    tags = [tag.strip().removeprefix("W/").strip('"') for tag in header.split(",")]
    return "*" in tags or sha256 in tags


async def download(request: web.Request) -> web.StreamResponse:
    sha256 = _sha(request)
    opened = await store_of(request).open(sha256)  # 404 before any condition is considered
    headers = {"ETag": f'"{sha256}"', "Cache-Control": IMMUTABLE, "Accept-Ranges": "bytes"}
    span = None
    try:
        if _matches(request.headers.get("If-None-Match"), sha256):
            await opened.close()
            return web.Response(status=304, headers=headers)
        if_range = request.headers.get("If-Range")
        if if_range is None or _matches(if_range, sha256):
            span = artifacts.byte_range(request.headers.get("Range"), opened.size)
    except RangeNotSatisfiable:
        await opened.close()
        response = error_response(416, f"the range is outside the artifact's {opened.size} "
                                       "bytes")
        response.headers.update({**headers, "Content-Range": f"bytes */{opened.size}"})
        return response
    sent = ArtifactResponse(opened, span, write_stall_s(request))
    filename = artifacts.download_name(request.query.get("filename"))
    if filename is not None:
        sent.headers["Content-Disposition"] = f'attachment; filename="{filename}"'
    return sent


# -- records --------------------------------------------------------------------------------------


async def api_list(request: web.Request) -> web.Response:
    return json_response(await store_of(request).listing(request.query))


async def api_gc_candidates(request: web.Request) -> web.Response:
    return json_response(await store_of(request).gc_candidates(request.query))


async def api_detail(request: web.Request) -> web.Response:
    return json_response(await store_of(request).detail(_sha(request)))


async def api_delete(request: web.Request) -> web.Response:
    return json_response(await store_of(request).delete(_sha(request)))


def _setup_mutations(service: Service) -> list[web.RouteDef]:
    async def api_pin(request: web.Request) -> web.Response:
        sha256 = _sha(request)
        body = await read_json_object(request)
        if artifacts.wants_unpin(body):
            return json_response(await service.transact(artifacts.unpin, sha256))
        reason = artifacts.check_reason(body)
        return json_response(await service.transact(artifacts.pin, sha256, reason))

    async def api_unpin(request: web.Request) -> web.Response:
        return json_response(await service.transact(artifacts.unpin, _sha(request)))

    async def api_baseline(request: web.Request) -> web.Response:
        sha256 = _sha(request)
        accepted = artifacts.check_accepted(await read_json_object(request))
        return json_response(await service.transact(artifacts.set_baseline, sha256, accepted))

    return [web.post("/api/artifacts/{sha256}/pin", api_pin),
            web.delete("/api/artifacts/{sha256}/pin", api_unpin),
            web.post("/api/artifacts/{sha256}/baseline", api_baseline)]


def setup(app: web.Application, service: Service) -> None:
    """Wire this feature: its routes, and the adoption of files found on disk as a cleanup
    context."""
    store = ArtifactStore(service.data_dir / "artifacts",
                          artifacts.max_artifact_bytes(service.config), service.db,
                          service.transact)
    app[STORE] = store
    app.router.add_post("/artifacts", upload, expect_handler=refuse_oversized_early)
    app.router.add_get("/artifacts/{sha256}", download)  # HEAD too
    app.router.add_routes([
        web.get("/api/artifacts", api_list),
        web.get("/api/artifacts/gc-candidates", api_gc_candidates),
        web.get("/api/artifacts/{sha256}", api_detail),
        web.delete("/api/artifacts/{sha256}", api_delete),
        *_setup_mutations(service),
    ])

    async def running(_app: web.Application) -> AsyncIterator[None]:
        found = await store.scan()  # before the first request: no upload is in flight yet
        adopting = [service.spawn(store.adopt(found, now()), "artifact-adopt")] if found else []
        yield
        await service.stop_tasks(adopting)

    app.cleanup_ctx.append(running)
