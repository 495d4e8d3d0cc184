"""ruff and mypy are part of the suite, so `scripts/test.sh` keeps the code clean."""

from __future__ import annotations

import subprocess
import sys

from tests.support.collector import ROOT


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_tests_share_code_only_through_tests_support():
    """A test module imports shared helpers from tests.support, never from another test module
    or a conftest, so a helper has one home and moving a test file breaks nothing else."""
    import ast

    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                name = node.module
            elif isinstance(node, ast.Import):
                name = next((a.name for a in node.names if a.name.startswith("tests")), "")
            else:
                continue
            if name.startswith("tests") and not name.startswith("tests.support") \
                    and name != "tests":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not offenders, "\n".join(offenders)
