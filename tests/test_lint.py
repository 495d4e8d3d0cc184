"""ruff and mypy are part of the suite, so `scripts/test.sh` keeps the code clean."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
