"""HTTP plumbing shared by both services: JSON errors, body limits, security headers, static files.

Handlers stay thin: `body = await read_json(request)`, call one domain function, `return
json_response(...)`. Domain refusals (fleet_min.errors) become `{"error": ...}` with their status;
anything unexpected is logged with its traceback and answered 500 without one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import mimetypes
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestPayloadError

from fleet_min import jsonio, metrics
from fleet_min.db import StorageError
from fleet_min.errors import BadRequest, Refused, TimedOut, TooLarge
from fleet_min.logs import Throttled

log = logging.getLogger(__name__)
T = TypeVar("T")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A feature's life on an app (app.cleanup_ctx): start, yield while the app serves, stop.
CleanupContext = Callable[[web.Application], AsyncIterator[None]]

MAX_JSON_KEY = web.AppKey("max_json_bytes", int)
BODY_TIMEOUT_S = 60.0  # a JSON body must have arrived by then: a slow client is cut off
# A streamed answer (an artifact, the live mirror) whose client takes none of a piece for this
# long is cut: a client that stops reading would otherwise hold its connection, its descriptors
# and the bytes queued for it for ever (aiohttp has no send timeout).
WRITE_STALL_KEY = web.AppKey("write_stall_s", float)
WRITE_STALL_S = 60.0
_stalled = Throttled(log, "cut a client of %s that took nothing for %g s")

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}

PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
            "frame-ancestors 'none'; form-action 'self'")


# A JSON answer is born with every header base_middleware would add: passing them in one dict,
# with the body already bytes, costs aiohttp half of what setting them one by one does.
_JSON_HEADERS = {"Content-Type": "application/json; charset=utf-8", **SECURITY_HEADERS}


def link_url(value: str | None) -> str | None:
    """A URL a page may put in a link: http or https, with a host; anything else (javascript:,
    data:, a bare path) is None. Such URLs come from outside (GitHub's answers, a runner's
    .runner file); the pages' Content-Security-Policy would stop a script URL, but a link is no
    place to rely on that."""
    if not value:
        return None
    try:
        parts = urlsplit(value)
    except ValueError:
        return None
    return value if parts.scheme.lower() in ("http", "https") and parts.netloc else None


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(body=jsonio.dumps_body(value), status=status,
                        headers={**_JSON_HEADERS, **headers} if headers else _JSON_HEADERS)


def json_body_response(body: bytes | bytearray, status: int = 200) -> web.Response:
    """A JSON answer encoded already (jsonio.dumps_body), in a worker thread say."""
    return web.Response(body=body, status=status, headers=_JSON_HEADERS)


def error_response(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status=status)


async def read_json(request: web.Request, limit: int | None = None) -> Any:
    """The request body as JSON, refused with 413 past the limit and 400 when malformed, nested
    deeper than jsonio.MAX_DEPTH levels or holding text that is not Unicode (a lone surrogate)."""
    limit = limit if limit is not None else request.app.get(MAX_JSON_KEY, 1 << 20)
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(f"the request body is larger than the {limit}-byte limit")
    raw = await _read_body(request, limit)
    if not raw.strip():
        raise BadRequest("the request needs a JSON body")
    if jsonio.too_deep(raw):  # before any parser recurses into it
        raise BadRequest(f"the JSON body is nested deeper than {jsonio.MAX_DEPTH} levels")
    parsed, value = jsonio.loads_quick(raw)
    if parsed:
        return value
    try:
        # Decoded here: json.loads(bytes) would also take UTF-16 and UTF-32 (RFC 8259: UTF-8).
        # NaN, Infinity and numbers past float are refused: no JSON reply could carry them.
        value = _DECODER.decode(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest("the request body is not UTF-8 text") from None
    except RecursionError:  # too_deep keeps it from happening; never a 500 if it did
        raise BadRequest(f"the JSON body is nested deeper than {jsonio.MAX_DEPTH} levels"
                         ) from None
    except ValueError as exc:
        reason = exc.args[0].split(":")[0]
        raise BadRequest(f"the request body is not valid JSON ({reason})") from None
    # orjson refuses a lone surrogate's escape, so only this path can meet one.
    not_text = jsonio.lone_surrogate(value) if jsonio.may_hold_surrogate(raw) else None
    if not_text:
        raise BadRequest(not_text)
    return value


async def read_bytes(request: web.Request, limit: int) -> bytes | bytearray:
    """A whole binary request body, refused with 413 past the limit (a declared length past it
    before the body is read)."""
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(f"the request body is larger than the {limit}-byte limit")
    return await _read_body(request, limit)


async def _read_body(request: web.Request, limit: int) -> bytes | bytearray:
    content = request.content
    try:
        if content.is_eof():  # the whole body came with the headers: the usual small JSON body
            whole = content.read_nowait(limit + 1)
            if len(whole) > limit:
                raise TooLarge(f"the request body is larger than the {limit}-byte limit")
            return whole
        # read() returns what has arrived so far, so a large body takes several reads.
        raw = bytearray()
        async with asyncio.timeout(BODY_TIMEOUT_S):
            while len(raw) <= limit:
                chunk = await content.read(limit + 1 - len(raw))
                if not chunk:
                    break
                raw += chunk
    except TimeoutError:
        raise TimedOut(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    except RequestPayloadError as exc:
        raise unreadable_body(request, exc) from None
    if len(raw) > limit:
        raise TooLarge(f"the request body is larger than the {limit}-byte limit")
    return raw


def stop_reading(request: web.BaseRequest) -> None:
    """Read nothing more of this request's body, and close its connection after the answer.

    aiohttp reads on through a body its handler left unread ("lingering", up to 10 s), so that
    the client can finish sending and read the answer; for a body with a Content-Encoding each
    piece it reads is inflated on the event loop first. One gzip megabyte refused at once with
    413 still cost the loop up to a second after the answer, each."""
    request.content.feed_eof()
    request.protocol.close()  # no next request on this connection: the rest of it is garbage


def unreadable_body(request: web.BaseRequest, exc: RequestPayloadError) -> BadRequest:
    """The refusal of a body aiohttp could not decode (`Content-Encoding: gzip` over bytes that
    are not gzip). Nothing more of it is read: the connection closes after the answer, and
    aiohttp does not read on to log the same failure as its own."""
    stop_reading(request)  # else aiohttp drains the rest after the answer and logs it
    cause = exc.__cause__
    reason = str(getattr(cause, "message", None) or cause or exc).strip().rstrip(".")[:200]
    encoding = request.headers.get("Content-Encoding", "")[:40]
    advice = (f"; send it plain, or encoded as its Content-Encoding ({encoding}) says"
              if encoding else "")
    return BadRequest(f"the request body could not be read: {reason}{advice}")


def write_stall_s(request: web.Request) -> float:
    """How long a streamed answer may wait for its client to take a piece (FLEET_WRITE_STALL_S)."""
    return request.app.get(WRITE_STALL_KEY, WRITE_STALL_S)


async def within_stall(request: web.BaseRequest, stall_s: float, step: Awaitable[T]) -> T:
    """`step` (a write, a drain, one slice of sendfile) awaited until it completes, or for
    `stall_s`: then the client has taken nothing of it, and its connection is cut (and the
    cut logged, at most once a minute) instead of holding it and its queued bytes for ever."""
    try:
        async with asyncio.timeout(stall_s):
            return await step
    except TimeoutError:
        transport = request.transport
        if transport is not None:
            transport.abort()
        _stalled(f"{request.method} {request.path}", stall_s)
        raise ConnectionResetError(f"the client took nothing for {stall_s:g} s") from None


async def write_shared(request: web.BaseRequest, response: web.StreamResponse, data: bytes,
                       stall_s: float) -> None:
    """Send `data` as one piece of a prepared streamed answer, handing the transport the bytes
    object itself. aiohttp joins a chunk with its framing, a copy of it for every client; a
    frame sent to a thousand live-mirror viewers who read slowly would be held a thousand
    times. The same bytes object queued for each is held once."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away")
    if response.chunked:
        transport.write(b"%x\r\n" % len(data))
        transport.write(data)
        transport.write(b"\r\n")
    else:
        transport.write(data)
    await within_stall(request, stall_s, request.writer.drain())


