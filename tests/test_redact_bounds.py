"""The redactor stays linear on hostile lines (a key-like run with thousands of dots once made
it quadratic: 16 KB took 52 s). The timeout is a hang guard, far above the milliseconds needed."""

from __future__ import annotations

import pytest

from fleet_min.controlplane.redact import redact


@pytest.mark.timeout(20)
@pytest.mark.parametrize("line", ["a." * 8000, "a-" * 8000, "x://" * 4000, "k.k=" * 4000])
def test_hostile_runs_do_not_stall(line):
    assert len(redact(line)) > 0


def test_keys_after_dots_are_still_redacted():
    assert redact("runner.auth.token=abcdef123456") == "runner.auth.token=<redacted>"
