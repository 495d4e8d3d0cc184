"""Fixtures of the agent's tests; the helpers themselves live in support.py."""

from tests.support.agent import fa, http_stub, procs, trickle, website

__all__ = ["fa", "http_stub", "procs", "trickle", "website"]