def _not_json(name: str) -> Any:
    raise BadRequest(f"the request body holds {name}, which is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"the number {text[:20]} is too large")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > jsonio.MAX_INTEGER_DIGITS:
        raise BadRequest(f"the number {text[:20]}... has more than {jsonio.MAX_INTEGER_DIGITS} "
                         "digits, past what a float holds")
    return int(text)


# Built once (json.loads with options builds a decoder per call). It decides every body orjson
# did not take (see fleet_min.jsonio), and words the refusals.
_DECODER = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite_float,
                            parse_int=_bounded_int)


async def read_json_object(request: web.Request, limit: int | None = None) -> dict[str, Any]:
    body = await read_json(request, limit)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def query_int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer from {low} to {high}") from None
    if not low <= value <= high:
        raise BadRequest(f"{name} must be an integer from {low} to {high}")
    return value


RequestCheck = Callable[[web.Request], None]
CHECK_KEY: web.AppKey[RequestCheck] = web.AppKey("request_check")  # base_middleware_with's


def early_refusal(request: web.Request) -> web.Response | None:
    """The app's access check, for an `Expect: 100-continue` handler: aiohttp runs that before
    any middleware, so without this an upload the check refuses would first be invited to send
    its body. The refusal as a response (it carries the security headers), or None."""
    check = request.app.get(CHECK_KEY)
    if check is None:
        return None
    try:
        check(request)
    except Refused as exc:
        return error_response(exc.status, exc.message)
    return None


