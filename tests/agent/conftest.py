"""Fixtures of the agent's tests; the helpers themselves live in support.py."""

from tests.support.agent import fa, http_stub, procs, website

__all__ = ["fa", "http_stub", "procs", "website"]
