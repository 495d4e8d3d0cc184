"""Who may call a route: bearer tokens, cross-origin refusal, read-only mode.

Plain functions over the request's method and headers so the rules are tested without HTTP; the
app's middleware feeds them and turns the refusals into 401/403 answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from fleet_min import origin
from fleet_min.controlplane import tokens
from fleet_min.errors import Forbidden, Unauthorized

READ_ONLY_MESSAGE = "this daemon is running read-only"
CROSS_ORIGIN = "cross-origin requests are refused; use the daemon's own page"


class Need(Enum):
    NONE = "none"
    SAME_ORIGIN = "same-origin"  # no token, but never from another site's page (POST reads)
    CONTROL = "control"
    AGENT = "agent"


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_same_origin(headers: Mapping[str, str]) -> None:
    """Refuse a browser request made from another site, whatever token it carries.

    The daemon's own address is the Host the request was sent to: through an SSH tunnel or a
    TLS proxy that keeps Host, the page and the API share it, while a page on another site
    sends its own origin. A request without Origin (curl, the agent) is not a browser's.
    """
    origin.check_same_origin(headers, CROSS_ORIGIN)


SHARED_AGENT_REFUSED = (
    "this coordinator takes host tokens only (the live setting agent_tokens is host); make "
    "this agent host its own: fleet-min controlplane token --agent-host <its FLEET_HOST_NAME>")


def authorize(need: Need, headers: Mapping[str, str], *, read_only: bool,
              control: str | None, agent: str | None, shared_agent: bool = True) -> str:
    """Raise 401/403 unless the request may proceed; return who it is for the audit log.
    `shared_agent` False refuses the shared agent token (host tokens still pass): the shared
    token speaks for any host name, a host token for its own only."""
    if need is Need.NONE:
        return "anonymous"
    if need is Need.SAME_ORIGIN:
        check_same_origin(headers)
        return "anonymous"
    if read_only:
        raise Forbidden(READ_ONLY_MESSAGE)
    check_same_origin(headers)
    given = bearer(headers)
    if given is None:
        raise Unauthorized("this route needs an Authorization: Bearer <token> header")
    if tokens.matches(given, control):
        return "control token"
    if need is Need.AGENT and tokens.matches(given, agent):
        if not shared_agent:
            raise Forbidden(SHARED_AGENT_REFUSED)
        return "agent token"
    host = tokens.token_host(given, agent) if need is Need.AGENT else None
    if host is not None:
        return f"agent token for {host}"
    raise Forbidden("the bearer token is wrong")


def token_host(headers: Mapping[str, str], agent: str | None) -> str | None:
    """The one agent host the request's bearer token may speak for (a host token); None for
    any other token, which `authorize` has judged already."""
    given = bearer(headers)
    return tokens.token_host(given, agent) if given is not None else None
