"""What a request aiohttp answers itself is told (fleet_min.serving.unreadable_reason): a plain
function over the parser's exceptions, no sockets. The real services answering such requests
are in tests/collector/test_hostile_inputs.py and tests/controlplane/test_boundary.py."""

from __future__ import annotations

import pytest
from aiohttp import http_exceptions

from fleet_min.serving import unreadable_reason

UNREADABLE = "the request could not be read as HTTP/1.1"


@pytest.mark.parametrize(("status", "exc", "reason"), [
    (400, http_exceptions.LineTooLong(b"aaa", 8190),
     f"{UNREADABLE}: a line of its head is too long"),
    (400, http_exceptions.BadHttpMethod("G<script>"),
     f"{UNREADABLE}: its method is not an HTTP method"),
    (400, http_exceptions.InvalidURLError("Invalid URL: '/<script>'"),
     f"{UNREADABLE}: its target is not a valid URL"),
    (400, http_exceptions.InvalidHeader(b"X-<script>"), f"{UNREADABLE}: a header is malformed"),
    # The parser's description alone is repeated, its first letter lowered...
    (400, http_exceptions.BadHttpMessage("Invalid header value char:\n\n  b'X: \\x01'\n  ^"),
     f"{UNREADABLE}: invalid header value char"),
    (400, http_exceptions.BadHttpMessage("Too many headers received"),
     f"{UNREADABLE}: too many headers received"),
    # ...and any text that may carry what the client sent is not.
    (400, http_exceptions.BadHttpMessage("Bad request line 'GET /<script>'"), UNREADABLE),
    (400, http_exceptions.BadHttpMessage("Unexpected byte: <script>"), UNREADABLE),
    (400, http_exceptions.BadHttpMessage("x" * 81), UNREADABLE),
    (400, http_exceptions.BadHttpMessage(""), UNREADABLE),
    (400, None, UNREADABLE),
    (431, None, UNREADABLE),
    (500, RuntimeError("a secret in a traceback"), "internal error"),
    (504, None, "the request took too long"),
])
def test_the_answer_says_what_kind_of_fault_and_never_repeats_the_request(status, exc, reason):
    assert unreadable_reason(status, exc) == reason
