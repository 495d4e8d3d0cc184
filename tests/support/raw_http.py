"""A raw HTTP client for hostile requests: paths are sent as written (no normalising of `..`),
bodies as bytes, any header; plus the OpenAPI documents' operations to walk every route."""

from __future__ import annotations

import http.client
import io
import json
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from fleet_min import openapi

TIMEOUT_S = 30  # a hang detector, not a timing assertion
METHODS = ("get", "post", "put", "patch", "delete", "head")


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def media(self) -> str:
        return (self.headers.get("Content-Type") or "").split(";")[0].strip()

    def __repr__(self) -> str:
        return f"<{self.status} {self.media} {self.body[:300]!r}>"


def send(base: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT_S)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        given = {k.lower() for k in headers or {}}
        if body is not None and "content-length" not in given \
                and "transfer-encoding" not in given:
            conn.putheader("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        data = response.read() if method != "HEAD" else b""
        return Reply(response.status, response.headers, data)
    finally:
        conn.close()


def ask(base: str, method: str, path: str, headers: dict[str, str] | None = None,
        body: bytes | None = None, host: str | None = None) -> tuple[int, Any]:
    """One request with exactly these headers and `host` as its Host header (None: the host and
    port of `base`); the answer as (status, JSON, or the raw bytes when it is not JSON)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT_S)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host if host is not None else parts.netloc)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, raw
    finally:
        conn.close()


def send_json(base: str, method: str, path: str, value: Any,
              headers: dict[str, str] | None = None) -> Reply:
    return send(base, method, path, json.dumps(value).encode(),
                {"Content-Type": "application/json", **(headers or {})})


def raw_exchange(base: str, data: bytes) -> bytes:
    """Write bytes on a fresh connection; read until the server closes or times out."""
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname or "", parts.port or 80),
                                  timeout=TIMEOUT_S) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return received


def peek_status(base: str, path: str) -> int | None:
    """The status of a GET whose body may never end (an event stream): read the head, close."""
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname or "", parts.port or 80),
                                  timeout=TIMEOUT_S) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        head = b""
        while b"\r\n" not in head and (chunk := sock.recv(4096)):
            head += chunk
        return status_of(head)


def reply_of(raw: bytes) -> Reply:
    """A whole answer read off the wire (raw_exchange) as a Reply: status, headers, body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, _, fields = head.partition(b"\r\n")
    headers = http.client.parse_headers(io.BytesIO(fields + b"\r\n\r\n"))
    status = status_of(status_line)
    assert status is not None, raw[:200]
    return Reply(status, headers, body)


def status_of(raw: bytes) -> int | None:
    match = re.match(rb"HTTP/1\.[01] (\d{3})", raw)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Operation:
    method: str
    path: str  # OpenAPI template
    spec: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"\{([^{}]+)\}", self.path)

    @property
    def query_params(self) -> list[dict[str, Any]]:
        return [p for p in self.spec.get("parameters", []) if p["in"] == "query"]

    @property
    def json_body(self) -> bool:
        return "application/json" in self.spec.get("requestBody", {}).get("content", {})

    @property
    def streams(self) -> bool:
        ok = self.spec.get("responses", {}).get("200", {})
        return "text/event-stream" in ok.get("content", {})

    @property
    def secured(self) -> bool:
        return bool(self.spec.get("security"))

    def url(self, values: dict[str, str], encode: bool = True) -> str:
        path = self.path
        for name in self.path_params:
            value = values[name]
            path = path.replace("{" + name + "}", quote(value, safe="") if encode else value)
        return path


def operations(name: str) -> list[Operation]:
    doc = json.loads(openapi.document_bytes(name))
    return [Operation(method.upper(), path, spec) for path, item in doc["paths"].items()
            for method, spec in item.items() if method in METHODS]
