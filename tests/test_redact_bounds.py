"""The redactor stays linear on hostile lines (a key-like run with thousands of dots once made
it quadratic: 16 KB took 52 s). The timeout is a hang guard, far above the milliseconds needed."""

from __future__ import annotations

import pytest

from fleet_min.controlplane.runners.redact import redact


@pytest.mark.timeout(20)
@pytest.mark.parametrize("line", ["a." * 8000, "a-" * 8000, "x://" * 4000, "k.k=" * 4000])
def test_hostile_runs_do_not_stall(line):
    assert len(redact(line)) > 0


# A key word repeated without a separator once cost the key=value rule quadratic time ("token"
# * 4000, 20 KB, took 6 s: two stars around the word backtracked); the rest are the shapes the
# rules by name read: values after keys, quoted values, flags.
@pytest.mark.timeout(20)
@pytest.mark.parametrize("line", ["token" * 20000, "a=b" * 30000, "${token=" * 20000,
                                  '"a": ' * 20000, 'token="' * 20000, "--token " * 20000,
                                  "password " * 20000, "Authorization: \"" * 10000,
                                  "-----BEGIN A PRIVATE KEY-----" * 5000])
def test_long_runs_of_key_words_do_not_stall(line):
    assert len(redact(line)) > 0


def test_keys_after_dots_are_still_redacted():
    assert redact("runner.auth.token=abcdef123456") == "runner.auth.token=<redacted>"