def base_middleware_with(check: RequestCheck) -> Middleware:
    """The one middleware of each service: refusals and errors as `{"error": ...}`, the
    security headers on every answer, and first `check`, the service's access rule (it refuses
    a request by raising Refused), run here rather than as a layer of its own."""

    @web.middleware
    async def base_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        # One middleware for all of it: every request of both services passes through here,
        # and each layer of middleware costs aiohttp a call and a coroutine per request, and
        # every await below it a step more each time a handler resumes.
        try:
            check(request)
            response = await handler(request)
        except Refused as exc:
            response = error_response(exc.status, exc.message)
        except StorageError as exc:
            log.error("storage error on %s %s: %s", request.method, request.path, exc)
            response = error_response(503, str(exc))
        except web.HTTPException as exc:
            if exc.status < 400 or exc.content_type == "application/json":
                # Answered as raised (a redirect, a 304, a JSON refusal), with the headers
                # every other answer carries: the redirect from / went without them.
                for name, value in SECURITY_HEADERS.items():
                    exc.headers.setdefault(name, value)
                raise
            response = _http_error(request, exc)
        except (ConnectionResetError, TimeoutError):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = error_response(500, "internal error; the service log has the details")
        if (request.body_exists and "Content-Encoding" in request.headers
                and not request.content.is_eof()):
            stop_reading(request)  # an encoded body left unread: refused, or never wanted
        headers = response.headers
        if "X-Frame-Options" not in headers:  # json_response sets all three together
            for name, value in SECURITY_HEADERS.items():
                headers.setdefault(name, value)
        if headers.get("Content-Type", "").startswith("text/html"):
            headers.setdefault("Content-Security-Policy", PAGE_CSP)
        return response

    return base_middleware


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own 4xx/5xx (no route, wrong method, body too large) as JSON."""
    if exc.status == 405:
        response = error_response(405, f"{request.method} is not allowed on {request.path}")
        response.headers["Allow"] = exc.headers.get("Allow", "")  # RFC 9110
        return response
    if exc.status == 404:
        return error_response(404, f"no such route: {request.path}")
    if exc.status == 413:
        return error_response(413, "the request body is larger than the limit")
    return error_response(exc.status, exc.reason)


def metrics_response(text: str) -> web.Response:
    """A GET /metrics answer: the Prometheus text format, never cached."""
    return web.Response(body=text.encode(), headers={"Content-Type": metrics.CONTENT_TYPE,
                                                     "Cache-Control": "no-store"})


def static_file(package: str, relative: str, cache_s: int = 300) -> web.Response:
    """Serve `relative` from the package's resources; 404 for anything outside or missing.

    The path is checked segment by segment (no '..', no absolute paths, no hidden files, no
    backslashes), and read through importlib.resources so it also works inside fleet.pyz.
    """
    parts = relative.split("/")
    if (not relative or any(p in ("", ".", "..") or p.startswith(".") for p in parts)
            or "\\" in relative or "\x00" in relative):
        raise web.HTTPNotFound()
    node = resources.files(package)
    for part in parts:
        node = node.joinpath(part)
    try:
        data = node.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, OSError):
        raise web.HTTPNotFound() from None
    content_type, _ = mimetypes.guess_type(parts[-1])
    if parts[-1].endswith(".js"):
        content_type = "text/javascript"
    return web.Response(body=data, content_type=content_type or "application/octet-stream",
                        headers={"Cache-Control": f"public, max-age={cache_s}"})


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole (decompressed) body of an answer from another server, or None once it passes
    `limit` bytes: what answers there (a peer, a coordinator, a proxy in front of GitHub) is
    not trusted to end. A Content-Length over the limit is refused before any byte is read."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 << 10):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def read_within(resp: aiohttp.ClientResponse, limit: int, too_large: Exception) -> bytes:
    """read_capped for a caller that refuses a larger answer: `too_large` (its own error, which
    its retry rules know) is raised once the body passes `limit`."""
    body = await read_capped(resp, limit)
    if body is None:
        raise too_large
    return body
