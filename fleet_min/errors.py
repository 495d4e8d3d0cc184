"""Refusals raised by domain code and turned into HTTP answers by fleet_min.http.

Domain modules never import aiohttp; they raise one of these with a sentence a person can act on.
"""

from __future__ import annotations


class Refused(Exception):
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(Refused):
    status = 400


class Unauthorized(Refused):
    status = 401


class Forbidden(Refused):
    status = 403


class NotFound(Refused):
    status = 404


class Conflict(Refused):
    status = 409


class TimedOut(Refused):
    status = 408


class TooLarge(Refused):
    status = 413


class UnsupportedMediaType(Refused):
    status = 415


class Misdirected(Refused):
    """421: the request named a host this service does not answer to (DNS rebinding)."""

    status = 421


class Unprocessable(Refused):
    status = 422


class Unavailable(Refused):
    status = 503


class RegistryFull(Refused):
    """507: a registry (devices, host executors) holds as many as its bound allows and the
    request would add one more."""

    status = 507
